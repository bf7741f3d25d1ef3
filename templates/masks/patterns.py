"""The named block-mask patterns (``Problem.mask``, ``BlockMask.pattern``): their syntax and
validity, as strings only.

Kept apart from ``templates.masks.mods`` (which builds their masks) so that ``BlockMask`` can
validate its ``pattern`` without importing the module that imports it: problem validation
(e.g. a service query) must stay cheap at any length, so nothing here builds a mask.
"""

from __future__ import annotations

import math

__all__ = ["PATTERNS", "documents_pattern", "parse_pattern", "pattern_problem"]

PATTERNS = ("random:<density>", "sliding:<window>", "sliding_causal:<window>",
            "document:<count>", "documents:<length>", "documents_causal:<length>",
            "prefix:<length>", "causal")


def parse_pattern(pattern: str) -> tuple[str, str]:
    """(name, argument) of ``name:argument`` (argument "" when there is none)."""
    name, _, arg = pattern.partition(":")
    return name, arg


def pattern_problem(pattern: str, seqlen_q: int, seqlen_kv: int) -> str | None:
    """Why ``pattern`` is not a valid mask for (N_q, N_kv) (None if it is)."""
    name, arg = parse_pattern(pattern)
    try:
        if name == "random" and 0.0 < float(arg) <= 1.0:
            return None
        if name in ("sliding", "prefix") and int(arg) >= 0:
            return None
        if name == "sliding_causal" and int(arg) >= 1:  # 0 would hide every key
            return None
        if name == "document" and 1 <= int(arg) <= seqlen_q and seqlen_q == seqlen_kv:
            return None
        if (name in ("documents", "documents_causal") and 1 <= int(arg) <= seqlen_q
                and seqlen_q == seqlen_kv):
            return None
        if name == "causal" and not arg:
            return None
    except ValueError:
        pass
    return (f"unknown or malformed mask pattern {pattern!r} for N_q={seqlen_q}, "
            f"N_kv={seqlen_kv}; patterns: {list(PATTERNS)} (random density in (0, 1], "
            f"sliding_causal window >= 1, document, documents and documents_causal need "
            f"N_q == N_kv and a count or length in [1, N_q])")


def documents_pattern(lengths: list[int], *, causal: bool) -> str | None:
    """The pattern that prices packed documents of these lengths (``documents:<L>`` or
    ``documents_causal:<L>``; None for no tokens), L the power of two nearest (in log2) to
    the length of the document an average *token* is in, sum(len^2) / sum(len). The
    pattern's own mask is mixed documents of that per-token length
    (``templates.masks.mods.standin_document_lengths``).

    That length, not the mean document length, because it keeps the work: a row of
    documents of lengths l_i visits sum(l_i^2) / N^2 of the scores (a 16k row of lengths
    200-4000 has a mean of ~1.2k but a per-token length of ~2.7k; documents of 1.2k would
    price a third of its blocks). Rounding to a power of two is the bucket, as sequence
    lengths are bucketed."""
    total = sum(lengths)
    if total == 0:
        return None
    per_token = sum(n * n for n in lengths) / total
    exponent = max(0, round(math.log2(per_token)))
    length = min(1 << exponent, total)
    return f"{'documents_causal' if causal else 'documents'}:{length}"

