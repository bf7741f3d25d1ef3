"""transformers' mask rule (a ``mask_function(batch, head, q_idx, kv_idx)``) straight to a
``BlockMask``, for the causal, sliding-window, chunked and packed layers of a prefill or a
training step: no (L, L) tensor is made.

The rule is a closure transformers composes per forward, so its structure is read off the
rule itself, in O(L) and O(blocks) evaluations:

1. probe: every query sees itself, never the next key, and the previous key unless it starts
   a *segment* (a packed document, a chunk, or a window of 1), per batch row;
2. the hypothesis: query i sees key j iff they are in one segment, j <= i and, with a window
   w (transformers' ``local_size``: the sliding window, or the chunk size, which no segment
   exceeds), i - j < w. It classifies every block as empty, full or open;
3. the open blocks (segment edges, the diagonal, the window's edge) are evaluated element by
   element by transformers' rule itself, so every stored tile is exact;
4. the blocks taken as empty or full are checked at 9 points each (3 x 3: corners, edge
   midpoints, centre) against the rule. Any disagreement: not this family of rule, None
   (the caller falls back to transformers' own mask). Within a segment, the rules of this
   family are intersections of half-planes (j <= i, i - j < w), so a block whose corners
   all lie inside is inside, and one whose corners all lie outside one half-plane is
   outside it; the midpoints and centre catch a rule that is not of this family more often,
   but not always: such a rule differing from the hypothesis only strictly inside blocks
   the hypothesis calls empty or full, and the probe, is not caught.

Cost per forward: ~3 L evaluations of the rule, 9 per block, and the open blocks' elements
(O(L x block)), and one read from the device (a new layout also builds its BlockMask): for a
causal 8k prefill some 280 small operations (torch's profiler) and a wait for the GPU, all
before the first layer, where transformers' own "sdpa" mask function returns at once. So a
rule seen before (``mask_rule_key``: the same code
and closure values, as transformers' causal, sliding and chunk-free rules are from one forward
to the next) gets the verdict read off it the first time, with nothing evaluated; rules that
close over tensors (packed sequences, padding) are read on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch

from templates.compile.plan_cache import PlanCache
from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, EMPTY, EVALUATE, FULL, BlockMask
from templates.masks.document_offsets import DocumentOffsets
from templates.masks.patterns import documents_pattern
from tuner.dispatch.mask_rule_key import rule_key

__all__ = ["CAUSAL", "clear_rule_masks", "rule_block_mask"]

Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CAUSAL: Literal["causal"] = "causal"  # the rule is plain causal attention: no mask needed
MAX_CACHED_MASKS = 8
_MASKS: OrderedDict[tuple[object, ...], BlockMask] = OrderedDict()
# What a rule with a key (``mask_rule_key``) was read to be, per shape: its BlockMask, CAUSAL,
# or None (not of the family), each in a 1-tuple (a miss is None).
_VERDICTS: PlanCache[tuple[BlockMask | Literal["causal"] | None]] = PlanCache(maxsize=32)


def rule_block_mask(rule: Rule, batch: int, length: int, window: int | None,
                    device: torch.device | str, block_size: int = DEFAULT_BLOCK_SIZE
                    ) -> BlockMask | Literal["causal"] | None:
    """The (B|1, 1, L, L) BlockMask of ``rule`` (module docstring), ``CAUSAL`` where it is
    plain causal attention (one segment, no window short of L), or None where ``rule`` is
    not of the causal / window / chunk / packed family. Kept per segment layout, window and
    shape (an LRU of ``MAX_CACHED_MASKS``); the probe and the check run on every call but
    for a rule seen before (module docstring)."""
    device = torch.device(device)
    if window is not None and window < 1:
        return None
    if window is not None and window >= length:
        window = None
    key = rule_key(rule)
    if key is None:
        return _read_rule(rule, batch, length, window, device, block_size)
    verdict_key = (key, batch, length, window, block_size, device)
    found = _VERDICTS.get(verdict_key)
    if found is not None:
        return found[0]
    verdict = _read_rule(rule, batch, length, window, device, block_size)
    _VERDICTS.put(verdict_key, (verdict,))
    return verdict


def _read_rule(rule: Rule, batch: int, length: int, window: int | None, device: torch.device,
               block_size: int) -> BlockMask | Literal["causal"] | None:
    """``rule_block_mask`` read off the rule itself (module docstring, steps 1-4)."""
    # Everything up to the cache lookup runs on the device without reading it back, then one
    # read (the segment ids with the two verdicts): each read waits for the GPU, and a
    # transformers forward asks once per mask type before its first layer.
    segments, probe_ok = _segments(rule, batch, length, device)
    first = torch.arange(0, length, block_size, device=device)
    last = (first + block_size - 1).clamp(max=length - 1)
    kinds = _kinds(segments, first, last, window)
    agrees = _agrees(rule, kinds, batch, first, last, device)
    read = torch.cat([segments.flatten(), torch.stack([probe_ok, agrees]).long()]).cpu()
    if not bool(read[-2]) or not bool(read[-1]):
        return None
    host = read[:-2].view(batch, length)
    if bool((host == host[:1]).all()):  # every batch row alike: one row of blocks
        host, kinds = host[:1], kinds[:1]
    single = bool((host[:, -1] == 0).all())
    if single and window is None:
        return CAUSAL
    starts = tuple(tuple(r.nonzero().flatten().tolist()) for r in torch.diff(
        host, prepend=host[:, :1] - 1, dim=1) != 0)
    key = (starts, length, window, block_size, device)
    mask = _MASKS.get(key)
    if mask is not None:
        _MASKS.move_to_end(key)
        return mask
    mask = BlockMask.from_block_kinds(kinds, rule, length, length, block_size,
                                      pattern=_pattern(starts, length, window, block_size),
                                      documents=_documents(starts, length, window))
    _MASKS[key] = mask
    if len(_MASKS) > MAX_CACHED_MASKS:
        _MASKS.popitem(last=False)
    return mask


def clear_rule_masks() -> None:
    _MASKS.clear()
    _VERDICTS.clear()


def _segments(rule: Rule, batch: int, length: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) segment ids from the probe, and whether the rule is causal with every query
    seeing itself (a 0-d bool tensor, not read here; the ids mean nothing where it is
    False)."""
    b = torch.arange(batch, device=device)[:, None]
    h = torch.zeros(1, 1, dtype=torch.long, device=device)
    i = torch.arange(length, device=device)[None, :]

    def at(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(rule(b, h, q, k), device=device).expand(batch, q.shape[1])

    ok = at(i, i).all() & ~at(i[:, :-1], i[:, 1:]).any()
    starts = ~at(i[:, 1:], i[:, :-1])
    ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device),
                     starts.long().cumsum(-1)], dim=1)
    return ids, ok


