"""Softcapped scores (Gemma 2's ``attn_logit_softcapping``) inside the flash kernels.

The kernels keep scores in the log2 domain (``s2 = q.k * scale * log2(e)``), so the cap is
applied there: with ``cap2 = cap * log2(e)``, ``cap2 * tanh(s2 / cap2)`` is exactly
``log2(e) * cap * tanh(scale * q.k / cap)``, the capped score the softmax takes, in the units
the rest of the kernel works in.

tanh is built from exp2: ``tanh(x) = 1 - u`` with ``u = 2 / (exp(2x) + 1)``. exp2 is what
Triton's interpreter and every GPU target have alike (libdevice's tanh is CUDA's only, and
``tl.math`` has none); at large ``|x|`` exp2 gives inf or 0 and the cap comes out exactly
``±cap2``, never NaN. Near 0, ``1 - u`` cancels (an absolute error of fp32's epsilon, times the
cap: 1e-3 of a score at a cap of 1e4), so ``|x| < SERIES_BELOW`` takes tanh's odd series to
x^7 instead (its first left-out term is below 2e-10 of x there). The backward's slope
``1 - tanh^2`` is ``u * (2 - u)`` where ``t`` nears ±1 (``1 - t * t`` would cancel there) and
``1 - t * t`` on the series side.

This module imports only triton: the kernel modules that use it are exported as standalone
source, with it inlined (``templates.base.inline_template_imports``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2 log2(e), so that exp(2x) = exp2(x * TWO_LOG2_E_JIT); a jit function reads a global only as
# a constexpr.
TWO_LOG2_E_JIT = tl.constexpr(2.8853900817779268)


SERIES_BELOW = tl.constexpr(0.125)


@triton.jit
def _tanh(s2, cap2):
    """(tanh(x), u = 1 - tanh(x), whether x took the series) for ``x = s2 / cap2`` (fp32)."""
    x = s2 * (1.0 / cap2)
    u = 2.0 / (tl.math.exp2(x * TWO_LOG2_E_JIT) + 1.0)
    x2 = x * x
    series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))
    small = tl.abs(x) < SERIES_BELOW
    return tl.where(small, series, 1.0 - u), u, small


@triton.jit
def softcapped(s2, cap2):
    """The capped log2-domain scores ``cap2 * tanh(s2 / cap2)``."""
    t, u, small = _tanh(s2, cap2)
    return cap2 * t


@triton.jit
def softcapped_with_slope(s2, cap2):
    """(capped scores, ``d capped / d s2`` = ``1 - tanh^2``), for the backward."""
    t, u, small = _tanh(s2, cap2)
    return cap2 * t, tl.where(small, 1.0 - t * t, u * (2.0 - u))
