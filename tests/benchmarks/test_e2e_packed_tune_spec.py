"""benchmarks/e2e_packed.py --tune: the sweep spec holds the templates of every implementation
serving the row's training call (what ``tuner.record`` notes), so the tuned row prices the
implementation it runs untuned; a list written by hand had left gluon_train out."""

from __future__ import annotations

import argparse
import tomllib

import torch

from templates.masks.patterns import documents_pattern
from tests.api.serving_data import H100
from tests.benchmarks.benchmark_scripts import load_benchmark_script
from tuner.dispatch.implementations import implementations as registered_implementations
from tuner.dispatch.implementations.call import call_of_shapes


def test_the_tune_spec_prices_every_implementation_serving_the_row() -> None:
    script = load_benchmark_script("e2e_packed")
    args = argparse.Namespace(heads=32, kv_heads=8, tokens=16384, head_dim=128)
    pattern = str(documents_pattern([3000, 5000, 8384], causal=True))
    spec = tomllib.loads(script.tune_spec(args, pattern, torch.bfloat16, H100))
    [shape] = spec["shapes"]
    assert shape == {"B": 1, "H_q": 32, "H_kv": 8, "N": 16384, "D": 128, "causal": "none",
                     "mask": pattern}
    assert spec["dtypes"] == ["bfloat16"]
    call = call_of_shapes((1, 32, 16384, 128), (1, 8, 16384, 128), torch.bfloat16, False, True,
                          H100, mask=pattern)
    serving = {impl.name: impl.templates_for(call) for impl in registered_implementations()
               if impl.why_not(call) is None}
    assert {"gluon_train", "flash_gluon", "flash", "flex"} <= set(serving)
    assert set(spec["templates"]) == {name for names in serving.values() for name in names}
    assert "gluon_train" in spec["templates"] and "gluon_bwd" in spec["templates"]
