"""Mask functions ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for ``BlockMask.from_mask_mod``,
their combinators, and the named patterns a sweep spec uses (``Problem.mask``).

Each takes broadcasting index tensors, as FlexAttention's mask_mods do, so one function serves
any block of any mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, BlockMask, MaskMod
from templates.masks.document_offsets import DocumentOffsets
from templates.masks.patterns import PATTERNS, parse_pattern, pattern_problem

__all__ = ["and_masks", "causal_mask", "document_mask", "or_masks", "pattern_block_mask",
           "pattern_density", "pattern_problem", "prefix_lm_mask", "sliding_window_mask",
           "PATTERNS"]


def causal_mask(offset: int = 0) -> MaskMod:
    """Query i sees keys j <= i + offset (0: top-left as SDPA; N_kv - N_q: bottom-right)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        return k <= q + offset

    return mask_mod


def sliding_window_mask(window: int, *, causal: bool = False) -> MaskMod:
    """Local attention: |i - j| <= window, or 0 <= i - j <= window with ``causal``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative int, but got {window!r}")

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        if causal:
            return (k <= q) & (q - k <= window)
        return (q - k).abs() <= window

    return mask_mod


def prefix_lm_mask(prefix_length: int) -> MaskMod:
    """Prefix-LM: every query sees the first ``prefix_length`` keys, and causally after them."""
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
        raise ValueError(f"prefix_length must be a non-negative int, but got {prefix_length!r}")

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        return (k < prefix_length) | (k <= q)

    return mask_mod


def document_mask(lengths: list[int] | torch.Tensor, *, causal: bool = False,
                  device: torch.device | str = "cpu") -> MaskMod:
    """Packed sequences: a query sees only keys of its own document (documents given by their
    lengths, in order), causally within it with ``causal``; positions past the last document
    (padding) see nothing."""
    lengths_t = torch.as_tensor(lengths, device=device)
    if lengths_t.dim() != 1 or lengths_t.numel() == 0 or bool((lengths_t < 1).any()):
        raise ValueError(f"lengths must be a non-empty list of positive ints, but got {lengths!r}")
    doc_of = torch.repeat_interleave(torch.arange(lengths_t.numel(), device=device), lengths_t)
    total = doc_of.numel()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        # Positions past the documents see nothing. Clamped indexing, not a Python check, so
        # FlexAttention can trace this same function.
        inside = (q < total) & (k < total)
        # The table follows the indices: a mask built for the CPU (the default) and evaluated
        # on a GPU block mask still answers (a copy per call; pass ``device`` to avoid it).
        table = doc_of if doc_of.device == q.device else doc_of.to(q.device)
        same = table[q.clamp(max=total - 1)] == table[k.clamp(max=total - 1)]
        visible = inside & same
        return visible & (k <= q) if causal else visible

    return mask_mod


def and_masks(*mods: MaskMod) -> MaskMod:
    """Visible where every mask says so."""
    return _combined("and_masks", torch.logical_and, mods)


def or_masks(*mods: MaskMod) -> MaskMod:
    """Visible where any mask says so."""
    return _combined("or_masks", torch.logical_or, mods)


def _combined(name: str, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              mods: tuple[MaskMod, ...]) -> MaskMod:
    if not mods:
        raise ValueError(f"{name} needs at least one mask_mod")

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        out = mods[0](b, h, q, k)
        for mod in mods[1:]:
            out = op(out, mod(b, h, q, k))
        return out

    return mask_mod


def _random_blocks(density: float, seqlen_q: int, seqlen_kv: int, block: int, seed: int,
                   device: torch.device | str) -> MaskMod:
    """Whole blocks kept at random with probability ``density`` (seeded: one pattern per
    problem, so every trial of a sweep times the same mask)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nq, nk = -(-seqlen_q // block), -(-seqlen_kv // block)
    keep = (torch.rand(nq, nk, generator=gen) < density).to(device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        return keep[q // block, k // block]

    return mask_mod


def pattern_mask_mod(pattern: str, seqlen_q: int, seqlen_kv: int, *,
                     block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0,
                     device: torch.device | str = "cpu") -> MaskMod:
    """The mask_mod of a named pattern: ``random:0.1`` (10% of blocks kept), ``sliding:1024``
    (|i - j| <= 1024, both sides), ``sliding_causal:4096`` (i - 4096 < j <= i: the query and
    the 4095 keys before it, transformers' ``sliding_window`` rule, causality included so the
    call passes ``is_causal=False``), ``document:4`` (4 equal documents), ``documents:1024``
    and ``documents_causal:1024`` (packed documents of mixed lengths around 1024 tokens,
    ``standin_document_lengths``, causal within each with the latter: the pattern of packed
    sequences, ``templates.masks.patterns.documents_pattern``), ``prefix:256``, ``causal``.

    ``sliding_causal:<w>`` is a pattern of its own, not ``sliding:<w - 1>`` with a causal
    problem: a causal call applies causality elementwise on every listed block, so the two
    run (and are priced) differently although they see the same keys."""
    reason = pattern_problem(pattern, seqlen_q, seqlen_kv)
    if reason:
        raise ValueError(reason)
    name, arg = parse_pattern(pattern)
    if name == "random":
        return _random_blocks(float(arg), seqlen_q, seqlen_kv, block_size, seed, device)
    if name == "sliding":
        return sliding_window_mask(int(arg))
    if name == "sliding_causal":
        return sliding_window_mask(int(arg) - 1, causal=True)
    if name == "prefix":
        return prefix_lm_mask(int(arg))
    if name == "document":
        base, extra = divmod(seqlen_q, int(arg))
        return document_mask([base + (i < extra) for i in range(int(arg))], device=device)
    if name in ("documents", "documents_causal"):
        return document_mask(standin_document_lengths(int(arg), seqlen_q),
                             causal=name == "documents_causal", device=device)
    return causal_mask()


def pattern_block_mask(pattern: str, seqlen_q: int, seqlen_kv: int, *,
                       block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0,
                       device: torch.device | str = "cpu") -> BlockMask:
    """The (1, 1, N_q, N_kv) BlockMask of a named pattern. With the sweeps' block size and
    seed (``Problem.mask``'s masks) it carries the pattern's name (``BlockMask.pattern``), so
    the dispatcher prices calls with it by that problem's measurements. A documents pattern's
    mask carries its documents (``BlockMask.documents``), as a packed call's does."""
    mod = pattern_mask_mod(pattern, seqlen_q, seqlen_kv, block_size=block_size, seed=seed,
                           device=device)
    named = block_size == DEFAULT_BLOCK_SIZE and seed == 0
    return BlockMask.from_mask_mod(mod, None, None, seqlen_q, seqlen_kv, block_size,
                                   device=device, pattern=pattern if named else None,
                                   documents=pattern_documents(pattern, seqlen_q))


def pattern_documents(pattern: str, seqlen: int) -> DocumentOffsets | None:
    """The documents of a ``document:<n>`` / ``documents[_causal]:<L>`` pattern over
    ``seqlen`` tokens (as ``pattern_mask_mod`` lays them out); None for other patterns."""
    name, arg = parse_pattern(pattern)
    if name == "document":
        base, extra = divmod(seqlen, int(arg))
        return DocumentOffsets.of_lengths([base + (i < extra) for i in range(int(arg))],
                                          causal=False)
    if name in ("documents", "documents_causal"):
        return DocumentOffsets.of_lengths(standin_document_lengths(int(arg), seqlen),
                                          causal=name == "documents_causal")
    return None


# The documents of ``documents[_causal]:<L>``, in units of L, repeated in this order: mixed
# lengths (about L/4 to 2L, none a multiple of a block, as packed documents' lengths are not)
# whose per-token length, sum(l^2) / sum(l), is ~1.28 L, inside the pattern's bucket
# (``templates.masks.patterns.documents_pattern`` rounds it to the nearest power of two).
# Why not equal documents of L: kernels rank differently on those. On the H200 (2026-11-29,
# 16k tokens, 32 / 16 heads, d128, bf16), 13 documents of 274-2849 tokens ran in 0.99 ms by
# the persistent Gluon forward and 0.83 by our Triton forward; equal documents of 2048, 0.67
# and 0.68 (so a sweep chose the Gluon forward, and packed rows ran 20% slower than they
# could); mixed lengths that are multiples of 128, 0.86 and 0.89; these, 1.34 and 1.06: the
# order of the real rows. What the Gluon forward pays for is the partial blocks where
# documents meet inside a block.
STANDIN_DOCUMENTS = (0.23, 1.46, 0.57, 1.94, 1.03, 0.77)


def standin_document_lengths(length: int, seqlen: int) -> list[int]:
    """The document lengths of ``documents[_causal]:<length>`` over ``seqlen`` tokens:
    ``STANDIN_DOCUMENTS`` times ``length`` (at least 1 token each) in turn until the tokens
    run out, the last document what is left."""
    lengths: list[int] = []
    left, i = seqlen, 0
    while left > 0:
        n = min(left, max(1, round(STANDIN_DOCUMENTS[i % len(STANDIN_DOCUMENTS)] * length)))
        lengths.append(n)
        left -= n
        i += 1
    return lengths


def pattern_density(pattern: str, seqlen_q: int, seqlen_kv: int) -> float:
    """Fraction of the blocks a pattern visits (to report beside dense-equivalent TFLOP/s)."""
    return pattern_block_mask(pattern, seqlen_q, seqlen_kv).density()