def _kinds(segments: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
           window: int | None) -> torch.Tensor:
    """(Bm, 1, n, n) EMPTY / FULL / EVALUATE per block under the hypothesis."""
    q_lo, q_hi = segments[:, first][:, :, None], segments[:, last][:, :, None]
    k_lo, k_hi = segments[:, first][:, None, :], segments[:, last][:, None, :]
    fq, lq = first[None, :, None], last[None, :, None]
    fk, lk = first[None, None, :], last[None, None, :]
    empty = (q_hi < k_lo) | (k_hi < q_lo) | (fk > lq)
    full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & (lk <= fq)
    if window is not None:
        empty = empty | (fq - lk >= window)
        full = full & (lq - fk < window)
    kinds = torch.full(empty.shape, EVALUATE, dtype=torch.int8, device=segments.device)
    kinds[full & ~empty] = FULL
    kinds[empty] = EMPTY
    return kinds[:, None]


def _agrees(rule: Rule, kinds: torch.Tensor, batch: int, first: torch.Tensor,
            last: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Whether ``rule`` says what ``kinds`` does at 3 x 3 points of every EMPTY and FULL
    block, for every batch row (a 0-d bool tensor, not read here)."""
    pts = torch.stack([first, (first + last) // 2, last], dim=-1)  # (n, 3)
    b = torch.arange(batch, device=device)[:, None, None, None, None]
    h = torch.zeros(1, dtype=torch.long, device=device)[:, None, None, None, None]
    q = pts[None, :, None, :, None]
    k = pts[None, None, :, None, :]
    seen = torch.as_tensor(rule(b, h, q, k), device=device)
    n = first.numel()
    seen = seen.expand(batch, n, n, 3, 3).flatten(3)
    kind = kinds[:, 0].expand(batch, n, n)
    wrong_empty = (kind == EMPTY) & seen.any(-1)
    wrong_full = (kind == FULL) & ~seen.all(-1)
    return ~(wrong_empty | wrong_full).any()


def _documents(starts: tuple[tuple[int, ...], ...], length: int, window: int | None
               ) -> DocumentOffsets | None:
    """The causal packed documents the mask is (``BlockMask.documents``), where every batch
    row is packed alike and no window cuts them (a chunk or a window is no document)."""
    if len(starts) != 1 or window is not None:
        return None
    bounds = (*starts[0], length)
    return DocumentOffsets(bounds, bounds, causal=True)


def _pattern(starts: tuple[tuple[int, ...], ...], length: int, window: int | None,
             block_size: int) -> str | None:
    """The named problem of the mask (every batch row alike, the sweeps' blocks): the
    window alone, ``sliding_causal:<w>``; documents alone, ``documents_causal:<L>``."""
    if len(starts) != 1 or block_size != DEFAULT_BLOCK_SIZE:
        return None
    bounds = [*starts[0], length]
    if len(bounds) == 2 and window is not None:
        return f"sliding_causal:{window}"
    if window is None:
        return documents_pattern([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                                 causal=True)
    return None
