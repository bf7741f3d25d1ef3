"""``gluon_cudnn_train``: the Gluon forward with cuDNN's backward (``templates.pytorch.cudnn_bwd``).

CPU: what the template takes and refuses, its price (3.5x the forward's FLOPs, as
torch_sdpa_train), the backward's input checks. GPU (``gpu`` marker, Hopper): the template's
run against its reference on odd shapes, GQA, N_q != N_kv, fp16/bf16, D 64/128/256
(``tuner.attention``'s training path through it:
tests/tuner/dispatch/test_dispatch_gluon_training.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.kernel_common import normalize_causal
from templates.pytorch.cudnn_bwd import cudnn_backward_problem
from templates.registry import get_template
from tests.api.serving_data import H100

TRAIN = get_template("gluon_cudnn_train")
FWD = get_template("gluon_fwd")


def problem(**kw: Any) -> Problem:
    base = dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=300, head_dim=128,
                dtype="bfloat16", causal="top_left")
    return Problem(**{**base, **kw})  # type: ignore[arg-type]


def test_takes_dense_and_causal_problems_with_the_forwards_knobs() -> None:
    p = problem()
    assert TRAIN.unsupported(p) is None
    assert TRAIN.unsupported(problem(causal="none", heads_kv=4)) is None
    assert TRAIN.unsupported(problem(causal="bottom_right")) is None  # N_q = N_kv: top-left
    assert TRAIN.config_cls is FWD.config_cls
    assert TRAIN.default_config(p, H100) == FWD.default_config(p, H100)
    assert TRAIN.flops(p) == 3.5 * FWD.flops(p)
    assert TRAIN.version() != FWD.version()


@pytest.mark.parametrize(("kw", "why"), [
    ({"mask": "sliding:128"}, "no block mask"),
    ({"seqlen_q": 100, "causal": "bottom_right"}, "top-left"),
    ({"dtype": "float32"}, "float16 or bfloat16"),
    ({"head_dim": 96}, "head_dim"),
])
def test_refuses_what_cudnn_or_the_forward_cannot_take(kw: dict[str, Any], why: str) -> None:
    assert why in (TRAIN.unsupported(problem(**kw)) or "")


def test_exports_no_source_and_says_what_to_export_instead() -> None:
    with pytest.raises(NotImplementedError, match="export gluon_fwd"):
        TRAIN.standalone_source(TRAIN.default_config(problem(), H100))


def test_the_backward_checks_its_inputs() -> None:
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 8)
    assert "CUDA" in (cudnn_backward_problem(q, q, kv, kv, q, lse) or "")


# ----------------------------------------------------------------------------- GPU
CASES = [  # (B, H_q, H_kv, N_q, N_kv, D, dtype, causal)
    (2, 4, 4, 256, 256, 128, torch.bfloat16, False),
    (1, 4, 4, 333, 333, 128, torch.bfloat16, True),
    (1, 8, 2, 300, 300, 64, torch.float16, True),
    (1, 4, 1, 128, 515, 128, torch.bfloat16, True),
    (1, 4, 4, 1000, 1000, 64, torch.bfloat16, False),
    (1, 2, 2, 512, 512, 256, torch.bfloat16, True),
    (2, 8, 8, 2048, 2048, 128, torch.float16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_template_matches_its_reference_on_the_gpu(case: tuple[Any, ...]) -> None:
    b, hq, hkv, nq, nkv, d, dtype, causal = case
    p = Problem(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_kv=nkv, head_dim=d,
                dtype=str(dtype).removeprefix("torch."), causal=normalize_causal(causal))
    from templates.device import current_device

    inputs = TRAIN.make_inputs(p, "cuda")
    out = TRAIN.run(inputs, TRAIN.default_config(p, current_device()))
    ref = TRAIN.reference(inputs)
    assert all(float(g.abs().max()) > 0 for g in out)
    assert TRAIN.error(out, ref) < TRAIN.tolerance(p)
