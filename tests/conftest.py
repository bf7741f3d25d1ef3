"""Test-wide set-up: kernels run under Triton's interpreter when there is no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# The slow groups, beside the tests marked `slow` where they are: `make test` leaves them out
# (-m "not slow"), `make test-all` and CI (.ci/run) run them. The seconds are what each took
# under `pytest --durations` on the 2-core CPU machine shared with other jobs (2026-11-29),
# where the whole suite took 29.5 min and the rest (1212 tests) 4.2 (issue 41, item 2). A file
# marks all its tests; file::function all its parametrizations.
SLOW = {
    "tests/api/test_schemathesis.py": 213,  # the schema fuzzer, every operation
    "tests/api/test_api.py::test_a_bad_item_rejects_the_whole_upload": 18,
    "tests/api/test_api.py::test_bad_input_is_a_json_4xx": 10,
    # Kernels under the Triton interpreter.
    "tests/templates/flash/test_block_sparse.py::test_attn_mask_broadcasts": 20,
    "tests/templates/flash/test_block_sparse.py::test_random_block_masks": 13,
    "tests/templates/flash/test_block_sparse.py::test_per_batch_and_head_mask_mod_and_combining": 5,
    "tests/templates/flash/test_block_sparse.py::test_from_dense_round_trips": 5,
    "tests/templates/flash/test_block_sparse_bwd.py::test_attn_masks_broadcast": 47,
    "tests/templates/flash/test_block_sparse_bwd.py::"
    "test_random_block_masks_per_batch_and_head": 45,
    "tests/templates/flash/test_block_sparse_bwd.py::"
    "test_helper_masks_with_causal_gqa_and_the_default_config": 25,
    "tests/templates/flash/test_block_sparse_bwd.py::test_skipped_blocks_are_never_read": 9,
    "tests/templates/flash/test_flash_bwd.py::test_strided_bnhd_views_match_contiguous_inputs": 26,
    "tests/templates/flash/test_flash_bwd.py::test_autograd_function_matches_reference": 22,
    "tests/templates/flash/test_flash_bwd.py::test_grads_match_reference_fp16": 16,
    "tests/templates/flash/test_flash_bwd.py::test_float32_inputs_explicit_scale_and_configs": 9,
    "tests/templates/flash/test_flash_bwd.py::"
    "test_standalone_source_imports_and_matches_the_template": 9,
    "tests/templates/flash/test_flash_bwd.py::test_make_inputs_are_random_reproducible_and_run": 7,
    "tests/templates/flash/test_flash_bwd.py::"
    "test_large_scores_neither_overflow_nor_lose_accuracy": 6,
    "tests/templates/decode/test_flash_decode.py::"
    "test_fused_combine_with_empty_and_single_tile_sequences": 38,
    "tests/templates/decode/test_flash_decode.py::"
    "test_fused_combine_matches_separate_and_reference": 29,
    "tests/templates/decode/test_flash_decode.py::test_fused_combine_reuses_its_counters": 7,
    "tests/tuner/test_attention.py::"
    "test_the_first_call_may_be_a_training_step_in_a_fresh_process": 22,
    "tests/tuner/test_attention.py::test_compiles_without_graph_breaks_forward_and_backward": 4,
    "tests/tuner/dispatch/test_comparison.py::"
    "test_the_service_and_the_database_compare_as_the_dispatcher_chooses": 14,
    # Offline compiles for the H100 (triton's compiler on the CPU).
    "tests/templates/gluon/test_gluon_fwd.py::"
    "test_default_configs_compile_for_the_h100_without_spills": 81,
    "tests/templates/gluon/test_gluon_bwd.py::test_default_configs_compile_for_the_h100": 26,
    "tests/templates/gluon/test_gluon_pack_gqa.py::"
    "test_packed_configs_compile_for_the_h100_without_spills": 14,
    "tests/templates/compile/test_offline_compile.py": 11,
    "tests/tuner/cli/test_compile_check.py": 19,
    "tests/benchmarks/test_benchmark_gluon_sass_diff.py": 12,
    # Sweeps, workers and recordings in fresh processes.
    "tests/tuner/cli/test_sweep_cli.py": 52,
    "tests/tuner/tuning/test_resume_and_workers.py": 90,
    "tests/tuner/tuning/test_verify.py::"
    "test_verify_remeasures_the_stored_best_in_a_fresh_worker": 8,
    "tests/tuner/tuning/test_verify.py::test_a_stored_time_far_off_fails_and_names_the_problem": 3,
    "tests/tuner/tuning/test_verify.py::test_auto_tolerance_and_longer_timing_through_the_cli": 3,
    "tests/tuner/test_record.py": 13,
    "tests/tuner/tuning/test_space.py": 12,
    "tests/tuner/tuning/test_search_storage.py": 7,
    "tests/benchmarks/test_benchmark_dispatch.py": 7,
    "tests/benchmarks/test_benchmark_attention_overhead.py": 5,
    "tests/tuner/tuning/test_tpe_vs_grid.py": 5,
    "tests/benchmarks/test_benchmark_fleet.py::"
    "test_two_workers_one_killed_finish_every_problem_without_duplicates": 75,
    "tests/benchmarks/test_benchmark_rank_agreement.py": 45,
}


def is_slow(nodeid: str) -> bool:
    path, _, test = nodeid.partition("::")
    return path in SLOW or f"{path}::{test.split('[', 1)[0]}" in SLOW


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        # Kernel tests written once for both hosts: the GPU run can select them too.
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.on_device)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Torch device for kernel tests: cuda on a GPU host, cpu (interpreter) otherwise."""
    return "cuda" if HAS_CUDA else "cpu"


def cuda_context_lost() -> bool:
    """Whether this process's CUDA context is poisoned (an illegal address, a device-side
    assert): every later CUDA call in it fails, whatever the test."""
    if not (HAS_CUDA and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
    except RuntimeError:  # torch.AcceleratorError is one
        return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """After a test that left the CUDA context poisoned, stop this process instead of failing
    every test after it with the same error (one GPU run once showed 159 such failures for
    two real ones). Its own report is already out. Under pytest-xdist the worker exits and a
    fresh one runs the rest; alone, pytest stops with a message naming the test."""
    yield
    if not cuda_context_lost():
        return
    message = (f"{item.nodeid} left the CUDA context poisoned (an illegal address or a "
               f"device-side assert): later tests in this process could only fail")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import sys

        print(message, file=sys.stderr, flush=True)
        os._exit(70)
    pytest.exit(message, returncode=1)
