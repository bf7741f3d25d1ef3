"""benchmarks/step_kernels.py: a --smoke run on the CPU interpreter profiles our masked step
on every pattern of the masked bench's smoke row (checked against the reference first) and
writes the JSON; unknown implementations and rows are refused by name; without a GPU (and no
--smoke) it says what it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.benchmarks.benchmark_scripts import load_benchmark_script


def test_the_smoke_run_profiles_every_pattern(tmp_path: Path) -> None:
    script = load_benchmark_script("step_kernels")
    out = tmp_path / "kernels.json"
    assert script.main(["--smoke", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"].split()[-1] for r in rows] == ["sliding-causal:40", "document-causal:48",
                                                    "random:0.3"]
    for row in rows:
        assert row["impl"] == "ours" and "failed" not in row
        assert row["total_ms"] > 0 and row["total_ms"] == pytest.approx(
            sum(k["ms"] for k in row["kernels"].values()))
        # The autograd function's forward and backward are where the interpreter's time goes.
        assert {"FlashAttentionFunction", "FlashAttentionFunctionBackward"} <= set(row["kernels"])


def test_a_failing_step_is_reported_not_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_benchmark_script("step_kernels")
    bench = script.bench
    case = bench.prepare(bench.SMOKE, 32, 128, "random:0.3")
    step = [s for s in bench.steps(bench.ours(case.block_mask), case.tensors)
            if s[0] == "fwd+bwd"][0][1]
    assert script.checked(case, step, bench.SMOKE.tolerance) is None

    def wrong() -> tuple[torch.Tensor, ...]:
        o, dq, dk, dv = step()
        return o, dq * 2, dk, dv

    reason = script.checked(case, wrong, bench.SMOKE.tolerance)
    assert reason is not None and reason.startswith("dq error")


@pytest.mark.parametrize(("args", "says"), [
    (["--impls", "flash-gluon,nope"], "unknown ['nope']"),
    (["--rows", "256:16384"], "names none of the rows"),
])
def test_bad_arguments_are_refused_by_name(args: list[str], says: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    script = load_benchmark_script("step_kernels")
    # As on a GPU host (the arguments are checked before anything runs there).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script, "interpreter_active", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        script.main(args)
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    script = load_benchmark_script("step_kernels")
    monkeypatch.setattr(script, "interpreter_active", lambda: False)
    assert script.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_implementation_this_setup_lacks_is_named() -> None:
    """The builders are the masked bench's own: on the CPU smoke setup (no Flex, no Gluon) a
    Flex step is refused by name, with what does run there."""
    script = load_benchmark_script("step_kernels")
    bench = script.bench
    case = bench.prepare(bench.SMOKE, 32, 128, "random:0.3")
    assert callable(script.attention_of("ours", case, bench.SMOKE))
    with pytest.raises(ValueError, match=r"'flex' does not train here; here: \['ours'\]"):
        script.attention_of("flex", case, bench.SMOKE)
