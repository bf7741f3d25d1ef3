"""Host-side helpers the forward and backward kernel modules share.

Imports only torch-free Python: the kernel modules are exported as standalone source, and
``templates.base.inline_template_imports`` pastes this module into them there.
"""

from __future__ import annotations

CAUSAL_MODES = ("none", "top_left", "bottom_right")
LOG2_E = 1.4426950408889634
# ln(2) = 1 / LOG2_E: the kernels keep the logsumexp in base 2 and store it as ln (x * LN_2).
LN_2 = 0.6931471805599453


def check_softcap(value: object, name: str = "softcap") -> float:
    """``value`` as the cap of softcapped scores (c = cap * tanh(s / cap), Gemma 2's
    ``attn_logit_softcapping``): a finite number >= 0, 0 or None meaning none; returned as a
    float, so 50 and 50.0 are one problem."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a finite number >= 0 (0 or None: no cap), but got "
                        f"{type(value).__name__} {value!r}")
    cap = float(value)
    if not (cap >= 0.0 and cap != float("inf")):  # also refuses NaN
        raise ValueError(f"{name} must be a finite number >= 0 (0 or None: no cap), but got "
                         f"{value!r}")
    return cap


def block_d_for(head_dim: int) -> int:
    """The kernels' padded head dim: the next power of two, at least 16 (tl.dot's minimum K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def causal_offset(mode: str, seqlen_q: int, seqlen_kv: int) -> int:
    """Row i may see keys j <= i + offset: 0 top-left (SDPA), N_kv - N_q bottom-right (FA2)."""
    return seqlen_kv - seqlen_q if mode == "bottom_right" else 0


def normalize_causal(causal: bool | str) -> str:
    """True means SDPA's top-left alignment; strings name the mode."""
    if isinstance(causal, bool):
        return "top_left" if causal else "none"
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    raise ValueError(f"causal must be a bool or one of {list(CAUSAL_MODES)}, but got {causal!r}")


def output_strides(shape: tuple[int, ...], q_strides: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of the forward's o (B, H, N, D), as the kernels write it.

    Laid out as q when q is a (B, N, H, D) tensor viewed as (B, H, N, D) (transformers'
    layout: its attention returns ``o.transpose(1, 2).contiguous()``, a copy unless o is laid
    out so; torch SDPA's cuDNN backend returns that layout, and the copy cost 90 us a layer of
    an 8k Llama prefill on the H100); contiguous otherwise. Where H or N is 1 both layouts
    hold the same bytes, and o is contiguous.
    """
    batch, heads, seqlen, head_dim = shape
    if heads > 1 and seqlen > 1 and q_strides[2] > q_strides[1]:
        return (seqlen * heads * head_dim, head_dim, heads * head_dim, 1)
    return (heads * seqlen * head_dim, seqlen * head_dim, head_dim, 1)
