"""GET /v1/kernels/{template}/source: the generated module runs on its own and agrees with
the template (under the interpreter here, on a tiny shape)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fastapi.testclient import TestClient

from templates.base import Problem
from tests.api.serving_data import FWD, bundle, interpreter, item, problem, tuned_config


def load_module(source: str, path: Path) -> ModuleType:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses and triton look modules up by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[path.stem]
    return module


def source(client: TestClient, p: Problem, device: str) -> str:
    r = client.get(f"/v1/kernels/{FWD.name}/source", params={"device": device, **p.to_dict()})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/x-python")
    return r.text


@pytest.mark.parametrize("tuned", [True, False], ids=["tuned", "default"])
def test_generated_module_computes_what_the_template_computes(
    client: TestClient, auth: dict[str, str], tmp_path: Path, tuned: bool,
) -> None:
    p = problem(48, batch=1, heads=4, heads_kv=2, head_dim=16, dtype="float16",
                causal="top_left")
    device = interpreter()
    config = tuned_config(p, device) if tuned else FWD.default_config(p, device).to_dict()
    if tuned:
        r = client.post("/v1/results", json=bundle(item(p, device=device, config=config)),
                        headers=auth)
        assert r.status_code == 201, r.text
    text = source(client, p, device.key)
    assert f"config match: {'exact' if tuned else 'default'}" in text
    assert repr(FWD.config(config).key()) in text
    module = load_module(text, tmp_path / f"generated_fwd_{tuned}.py")
    assert config == module.CONFIG

    inputs = FWD.make_inputs(p, "cpu", seed=3)
    o, lse = module.flash_attention_fwd(inputs["q"], inputs["k"], inputs["v"],
                                        causal=inputs["causal"], scale=inputs["scale"])
    o_t, lse_t = FWD.run(inputs, FWD.config(config))
    torch.testing.assert_close(o, o_t, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_t, rtol=0, atol=0)
    assert FWD.error((o, lse), FWD.reference(inputs)) <= FWD.tolerance(p)


def test_caller_strings_cannot_inject_code_into_the_module(client: TestClient,
                                                          tmp_path: Path) -> None:
    p = problem(32, batch=1, heads=2, head_dim=16, dtype="float16")
    text = source(client, p, "gpu\nraise SystemExit('injected')")
    module = load_module(text, tmp_path / "generated_injection.py")  # imports without exiting
    assert hasattr(module, "flash_attention_fwd")
