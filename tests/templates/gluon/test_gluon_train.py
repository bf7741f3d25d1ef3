"""``gluon_train``: the Gluon forward with the Gluon backward, timed together.

CPU: what the template takes and refuses, its price (3.5x the forward's FLOPs, as
torch_sdpa_train). GPU (``gpu`` marker, Hopper): its run against its reference on odd shapes,
GQA, N_q != N_kv both causal alignments, fp16/bf16, D 64/128.
"""

from __future__ import annotations

from typing import Any

import pytest

from templates.base import Problem
from templates.registry import get_template
from tests.api.serving_data import H100

TRAIN = get_template("gluon_train")
FWD = get_template("gluon_fwd")


def problem(**kw: Any) -> Problem:
    base = dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=300, head_dim=128,
                dtype="bfloat16", causal="top_left")
    return Problem(**{**base, **kw})  # type: ignore[arg-type]


def test_takes_dense_and_causal_problems_with_the_forwards_knobs() -> None:
    p = problem()
    assert TRAIN.unsupported(p) is None
    assert TRAIN.unsupported(problem(causal="none", heads_kv=4)) is None
    # Our backward takes bottom-right with N_q != N_kv, which cuDNN's cannot.
    assert TRAIN.unsupported(problem(seqlen_q=100, causal="bottom_right")) is None
    assert TRAIN.config_cls is FWD.config_cls
    assert TRAIN.default_config(p, H100) == FWD.default_config(p, H100)
    assert TRAIN.flops(p) == 3.5 * FWD.flops(p)
    assert TRAIN.version() not in (FWD.version(), get_template("gluon_cudnn_train").version())


@pytest.mark.parametrize(("kw", "why"), [
    # Block masks with the mask's own causality only (the backward's walk).
    ({"mask": "sliding:128"}, "own causality"),
    ({"dtype": "float32"}, "float16 or bfloat16"),
    ({"head_dim": 96}, "head_dim"),
])
def test_refuses_what_either_kernel_cannot_take(kw: dict[str, Any], why: str) -> None:
    assert why in (TRAIN.unsupported(problem(**kw)) or "")


def test_takes_mask_patterns_with_causal_none() -> None:
    masked = problem(causal="none", mask="sliding_causal:128")
    assert TRAIN.unsupported(masked) is None
    assert TRAIN.constraint(masked, TRAIN.default_config(masked, H100), H100) is None
    assert "no block mask" in str(get_template("gluon_cudnn_train").unsupported(masked))


def test_exports_no_source_and_says_what_to_export_instead() -> None:
    with pytest.raises(NotImplementedError, match="export gluon_fwd"):
        TRAIN.standalone_source(TRAIN.default_config(problem(), H100))


# ----------------------------------------------------------------------------- GPU
CASES = [  # (B, H_q, H_kv, N_q, N_kv, D, dtype, causal)
    (2, 4, 4, 256, 256, 128, "bfloat16", "none"),
    (1, 4, 4, 333, 333, 128, "bfloat16", "top_left"),
    (1, 8, 1, 300, 300, 64, "float16", "top_left"),  # GQA 8:1
    (1, 4, 1, 128, 515, 128, "bfloat16", "bottom_right"),
    (1, 4, 4, 1000, 1000, 64, "bfloat16", "none"),
    (2, 8, 8, 2048, 2048, 128, "float16", "top_left"),
    (1, 8, 2, 700, 700, 256, "bfloat16", "top_left"),  # the d256 backward, GQA 4:1
    (1, 4, 4, 515, 900, 256, "float16", "none"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_template_matches_its_reference_on_the_gpu(case: tuple[Any, ...]) -> None:
    from templates.device import current_device

    p = Problem(*case)
    if TRAIN.unsupported_on(p, current_device()):
        pytest.skip(TRAIN.unsupported_on(p, current_device()) or "")
    inputs = TRAIN.make_inputs(p, "cuda")
    out = TRAIN.run(inputs, TRAIN.default_config(p, current_device()))
    ref = TRAIN.reference(inputs)
    assert all(float(g.abs().max()) > 0 for g in out)
    assert TRAIN.error(out, ref) < TRAIN.tolerance(p)
