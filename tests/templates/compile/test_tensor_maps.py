"""``templates.compile.tensor_maps`` against Triton's own descriptor handling, on the CPU.

The compiled launcher is a real ``CudaLauncher`` of the installed Triton with its real
descriptor wrapper (``wrap_handle_tensordesc``) around a stand-in C launcher that records what
it gets, and a stand-in driver whose ``fill_tma_descriptor`` returns its arguments: a direct
launch must hand the C launcher exactly what Triton's path hands it, and encode a tensor map
only for an address it has not seen. The same file runs under triton 3.6 and 3.9 (both
launcher conventions); the GPU tests of test_direct_launch_fwd.py check the real thing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.backends.nvidia.driver as nvidia
from triton.runtime import driver as runtime_driver
from triton.tools.tensor_descriptor import TensorDescriptor

from templates.compile import tensor_maps
from templates.compile.direct_launch import DirectLaunch, PlannedDescriptor

NAMES = ["QD", "X", "KD", "n", "BLOCK"]
SIGNATURE = {"QD": "tensordesc<fp16[16, 16]>", "X": "*fp32", "KD": "tensordesc<fp16[8, 16]>",
             "n": "i32", "BLOCK": "constexpr"}
METAS = [{"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [16, 16],
          "fp4_padded": False},
         {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [8, 16],
          "fp4_padded": False}]
GRID, STREAM, FUNCTION, METADATA = (3, 1, 1), 1234, 77, (4, 1, 0)


class _Utils:
    def __init__(self) -> None:
        self.fills: list[tuple[Any, ...]] = []

    def fill_tma_descriptor(self, *args: Any) -> tuple[Any, ...]:
        self.fills.append(args)
        return ("tensor map", *args)

    fill_tma_descriptor_tiled = fill_tma_descriptor  # its name in triton 3.9


class _Driver:
    def __init__(self) -> None:
        self.utils = _Utils()


@pytest.fixture
def fills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    driver = _Driver()
    monkeypatch.setattr(runtime_driver, "_active", driver)
    return driver.utils.fills


def _launcher(calls: list[tuple[Any, ...]], metas: Any = METAS, scratch: int = 0) -> Any:
    """A CudaLauncher as Triton builds it, less the compiled C module."""
    run = object.__new__(nvidia.CudaLauncher)
    run.launch = nvidia.wrap_handle_tensordesc(lambda *args: calls.append(args), SIGNATURE,
                                               metas)
    run.global_scratch_size, run.profile_scratch_size = scratch, 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl, run.num_ctas = False, True, 1
    run.gsan_enabled = False
    run.arg_annotations, run.kernel_signature = "annotations", b"signature"
    return run


class _Compiled:
    function, packed_metadata = FUNCTION, METADATA

    def __init__(self, run: Any) -> None:
        self.run = run


class _Kernel:
    arg_names = NAMES

    def __init__(self, run: Any) -> None:
        self.compiled = _Compiled(run)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.compiled


def _makers() -> dict[int, PlannedDescriptor]:
    return {0: PlannedDescriptor(lambda t: TensorDescriptor.from_tensor(t, [16, 16])),
            2: PlannedDescriptor(lambda t: TensorDescriptor.from_tensor(t, [8, 16]))}


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(64, 32).half(), torch.zeros(10), torch.randn(40, 16).half())


def _through_triton(run: Any, makers: dict[int, PlannedDescriptor], qd: torch.Tensor,
                    x: Any, kd: torch.Tensor) -> None:
    """What the JIT calls once it has the compiled kernel: descriptors as objects."""
    run(*GRID, STREAM, FUNCTION, METADATA, None, None, None, makers[0](qd), x, makers[2](kd),
        5, 16)


def test_direct_launches_hand_the_launcher_what_triton_does(fills: list[Any]) -> None:
    calls: list[tuple[Any, ...]] = []
    run = _launcher(calls)
    makers = _makers()
    launch = DirectLaunch(_Kernel(run), GRID[:1], {"BLOCK": 16}, {}, makers)
    qd, x, kd = _tensors()
    launch.launch_on(STREAM, qd, x, kd, 5)  # "compiles": adopts the launcher
    assert launch.keeps_tensor_maps
    for _ in range(2):
        assert launch.try_direct(STREAM, qd, x.data_ptr(), kd, 5)
    _through_triton(run, makers, qd, x.data_ptr(), kd)
    assert calls[0] == calls[1] == calls[2], "a direct launch differs from Triton's"
    # One map per descriptor for the direct launches (the first), two more for Triton's.
    assert len(fills) == 4 and fills[0][0] == qd.data_ptr() and fills[1][0] == kd.data_ptr()


def test_a_new_address_gets_its_own_map(fills: list[Any]) -> None:
    calls: list[tuple[Any, ...]] = []
    run = _launcher(calls)
    makers = _makers()
    launch = DirectLaunch(_Kernel(run), GRID[:1], {"BLOCK": 16}, {}, makers)
    qd, x, kd = _tensors()
    launch.launch_on(STREAM, qd, x, kd, 5)
    other = torch.randn(64, 32).half()
    assert launch.try_direct(STREAM, other, 0, kd, 5)
    assert launch.try_direct(STREAM, qd, 0, kd, 5)
    # The first call went through the (stand-in) JIT: the maps are encoded by direct launches.
    assert [f[0] for f in fills] == [other.data_ptr(), kd.data_ptr(), qd.data_ptr()]
    _through_triton(run, makers, other, 0, kd)
    assert calls[0] == calls[2]


def test_kept_maps_per_slot_are_bounded(fills: list[Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_maps, "MAX_KEPT_MAPS", 2)
    launch = DirectLaunch(_Kernel(_launcher([])), GRID[:1], {"BLOCK": 16}, {}, _makers())
    qd, x, kd = _tensors()
    launch.launch_on(STREAM, qd, x, kd, 5)
    outputs = [torch.randn(64, 32).half() for _ in range(3)]
    for o in outputs:
        launch.try_direct(STREAM, o, 0, kd, 5)
    kept = launch._tensor_maps._slots[0][1]  # type: ignore[union-attr]
    assert list(kept) == [outputs[2].data_ptr()]


@pytest.mark.parametrize("why", ["scratch", "no metadata", "other positions"])
def test_launchers_not_understood_get_descriptor_objects(fills: list[Any], why: str) -> None:
    calls: list[tuple[Any, ...]] = []
    run = _launcher(calls, metas=None if why == "no metadata" else METAS,
                    scratch=64 if why == "scratch" else 0)
    makers = _makers()
    positions = {0: makers[0], 1: makers[2]} if why == "other positions" else makers
    assert tensor_maps.tensor_map_launch(_Compiled(run), list(positions),
                                         list(positions.values()), (16,)) is None


def test_descriptor_objects_reach_the_launcher_where_maps_are_not_kept() -> None:
    received: list[tuple[Any, ...]] = []

    class Run:  # not a CudaLauncher: the compiled kernel's run, as the JIT calls it
        def __call__(self, *args: Any) -> None:
            received.append(args)

    makers = _makers()
    launch = DirectLaunch(_Kernel(Run()), GRID[:1], {"BLOCK": 16}, {}, makers)
    qd, x, kd = _tensors()
    launch.launch_on(STREAM, qd, x, kd, 5)
    assert not launch.keeps_tensor_maps
    assert launch.try_direct(STREAM, qd, 8, kd, 5)
    (args,) = received
    assert args[:9] == (*GRID, STREAM, FUNCTION, METADATA, None, None, None)
    descs = args[9], args[11]
    assert all(isinstance(d, TensorDescriptor) for d in descs)
    assert descs[0].base is qd and descs[1].base is kd and descs[1].block_shape == [8, 16]
    assert args[10] == 8 and args[12:] == (5, 16)
