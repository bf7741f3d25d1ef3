"""Two small Triton templates for testing the tuner without the attention kernels.

``toy_add``: ``out = alpha * x + y`` with a BLOCK x warps space; BLOCK 128 on one warp is
rejected by its static constraint. ``toy_faulty``: the same kernel with a ``fault`` knob
whose values misbehave the way real configs do: a wrong result (the kernel drops ``y``), an
exception at launch, a crashed process (SIGSEGV), a hang. Faults need BLOCK 32 (constraint).

Importing this module registers both (once per process); the tuner's worker processes import
it by its module name, as they would any template outside the ``templates`` package.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from templates.base import KernelConfig, Problem, Template, knob
from templates.device import DeviceInfo
from templates.registry import get_template, register

DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Set by tests that check compile-ahead: precompile() leaves one file per config there.
PRECOMPILE_DIR_ENV = "TOY_PRECOMPILE_DIR"
# Set by tests that count measurements: every launch appends "<inputs token> <template>
# n=<elements> <config key>"; each measurement makes fresh inputs (a new token), so distinct
# tokens per (template, n, config) count its measurements.
MEASURE_LOG_ENV = "TOY_MEASURE_LOG"
# Set by tests that must catch a worker mid-trial: each toy_add measurement sleeps this many
# seconds right after its first launch is logged, before the kernel runs. A measurement whose
# token has exactly one logged launch is therefore in flight, its result not stored yet.
SLOW_ENV = "TOY_SLOW_S"
_slowed: set[str] = set()  # tokens of this process's measurements that have slept already


@triton.jit
def _scaled_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, DROP_Y: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    acc = alpha * x
    if not DROP_Y:
        acc += tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class ToyAddConfig(KernelConfig):
    BLOCK: int = knob(32, [16, 32, 64, 128], "elements per program")
    num_warps: int = knob(1, [1, 2], "warps per program")


@dataclass(frozen=True)
class ToyFaultyConfig(KernelConfig):
    BLOCK: int = knob(32, [32, 64], "elements per program")
    fault: str = knob("none", ["none", "wrong", "raise", "segv", "hang"], "how it misbehaves")


def _elements(problem: Problem) -> int:
    return problem.batch * problem.heads_q * problem.seqlen_q * problem.head_dim


class _ToyBase(Template):
    def flops(self, problem: Problem) -> float:
        return 2.0 * _elements(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return 3.0 * _elements(problem) * torch.tensor([], dtype=DTYPES[problem.dtype]).element_size()

    def default_config(self, problem: Problem, device: DeviceInfo) -> KernelConfig:
        if problem.head_dim == 8:  # a template bug for one problem: the sweep must go on
            raise RuntimeError("toy: no default config for head_dim 8")
        return self.config_cls()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n = _elements(problem)
        dtype = DTYPES[problem.dtype]
        x = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        y = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        return {"x": x, "y": y, "alpha": 0.5 + float(torch.rand(1, generator=gen)),
                "token": f"{os.getpid()}-{seed}-{uuid.uuid4().hex[:8]}"}

    def _log_launch(self, inputs: Mapping[str, Any], config: KernelConfig) -> None:
        log = os.environ.get(MEASURE_LOG_ENV)
        if log:
            with open(log, "a") as f:
                f.write(f"{inputs['token']} {self.name} n={inputs['x'].numel()} "
                        f"{config.key()}\n")

    def _slow_down_once(self, inputs: Mapping[str, Any]) -> None:
        seconds = float(os.environ.get(SLOW_ENV) or 0)
        if seconds > 0 and inputs["token"] not in _slowed:
            _slowed.add(inputs["token"])
            time.sleep(seconds)

    def _launch(self, inputs: Mapping[str, Any], block: int, warps: int, drop_y: bool) -> Any:
        x, y = inputs["x"], inputs["y"]
        out = torch.empty_like(x)
        grid = (triton.cdiv(x.numel(), block),)
        _scaled_add[grid](x, y, out, x.numel(), inputs["alpha"], BLOCK=block, DROP_Y=drop_y,
                          num_warps=warps)
        return out

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return inputs["alpha"] * inputs["x"].float() + inputs["y"].float()

    def precompile(self, problem: Problem, config: KernelConfig) -> bool:
        folder = os.environ.get(PRECOMPILE_DIR_ENV)
        if not folder:
            return False
        Path(folder, config.key().replace(",", "+")).write_text(str(os.getpid()))
        return True


class ToyAdd(_ToyBase):
    name = "toy_add"
    description = "alpha * x + y (tests of the tuner)"
    config_cls = ToyAddConfig

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        assert isinstance(config, ToyAddConfig)
        if config.BLOCK == 128 and config.num_warps == 1:
            return "BLOCK 128 needs at least 2 warps"
        return None

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        return [ToyAddConfig(BLOCK=64, num_warps=2)]

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        assert isinstance(config, ToyAddConfig)
        self._log_launch(inputs, config)
        self._slow_down_once(inputs)
        return self._launch(inputs, config.BLOCK, config.num_warps, drop_y=False)


class ToyFaulty(_ToyBase):
    name = "toy_faulty"
    description = "alpha * x + y with configs that fail in every way (tests of the tuner)"
    config_cls = ToyFaultyConfig

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        assert isinstance(config, ToyFaultyConfig)
        if config.fault != "none" and config.BLOCK != 32:
            return "faults need BLOCK 32"
        return None

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        assert isinstance(config, ToyFaultyConfig)
        self._log_launch(inputs, config)
        if config.fault == "raise":
            raise RuntimeError("toy: simulated launch failure")
        if config.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if config.fault == "hang":
            time.sleep(3600)
        return self._launch(inputs, config.BLOCK, 1, drop_y=config.fault == "wrong")


@dataclass(frozen=True)
class ToyTilesConfig(KernelConfig):
    BLOCK_M: int = knob(64, [16, 32, 64, 128, 256], "rows per program")
    BLOCK_N: int = knob(64, [16, 32, 64, 128, 256], "columns per step (ignored by the toy)")
    num_warps: int = knob(4, [1, 2, 4, 8], "warps per program")
    num_stages: int = knob(2, [1, 2, 3, 4], "pipeline depth (ignored by the toy)")


class ToyTiles(_ToyBase):
    """An attention-like space of 400 configs (48 rejected) for replays of the search."""

    name = "toy_tiles"
    description = "alpha * x + y over an attention-like tile space (tests of the tuner)"
    config_cls = ToyTilesConfig

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        assert isinstance(config, ToyTilesConfig)
        if config.BLOCK_M * config.BLOCK_N > 16384:
            return f"a {config.BLOCK_M}x{config.BLOCK_N} tile exceeds 16384 elements"
        return None

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        assert isinstance(config, ToyTilesConfig)
        return self._launch(inputs, config.BLOCK_M, config.num_warps, drop_y=False)


def _register(template: Template) -> None:
    try:
        get_template(template.name)
    except ValueError:
        register(template)


_register(ToyAdd())
_register(ToyFaulty())
_register(ToyTiles())


def measurements(log_path: Path) -> dict[tuple[str, str, str], set[str]]:
    """(template, "n=<elements>", config key) -> the tokens of its measurements."""
    found: dict[tuple[str, str, str], set[str]] = {}
    if not log_path.exists():
        return found
    for line in log_path.read_text().splitlines():
        token, template, n, key = line.split(" ")
        found.setdefault((template, n, key), set()).add(token)
    return found


def launches(log_path: Path) -> Counter[str]:
    """Measurement token -> launches logged for it, in the order the tokens first appear."""
    counts: Counter[str] = Counter()
    if log_path.exists():
        for line in log_path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):  # a line still being written is not counted yet
                counts[line.split(" ", 1)[0]] += 1
    return counts
