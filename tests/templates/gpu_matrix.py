"""The cases of the GPU matrix tests: every combination in bfloat16, a Latin diagonal in float16.

Each case compiles its own kernels, and compiling is most of a GPU run's time (a device call
lasts at most 10 minutes; scripts/gpu_tests.py). float16 and bfloat16 run the same kernel code
with another element type, so float16 need not meet every combination of the other axes: the
diagonal pairs it with each value of each axis once. Every pair of values of two parameters,
the dtype included, is still tested together (pairwise coverage); bfloat16, the dtype that
GPUs are tuned for, keeps the full product.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch


def bf16_product_fp16_diagonal(*axes: Sequence[Any]) -> list[Any]:
    """``pytest.param(dtype, *values)`` cases: bfloat16 with every combination of ``axes``,
    then float16 with the i-th value of each axis together (shorter axes wrap around)."""
    product = [(torch.bfloat16, *values) for values in itertools.product(*axes)]
    longest = max(len(axis) for axis in axes)
    diagonal = [(torch.float16, *(axis[i % len(axis)] for axis in axes))
                for i in range(longest)]
    return [pytest.param(*case, id="-".join(str(v).removeprefix("torch.") for v in case))
            for case in product + diagonal]
