"""Shared set-up of the tuner tests: the toy templates, registered in this process."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.tuner.toy_templates  # noqa: F401  (registers toy_add, toy_faulty, toy_tiles)
from db.models import TrialStatus
from templates import Problem, current_device, get_template
from templates.attention_reference import attention_reference
from tuner.attention import clear_plans
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.tuning.replay import RecordedProblem
from tuner.tuning.runner.outcome import TrialOutcome

TOY_PROBLEM = Problem(1, 1, 1, 16, 16, 16, "float16")


@pytest.fixture
def no_tuned_configs(tmp_path: Path) -> Iterator[None]:
    """No database, no service, no kept plan: whatever the environment says, unless a test
    stores one (tests of tuner.attention, the dispatcher and recording)."""
    from tuner.settings import load_settings

    # No shipped tables either (tuner.lookup.shipped): a table shipped for a test device's model
    # would otherwise answer these tests' problems.
    set_resolver(ConfigResolver(load_settings(database_url=f"sqlite:///{tmp_path / 'no.db'}",
                                              url=None), shipped_dir=None))
    clear_plans()
    yield
    clear_plans()
    set_resolver(None)


@pytest.fixture
def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Calls of templates.pytorch.flex.flex, which answers with the reference (compiling Flex
    on the CPU takes ~10 s per shape, and it has no CPU backward)."""
    import templates.pytorch.flex

    calls: list[dict[str, Any]] = []

    def recorder(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
                 **kwargs: Any) -> torch.Tensor:
        calls.append({"block_mask": block_mask, **kwargs})
        group = q.shape[1] // k.shape[1]
        return attention_reference(q, k.repeat_interleave(group, 1),
                                   v.repeat_interleave(group, 1), causal=kwargs["causal"],
                                   scale=q.shape[-1] ** -0.5, mask=block_mask.to_dense())[0]

    monkeypatch.setattr(templates.pytorch.flex, "flex", recorder)
    return calls


def tiles_landscape() -> RecordedProblem:
    """A recorded toy_tiles problem: a smooth landscape with one best config (BLOCK_M=128,
    BLOCK_N=64, 4 warps, 3 stages: 100 TFLOP/s), 8 warps x 4 stages failing to compile,
    and BLOCK_N=16 x 1 stage never recorded."""
    template = get_template("toy_tiles")
    device = current_device()
    trials: dict[str, TrialOutcome] = {}
    configs: dict[str, dict] = {}
    for c in template.config_cls.grid():
        if template.constraint(TOY_PROBLEM, c, device):
            continue
        if c.BLOCK_N == 16 and c.num_stages == 1:
            continue
        configs[c.key()] = c.to_dict()
        if c.num_warps == 8 and c.num_stages == 4:
            trials[c.key()] = TrialOutcome(TrialStatus.COMPILE_ERROR, "out of registers")
            continue
        lg = math.log2
        tflops = (100 - 3 * (lg(c.BLOCK_M) - 7) ** 2 - 2 * (lg(c.BLOCK_N) - 6) ** 2
                  - 4 * (lg(c.num_warps) - 2) ** 2 - 1.5 * (c.num_stages - 3) ** 2)
        trials[c.key()] = TrialOutcome(TrialStatus.OK, tflops=tflops,
                                       median_ms=template.flops(TOY_PROBLEM) / tflops / 1e9)
    return RecordedProblem(template="toy_tiles", template_version=template.version(),
                           device=device.to_dict() | {"key": device.key},
                           problem=TOY_PROBLEM.to_dict(),
                           problem_key=template.problem_key(TOY_PROBLEM), trials=trials,
                           configs=configs)


@pytest.fixture(scope="session")
def landscape() -> RecordedProblem:
    return tiles_landscape()


# The storage fixtures of tests/db: a fresh SQLite file, and a fresh PostgreSQL schema
# (skipped with the reason when no server answers).
from tests.db.conftest import db_url, postgres_server, sqlite_url  # noqa: E402, F401
