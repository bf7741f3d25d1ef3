"""benchmarks/e2e_profile.py's sums (the script itself needs a GPU and transformers): kernels
counted once each, and the attention kernels told from the rest by name, as the H200's
profiles of this project's steps named them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.benchmarks.benchmark_scripts import load_benchmark_script

SCRIPT = load_benchmark_script("e2e_profile")
CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name: str, us: float, device: torch.autograd.DeviceType = CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, self_device_time_total=us, device_type=device)


def test_kernels_are_counted_once_and_attention_by_name() -> None:
    events = [
        event("aten::mm", 700.0, CPU),  # an operator: its kernel's time again, not counted
        event("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 700.0),
        event("_gluon_bwd_split_kernel", 3000.0), event("_gluon_bwd_split_kernel", 3100.0),
        event("_gluon_bwd_preprocess_kernel", 60.0), event("_dq_cast_kernel", 50.0),
        event("_gluon_fwd_kernel", 900.0), event("_flash_fwd_kernel", 400.0),
        event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 3700.0),
        event("triton_tem_fused_flex_attention_backward_1", 980.0),
        event("void at::native::vectorized_elementwise_kernel<4, ...>", 120.0),
    ]
    kernels = SCRIPT.kernel_ms(events)
    assert "aten::mm" not in kernels
    assert abs(kernels["_gluon_bwd_split_kernel"] - 6.1) < 1e-9
    assert abs(sum(kernels.values()) - 13.01) < 1e-9
    attention = {k for k in kernels if SCRIPT.is_attention_kernel(k)}
    assert attention == {"_gluon_bwd_split_kernel", "_gluon_bwd_preprocess_kernel",
                         "_dq_cast_kernel", "_gluon_fwd_kernel", "_flash_fwd_kernel",
                         "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16",
                         "triton_tem_fused_flex_attention_backward_1"}
