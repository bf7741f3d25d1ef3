"""Which tiles (and pieces of tiles) each program of the Gluon forward's persistent grid
walks: schedules made on the host and read by ``templates.gluon.fwd_kernel``'s
``_program_tile`` (``TILE_ORDER`` 2-4), and the cost models that choose them.

  * ``lpt_schedule``: a causal grid's whole tiles, longest first, each to the program with
    the least work so far, in head groups whose K/V stay in L2;
  * ``split_schedule``: a dense grid's whole rounds, then its partial last round cut into
    pieces of KV blocks spread over every program (stream-K over the tail);
  * ``cut_lpt_schedule``: a causal grid too small for whole tiles to balance, its longest
    tiles cut into pieces.

Costs are in KV blocks; the constants below say what they were calibrated on. Pure Python:
``GluonFwdTemplate.standalone_source`` inlines this module into the exported kernel.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

# K/V bytes a persistent causal grid keeps in L2 at a time (its head groups, see
# ``head_group``): well under the H100's 50 MB, which the Q and O traffic shares.
L2_KV_BYTES = 16 * 1024 * 1024

# What a tile costs beyond its KV blocks, in blocks, for the persistent causal schedule
# (``lpt_schedule``): the Q load, the unoverlapped first S and last PV GEMMs and the epilogue,
# about one block's work. Insensitive: 3 instead read -0.6% to +1.5% against 1 on the H100
# at 512-2k causal, d64 and d128 (notes/gluon_notes.md).
TILE_OVERHEAD_BLOCKS = 1
# What a piece of a split tile (``split_schedule``, ``cut_lpt_schedule``) costs beyond its
# blocks and the tile overhead, per piece of its tile, in KV blocks of 128 keys at d128
# (twice as many at d64, whose blocks take half the time): its partial result stored (the
# unnormalized O, m, l of its rows), the release and acquire, the last piece reading every
# partial back. Session #13 (H100) set 3 from 64 tiles of 8 blocks cut in two (1.157x the
# time of whole ones) and of 16 blocks (0.93x). Session #15 (H200, notes/gluon_notes.md,
# "The split model's piece cost"): 2 leaves those two grids as 3 did and cuts small causal
# grids finer, 0.87-0.92x the time of 3 (one head at 4k and 8k, 4 heads at 2k), the dense
# 32-tile grid 0.95x; 1 cut the 8-block tiles too and lost there (1.04-1.08x).
COMBINE_BLOCKS_PER_PIECE = 2.0
# A split that the cost model says shortens the whole grid by less than this fraction is
# not made: within the A/B noise (about 1%) it gained nothing measurable (d128 2k).
MIN_SPLIT_GAIN = 0.01
# Above this many tiles a persistent causal grid keeps the kernel's own order: the host's
# schedule costs a heap operation per tile in Python at the plan (2^17 tiles: 74 ms here).
MAX_SCHEDULED_TILES = 1 << 17
# A schedule entry (the kernel's ``TILE_ORDER`` 2-4): the tile, its first and end KV blocks
# (``WHOLE_BLOCKS``: to the tile's end), and for a tile cut into pieces this piece's slot of
# the split workspace, the tile's first slot and its piece count (-1, -1, 1: a whole tile).
ENTRY_INTS = 6
WHOLE_BLOCKS = 1 << 30


def lpt_schedule(n_q_tiles: int, batch_heads: int, group: int, costs: Sequence[int],
                 programs: int) -> list[list[int]]:
    """A persistent causal grid's tiles (``bh * n_q_tiles + query tile``), per program.

    Tiles are taken in head groups of ``group`` heads (their K/V stay in L2 while they run),
    each group's by decreasing cost (``costs[m]``, query tile m's, the same for every head),
    and each goes to the program with the least work so far (LPT list scheduling): every
    one of the grid's programs is used (the kernel's own order balances only half a group's
    tiles over as many programs: 128 of an H100's 132 SMs on the standard problems), and the
    short tiles that come last even the loads out."""
    loads = [(0, p) for p in range(programs)]
    owned: list[list[int]] = [[] for _ in range(programs)]
    longest_first = sorted(range(n_q_tiles), key=lambda m: (-costs[m], m))
    for g0 in range(0, batch_heads, group):
        for m in longest_first:
            for bh in range(g0, min(g0 + group, batch_heads)):
                load, p = loads[0]  # (the least loaded: (load, program) pairs are unique)
                owned[p].append(bh * n_q_tiles + m)
                heapq.heapreplace(loads, (load + costs[m], p))
    return owned


def whole_tile(tile: int) -> tuple[int, ...]:
    """A schedule entry (``ENTRY_INTS`` ints, see the kernel's ``_program_tile``) for a whole
    tile."""
    return (tile, 0, WHOLE_BLOCKS, -1, -1, 1)


def schedule_table(entries: Sequence[Sequence[tuple[int, ...]]]) -> list[int]:
    """The schedule as the kernel reads it: ``programs + 1`` offsets (in entries), then the
    entries of program 0, of program 1, ... flattened."""
    offsets = [0]
    for mine in entries:
        offsets.append(offsets[-1] + len(mine))
    return offsets + [x for mine in entries for entry in mine for x in entry]


class SplitSchedule(NamedTuple):
    """A persistent grid's schedule with tiles cut into pieces: ``entries`` per program,
    ``slots`` of the split workspace, and the cost model's lengths (in KV blocks) of what
    the cuts shorten (a dense grid's last round; a causal grid's longest program) with and
    without them."""

    entries: list[list[tuple[int, ...]]]
    slots: int
    cut_cost: float
    uncut_cost: float


def split_schedule(n_tiles: int, blocks: int, programs: int, head_dim: int = 128,
                   overhead: float = TILE_OVERHEAD_BLOCKS,
                   combine: float | None = None) -> SplitSchedule | None:
    """Whole tiles in rounds of ``programs`` (tile ``r * programs + p`` to program p, as the
    kernel's own order), then the ``n_tiles % programs`` tiles of the last, partial round cut
    into pieces of KV blocks spread over more programs, stream-K style: the tail's
    ``rest * blocks`` blocks split evenly over ``workers`` programs, each cut where a tile
    ends, so a program takes one or two pieces. A piece costs its blocks plus ``overhead``,
    plus, for a tile of c pieces, c x ``combine`` (``COMBINE_BLOCKS_PER_PIECE`` by default,
    scaled to ``head_dim``'s blocks); the worker count with the shortest tail wins. None
    where the last round is full, or where the cut shortens the grid (its whole rounds and
    the last) by less than ``MIN_SPLIT_GAIN``."""
    rounds, rest = divmod(n_tiles, programs)
    whole_cost = blocks + overhead
    if rest == 0 or blocks < 2:
        return None
    combine = (COMBINE_BLOCKS_PER_PIECE if combine is None else combine) * 128 / head_dim
    best: tuple[float, int] | None = None
    enough = whole_cost - MIN_SPLIT_GAIN * (rounds + 1) * whole_cost
    # Worker counts from the most down, each after a lower bound of its tail (less a
    # relative 1e-9, for rounding): more workers than tiles cut a tile, and a worker with a
    # piece of it pays its share, an overhead and two combines at least. The bound only
    # grows as the count falls, so the scan ends once it leaves no room to beat the best or
    # to gain MIN_SPLIT_GAIN: the same choice as pricing every count (the cheapest tail,
    # the fewest workers of equals) in a fraction of the plan's time (notes/gluon_notes.md,
    # "Planning time").
    for workers in range(programs, rest, -1):
        bound = ((rest * blocks) // workers + overhead + 2 * combine) * (1 - 1e-9)
        if bound > enough or (best is not None and bound > best[0]):
            break
        cost = max(_worker_costs(rest, blocks, workers, overhead, combine))
        if best is None or cost <= best[0]:
            best = (cost, workers)
    if best is None or whole_cost - best[0] < MIN_SPLIT_GAIN * (rounds + 1) * whole_cost:
        return None
    cost, workers = best
    entries = [[whole_tile(r * programs + p) for r in range(rounds)] for p in range(programs)]
    slots = 0
    tail0 = rounds * programs
    for i, pieces in enumerate(_tail_pieces(rest, blocks, workers)):
        if len(pieces) == 1:
            (worker, _, _), = pieces
            entries[worker].append(whole_tile(tail0 + i))
            continue
        for k, (worker, first, end) in enumerate(pieces):
            entries[worker].append((tail0 + i, first, end, slots + k, slots, len(pieces)))
        slots += len(pieces)
    return SplitSchedule(entries, slots, cost, whole_cost)


def cut_lpt_schedule(n_q_tiles: int, batch_heads: int, blocks: Sequence[int], programs: int,
                     head_dim: int = 128, overhead: float = TILE_OVERHEAD_BLOCKS,
                     combine: float | None = None) -> SplitSchedule | None:
    """A persistent causal grid whose longest tiles outlast the average program (few tiles,
    of very unequal lengths: a short batch of few heads; or of equal ones, one query tile per
    head: a few queries at the end of a long cache). For each cap of ``candidate_caps``
    (below the longest tile's cost: ``blocks[m]``, query tile m's KV blocks, plus
    ``overhead``), the tiles above it are cut into the fewest near-equal pieces that fit it
    (a piece of a tile of c pieces costs c x ``combine`` more, as in ``split_schedule``), and
    tiles and pieces go longest first to the program with the least work so far (LPT, as
    ``lpt_schedule`` but without head groups: a grid this small keeps every head's K/V in
    L2); the cap with the shortest longest program wins. None where no tile outlasts the
    average program or no cap shortens the longest program by ``MIN_SPLIT_GAIN``."""
    combine = (COMBINE_BLOCKS_PER_PIECE if combine is None else combine) * 128 / head_dim
    whole = [n + overhead for n in blocks]
    if max(whole) <= batch_heads * sum(whole) / programs:
        return None
    uncut = _lpt_makespan(sorted((w for w in whole for _ in range(batch_heads)),
                                 reverse=True), programs)
    best = _best_cap(blocks, batch_heads, programs, overhead, combine,
                     uncut - MIN_SPLIT_GAIN * uncut)
    if best is None or uncut - best[0] < MIN_SPLIT_GAIN * uncut:
        return None
    loads = [(0.0, p) for p in range(programs)]
    entries: list[list[tuple[int, ...]]] = [[] for _ in range(programs)]
    bases: dict[int, int] = {}
    slots = 0
    items = _cut_items(n_q_tiles, batch_heads, blocks, overhead, combine, best[1])
    assert items is not None  # (``_best_cap`` priced its costs)
    for cost, tile, k, count, first, end in items:
        load, p = heapq.heappop(loads)
        if count == 1:
            entries[p].append(whole_tile(tile))
        else:
            if tile not in bases:
                bases[tile] = slots
                slots += count
            entries[p].append((tile, first, end, bases[tile] + k, bases[tile], count))
        heapq.heappush(loads, (load + cost, p))
    return SplitSchedule(entries, slots, best[0], uncut)


def _best_cap(blocks: Sequence[int], batch_heads: int, programs: int, overhead: float,
              combine: float, enough: float) -> tuple[float, float] | None:
    """(longest program, cap) of the cap whose ``_cut_items`` LPT assignment has the shortest
    longest program (the highest cap of equals), among ``candidate_caps``, wherever that
    program is at most ``enough``; else a cap no better, or None.

    Caps are taken from the highest down, each priced by the LPT makespan of its costs alone
    (``_cut_costs``; the piece counts carried from cap to cap) after two lower bounds of it:
    the cap itself (a tile of exactly that cost stays whole), and the work spread evenly over
    the programs, which only grows as the cap falls (more pieces, each paying its combine),
    so the scan ends once that leaves no room. The same answer as an LPT run of every cap's
    items, in a fraction of the time (notes/gluon_notes.md, "Planning time")."""
    best: tuple[float, float] | None = None
    slack = 1 - 1e-9  # (the bounds less a relative 1e-9, for rounding)
    fewest = [2] * len(blocks)
    for cap in candidate_caps(blocks, batch_heads, programs, overhead, combine):
        counts = _piece_counts(blocks, overhead, combine, cap, fewest)
        if counts is None:  # (a tile that cannot be cut to fit this cap fits no lower one)
            break
        costs = _cut_costs(blocks, overhead, combine, counts)
        room = enough if best is None else min(enough, best[0])
        spread = batch_heads * sum(costs) / programs * slack
        if spread > room or (best is not None and spread >= best[0]):
            break
        if cap * slack > room or (best is not None and cap * slack >= best[0]):
            continue
        makespan = _lpt_makespan(sorted(costs * batch_heads, reverse=True), programs)
        if best is None or makespan < best[0]:
            best = (makespan, cap)
    return best


def candidate_caps(blocks: Sequence[int], batch_heads: int, programs: int, overhead: float,
                   combine: float) -> list[float]:
    """The caps ``_best_cap`` tries, highest first: each tile cost below the longest's, and
    the cost of a piece of the longest tile cut into 2, 3, ... pieces (what a grid of equal
    tiles has to cut to: one query tile per head, as a few queries at the end of a long
    cache make), none below half the average program (there cuts add combines and cannot
    shorten the longest)."""
    whole = [n + overhead for n in blocks]
    top = max(whole)
    floor = batch_heads * sum(whole) / programs / 2
    longest = max(blocks)
    pieces = {_largest_piece(longest, count, overhead, combine)
              for count in range(2, _most_pieces(longest, combine) + 1)}
    return sorted((c for c in set(whole) | pieces if floor <= c < top), reverse=True)


def _cut_items(n_q_tiles: int, batch_heads: int, blocks: Sequence[int], overhead: float,
               combine: float, cap: float) -> list[tuple[float, int, int, int, int, int]] | None:
    """Every tile, or its pieces where it costs more than ``cap``, as (cost, tile, piece k,
    piece count, first block, end block), longest first; None where a tile cannot be cut
    to fit ``cap``."""
    counts = _piece_counts(blocks, overhead, combine, cap, [2] * len(blocks))
    if counts is None:
        return None
    items = []
    for m, (n, count) in enumerate(zip(blocks, counts, strict=True)):
        extra = combine * count if count > 1 else 0.0
        for bh in range(batch_heads):
            for k in range(count):
                first, end = k * n // count, (k + 1) * n // count
                items.append((end - first + overhead + extra, bh * n_q_tiles + m, k, count,
                              first, end))
    return sorted(items, key=lambda it: (-it[0], it[1], it[2]))


def _cut_costs(blocks: Sequence[int], overhead: float, combine: float, counts: list[int]
               ) -> list[float]:
    """One head's ``_cut_items`` costs for tiles cut into ``counts`` pieces (the same values,
    not in their order)."""
    costs = []
    for n, count in zip(blocks, counts, strict=True):
        if count == 1:
            costs.append(n + overhead + 0.0)
            continue
        extra = combine * count
        # (Pieces of n // count blocks, n % count of them one more: as ``_cut_items`` cuts.)
        short, longer = divmod(n, count)
        costs.extend([short + 1 + overhead + extra] * longer)
        costs.extend([short + overhead + extra] * (count - longer))
    return costs


def _piece_counts(blocks: Sequence[int], overhead: float, combine: float, cap: float,
                  fewest: list[int]) -> list[int] | None:
    """Per tile, the fewest pieces it is cut into to fit ``cap`` (1: it fits whole), or None
    where one cannot be cut to fit. ``fewest``: per tile, a count no lower cap can go under
    (2, or what a higher cap needed), updated here for a scan of caps highest first."""
    counts = []
    for m, n in enumerate(blocks):
        if n + overhead <= cap:
            counts.append(1)
            continue
        count = fewest[m]
        if n < 2 or _largest_piece(n, count, overhead, combine) > cap:  # (as _fewest_pieces)
            found = _fewest_pieces(n, overhead, combine, cap, count)
            if found is None:
                return None
            count = fewest[m] = found
        counts.append(count)
    return counts


def _fewest_pieces(n: int, overhead: float, combine: float, cap: float, least: int = 2
                   ) -> int | None:
    """The fewest pieces (at least ``least``, at least 2) of a tile of ``n`` blocks whose
    largest fits ``cap``, or None (no count past ``_most_pieces`` fits if none before did)."""
    for count in range(max(2, least), _most_pieces(n, combine) + 1):
        if _largest_piece(n, count, overhead, combine) <= cap:
            return count
    return None


def _largest_piece(n: int, count: int, overhead: float, combine: float) -> float:
    """The cost of the largest of ``count`` pieces of a tile of ``n`` blocks: ceil(n /
    count) + overhead + combine x count."""
    return -(-n // count) + overhead + combine * count


def _most_pieces(n: int, combine: float) -> int:
    """The most pieces worth pricing for a tile of ``n`` blocks: the largest piece's cost
    falls until about sqrt(n / combine) pieces and rises after."""
    return min(n, int(math.isqrt(int(n / combine)) + 2) if combine > 0 else n)


def _lpt_makespan(costs: Sequence[float], programs: int) -> float:
    """The longest program of an LPT assignment of ``costs`` (given longest first)."""
    loads = [0.0] * programs
    for cost in costs:
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


def _tail_pieces(rest: int, blocks: int, workers: int) -> list[list[tuple[int, int, int]]]:
    """Per tail tile, its pieces as (worker, first block, end block): the tail's blocks
    (tile after tile) split evenly over ``workers``, cut where a worker's share ends."""
    total = rest * blocks
    bounds = [w * total // workers for w in range(workers + 1)]
    cuts = sorted(set(bounds) | {i * blocks for i in range(rest + 1)})
    tiles: list[list[tuple[int, int, int]]] = [[] for _ in range(rest)]
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b > a:
            worker = bisect.bisect_right(bounds, a) - 1
            tile = a // blocks
            tiles[tile].append((worker, a - tile * blocks, b - tile * blocks))
    return tiles


def _worker_costs(rest: int, blocks: int, workers: int, overhead: float,
                  combine: float) -> list[float]:
    costs = [0.0] * workers
    for pieces in _tail_pieces(rest, blocks, workers):
        extra = combine * len(pieces) if len(pieces) > 1 else 0.0
        for worker, first, end in pieces:
            costs[worker] += end - first + overhead + extra
    return costs


def causal_tile_costs(n_q_tiles: int, block_m: int, block_n: int, seqlen_kv: int,
                      causal_offset: int, overhead: int = TILE_OVERHEAD_BLOCKS,
                      q_per_head: int = 0) -> list[int]:
    """Each causal query tile's work in KV blocks (as ``_tile_coords`` counts them), plus
    ``overhead`` for what every tile pays (its Q load, first S and last PV GEMMs alone, the
    epilogue). ``q_per_head`` > 0: packed GQA rows (``query_rows``)."""
    costs = []
    for m in range(n_q_tiles):
        last = query_rows(m * block_m, block_m, q_per_head)[1]
        kv_end = max(min(seqlen_kv, last + 1 + causal_offset), 0)
        costs.append(-(-kv_end // block_n) + overhead)
    return costs


def query_rows(m0: int, rows: int, q_per_head: int) -> tuple[int, int]:
    """(first, last) query index, within its head, of the tile rows [m0, m0 + rows), as the
    kernel's ``_query_rows`` bounds a causal tile: the rows themselves, or with GQA packed
    (each KV head's query heads stacked, ``q_per_head`` rows each) the mapped rows of a tile
    within one head, every query (0 .. q_per_head - 1) of one that spans heads."""
    last = m0 + rows - 1
    if q_per_head <= 0:
        return m0, last
    head = m0 // q_per_head
    if head == last // q_per_head:
        return m0 - head * q_per_head, last - head * q_per_head
    return 0, q_per_head - 1


def head_group(batch_heads: int, n_q_tiles: int, kv_bytes_per_head: int, sm_count: int
               ) -> int:
    """Heads per group of a persistent causal grid's longest-first order (``_tile_coords``):
    the most heads, dividing ``batch_heads``, whose tiles make at most two rounds of one
    program per SM and whose K/V fit in ``L2_KV_BYTES``."""
    best = 1
    for g in range(1, batch_heads + 1):
        if batch_heads % g == 0 and g * n_q_tiles <= 2 * sm_count and g * kv_bytes_per_head \
                <= L2_KV_BYTES:
            best = g
    return best


def causal_grid(group_tiles: int, sm_count: int) -> int:
    """Programs of a persistent causal grid: half a head group's tiles, so that each group is
    walked in two rounds, the second in the opposite direction (snake). A group's tiles come
    by decreasing length, so program p takes the p-th longest tile and the p-th shortest:
    every program gets the same work (with a full grid, groups cut across rounds and the
    snake paired tiles at random: 0.71-0.79x cuDNN on H100, notes/gluon_notes.md run 5)."""
    return max(1, min(sm_count, -(-group_tiles // 2)))
