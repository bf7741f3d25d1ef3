"""Benchmark report: a Markdown page and PNG plots from the JSON in benchmarks/results/.

The page is generated, not committed: it goes where ``--out`` says (default
``build/benchmarks.md``, the plots under ``build/img/``; ``build/`` is git-ignored). The
curated numbers users read are docs/PERFORMANCE.md.

Reads what the benchmark scripts wrote (every number in the report comes from those files;
only the targets' thresholds are written here):

- ``fwd_quick*.json``      benchmarks/fwd_quick.py: forward, our default config, a grid of
                           configs and their variants, SDPA FA2 / cuDNN / EFF, per problem;
- ``fwd_bwd*.json``        benchmarks/fwd_bwd_bench.py: forward + backward, our defaults and a
                           backward grid, SDPA FA2 / cuDNN, FlexAttention;
- ``masked_fwd_bwd*.json`` benchmarks/masked_fwd_bwd_bench.py: forward and forward + backward
                           with a BlockMask, ours (defaults, a backward grid) against
                           FlexAttention and SDPA with the mask materialized, per mask;
- ``decode*.json``         benchmarks/decode_bench.py: flash-decoding, bandwidth;
- ``blocksparse*.json``    benchmarks/blocksparse_bench.py: block-sparse forward against our
                           dense kernel and FlexAttention, per mask pattern;
- ``sweep*.json``          the JSON report of ``tuner sweep NAME --json``: best and default
                           TFLOP/s per problem, trial counts, seconds per trial;
- ``dispatch*.json``       benchmarks/dispatch_bench.py: the drop-in ``tuner.attention``
                           against torch SDPA per row, every candidate forced, SDPA timed
                           twice (the noise floor); newer files: per row the paired ratio
                           and verdict of benchmarks/paired.py;
- ``decode_loop*.json``    benchmarks/decode_loop.py: decode steps back to back, SDPA against
                           ``tuner.attention`` and ``tuner.decode``;
- ``decode_grid*.json``    benchmarks/decode_grid.py: flash_decode configs beside cuDNN, the
                           GPU's time alone;
- ``e2e_hf*.json``         benchmarks/e2e_hf.py: a transformers model, SDPA against ours
                           (newer files: paired rounds, an A/A floor, a verdict per step);
- ``gluon_fwd*.json``      ``benchmarks/gluon_fwd_bench.py --time``: the Gluon forward's
                           variants beside SDPA cuDNN / FA2 and our Triton forward, per
                           problem (its diagnostic timings, wrong by design, left out);
- ``gluon_fwd_ab*.json``   ``benchmarks/gluon_fwd_ab.py``: one switch of the Gluon forward
                           (a DIAG value, the causal order, the schedule's tile cost, changed
                           knobs) against its default, beside cuDNN, rounds rotated;
- ``gluon_pack_gqa*.json`` ``benchmarks/gluon_pack_gqa.py``: the Gluon forward with GQA packed
                           and unpacked beside torch SDPA, on GQA shapes of few queries;
- ``winners*.json``        ``tuner winners --json`` after a sweep of a suite: which
                           implementation won each stored problem (issue 17's target: ours on
                           >= 75% of ``standard``);
- ``gluon_cudnn_train*.json`` benchmarks/gluon_cudnn_train_bench.py: a training step by the
                           Gluon forward and cuDNN's backward against SDPA's (cuDNN both
                           ways), paired rounds, and the parts alone;
- ``fwd_compile_sweep*``, ``sweep_quick_trials*``, ``decode_probe*``, ``search_winners*``
                           compile data, the recorded trials of a sweep (``tuner replay``'s
                           input), the first decode probes and the winners of a sweep of part
                           of a suite: listed, not reported.

Any other file is listed as skipped with the reason, so a new benchmark's results never break
the report. A sidecar ``NAME.meta.json`` beside ``NAME.json`` states what the result file does
not record (``command``, ``date``, ``gpu``, ``driver``, ``torch``, ``triton``, ``cuda``); the
file's own values win. The hand-written analysis ``notes/benchmarks_notes.md`` (``--notes``) is
included verbatim.

    pip install -e '.[report]'          # matplotlib, for the plots
    python benchmarks/report.py [--results DIR] [--out FILE] [--img-dir DIR] [--notes FILE]
                                [--no-plots]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = ROOT / "build" / "benchmarks.md"
DEFAULT_IMG = ROOT / "build" / "img"
DEFAULT_NOTES = ROOT / "notes" / "benchmarks_notes.md"
MATPLOTLIB_MISSING = ("report.py draws its plots with matplotlib, which is not installed: "
                      "pip install -e '.[report]' (or pip install 'matplotlib>=3.7'), "
                      "or pass --no-plots for the tables alone")

# The targets of the project's performance issues (thresholds, not measurements).
FWD_D128_VS_CUDNN = 1.0      # forward best >= 1.0x cuDNN at d=128, N >= 2k, causal and not
FWD_D128_MIN_N = 2048
FWD_D64_VS_CUDNN = 1.1       # forward best >= 1.1x cuDNN at d=64
FWD_VS_FA2 = 1.6             # forward best >= 1.6x FA2 everywhere
FWD_TUNED_VS_DEFAULT = 1.2   # geomean over problems of best / default
FWD_BWD_VS_CUDNN = 1.0       # fwd+bwd best >= 1.0x cuDNN at d=128, N >= 4k
FWD_BWD_MIN_N = 4096
DECODE_COPY_SHARE = 0.8      # decode B=1, 32k cache: >= 80% of the measured copy bandwidth
DECODE_VS_ONE_SPLIT = 3.0    # ... and >= 3x faster than the same kernel with one split
DECODE_SEQLEN = 32768
BLOCKSPARSE_PATTERN = "random:0.1"  # block-sparse, ~90% sparse random blocks:
BLOCKSPARSE_VS_DENSE = 0.15          # time <= 0.15x our dense kernel's
BLOCKSPARSE_VS_FLEX = 1.3            # ... and >= 1.3x faster than FlexAttention
SWEEP_TUNED_VS_DEFAULT = 1.2         # tuner sweep: geomean of best / default over the suite
SWEEP_OVERHEAD_S = 1.0               # ... seconds per trial beyond the benchmark, worst problem
# Issue 16: tuner.attention and tuner.decode replace torch SDPA (cuDNN on the H100), so their
# time over SDPA's must stay <= 1.0x: on decode_loop.py's rows of the issue, on every row of
# e2e_hf.py, and on every row of dispatch_bench.py beyond the file's own noise floor.
DROP_IN_VS_SDPA = 1.0
DECODE_LOOP_ROWS = ("b1-32k", "b1-128k", "b8-32k")
E2E_SLIDING_SPEEDUP = 1.3            # e2e_hf: the sliding-window prefill >= 1.3x faster
# Issue 17: the Gluon forward (its best passing variant per problem) over cuDNN timed in the
# same run, at N = 4k and 16k: >= 1.05x at d128, dense and causal apart; >= 1.0x at d64, d256.
GLUON_FWD_VS_CUDNN = {128: 1.05, 64: 1.0, 256: 1.0}
GLUON_FWD_SEQLENS = (4096, 16384)
META_SUFFIX = ".meta.json"


# ----------------------------------------------------------------------------- data
@dataclass
class Source:
    """Where one file's numbers come from."""

    path: Path
    kind: str
    gpu: str = ""
    driver: str = ""
    torch: str = ""
    triton: str = ""
    cuda: str = ""
    date: str = ""
    command: str = ""
    meta: str = ""  # the sidecar that stated some of these, if any
    meta_keys: tuple[str, ...] = ()


@dataclass
class ProblemRow:
    """A forward problem as ``Problem.key()`` names it (``problem_row_fields`` reads one)."""

    dtype: str
    head_dim: int
    seqlen: int
    seqlen_kv: int
    batch: int
    heads_q: int
    heads_kv: int
    variant: str  # Problem.key()'s last part: dense, causal-top_left, causal-bottom_right, ...

    @property
    def causal(self) -> bool:
        return self.variant.startswith("causal")


@dataclass
class FwdRow(ProblemRow):
    default: float | None = None
    best: float | None = None
    best_label: str = ""
    best_config: dict[str, Any] | None = None
    timed: int = 0
    fa2: float | None = None
    cudnn: float | None = None
    flex: float | None = None

    @property
    def dense_mask(self) -> bool:
        return "sparse" not in self.variant

    @property
    def name(self) -> str:
        return f"d{self.head_dim} N{_n(self.seqlen)} {'causal' if self.causal else 'dense'}"


@dataclass
class FwdBwdRow:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    default: float | None = None
    best: float | None = None
    best_label: str = ""
    best_config: dict[str, Any] | None = None
    grid: int = 0
    fa2: float | None = None
    cudnn: float | None = None
    flex: float | None = None

    @property
    def name(self) -> str:
        return f"d{self.head_dim} N{_n(self.seqlen)} {'causal' if self.causal else 'dense'}"


@dataclass
class Timed:
    """The fastest timed call of one implementation and step of a masked row."""

    ms: float
    tflops: float | None
    impl: str
    config: dict[str, Any] | None = None


@dataclass
class MaskedRow:
    pattern: str
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    visible: float | None  # fraction of (query, key) pairs the mask lets through
    timed: dict[tuple[str, str], Timed] = field(default_factory=dict)  # (impl, step) ->
    grid: int = 0  # backward configs of the grid that were timed

    @property
    def name(self) -> str:
        return f"d{self.head_dim} N{_n(self.seqlen)} {self.pattern}"

    def fastest(self, impls: Sequence[str], step: str) -> Timed | None:
        found = [t for impl in impls if (t := self.timed.get((impl, step))) is not None]
        return min(found, key=lambda t: t.ms, default=None)


@dataclass
class DecodeResult:
    us: float | None
    tb_per_s: float | None
    config: dict[str, Any] | None = None
    note: str = ""


@dataclass
class DecodeRow:
    name: str
    batch: int
    seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    mask: str
    results: dict[str, DecodeResult] = field(default_factory=dict)


@dataclass
class BlockSparseRow:
    pattern: str
    density: float | None = None
    default_ms: float | None = None
    best_ms: float | None = None
    best_config: dict[str, Any] | None = None
    best_label: str = ""
    best_tflops: float | None = None
    timed: int = 0
    failed: int = 0
    flex_ms: float | None = None
    flex_note: str = ""


@dataclass
class SweepRow:
    label: str
    best: float | None
    default: float | None
    speedup: float | None
    ok: int
    failed: dict[str, int]
    budget: int | None
    seconds_per_trial: float | None
    bench_seconds_per_trial: float | None

    @property
    def overhead(self) -> float | None:
        if self.seconds_per_trial is None or self.bench_seconds_per_trial is None:
            return None
        return self.seconds_per_trial - self.bench_seconds_per_trial


@dataclass
class Target:
    what: str
    source: str
    threshold: str
    measured: str
    met: bool | None  # None: not measured
    margin: str
    rows: str = ""


@dataclass
class Section:
    """One result file's part of the report."""

    source: Source
    markdown: list[str]
    targets: list[Target]
    plot: Callable[[Path], None] | None = None
    plot_name: str = ""


class FormatError(ValueError):
    """A result file whose rows are not in the format its name promises."""


# ----------------------------------------------------------------------------- helpers
def _n(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def _tf(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: Any) -> float | None:
    return (float(value) if isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) else None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def max_target(what: str, source: str, threshold: float, value: float | None, unit: str,
               measured: str, rows: str = "") -> Target:
    """'value <= threshold'; unit is 'x' or ' s'."""
    limit = f"<= {threshold:.2f}{unit}"
    if value is None:
        return Target(what, source, limit, "no row", None, "not measured")
    met = value <= threshold
    gap = abs(1 - value / threshold)
    return Target(what, source, limit, measured, met,
                  f"{100 * gap:.0f}% {'under the limit' if met else 'over the limit'}", rows)


def max_rows_target(what: str, source: str, threshold: float, rows: list[tuple[str, float]],
                    limit: str = "", missing: Sequence[str] = ()) -> Target:
    """'every row's time ratio <= threshold' (the worst row decides); a row of ``missing``
    has no ratio, so the target cannot be met while one does."""
    limit = limit or f"<= {threshold:.2f}x"
    gone = f"; not measured: {', '.join(missing)}" if missing else ""
    if not rows:
        return Target(what, source, limit, "no rows", None, "not measured" + gone)
    name, worst = max(rows, key=lambda r: r[1])
    meeting = sum(r <= threshold for _, r in rows)
    gap = 100 * abs(worst / threshold - 1)
    met: bool | None = worst <= threshold
    if met and missing:
        met = None
    margin = (f"worst row {gap:.1f}% under the limit" if worst <= threshold else
              f"worst row {gap:.1f}% over; {meeting} of {len(rows)} rows meet it")
    return Target(what, source, limit, f"worst {worst:.3f}x ({name})", met, margin + gone,
                  ", ".join(f"{n} {r:.3f}x" for n, r in rows))


PAIRED_DECIDED = ("faster", "same within noise", "slower")


def _paired(value: Any) -> dict[str, Any] | None:
    """benchmarks/paired.py's comparison (tuner / sdpa time within each round, its interval,
    the A/A floor, a verdict) as a file holds it; None where it holds none (older files)."""
    if not isinstance(value, dict) or not isinstance(value.get("ratio"), dict):
        return None
    return value if _num(value["ratio"].get("median")) is not None else None


def paired_cells(c: dict[str, Any] | None) -> list[str]:
    """The paired median [interval], the A/A floor and the verdict, as table cells."""
    if c is None:
        return ["-", "-", "-"]
    r = c["ratio"]
    low, high, floor = _num(r.get("ci_low")), _num(r.get("ci_high")), _num(c.get("floor"))
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return [f"{r['median']:.3f}x{interval}", "-" if floor is None else f"{100 * floor:.1f}%",
            str(c.get("verdict", "-"))]


PAIRED_HEADER = ["tuner/sdpa time, paired median [95% interval]", "A/A floor", "verdict"]
PAIRED_TEXT = ("**tuner/sdpa time, paired**: the median over rounds of ours / sdpa timed in "
               "the same round (rounds alternate the order), with the distribution-free 95% "
               "interval of that median; *A/A floor*: how far from 1.00x the same median of "
               "sdpa timed again / sdpa reaches (two timings of one implementation read that "
               "far apart here); *verdict*: faster or slower where the interval lies wholly "
               "beyond 1.00x -/+ the floor, else same within noise (benchmarks/paired.py)")


def paired_target(what: str, source: str, rows: list[tuple[str, dict[str, Any]]],
                  missing: Sequence[str] = ()) -> Target:
    """'no row slower than SDPA beyond its A/A floor': each row's paired verdict decides (a
    row without one, too few rounds or not timed, leaves the target not measured)."""
    limit = "<= 1.00x, or within the A/A floor"
    gone = f"; not measured: {', '.join(missing)}" if missing else ""
    if not rows:
        return Target(what, source, limit, "no rows", None, "not measured" + gone)
    name, worst = max(rows, key=lambda r: r[1]["ratio"]["median"])
    slower = [n for n, c in rows if c.get("verdict") == "slower"]
    undecided = [n for n, c in rows if c.get("verdict") not in PAIRED_DECIDED]
    met: bool | None = not slower
    if not slower and (undecided or missing):
        met = None
    counts = {v: sum(c.get("verdict") == v for _, c in rows)
              for v in (*PAIRED_DECIDED, "too few rounds")}
    margin = (", ".join(f"{n} {v}" for v, n in counts.items() if n)
              + (f" (of {len(rows)} rows); slower: {', '.join(slower)}" if slower
                 else f" (of {len(rows)} rows)") + gone)
    floor = _num(worst.get("floor"))
    return Target(what, source, limit,
                  f"worst {worst['ratio']['median']:.3f}x ({name}: {worst.get('verdict')}"
                  + (f", floor {100 * floor:.1f}%)" if floor is not None else ")"), met, margin,
                  ", ".join(f"{n} {c['ratio']['median']:.3f}x {c.get('verdict')}"
                            for n, c in rows))


def _first_sentence(text: str, limit: int = 100) -> str:
    head = text.split(". ", 1)[0]
    return head if len(head) <= limit else head[:limit] + "..."


def _date(text: str) -> str:
    """An ISO timestamp to the minute (the scripts record microseconds); anything else as is."""
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return text
    if when.hour == when.minute == when.second == 0 and "T" not in text:
        return text
    zone = " UTC" if when.utcoffset() == datetime.timedelta(0) else ""
    return when.strftime("%Y-%m-%d %H:%M") + zone


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return out


def _margin_min(rows: list[tuple[str, float]], threshold: float) -> tuple[str, bool, str]:
    """(measured, met, margin) for 'every row's ratio >= threshold'."""
    name, worst = min(rows, key=lambda r: r[1])
    meeting = sum(r >= threshold for _, r in rows)
    gap = worst / threshold - 1
    met = worst >= threshold
    margin = (f"worst row {100 * gap:.0f}% above" if met else
              f"worst row {100 * -gap:.0f}% short; {meeting} of {len(rows)} rows meet it")
    return f"worst {worst:.2f}x ({name})", met, margin


def min_target(what: str, source: str, threshold: float, rows: list[tuple[str, float]],
               missing: Sequence[str] = ()) -> Target:
    """'every row's ratio >= threshold' (the worst row decides); a row of ``missing`` has no
    ratio, so the target cannot be met while one does (as in max_rows_target)."""
    gone = f"; not measured: {', '.join(missing)}" if missing else ""
    if not rows:
        return Target(what, source, f">= {threshold:.2f}x", "no rows", None,
                      f"not measured: {', '.join(missing)}" if missing else "not measured")
    measured, met, margin = _margin_min(rows, threshold)
    return Target(what, source, f">= {threshold:.2f}x", measured,
                  None if met and missing else met, margin + gone,
                  ", ".join(f"{n} {r:.2f}x" for n, r in rows))


# fwd_quick.py's short config text (written again here: report.py imports no torch).
def fwd_config_text(cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return "-"
    text = (f"{cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')} w{cfg.get('num_warps')} "
            f"s{cfg.get('num_stages')}")
    flags = [("use_tma", True, "tma"), ("longest_first", True, "lf"),
             ("grid_order", "heads_inner", "heads"), ("pipeline_masked_loop", False,
                                                      "nopipe-masked"),
             ("warp_specialize", True, "ws")]
    text += "".join(f" {label}" for key, value, label in flags if cfg.get(key) == value)
    if (cfg.get("loop_unroll") or 1) > 1:
        text += f" unroll{cfg['loop_unroll']}"
    return text


def bwd_config_text(cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return "-"
    blocks = "/".join(str(cfg[k]) for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
                      if k in cfg)
    return (f"{blocks} w{cfg.get('num_warps')} s{cfg.get('num_stages')} "
            f"{cfg.get('dq_mode', '')}").strip()


def decode_config_text(cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return "-"
    # Knobs at their defaults are left out, as in decode_bench's labels.
    extras = [text for text, on in (("fused", cfg.get("combine") == "fused"),
                                    (str(cfg.get("kv_load")), cfg.get("kv_load") not in
                                     (None, "default")),
                                    ("waves", bool(cfg.get("whole_waves")))) if on]
    return " ".join([f"splits {cfg.get('num_splits')} bn{cfg.get('block_n')} "
                     f"w{cfg.get('num_warps')} s{cfg.get('num_stages')}", *extras])


# ----------------------------------------------------------------------------- loading
def read_source(path: Path, kind: str, data: dict[str, Any]) -> Source:
    """fwd_quick.py writes ``device`` (templates.device) with ``command``/``date`` beside it;
    fwd_bwd_bench.py and decode_bench.py write ``environment``; gluon_fwd_bench.py too, with
    ``argv`` for the command; dispatch_bench.py, decode_loop.py, decode_grid.py and e2e_hf.py
    write ``device`` as the GPU's name and ``torch`` (``triton``) beside it."""
    src = Source(path, kind)
    env = data.get("environment")
    dev = data.get("device")
    if isinstance(env, dict):
        src.gpu, src.driver = str(env.get("gpu", "")), str(env.get("driver", ""))
        src.torch, src.triton = str(env.get("torch", "")), str(env.get("triton", ""))
        src.cuda, src.date = str(env.get("cuda", "")), str(env.get("date", ""))
        src.command = str(env.get("command", ""))
        if not src.command and isinstance(env.get("argv"), list):
            # sys.argv as the script saw it: what was run, less the interpreter.
            src.command = shlex.join(str(a) for a in env["argv"])
    if isinstance(dev, dict):
        src.gpu = src.gpu or str(dev.get("name", ""))
        src.driver = src.driver or str(dev.get("driver_version", ""))
        src.torch = src.torch or str(dev.get("torch_version", ""))
        src.triton = src.triton or str(dev.get("triton_version", ""))
        src.cuda = src.cuda or str(dev.get("cuda_version", ""))
    if isinstance(dev, str):
        src.gpu = src.gpu or dev
    for key in ("torch", "triton"):
        if isinstance(data.get(key), str) and not getattr(src, key):
            setattr(src, key, data[key])
    src.date = src.date or str(data.get("date", ""))
    src.command = src.command or str(data.get("command", ""))
    return src


def read_meta(path: Path, src: Source) -> None:
    """Fill what the result file left empty from its sidecar ``NAME.meta.json``."""
    meta_path = path.with_name(path.stem + META_SUFFIX)
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"unreadable sidecar {meta_path.name}: {exc}") from exc
    if not isinstance(meta, dict):
        raise FormatError(f"sidecar {meta_path.name} is not an object")
    keys = []
    for key in ("gpu", "driver", "torch", "triton", "cuda", "date", "command"):
        if not getattr(src, key) and meta.get(key):
            setattr(src, key, str(meta[key]))
            keys.append(key)
    if keys:
        src.meta, src.meta_keys = meta_path.name, tuple(keys)


PROBLEM_KEY = re.compile(r"^b(\d+)-hq(\d+)-hkv(\d+)-q(\d+)-kv(\d+)-d(\d+)-([a-z0-9]+)-(.+)$")


def problem_row_fields(key: str) -> tuple[str, int, int, int, int, int, int, str]:
    """``ProblemRow``'s fields, in order, from a ``Problem.key()``."""
    m = PROBLEM_KEY.match(key)
    if m is None:
        raise FormatError(f"problem key {key!r} is not Problem.key()'s format")
    b, hq, hkv, nq, nkv, d = (int(g) for g in m.groups()[:6])
    return m[7], d, nq, nkv, b, hq, hkv, m[8]


def fwd_rows(data: dict[str, Any]) -> list[FwdRow]:
    rows: dict[str, FwdRow] = {}
    for r in data["rows"]:
        if not isinstance(r, dict) or "problem" not in r or "kernel" not in r:
            raise FormatError(f"a row without 'problem' and 'kernel': {str(r)[:120]}")
        key, kernel = str(r["problem"]), str(r["kernel"])
        if key not in rows:
            rows[key] = FwdRow(*problem_row_fields(key))
        row, tflops = rows[key], _num(r.get("tflops"))
        if tflops is None:
            continue  # failed, wrong result or not timed: not a number to report
        if kernel.startswith("sdpa-"):
            backend = kernel.removeprefix("sdpa-").lower()
            if backend == "fa2":
                row.fa2 = tflops
            elif backend == "cudnn":
                row.cudnn = tflops
        elif kernel.startswith("flex"):
            row.flex = max(tflops, row.flex or 0.0)
        else:  # ours: flash_fwd-default, -grid, -variant
            label = kernel.rsplit("-", 1)[-1]
            row.timed += 1
            if label == "default":
                row.default = tflops
            if row.best is None or tflops > row.best:
                row.best, row.best_label, row.best_config = tflops, label, r.get("config")
    return sorted(rows.values(), key=lambda r: (r.dtype != "bfloat16", r.dtype, r.head_dim,
                                                 not r.dense_mask, r.causal, r.variant,
                                                 r.seqlen, r.seqlen_kv))


def fwd_bwd_rows(data: dict[str, Any]) -> tuple[list[FwdBwdRow], list[str]]:
    rows, failures = [], []
    for r in data["rows"]:
        try:
            row = FwdBwdRow(int(r["head_dim"]), int(r["seqlen"]), bool(r["causal"]),
                            int(r["batch"]), int(r["heads"]))
            results = list(r["results"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
        best_ms: float | None = None
        for m in results:
            what, tflops, ms = str(m.get("what")), _num(m.get("tflops")), _num(m.get("ms"))
            if tflops is None or ms is None:
                if m.get("note"):
                    failures.append(f"{row.name} {what}: {_first_sentence(str(m['note']))}")
                continue
            if what == "sdpa-fa2":
                row.fa2 = tflops
            elif what == "sdpa-cudnn":
                row.cudnn = tflops
            elif what == "flex":
                row.flex = tflops
            elif what in ("default", "grid"):
                row.grid += what == "grid"
                if what == "default":
                    row.default = tflops
                if best_ms is None or ms < best_ms:  # RowResult.best_grid: the least time
                    best_ms = ms
                    row.best, row.best_label, row.best_config = tflops, what, m.get("config")
        rows.append(row)
    return rows, failures


def decode_rows(data: dict[str, Any]) -> list[DecodeRow]:
    rows = []
    for r in data["rows"]:
        try:
            p = r["problem"]
            row = DecodeRow(str(r["name"]), int(p["batch"]), int(p["seqlen_kv"]),
                            int(p["heads_q"]), int(p["heads_kv"]), int(p["head_dim"]),
                            str(p.get("mask", "none")))
            for m in r["results"]:
                row.results[str(m["what"])] = DecodeResult(_num(m.get("us")),
                                                           _num(m.get("tb_per_s")),
                                                           m.get("config"),
                                                           str(m.get("note", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
        rows.append(row)
    return rows


MASKED_SDPA = ("sdpa-cudnn", "sdpa-efficient")  # the backend that took the mask


def masked_rows(data: dict[str, Any]) -> tuple[list[MaskedRow], list[str]]:
    """Per row (in the file's order) the fastest timed call of each implementation and step,
    and a line for every call that was not timed (failed its check or raised)."""
    rows, failures = [], []
    for r in data["rows"]:
        try:
            row = MaskedRow(str(r["pattern"]), int(r["head_dim"]), int(r["seqlen"]),
                            int(r["batch"]), int(r["heads"]), _num(r.get("visible_fraction")))
            results = list(r["results"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
        for m in results:
            impl, step, ms = str(m.get("impl")), str(m.get("step")), _num(m.get("ms"))
            if m.get("status") != "timed" or ms is None:
                failures.append(f"{row.name} {impl} {step} ({m.get('status')}): "
                                f"{_first_sentence(str(m.get('note') or 'no note'))}")
                continue
            row.grid += impl == "ours-grid"
            known = row.timed.get((impl, step))
            if known is None or ms < known.ms:
                row.timed[(impl, step)] = Timed(ms, _num(m.get("tflops")), impl,
                                                m.get("config"))
        rows.append(row)
    return rows, failures


# ----------------------------------------------------------------------------- sections
def forward_section(src: Source, data: dict[str, Any]) -> Section:
    rows = fwd_rows(data)
    has_flex = any(r.flex is not None for r in rows)
    multi_dtype = len({r.dtype for r in rows}) > 1
    header = (["dtype"] if multi_dtype else []) + [
        "D", "N", "variant", "B x H", "default", "best", "best config (of n timed)", "SDPA FA2",
        "SDPA cuDNN"] + (["Flex"] if has_flex else []) + [
        "best/cuDNN", "best/FA2", "best/default"]
    cells = []
    for r in rows:
        heads = str(r.heads_q) if r.heads_q == r.heads_kv else f"{r.heads_q}/{r.heads_kv}"
        seq = _n(r.seqlen) if r.seqlen == r.seqlen_kv else f"{_n(r.seqlen)}/{_n(r.seqlen_kv)}"
        cells.append(([r.dtype] if multi_dtype else []) + [
            str(r.head_dim), seq, r.variant, f"{r.batch} x {heads}", _tf(r.default),
            _tf(r.best), f"{fwd_config_text(r.best_config)} ({r.best_label}, of {r.timed})",
            _tf(r.fa2), _tf(r.cudnn)] + ([_tf(r.flex)] if has_flex else []) + [
            _x(_ratio(r.best, r.cudnn)), _x(_ratio(r.best, r.fa2)),
            _x(_ratio(r.best, r.default))])
    md = [f"### Forward: `{src.path.name}`", "",
          "TFLOP/s (forward FLOPs = 4 B H N^2 D, halved for causal). *default*: the template's "
          "default config; *best*: the fastest of every config of ours timed for the problem "
          "(default, grid and variants): what a tuning sweep over those configs would return.",
          "", *_table(header, cells), ""]
    name = src.path.stem
    plot_rows = [r for r in rows if r.dtype == "bfloat16" and r.dense_mask
                 and r.seqlen == r.seqlen_kv]
    return Section(src, md, forward_targets(src.path.name, rows),
                   (lambda path: plot_tflops(path, plot_rows, f"{src.gpu}: forward, bf16"))
                   if plot_rows else None, f"{name}.png")


def forward_targets(source: str, rows: list[FwdRow]) -> list[Target]:
    rows = [r for r in rows if r.dtype == "bfloat16" and r.dense_mask]

    def ratios(keep: Callable[[FwdRow], bool], base: str) -> list[tuple[str, float]]:
        out = []
        for r in rows:
            ratio = _ratio(r.best, getattr(r, base))
            if keep(r) and ratio is not None:
                out.append((r.name, ratio))
        return out

    def d128(causal: bool) -> Callable[[FwdRow], bool]:
        return lambda r: r.head_dim == 128 and r.seqlen >= FWD_D128_MIN_N and r.causal == causal

    out = [min_target(f"forward best vs cuDNN, d=128, N >= {_n(FWD_D128_MIN_N)}, "
                      f"{'causal' if causal else 'dense'}", source, FWD_D128_VS_CUDNN,
                      ratios(d128(causal), "cudnn")) for causal in (False, True)]
    out.append(min_target("forward best vs cuDNN, d=64", source, FWD_D64_VS_CUDNN,
                          ratios(lambda r: r.head_dim == 64, "cudnn")))
    out.append(min_target("forward best vs FA2, every row", source, FWD_VS_FA2,
                          ratios(lambda r: True, "fa2")))
    tuned = ratios(lambda r: True, "default")
    what = "forward tuned (best) vs default, geomean over problems"
    if not tuned:
        out.append(Target(what, source, f">= {FWD_TUNED_VS_DEFAULT:.2f}x", "no rows", None,
                          "not measured"))
    else:
        geomean = math.exp(sum(math.log(r) for _, r in tuned) / len(tuned))
        gap = geomean / FWD_TUNED_VS_DEFAULT - 1
        met = geomean >= FWD_TUNED_VS_DEFAULT
        out.append(Target(what, source, f">= {FWD_TUNED_VS_DEFAULT:.2f}x",
                          f"{geomean:.3f}x over {len(tuned)} problems", met,
                          f"{100 * abs(gap):.0f}% {'above' if met else 'short'}",
                          ", ".join(f"{n} {r:.2f}x" for n, r in tuned)))
    return out


def fwd_bwd_section(src: Source, data: dict[str, Any]) -> Section:
    rows, failures = fwd_bwd_rows(data)
    has_flex = any(r.flex is not None for r in rows) or any("flex" in f for f in failures)
    header = ["D", "N", "causal", "B x H", "default", "best", "best bwd config (of n grid)",
              "SDPA FA2", "SDPA cuDNN"] + (["Flex"] if has_flex else []) + [
        "best/cuDNN", "best/FA2", "best/default"]
    cells = [[str(r.head_dim), _n(r.seqlen), "yes" if r.causal else "no",
              f"{r.batch} x {r.heads}", _tf(r.default), _tf(r.best),
              f"{bwd_config_text(r.best_config)} ({r.best_label}, of {r.grid})", _tf(r.fa2),
              _tf(r.cudnn)] + ([_tf(r.flex)] if has_flex else []) + [
                 _x(_ratio(r.best, r.cudnn)), _x(_ratio(r.best, r.fa2)),
                 _x(_ratio(r.best, r.default))] for r in rows]
    md = [f"### Forward + backward: `{src.path.name}`", "",
          "TFLOP/s (fwd+bwd FLOPs = 3.5 x forward); one call is `torch.autograd.grad` of the "
          "attention output. *default*: our forward and backward default configs; *best*: the "
          "fastest of the default and the backward grid (default forward).",
          "", *_table(header, cells), ""]
    if failures:
        md += ["Not timed:", "", *(f"- {f}" for f in failures), ""]
    keep = [(r.name, ratio) for r in rows
            if r.head_dim == 128 and r.seqlen >= FWD_BWD_MIN_N
            and (ratio := _ratio(r.best, r.cudnn)) is not None]
    targets = [min_target(f"fwd+bwd best vs cuDNN, d=128, N >= {_n(FWD_BWD_MIN_N)}",
                          src.path.name, FWD_BWD_VS_CUDNN, keep)]
    fwd_like = [FwdRow("bfloat16", r.head_dim, r.seqlen, r.seqlen, r.batch, r.heads, r.heads,
                       "causal" if r.causal else "dense", r.default, r.best, fa2=r.fa2,
                       cudnn=r.cudnn, flex=r.flex) for r in rows]
    return Section(src, md, targets,
                   (lambda path: plot_tflops(path, fwd_like, f"{src.gpu}: forward + backward, "
                                                             "bf16")) if rows else None,
                   f"{src.path.stem}.png")


def masked_section(src: Source, data: dict[str, Any]) -> Section:
    rows, failures = masked_rows(data)

    def tf(t: Timed | None) -> str:
        return _tf(t.tflops if t else None)

    def flex_over(ours: Timed | None, flex: Timed | None) -> float | None:
        """Flex's time over ours: > 1 where ours is faster (a row shares one FLOP count)."""
        return _ratio(flex.ms if flex else None, ours.ms if ours else None)

    header = ["D", "N", "mask", "visible", "ours fwd", "Flex fwd", "fwd ours/Flex",
              "ours f+b default", "ours f+b best (config, of n grid)", "Flex f+b",
              "f+b best/Flex", "f+b default/Flex", "SDPA fwd", "SDPA f+b"]
    cells = []
    fwd_ratios: list[tuple[str, float]] = []
    best_ratios: list[tuple[str, float]] = []
    default_ratios: list[tuple[str, float]] = []
    for r in rows:
        ours_fwd, flex_fwd = r.fastest(["ours"], "fwd"), r.fastest(["flex"], "fwd")
        default = r.fastest(["ours"], "fwd+bwd")
        best = r.fastest(["ours", "ours-grid"], "fwd+bwd")
        flex = r.fastest(["flex"], "fwd+bwd")
        sdpa_fwd, sdpa = r.fastest(MASKED_SDPA, "fwd"), r.fastest(MASKED_SDPA, "fwd+bwd")
        ratios = (flex_over(ours_fwd, flex_fwd), flex_over(best, flex), flex_over(default, flex))
        for into, ratio in zip((fwd_ratios, best_ratios, default_ratios), ratios, strict=True):
            if ratio is not None:
                into.append((r.name, ratio))
        label = ("-" if best is None else "default" if best.impl == "ours"
                 else bwd_config_text(best.config))
        cells.append([str(r.head_dim), _n(r.seqlen), f"`{r.pattern}`",
                      "-" if r.visible is None else f"{r.visible:.3f}", tf(ours_fwd),
                      tf(flex_fwd), _x(ratios[0]), tf(default),
                      f"{tf(best)} ({label}, of {r.grid})", tf(flex), _x(ratios[1]),
                      _x(ratios[2]), tf(sdpa_fwd),
                      f"{tf(sdpa)} ({sdpa.impl.removeprefix('sdpa-')})" if sdpa else "-"])

    def span(ratios: list[tuple[str, float]]) -> str:
        if not ratios:
            return "not measured"
        (low_name, low), (high_name, high) = (min(ratios, key=lambda x: x[1]),
                                              max(ratios, key=lambda x: x[1]))
        slower = [n for n, x in ratios if x < 1]
        return (f"{low:.2f}x ({low_name}) to {high:.2f}x ({high_name}) over {len(ratios)} "
                f"rows, ours slower on {len(slower)}" + (f" ({', '.join(slower)})"
                                                          if slower else ""))

    md = [f"### Masked forward + backward: `{src.path.name}`", "",
          "TFLOP/s of the visible work only (forward = 4 B H D x visible pairs; forward + "
          "backward = 3.5 x forward), so the ratios of a row are time ratios. *visible*: the "
          "fraction of (query, key) pairs the mask lets through. *ours*: `flash_attention` "
          "with the `BlockMask`, default configs; *best*: the fastest of the default and the "
          "backward grid; *Flex*: compiled FlexAttention with the same mask_mod; *SDPA*: the "
          "mask materialized as a dense `attn_mask` (the backend that took it). *ours/Flex*: "
          "Flex's time over ours (above 1: ours is faster).", "",
          *_table(header, cells), "",
          f"- Forward, ours/Flex: {span(fwd_ratios)}.",
          f"- Forward + backward, best/Flex: {span(best_ratios)}.",
          f"- Forward + backward, default configs/Flex: {span(default_ratios)}.", ""]
    if failures:
        md += ["Not timed:", "", *(f"- {f}" for f in failures), ""]
    return Section(src, md, [])


def decode_section(src: Source, data: dict[str, Any]) -> Section:
    rows = decode_rows(data)
    copy = _num(data.get("copy_tb_per_s"))

    def bw(m: DecodeResult | None) -> str:
        if m is None or m.us is None or m.tb_per_s is None:
            return "-"
        share = f", {100 * m.tb_per_s / copy:.0f}%" if copy else ""
        return f"{m.us:.1f} ({m.tb_per_s:.2f}{share})"

    def speedup(row: DecodeRow, what: str) -> float | None:
        m, one = row.results.get(what), row.results.get("one-split")
        return _ratio(one.us if one else None, m.us if m else None)

    header = ["row", "B", "cache", "q/kv heads", "layout", "default", "x vs 1 split", "best",
              "x vs 1 split", "best config", "SDPA FA2", "SDPA cuDNN", "best/cuDNN time"]
    cells = []
    for r in rows:
        best, cudnn = r.results.get("tuned"), r.results.get("sdpa-cudnn")
        cells.append([r.name, str(r.batch), _n(r.seqlen_kv), f"{r.heads_q}/{r.heads_kv}",
                      r.mask, bw(r.results.get("default")), _x(speedup(r, "default")),
                      bw(best), _x(speedup(r, "tuned")),
                      f"{decode_config_text(best.config if best else None)}"
                      f"{f' ({best.note})' if best and best.note else ''}",
                      bw(r.results.get("sdpa-fa2")), bw(cudnn),
                      _x(_ratio(cudnn.us if cudnn else None, best.us if best else None))])
    copy_text = f"{copy:.2f} TB/s" if copy else "not recorded"
    md = [f"### Decode: `{src.path.name}`", "",
          f"One query token, bf16. Each cell: microseconds (TB/s of K and V read, % of the "
          f"device-to-device copy bandwidth measured in the same run: {copy_text}, read + "
          "write). *default*: the template's default config; *1 split*: the default with "
          "num_splits = 1; *best*: the fastest of the default and a short sweep around it. "
          "*best/cuDNN time*: cuDNN's time over ours (above 1: ours is faster).",
          "", *_table(header, cells), ""]
    name = src.path.name
    target_rows = [r for r in rows if r.batch == 1 and r.seqlen_kv == DECODE_SEQLEN
                   and r.mask == "none"]
    bw_what = f"decode B=1, {_n(DECODE_SEQLEN)} cache: best's K+V bandwidth vs copy"
    split_what = f"decode B=1, {_n(DECODE_SEQLEN)} cache: best vs one split"
    best = target_rows[0].results.get("tuned") if target_rows else None
    default = target_rows[0].results.get("default") if target_rows else None
    targets = []
    if best is None or best.tb_per_s is None or not copy:
        targets.append(Target(bw_what, name, f">= {100 * DECODE_COPY_SHARE:.0f}%",
                              "no row", None, "not measured"))
    else:
        share = best.tb_per_s / copy
        met = share >= DECODE_COPY_SHARE
        targets.append(Target(
            bw_what, name, f">= {100 * DECODE_COPY_SHARE:.0f}%",
            f"{100 * share:.1f}% ({best.tb_per_s:.2f} of {copy:.2f} TB/s)", met,
            f"{100 * abs(share - DECODE_COPY_SHARE):.1f} points "
            f"{'above' if met else 'short'}",
            f"default {100 * default.tb_per_s / copy:.1f}%"
            if default and default.tb_per_s else ""))
    x_best = speedup(target_rows[0], "tuned") if target_rows else None
    if x_best is None:
        targets.append(Target(split_what, name, f">= {DECODE_VS_ONE_SPLIT:.1f}x", "no row",
                              None, "not measured"))
    else:
        x_default = speedup(target_rows[0], "default")
        met = x_best >= DECODE_VS_ONE_SPLIT
        targets.append(Target(
            split_what, name, f">= {DECODE_VS_ONE_SPLIT:.1f}x", f"{x_best:.2f}x", met,
            f"{100 * abs(x_best / DECODE_VS_ONE_SPLIT - 1):.0f}% "
            f"{'above' if met else 'short'}",
            f"default {x_default:.2f}x" if x_default is not None else ""))
    return Section(src, md, targets,
                   (lambda path: plot_decode(path, rows, copy, f"{src.gpu}: decode, bf16"))
                   if rows else None, f"{src.path.stem}.png")


def blocksparse_rows(data: dict[str, Any]) -> tuple[list[BlockSparseRow], float | None]:
    """Per pattern (in the file's order), and our dense kernel's time."""
    rows: dict[str, BlockSparseRow] = {}
    dense_ms: float | None = None
    for r in data["rows"]:
        if not isinstance(r, dict) or "pattern" not in r or "kernel" not in r:
            raise FormatError(f"a row without 'pattern' and 'kernel': {str(r)[:120]}")
        pattern, kernel, ms = str(r["pattern"]), str(r["kernel"]), _num(r.get("ms"))
        if kernel == "ours-dense":
            dense_ms = ms if ms is not None else dense_ms
            continue
        if kernel not in ("ours-default", "ours-default-again", "ours-grid", "flex"):
            raise FormatError(f"unknown kernel {kernel!r}")
        # The default config is timed twice (before and after the grid; the first timing of
        # a run can read slow): its time is the faster of the two.
        kernel = "ours-default" if kernel == "ours-default-again" else kernel
        row = rows.setdefault(pattern, BlockSparseRow(pattern))
        if row.density is None:
            row.density = _num(r.get("density"))
        if ms is None:
            if kernel == "flex":
                row.flex_note = _first_sentence(str(r.get("failed", "not timed")))
            else:
                row.failed += 1
            continue
        if kernel == "flex":
            row.flex_ms = ms
            continue
        row.timed += 1
        label = kernel.removeprefix("ours-")
        if label == "default":
            row.default_ms = ms if row.default_ms is None else min(row.default_ms, ms)
        if row.best_ms is None or ms < row.best_ms:
            row.best_ms, row.best_label, row.best_config = ms, label, r.get("config")
            row.best_tflops = _num(r.get("tflops_dense_equiv"))
    return list(rows.values()), dense_ms


def blocksparse_section(src: Source, data: dict[str, Any]) -> Section:
    rows, dense_ms = blocksparse_rows(data)
    shape: dict[str, Any] = data["shape"] if isinstance(data.get("shape"), dict) else {}
    shape_text = (", ".join(f"{k}={shape[k]}" for k in ("B", "H", "N", "D") if k in shape)
                  + (f", {shape['dtype']}" if "dtype" in shape else "")
                  + (f", mask block {shape['block']}" if "block" in shape else ""))
    header = ["pattern", "block density", "ours default ms", "ours best ms",
              "best config (of n timed)", "Flex ms", "best/Flex speed-up", "best/dense time",
              "best TFLOP/s (dense-equiv.)"]
    cells = []
    for r in rows:
        failed = f", {r.failed} failed" if r.failed else ""
        config = (f"default (of {r.timed}{failed})" if r.best_label == "default" else
                  f"{fwd_config_text(r.best_config)} ({r.best_label}, of {r.timed}{failed})"
                  if r.best_ms is not None else f"- (of {r.timed}{failed})")
        vs_dense = _ratio(r.best_ms, dense_ms)
        cells.append([f"`{r.pattern}`", "-" if r.density is None else f"{r.density:.3f}",
                      _ms(r.default_ms), _ms(r.best_ms), config,
                      _ms(r.flex_ms) if r.flex_ms is not None else (r.flex_note or "-"),
                      _x(_ratio(r.flex_ms, r.best_ms)),
                      "-" if vs_dense is None else f"{vs_dense:.3f}x",
                      _tf(r.best_tflops)])
    dense_text = (f"{dense_ms:.3f} ms" if dense_ms is not None else "not recorded")
    md = [f"### Block-sparse forward: `{src.path.name}`", "",
          f"{shape_text or 'Shape not recorded'}. Milliseconds per call. *default*: our "
          "default config for the mask; *best*: the fastest of the default and the grid; "
          "*Flex*: compiled FlexAttention with a block mask of the same pattern. "
          f"*best/dense time*: our best time over our dense kernel's (no mask: {dense_text}). "
          "Dense-equivalent TFLOP/s = 4 B H N^2 D / time. Targets apply to "
          f"`{BLOCKSPARSE_PATTERN}` only; the other patterns are shown for reference.",
          "", *_table(header, cells), ""]
    name = src.path.name
    row = next((r for r in rows if r.pattern == BLOCKSPARSE_PATTERN), None)
    best = row.best_ms if row else None
    vs_dense = _ratio(best, dense_ms)
    default_vs_dense = _ratio(row.default_ms if row else None, dense_ms)
    targets = [max_target(
        f"block-sparse `{BLOCKSPARSE_PATTERN}`: best time vs our dense kernel", name,
        BLOCKSPARSE_VS_DENSE, vs_dense, "x",
        f"{vs_dense:.3f}x ({best:.3f} of {dense_ms:.3f} ms)"
        if vs_dense is not None and best is not None and dense_ms is not None else "",
        f"default {default_vs_dense:.3f}x" if default_vs_dense is not None else "")]
    vs_flex = _ratio(row.flex_ms if row else None, best)
    what = f"block-sparse `{BLOCKSPARSE_PATTERN}`: best vs FlexAttention (Flex time / ours)"
    if vs_flex is None or row is None or row.flex_ms is None or best is None:
        targets.append(Target(what, name, f">= {BLOCKSPARSE_VS_FLEX:.2f}x", "no row", None,
                              "not measured"))
    else:
        met = vs_flex >= BLOCKSPARSE_VS_FLEX
        default_vs_flex = _ratio(row.flex_ms, row.default_ms)
        targets.append(Target(
            what, name, f">= {BLOCKSPARSE_VS_FLEX:.2f}x",
            f"{vs_flex:.2f}x ({row.flex_ms:.3f} / {best:.3f} ms)", met,
            f"{100 * abs(vs_flex / BLOCKSPARSE_VS_FLEX - 1):.0f}% "
            f"{'above' if met else 'short'}",
            f"default {default_vs_flex:.2f}x" if default_vs_flex is not None else ""))
    short = ", ".join(f"{k}={_n(int(v)) if k == 'N' else v}" for k, v in shape.items()
                      if k in ("B", "H", "N", "D") and isinstance(v, int))
    title = f"{src.gpu}: block-sparse forward" + (f"\n{short}, {shape.get('dtype', '')}"
                                                  if short else "")
    return Section(src, md, targets,
                   (lambda path: plot_blocksparse(path, rows, dense_ms, title)) if rows else None,
                   f"{src.path.stem}.png")


def sweep_rows(data: dict[str, Any]) -> list[SweepRow]:
    rows = []
    for p in data["problems"]:
        try:
            counts = p.get("counts") or {}
            failed = p.get("failed")
            if not isinstance(failed, dict):
                failed = {k: v for k, v in counts.items() if k != "ok"}
            ok = p.get("ok", counts.get("ok", 0))
            best, default = _num(p.get("best_tflops")), _num(p.get("default_tflops"))
            speedup = _num(p.get("speedup"))
            rows.append(SweepRow(str(p["label"]), best, default,
                                 speedup if speedup is not None else _ratio(best, default),
                                 int(ok), {str(k): int(v) for k, v in failed.items() if v},
                                 int(p["budget"]) if p.get("budget") is not None else None,
                                 _num(p.get("seconds_per_trial")),
                                 _num(p.get("bench_seconds_per_trial"))))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a problem without {exc}: {str(p)[:120]}") from exc
    return rows


def sweep_section(src: Source, data: dict[str, Any]) -> Section:
    rows = sweep_rows(data)
    sweep = str(data.get("name", "?"))

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = ["problem", "best TFLOP/s", "default TFLOP/s", "speed-up",
              "trials ok / failed by kind", "s per trial", "bench s per trial",
              "overhead s per trial"]
    cells = [[r.label, _tf(r.best), _tf(r.default), _x(r.speedup),
              f"{r.ok} / " + (", ".join(f"{k} {v}" for k, v in sorted(r.failed.items()))
                              or "none"),
              s(r.seconds_per_trial), s(r.bench_seconds_per_trial), s(r.overhead)]
             for r in rows]
    budgets = sorted({r.budget for r in rows if r.budget is not None})
    budget_text = (f"{budgets[0]} trials per problem" if len(budgets) == 1 else
                   f"{budgets[0]}-{budgets[-1]} trials per problem" if budgets else
                   "trials per problem not recorded")
    facts = [f"sampler {data['sampler']}" if data.get("sampler") else "",
             f"{data['workers']} worker{'' if data['workers'] == 1 else 's'}"
             if data.get("workers") is not None else "",
             f"compile ahead {data['compile_ahead']}" if data.get("compile_ahead") is not None
             else "",
             f"wall {_num(data.get('wall_s')):.1f} s" if _num(data.get("wall_s")) else "",
             f"status {data['status']}" if data.get("status") else ""]
    md = [f"### Tuner sweep `{sweep}`: `{src.path.name}`", "",
          f"The JSON report of `tuner sweep {sweep} --json`: {budget_text}, "
          f"{', '.join(f for f in facts if f)}. *best*: the fastest config the sweep found; "
          "*default*: the template's default config; *trials*: timed configs (ok) and the "
          "failures by kind (*invalid*: rejected by the template's constraints, never compiled). *s per trial*: the "
          "problem's wall time over its trials; *bench s per trial*: the part spent timing; "
          "*overhead*: the rest (compiling, checking, bookkeeping)."
          + (f" The {' and '.join(src.meta_keys)} of this run are not in the JSON; they are "
             f"stated in `{src.meta}`." if src.meta else ""),
          "", *_table(header, cells), ""]
    name = src.path.name
    speedups = [(r.label, r.speedup) for r in rows if r.speedup]
    what = (f"tuner sweep `{sweep}`: tuned vs default, geomean over the suite "
            f"(only {budget_text})")
    if not speedups:
        targets = [Target(what, name, f">= {SWEEP_TUNED_VS_DEFAULT:.2f}x", "no rows", None,
                          "not measured")]
    else:
        geomean = _geomean([r for _, r in speedups])
        met = geomean >= SWEEP_TUNED_VS_DEFAULT
        targets = [Target(what, name, f">= {SWEEP_TUNED_VS_DEFAULT:.2f}x",
                          f"{geomean:.3f}x over {len(speedups)} problems", met,
                          f"{100 * abs(geomean / SWEEP_TUNED_VS_DEFAULT - 1):.0f}% "
                          f"{'above' if met else 'short'}",
                          ", ".join(f"{n} {r:.2f}x" for n, r in speedups))]
    overheads = [(r.label, r.overhead) for r in rows if r.overhead is not None]
    worst = max(overheads, key=lambda r: r[1]) if overheads else None
    targets.append(max_target(
        f"tuner sweep `{sweep}`: seconds per trial beyond the benchmark, worst problem", name,
        SWEEP_OVERHEAD_S, worst[1] if worst else None, " s",
        f"{worst[1]:.2f} s ({worst[0]})" if worst else "",
        ", ".join(f"{n} {o:.2f} s" for n, o in overheads)))
    return Section(src, md, targets)


# ----------------------------------------------------------------------------- issue 16
def _knobs(key: str) -> dict[str, Any]:
    """A config key ("block_n=64,combine=fused,whole_waves=False") as a dict, numbers as ints
    and True/False as bools."""
    items = (item.split("=", 1) for item in key.split(",") if "=" in item)
    known = {"True": True, "False": False}
    return {k: int(v) if v.isdigit() else known.get(v, v) for k, v in items}


def implementation_text(chosen: str) -> str:
    """dispatch_bench.py's ``chosen`` ("gluon BLOCK_M=128,BLOCK_N=128,...,pingpong=True") in
    short: the implementation, the tile, the flags that are on and the other knobs."""
    impl, _, key = chosen.partition(" ")
    knobs = _knobs(key)
    if impl == "sdpa" and set(knobs) == {"backend"}:
        return f"sdpa ({knobs['backend']})"
    if impl == "decode":
        return f"decode ({decode_config_text(knobs)})"
    return " ".join(w for w in (impl, knobs_text(knobs)) if w)


def knobs_text(knobs: dict[str, Any]) -> str:
    """A config's knobs in short: the tile, the flags that are on and the other knobs."""
    knobs = dict(knobs)
    tile = {"BLOCK_M", "BLOCK_N"} <= set(knobs)
    words = [f"{knobs.pop('BLOCK_M')}x{knobs.pop('BLOCK_N')}"] if tile else []
    words += [k if v is True else f"{k}={v}" for k, v in knobs.items() if v is not False]
    return " ".join(words)


def _span(ratios: list[tuple[str, float]]) -> str:
    (low_name, low), (high_name, high) = (min(ratios, key=lambda x: x[1]),
                                          max(ratios, key=lambda x: x[1]))
    return f"{low:.2f}x ({low_name}) to {high:.2f}x ({high_name}) over {len(ratios)} rows"


@dataclass
class DispatchRow:
    name: str
    training: bool
    ms: dict[str, float | None]
    errors: dict[str, str]
    chosen: str
    why: str
    paired: dict[str, Any] | None = None  # benchmarks/paired.py's, in newer files

    @property
    def speedup(self) -> float | None:
        """sdpa's time over tuner.attention's: >= 1 where tuner.attention is not slower."""
        return _ratio(self.ms.get("sdpa"), self.ms.get("tuner.attention"))

    @property
    def noise(self) -> float | None:
        """The gap between two timings of the same sdpa call (dispatch_bench's noise floor)."""
        again = _ratio(self.ms.get("sdpa"), self.ms.get("sdpa again"))
        return None if again is None else abs(1 - again)

    def fastest(self) -> tuple[str, float] | None:
        """The fastest single candidate (dispatch_bench's ``vs best``)."""
        singles = [(n, t) for n, t in self.ms.items()
                   if n not in ("tuner.attention", "sdpa again") and t]
        return min(singles, key=lambda x: x[1], default=None)


def problem_name(p: dict[str, Any], training: bool) -> str:
    """templates.base.Problem's dict in short: "train B2 H32/8 N4k d128 causal"."""
    heads = (str(p["heads_q"]) if p["heads_q"] == p["heads_kv"]
             else f"{p['heads_q']}/{p['heads_kv']}")
    seq = (f"N{_n(int(p['seqlen_q']))}" if p["seqlen_q"] == p["seqlen_kv"]
           else f"q{_n(int(p['seqlen_q']))} kv{_n(int(p['seqlen_kv']))}")
    variant = "dense" if p.get("causal", "none") == "none" else "causal"
    dtype = "" if p.get("dtype", "bfloat16") == "bfloat16" else f" {p['dtype']}"
    mask = "" if p.get("mask", "none") == "none" else f" {p['mask']}"
    return (f"{'train ' if training else ''}B{p['batch']} H{heads} {seq} d{p['head_dim']} "
            f"{variant}{mask}{dtype}")


def dispatch_rows(data: dict[str, Any]) -> list[DispatchRow]:
    rows = []
    for r in data["rows"]:
        try:
            training = bool(r["training"])
            rows.append(DispatchRow(problem_name(r["problem"], training), training,
                                    {str(k): _num(v) for k, v in r["ms"].items()},
                                    {str(k): str(v) for k, v in r.get("errors", {}).items()},
                                    str(r.get("chosen", "")), str(r.get("why", "")),
                                    _paired(r.get("paired"))))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
    return rows


def dispatch_section(src: Source, data: dict[str, Any]) -> Section:
    rows = dispatch_rows(data)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    is_paired = any(r.paired for r in rows)
    header = ["row", "sdpa ms", "tuner.attention ms", "sdpa/tuner", "noise: sdpa/sdpa again",
              *(PAIRED_HEADER if is_paired else []),
              "ran (tuner.attention's choice)", "fastest single (ms)", "fastest/tuner",
              "each candidate forced, ms"]
    cells = []
    for r in rows:
        fastest = r.fastest()
        again = _ratio(r.ms.get("sdpa"), r.ms.get("sdpa again"))
        why = "" if r.why.startswith("fastest measured") else f": {r.why.split(':')[0]}"
        forced = ", ".join(f"{n} {ms(t)}" for n, t in r.ms.items()
                           if n not in ("sdpa", "sdpa again", "tuner.attention"))
        cells.append([r.name, ms(r.ms.get("sdpa")), ms(r.ms.get("tuner.attention")),
                      _x(r.speedup), _x(again), *(paired_cells(r.paired) if is_paired else []),
                      (implementation_text(r.chosen) if r.chosen else "-") + why,
                      f"{fastest[0]} {ms(fastest[1])}" if fastest else "-",
                      _x(_ratio(fastest[1] if fastest else None, r.ms.get("tuner.attention"))),
                      forced or "-"])
    gaps = [(r.name, g) for r in rows if (g := r.noise) is not None]
    floor = max(gaps, key=lambda x: x[1]) if gaps else None
    layout = {"bhsd": "q, k, v contiguous (B, H, S, D)",
              "bshd": "q, k, v as transposed views of (B, S, H, D) memory, as a model hands "
                      "them over"}.get(str(data.get("layout")), f"layout {data.get('layout')}")
    facts = [layout, f"database `{data['db']}`" if data.get("db") else "no database",
             # since TUNER_SHIPPED (older runs did not say): on, off or a folder of tables
             f"shipped tables `{data['shipped']}`" if data.get("shipped") else "",
             f"cuDNN {data['cudnn']}" if data.get("cudnn") else ""]
    interpreted = ("" if data.get("timings_are_gpu_timings", True) else
                   " **Not GPU timings** (the CPU interpreter): they show the rows run, nothing "
                   "more.")
    md = [f"### Drop-in `tuner.attention` against torch SDPA: `{src.path.name}`", "",
          f"{'; '.join(f for f in facts if f)}. Milliseconds per call, each the median of "
          "its alternated rounds (the command's `--rounds`); *train* rows time forward + "
          "backward. *sdpa*: `torch.nn.functional.scaled_dot_product_attention` as a user's "
          "code calls it (torch picks cuDNN on an H100); *tuner.attention*: the drop-in, "
          "running the implementation under *ran*. **sdpa/tuner**: sdpa's time over "
          "tuner.attention's (**>= 1.00x: tuner.attention is not slower**). *noise*: the same "
          "sdpa call timed again as another candidate: two timings of one kernel differ by "
          "this much, so a smaller gap says nothing"
          + (f"; this file's noise floor (the largest gap) is {100 * floor[1]:.1f}% "
             f"({floor[0]})" if floor else "; not recorded")
          + ". *fastest single*: the fastest candidate, SDPA's backends and ours forced "
          "through `tuner.use_implementation`." + (f" {PAIRED_TEXT}." if is_paired else "")
          + interpreted,
          "", *_table(header, cells), ""]
    speedups = [(r.name, x) for r in rows if (x := r.speedup) is not None]
    if speedups and floor:
        beyond = [n for n, x in speedups if 1 / x > DROP_IN_VS_SDPA + floor[1]]
        md += [f"- tuner.attention against sdpa: {_span(speedups)}; slower than sdpa beyond "
               f"the noise floor on {len(beyond)}" + (f" ({', '.join(beyond)})" if beyond
                                                      else "") + ".", ""]
    errors: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for candidate, why in r.errors.items():
            errors.setdefault((candidate, _first_sentence(why)), []).append(r.name)
    if errors:
        md += ["Not timed (failed the check against float32, or raised):", "",
               *(f"- {c}, {len(names)} of {len(rows)} rows: {why}"
                 for (c, why), names in errors.items()), ""]
    what = "tuner.attention time vs SDPA, every row, within the file's noise floor"
    if is_paired:  # each row against its own A/A floor, pairs within rounds
        targets = [paired_target("tuner.attention time vs SDPA, every row, paired, beyond the "
                                 "A/A floor", src.path.name,
                                 [(r.name, r.paired) for r in rows if r.paired],
                                 [r.name for r in rows if not r.paired])]
    elif floor is None:
        targets = [Target(what, src.path.name, f"<= {DROP_IN_VS_SDPA:.2f}x + noise",
                          "no noise floor recorded", None, "not measured")]
    else:
        limit = DROP_IN_VS_SDPA + floor[1]
        times = [(r.name, t) for r in rows
                 if (t := _ratio(r.ms.get("tuner.attention"), r.ms.get("sdpa"))) is not None]
        timed = {name for name, _ in times}
        targets = [max_rows_target(what, src.path.name, limit, times,
                                   f"<= {limit:.3f}x (noise floor {100 * floor[1]:.1f}%)",
                                   [r.name for r in rows if r.name not in timed])]
    return Section(src, md, targets)


LOOP_NOTE = re.compile(r"^tuner\.attention runs (\S+) \(([^)]*)\); "
                       r"tuner\.decode runs (\S+) \(([^)]*)\)$")
LOOP_IMPLS = ("sdpa", "tuner.attention", "tuner.decode")


@dataclass
class LoopRow:
    name: str
    us: dict[str, float | None]
    host_us: dict[str, float | None]
    graph_us: dict[str, float | None]
    error: dict[str, float | None]
    note: str

    def time_vs_sdpa(self, what: str) -> float | None:
        return _ratio(self.us.get(what), self.us.get("sdpa"))


def decode_loop_rows(data: dict[str, Any]) -> list[LoopRow]:
    def numbers(value: Any) -> dict[str, float | None]:
        return {str(k): _num(v) for k, v in (value or {}).items()}

    rows = []
    for r in data["rows"]:
        try:
            rows.append(LoopRow(str(r["row"]), numbers(r["us_per_call"]),
                                numbers(r.get("host_us_per_call")),
                                numbers(r.get("graph_us_per_call")),
                                numbers(r.get("max_abs_error_vs_sdpa")), str(r.get("note", ""))))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
    return rows


def loop_note_text(note: str) -> str:
    """decode_loop.py's note ("tuner.attention runs decode (exact); tuner.decode runs
    block_n=64,...") in short; any other note as it is."""
    m = LOOP_NOTE.match(note)
    if m is None:
        return note or "-"
    return (f"tuner.attention: {m[1]} ({m[2]}); tuner.decode: "
            f"{decode_config_text(_knobs(m[3]))} ({m[4]})")


def decode_loop_section(src: Source, data: dict[str, Any]) -> Section:
    rows = decode_loop_rows(data)

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def three(values: dict[str, float | None]) -> str:
        return " / ".join(us(values.get(w)) for w in LOOP_IMPLS)

    def err(value: float | None) -> str:
        return "-" if value is None else f"{value:.1e}"

    header = ["row", "sdpa us", "tuner.attention us", "sdpa/attention", "tuner.decode us",
              "sdpa/decode", "host us: sdpa / attention / decode",
              "graph us: sdpa / attention / decode", "max abs error vs sdpa: attention / decode",
              "ran"]
    cells = [[r.name, us(r.us.get("sdpa")), us(r.us.get("tuner.attention")),
              _x(_ratio(r.us.get("sdpa"), r.us.get("tuner.attention"))),
              us(r.us.get("tuner.decode")),
              _x(_ratio(r.us.get("sdpa"), r.us.get("tuner.decode"))), three(r.host_us),
              three(r.graph_us),
              f"{err(r.error.get('tuner.attention'))} / {err(r.error.get('tuner.decode'))}",
              loop_note_text(r.note)] for r in rows]
    calls, rounds = data.get("calls"), data.get("rounds")
    cudnn = f"cuDNN {data['cudnn']}" if data.get("cudnn") else "cuDNN"
    md = [f"### Decode loop: `{src.path.name}`", "",
          "decode_loop.py's rows (bf16, one query token, 32 query and 8 KV heads, d128, a full "
          "cache of the row's length, batch B): microseconds per call of "
          f"{calls if calls is not None else 'N'} calls queued back to back between two CUDA "
          f"events, the median of {rounds if rounds is not None else 'the'} alternated rounds: "
          "the pace a model's decode loop sees. *sdpa*: torch SDPA as a user calls it "
          f"({cudnn} on an H100); "
          "*tuner.attention*: the drop-in; *tuner.decode*: the decode entry (per-sequence "
          "lengths), with the database's configs. **sdpa/attention, sdpa/decode**: sdpa's time "
          "over ours (**>= 1.00x: ours is not slower**). *host*: the same loop not waiting for "
          "the GPU; *graph*: the calls captured in a CUDA graph and replayed, the GPU alone. "
          "*ran*: what each of ours ran and how its config matched. Nothing is timed twice "
          "here, so the file has no noise floor.",
          "", *_table(header, cells), ""]
    targets = []
    for what in ("tuner.attention", "tuner.decode"):
        times = [(r.name, t) for r in rows
                 if r.name in DECODE_LOOP_ROWS and (t := r.time_vs_sdpa(what)) is not None]
        missing = [n for n in DECODE_LOOP_ROWS if n not in {name for name, _ in times}]
        targets.append(max_rows_target(
            f"decode loop {', '.join(DECODE_LOOP_ROWS)} through {what}: time vs cuDNN (SDPA)",
            src.path.name, DROP_IN_VS_SDPA, times, missing=missing))
    return Section(src, md, targets)


def decode_grid_section(src: Source, data: dict[str, Any]) -> Section:
    header = ["row", "cuDNN us", "fastest us", "fastest config", "cuDNN/fastest",
              "configs timed (of run)", "wrong / failed", "skipped (budget)",
              "split kernel alone us (with its combine)"]
    cells = []
    for name, r in data["rows"].items():
        try:
            configs = list(r["configs"])
            cudnn = _num(r.get("cudnn_us"))
        except (KeyError, TypeError) as exc:
            raise FormatError(f"a row without {exc}: {str(r)[:120]}") from exc
        timed = sorted((c for c in configs if _num(c.get("us")) is not None),
                       key=lambda c: c["us"])
        failed = sum(1 for c in configs if c.get("error"))
        wrong = len(configs) - len(timed) - failed
        best = timed[0] if timed else None
        split = r.get("split_only")
        alone, with_combine = ((_num(split.get("us")), _num(split.get("with_combine_us")))
                               if isinstance(split, dict) else (None, None))
        cells.append([str(name), "-" if cudnn is None else f"{cudnn:.1f}",
                      f"{best['us']:.1f}" if best else "-",
                      decode_config_text(best["knobs"]) if best else "-",
                      _x(_ratio(cudnn, best["us"] if best else None)),
                      f"{len(timed)} (of {len(configs)})", f"{wrong} / {failed}",
                      str(len(r.get("skipped") or [])),
                      f"{alone:.1f} ({with_combine:.1f})"
                      if alone is not None and with_combine is not None else "-"])
    md = [f"### Decode config grid: `{src.path.name}`", "",
          f"decode_grid.py's `{data.get('grid', '?')}` grid of flash_decode configs beside "
          "cuDNN on decode_loop.py's rows (bf16, one query token, 32/8 heads, d128, a full "
          "cache): microseconds per call, the calls captured in a CUDA graph and replayed, so "
          "the GPU's time alone (the decode loop above adds the host). Every config is "
          "checked against SDPA first (*wrong*: beyond the tolerance; *failed*: did not "
          "compile or launch). **cuDNN/fastest**: cuDNN's time over the fastest config's "
          "(**>= 1.00x: the config is not slower**). How the configs of `tuner.decode` were "
          "found; the targets are the decode loop's.",
          "", *_table(header, cells), ""]
    return Section(src, md, [])


def e2e_section(src: Source, data: dict[str, Any]) -> Section:
    """e2e_hf.py: per model (llama, sliding) the times of sdpa and ours, and logits errors;
    files from the paired e2e_hf.py also the paired ratio, its floor and verdict per step."""
    cells, logits = [], []
    times: list[tuple[str, float]] = []
    pairs: list[tuple[str, dict[str, Any]]] = []
    sliding: tuple[float, float] | None = None
    sliding_pair: dict[str, Any] | None = None
    for model, r in data["results"].items():
        try:
            ours_key = "tuner" if "tuner" in r else next(
                k for k in r if k not in ("sdpa", "ratio", "paired", "rounds_ms"))
            sdpa, ours = r["sdpa"], r[ours_key]
            steps = [k for k in sdpa if k.endswith("ms") or k.endswith("token")]
        except (AttributeError, KeyError, StopIteration, TypeError) as exc:
            raise FormatError(f"a model without sdpa and ours ({exc!r}): {str(r)[:120]}") \
                from exc
        paired = r.get("paired") if isinstance(r.get("paired"), dict) else {}
        for step in steps:
            base, mine = _num(sdpa.get(step)), _num(ours.get(step))
            c = _paired(paired.get(step))
            cells.append([str(model), step, _ms(base), _ms(mine), _x(_ratio(base, mine)),
                          *paired_cells(c)])
            name = f"{model} {step.removesuffix(' ms')}"
            if (t := _ratio(mine, base)) is not None:
                times.append((name, t))
            if c is not None:
                pairs.append((name, c))
            if model == "sliding" and step == "prefill ms" and base and mine:
                sliding, sliding_pair = (base, mine), c
        errors = [_num(x.get("logits error vs fp32")) for x in (sdpa, ours)]
        if any(e is not None for e in errors):
            logits.append(f"- {model}: logits' relative error against an fp32 eager model, "
                          + ", ".join(f"{who} {'-' if e is None else f'{e:.2e}'}"
                                      for who, e in zip(("sdpa", ours_key), errors, strict=True)))
    is_paired = bool(pairs)
    if not is_paired:  # files of the best-of-3 e2e_hf.py: the table as it was
        cells = [row[:5] for row in cells]
    sizes = data.get("sizes") if isinstance(data.get("sizes"), dict) else {}
    library = f"transformers {data['transformers']}" if data.get("transformers") else \
        "transformers"
    how = (f"each the median of {data.get('rounds', 'its')} paired rounds (sdpa, ours and sdpa "
           "again, both models resident)" if is_paired else
           "each the best of 3 wall times after a warm-up")
    noise = (f". {PAIRED_TEXT}" if is_paired else
             ". Nothing is timed twice here, so the file has no noise floor")
    md = [f"### End to end, a transformers model: `{src.path.name}`", "",
          f"e2e_hf.py: a {library} model with random weights, "
          "`attn_implementation=\"sdpa\"` against the project's, "
          f"side by side in one process, database `{data.get('db') or 'none'}`. *llama*: "
          "Llama-3-8B attention, 4 layers; *sliding*: the same as Mistral with a sliding window "
          f"on every layer. Milliseconds, {how}"
          + (f"; sizes {', '.join(f'{k} {v}' for k, v in sizes.items())}" if sizes else "")
          + " (the sliding model trains one batch of twice the window). **sdpa/tuner**: sdpa's "
          "time over ours (**>= 1.00x: ours is not slower**)" + noise
          + "; the file does not record which implementation ran.",
          "", *_table(["model", "step", "sdpa", "tuner", "sdpa/tuner",
                       *(PAIRED_HEADER if is_paired else [])], cells), ""]
    if logits:
        md += [*logits, ""]
    name = src.path.name
    every = "e2e_hf: tuner time vs SDPA, every row"
    targets = [paired_target(every + ", paired, beyond the A/A floor", name, pairs,
                             [n for n, _ in times if n not in dict(pairs)])
               if is_paired else max_rows_target(every, name, DROP_IN_VS_SDPA, times)]
    what = "e2e_hf: sliding-window prefill, SDPA time / tuner"
    if sliding is None:
        targets.append(Target(what, name, f">= {E2E_SLIDING_SPEEDUP:.2f}x", "no sliding row",
                              None, "not measured"))
    else:
        x = sliding[0] / sliding[1]
        measured = f"{x:.2f}x ({sliding[0]:.1f} / {sliding[1]:.1f} ms)"
        if sliding_pair is not None:  # the paired median decides; its interval beside it
            r = sliding_pair["ratio"]
            x = 1 / r["median"]
            slow, fast = _num(r.get("ci_high")), _num(r.get("ci_low"))  # time ratios
            measured = (f"{x:.2f}x paired" + (f" (interval {1 / slow:.2f}-{1 / fast:.2f}x)"
                                               if slow and fast else "")
                        + f"; medians {sliding[0]:.1f} / {sliding[1]:.1f} ms")
        met = x >= E2E_SLIDING_SPEEDUP
        targets.append(Target(what, name, f">= {E2E_SLIDING_SPEEDUP:.2f}x", measured, met,
                              f"{100 * abs(x / E2E_SLIDING_SPEEDUP - 1):.0f}% "
                              f"{'above' if met else 'short'}"))
    return Section(src, md, targets)


# ----------------------------------------------------------------------------- issue 17
GLUON_PREFIX = "gluon-"  # gluon_fwd_bench.py's "what" of a Gluon variant: gluon-NAME
# The candidates it times beside the Gluon variants, as the table's columns name them.
GLUON_BASELINES = {"sdpa-cudnn": "cuDNN TFLOP/s", "sdpa-fa2": "FA2",
                   "triton-fwd": "Triton flash_fwd"}
CUDNN = "sdpa-cudnn"


@dataclass
class GluonFwdRow(ProblemRow):
    """One problem of gluon_fwd_bench.py --time: each candidate's TFLOP/s, or why it has none."""

    tflops: dict[str, float] = field(default_factory=dict)  # what -> median TFLOP/s
    failed: dict[str, str] = field(default_factory=dict)  # what -> why it was not timed

    @property
    def name(self) -> str:
        """The problem as the forward targets name one, "d128 N4k causal" (the alignment only
        where it is not top-left, the dtype only where it is not bf16)."""
        seq = (f"N{_n(self.seqlen)}" if self.seqlen == self.seqlen_kv
               else f"q{_n(self.seqlen)} kv{_n(self.seqlen_kv)}")
        mask = ("dense" if self.variant == "dense" else "causal"
                if self.variant == "causal-top_left" else self.variant)
        dtype = "" if self.dtype == "bfloat16" else f" {self.dtype}"
        return f"d{self.head_dim} {seq} {mask}{dtype}"

    @property
    def shape(self) -> str:
        heads = (str(self.heads_q) if self.heads_q == self.heads_kv
                 else f"{self.heads_q}/{self.heads_kv}")
        return f"B{self.batch} H{heads}"

    def best_gluon(self) -> tuple[str, float] | None:
        """The fastest Gluon variant that passed its check and was timed: (variant, TFLOP/s)."""
        timed = [(what.removeprefix(GLUON_PREFIX), t) for what, t in self.tflops.items()
                 if what.startswith(GLUON_PREFIX)]
        return max(timed, key=lambda x: x[1], default=None)


def gluon_fwd_rows(data: dict[str, Any]) -> tuple[list[GluonFwdRow], list[str], list[str]]:
    """Per problem (in the file's order) the timed candidates; a line for every candidate that
    was not timed; the names of the diagnostic timings left out."""
    rows: dict[str, GluonFwdRow] = {}
    failures, diagnostics = [], []
    for r in data["timings"]:
        if not isinstance(r, dict) or "problem" not in r or "what" not in r:
            raise FormatError(f"a timing without 'problem' and 'what': {str(r)[:120]}")
        key, what = str(r["problem"]), str(r["what"])
        if r.get("diagnostic"):
            # The kernel without its exponentials or its softmax: wrong results by design,
            # a cost breakdown, never a speed of the forward.
            diagnostics.append(what)
            continue
        if key not in rows:
            rows[key] = GluonFwdRow(*problem_row_fields(key))
        row, tflops = rows[key], _num(r.get("tflops"))
        # "error" is the output's relative error (a number every checked row has); "failed"
        # says the row failed its check or raised, and then its time is no speed.
        if r.get("failed") or tflops is None:
            row.failed[what] = _first_sentence(str(r.get("failed") or "not timed"))
            failures.append(f"{row.name} ({row.shape}) {what}: {row.failed[what]}")
        else:
            row.tflops[what] = tflops
    return list(rows.values()), failures, list(dict.fromkeys(diagnostics))


def gluon_checks_text(checks: Any) -> str:
    """gluon_fwd_bench.py --check's verdicts per variant: "pp 13 of 13 ok"."""
    if not isinstance(checks, dict) or not checks:
        return "none in this file (run without `--check`)"
    out = []
    for name, results in checks.items():
        results = results if isinstance(results, list) else []
        ok = sum(1 for c in results if isinstance(c, dict) and c.get("ok"))
        skipped = sum(1 for c in results if isinstance(c, dict) and "skipped" in c)
        out.append(f"`{name}` {ok} of {len(results)} ok"
                   + (f" ({skipped} skipped)" if skipped else ""))
    return ", ".join(out)


def gluon_fwd_section(src: Source, data: dict[str, Any]) -> Section:
    rows, failures, diagnostics = gluon_fwd_rows(data)
    seen = list(dict.fromkeys(w for r in rows for w in (*r.tflops, *r.failed)))
    baselines = [w for w in GLUON_BASELINES if w in seen]
    variants = [w for w in seen if w not in GLUON_BASELINES]

    def cell(row: GluonFwdRow, what: str, vs_cudnn: bool) -> str:
        if what in row.failed:
            return "failed"  # its time, if any, is no speed: it failed its check or raised
        t = row.tflops.get(what)
        ratio = _ratio(t, row.tflops.get(CUDNN)) if vs_cudnn else None
        return _tf(t) + ("" if ratio is None else f" ({ratio:.2f}x)")

    def best_cell(row: GluonFwdRow) -> str:
        best = row.best_gluon()
        ratio = _ratio(best[1], row.tflops.get(CUDNN)) if best else None
        return "-" if best is None else f"{best[0]} {_x(ratio)}"

    header = ["problem", *(GLUON_BASELINES[w] for w in baselines), *variants,
              "best Gluon (x cuDNN)"]
    cells = [[f"{r.name} ({r.shape})", *(cell(r, w, False) for w in baselines),
              *(cell(r, w, True) for w in variants), best_cell(r)] for r in rows]
    readings = max((len(r["tflops_readings"]) for r in data["timings"]
                    if isinstance(r, dict) and isinstance(r.get("tflops_readings"), list)),
                   default=0)
    knobs: dict[str, Any] = data["variants"] if isinstance(data.get("variants"), dict) else {}
    named = [w.removeprefix(GLUON_PREFIX) for w in variants]
    md = [f"### Gluon forward: `{src.path.name}`", "",
          "gluon_fwd_bench.py --time: TFLOP/s (forward FLOPs = 4 B H N^2 D, halved for "
          "causal), each candidate's output checked against an fp32 SDPA before it is timed, "
          "then timed in rotation with the others"
          + (f", the median of its {readings} readings" if readings > 1 else "")
          + ". *cuDNN*, *FA2*: torch SDPA with the backend forced; *Triton flash_fwd*: our "
          "Triton forward at its default config; *gluon-NAME*: the Gluon forward with the "
          "variant's knobs (below): TFLOP/s (x cuDNN: over cuDNN's TFLOP/s on the problem). "
          "*failed*: failed the check or raised (listed below), so no speed. *best Gluon*: the "
          "fastest variant that passed, which issue 17's targets use. Checks before timing: "
          f"{gluon_checks_text(data.get('checks'))}.", "", *_table(header, cells), ""]
    md += [f"- `{n}`: {knobs_text(knobs[n]) if isinstance(knobs.get(n), dict) else '-'}"
           for n in named]
    md += [""] if named else []
    if failures:
        md += ["Not timed:", "", *(f"- {f}" for f in failures), ""]
    if diagnostics:
        names = ", ".join(f"`{d}`" for d in diagnostics)
        md += [f"Left out: the timings marked diagnostic ({names}): wrong results by design "
               "(the kernel without its exponentials or without its softmax), a cost breakdown, "
               "not a speed.", ""]
    return Section(src, md, gluon_fwd_targets(src.path.name, rows))


def gluon_fwd_targets(source: str, rows: list[GluonFwdRow]) -> list[Target]:
    """Issue 17's forward targets, each on the best passing Gluon variant per problem (named
    in the row), for the head dims and masks the file has: a file without d256 problems has
    no d256 target rather than one not measured."""
    seqlens = " and ".join(_n(n) for n in GLUON_FWD_SEQLENS)
    out = []
    for head_dim, threshold in GLUON_FWD_VS_CUDNN.items():
        # d128 dense and causal apart (as the issue states them), d64 and d256 as one.
        for causal in ((False, True) if head_dim == 128 else (None,)):
            keep = [r for r in rows if r.head_dim == head_dim and r.seqlen == r.seqlen_kv
                    and r.seqlen in GLUON_FWD_SEQLENS and causal in (None, r.causal)]
            if not keep:
                continue
            ratios, missing = [], []
            for r in keep:
                best = r.best_gluon()
                ratio = _ratio(best[1], r.tflops.get(CUDNN)) if best else None
                if best is None or ratio is None:
                    missing.append(r.name)  # no Gluon variant passed, or cuDNN failed
                else:
                    ratios.append((f"{r.name} by {best[0]}", ratio))
            mask = "" if causal is None else f", {'causal' if causal else 'dense'}"
            out.append(min_target(f"Gluon forward best vs cuDNN, d={head_dim}, N = {seqlens}"
                                  f"{mask}", source, threshold, ratios, missing))
    return out


def hybrid_train_section(src: Source, data: dict[str, Any]) -> Section:
    """gluon_cudnn_train_bench.py --time: per row the medians of paired rounds."""
    rows = data["time"]
    cells = []
    try:
        for r in rows:
            ms = r["ms"]
            cells.append([f"d{r['d']} {_n(int(r['n']))} {'causal' if r['causal'] else 'dense'}",
                          _ms(_num(ms["sdpa"])), _ms(_num(ms["hybrid"])),
                          _x(_num(r["speedup_median"])),
                          f"{min(r['sdpa_over_hybrid_per_round']):.3f}-"
                          f"{max(r['sdpa_over_hybrid_per_round']):.3f}",
                          f"{_ms(_num(ms['cudnn_fwd']))} / {_ms(_num(ms['gluon_fwd']))}",
                          _x(_ratio(_num(ms["cudnn_fwd"]), _num(ms["gluon_fwd"]))),
                          _ms(_num(ms["cudnn_bwd"])),
                          f"{max(r['errors_vs_reference'].values()):.1e}"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"a row without {exc}") from exc
    checks = data.get("check") or []
    passed = sum(1 for c in checks if c.get("ok"))
    md = [f"### Training step, Gluon forward + cuDNN backward: `{src.path.name}`", "",
          "gluon_cudnn_train_bench.py's rows (bf16, 16k tokens per batch, H = 2048 / D): "
          "*sdpa* is SDPA's cuDNN forward + backward through autograd (what a model runs), "
          "*hybrid* the Gluon forward (gluon_fwd's default) with cuDNN's backward fed its o and "
          "logsumexp (`templates/pytorch/cudnn_bwd.py`); ms are medians of paired rounds, *x* the "
          "median of sdpa / hybrid within each round, then its range over the rounds; the "
          "parts alone last. Every timed gradient was checked against the autograd "
          f"reference (largest relative error shown). Odd-shape checks passed: {passed} of "
          f"{len(checks)}.", ""]
    md += _table(["row", "sdpa ms", "hybrid ms", "sdpa / hybrid", "rounds",
                  "fwd ms: cuDNN / Gluon", "Gluon fwd x cuDNN", "cuDNN bwd ms", "error"], cells)
    md.append("")
    return Section(src, md, [])


# What gluon_fwd_ab.py's DIAG values did (templates/gluon/fwd_kernel.py's ``_softmax_block``;
# 4 lived only in commit 0ae5ad6, reverted after its A/B).
DIAG_MEANINGS = {
    1: "no exponentials (wrong results by design: timing only)",
    2: "no softmax at all (wrong results by design: timing only)",
    3: "the O store waited for at once",
    4: "the row sum on the tensor cores (commit 0ae5ad6, reverted)",
    7: "a split tile's pieces not combined (wrong O for cut tiles: timing only)",
}


def _ab_switch(data: dict[str, Any]) -> str:
    """What gluon_fwd_ab.py's B side changed, in words."""
    parts = []
    if data.get("diag"):
        # A file may say what its DIAG meant: the numbers of experiments that were not kept
        # are reused by later ones.
        meaning = data.get("diag_meaning") or DIAG_MEANINGS.get(data["diag"])
        parts.append(f"DIAG {data['diag']}" + (f" ({meaning})" if meaning else ""))
    if data.get("kernel_order"):
        parts.append("the kernel's own causal order instead of the host's schedule")
    if data.get("tile_overhead") is not None:
        parts.append(f"the schedule's tile overhead {data['tile_overhead']}")
    if data.get("combine") is not None:
        parts.append(f"the split schedules' piece cost {data['combine']:g} blocks per piece")
    parts += [f"{knob}={value}" for knob, value in sorted((data.get("config") or {}).items())]
    return ", ".join(parts) or "nothing (an A/A run)"


def gluon_ab_section(src: Source, data: dict[str, Any]) -> Section:
    """gluon_fwd_ab.py: per problem B's time over A's, the median of the per-round ratios
    with their range, and each side against cuDNN."""
    cells = []
    try:
        for r in data["rows"]:
            ms, readings = r["ms"], r["readings_ms"]
            per_round = [b / a for a, b in zip(readings["A"], readings["B"], strict=True)]
            cells.append([str(r["problem"]), f"{statistics.median(per_round):.3f}",
                          f"{min(per_round):.3f}-{max(per_round):.3f}", str(len(per_round)),
                          _x(_ratio(_num(ms.get("cudnn")), _num(ms["A"]))),
                          _x(_ratio(_num(ms.get("cudnn")), _num(ms["B"]))),
                          f"{max(r['errors'].values()):.1e}"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"a row without {exc}") from exc
    md = [f"### Gluon forward A/B: `{src.path.name}`", "",
          f"gluon_fwd_ab.py: A is gluon_fwd's default config, B the same with "
          f"{_ab_switch(data)}; cuDNN beside them, readings rotated over the three in each "
          f"round. *B / A time*: the median over rounds of B's time over A's in the same round "
          f"(below 1: B is faster), then its range; *x cuDNN*: cuDNN's median time over each "
          f"side's. Every output was checked against fp32 first (largest relative error "
          f"shown).", ""]
    md += _table(["problem", "B / A time", "rounds' range", "rounds", "A x cuDNN",
                  "B x cuDNN", "error"], cells)
    md.append("")
    return Section(src, md, [])


def pack_gqa_section(src: Source, data: dict[str, Any]) -> Section:
    """gluon_pack_gqa.py: per GQA problem, torch SDPA (GQA in the call, and on K/V expanded
    beforehand), gluon_fwd unpacked and packed, in microseconds, and the ratios."""
    cells = []
    try:
        for r in data["rows"]:
            ms = {k: _num(v) for k, v in r["ms"].items()}
            sdpa = [v for k, v in ms.items() if k.startswith("sdpa") and v is not None]
            packed = ms.get("gluon_packed")
            cells.append([str(r["problem"]),
                          *(f"{1e3 * v:.1f}" if (v := ms.get(k)) is not None else "-"
                            for k in ("sdpa", "sdpa_expanded", "gluon", "gluon_packed")),
                          _x(_ratio(ms.get("gluon"), packed)),
                          _x(_ratio(min(sdpa) if sdpa else None, packed)),
                          "yes" if r["default_packs"] else "no"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"a row without {exc}") from exc
    md = [f"### Packed GQA: `{src.path.name}`", "",
          "gluon_pack_gqa.py: gluon_fwd's default config unpacked and packed (`pack_gqa`: each "
          "KV head's query heads stacked into one head of rows) beside torch SDPA with "
          "`enable_gqa` and on K/V expanded beforehand (bottom-right causal as "
          "`causal_lower_right`), readings rotated; medians in microseconds. *unpacked / "
          "packed* and *SDPA / packed* are time ratios (above 1: packed is faster; SDPA: the "
          "faster of its two); *default packs*: what `packing_fills_rows` chooses.", ""]
    md += _table(["problem", "SDPA", "SDPA expanded", "gluon", "gluon packed",
                  "unpacked / packed", "SDPA / packed", "default packs"], cells)
    md.append("")
    return Section(src, md, [])


# Issue 17: our kernels the stored winners on at least this share of `standard`'s problems.
WINNERS_SHARE_TARGET = 0.75


def winners_section(src: Source, data: dict[str, Any]) -> Section:
    """``tuner winners --json``: per problem the winner, its margin over the runner-up, and
    torch SDPA's time over our best's."""
    cells, ours, ours_in_noise = [], 0, 0
    try:
        for r in sorted(data["rows"], key=lambda r: (int(r["problem"]["head_dim"]),
                                                     str(r["problem"]["causal"]),
                                                     int(r["problem"]["seqlen_q"]))):
            p, ms = r["problem"], r["median_ms"]
            mine = [_num(v) for k, v in ms.items() if k != "sdpa" and _num(v) is not None]
            best_ours = min(mine) if mine else None
            ours += r["winner"] != "sdpa"
            # (Rows of winners files older than the field have no "decided".)
            in_noise = r.get("decided") is False
            ours_in_noise += in_noise and r["winner"] != "sdpa"
            cells.append([f"d{p['head_dim']} {_n(int(p['seqlen_q']))} "
                          f"{'dense' if p['causal'] == 'none' else 'causal'} "
                          f"(B{p['batch']} H{p['heads_q']})", str(r["winner"]),
                          _x(_num(r["margin"])) + (" (noise)" if in_noise else ""),
                          _x(_ratio(_num(ms.get("sdpa")), best_ours)),
                          ", ".join(f"{k} {_ms(_num(v))}" for k, v in sorted(ms.items()))])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"a row without {exc}") from exc
    share = ours / len(cells) if cells else None
    md = [f"### Stored winners: `{src.path.name}`", "",
          "`tuner winners --json` after a sweep: per problem the implementation the dispatcher "
          "runs (fastest in the sweep's head-to-head), its *margin* over the runner-up, and "
          "*SDPA / ours*: torch SDPA's time over our fastest kernel's (above 1: ours is "
          "faster). Times in ms, medians of the head-to-head's rounds. *(noise)*: the "
          "head-to-head's readings do not tell the winner from the runner-up "
          "(`tuner.dispatch.close_calls`; files from before that field say nothing).", ""]
    md += _table(["problem", "winner", "margin", "SDPA / ours", "ms"], cells)
    md.append("")
    if "standard" not in src.path.name:
        # Another suite's winners (e.g. winners_small_grids_*): a table, not issue 17's bar.
        return Section(src, md, [])
    target = Target(
        "our kernels the stored winners of `standard`", src.path.name,
        f">= {100 * WINNERS_SHARE_TARGET:.0f}% of problems",
        f"{ours} of {len(cells)}" if cells else "no rows",
        None if share is None else share >= WINNERS_SHARE_TARGET,
        "not measured" if share is None else _share_margin(ours, len(cells))
        + (f"; {ours_in_noise} of ours within the head-to-head's noise" if ours_in_noise
           else ""))
    return Section(src, md, [target])


def _share_margin(ours: int, rows: int) -> str:
    need = math.ceil(WINNERS_SHARE_TARGET * rows)
    if ours >= need:
        return f"{100 * ours / rows:.0f}%, {ours - need} above the {need} needed"
    return f"{100 * ours / rows:.0f}%, {need - ours} short of the {need} needed"


@dataclass(frozen=True)
class Kind:
    """Result files whose name starts with ``prefix``: written by ``script``."""

    prefix: str
    label: str
    script: str
    build: Callable[[Source, dict[str, Any]], Section] | None  # None: listed, not reported
    # What the file must hold: a list (or a dict where rows_type says); "": the file is the list.
    rows_key: str = "rows"
    rows_type: type = list
    why_not: str = ""  # for a kind listed, not reported: why


# The longest matching prefix wins (decode_loop before decode); the order is the report's.
KINDS = [Kind("fwd_compile_sweep", "compile sweep", "fwd_quick.py --compile-sweep", None),
         Kind("compile_check", "compiler resources (`tuner compile-check`, no GPU)",
              "tuner compile-check --json", None),
         Kind("sweep_quick_trials", "recorded sweep trials (`tuner replay` input)",
              "tuner sweep --record", None),
         Kind("fwd_quick", "forward", "fwd_quick.py", forward_section),
         Kind("gluon_fwd", "Gluon forward", "gluon_fwd_bench.py --time", gluon_fwd_section,
              "timings"),
         Kind("gluon_fwd_ab", "Gluon forward A/B", "gluon_fwd_ab.py", gluon_ab_section),
         Kind("gluon_pack_gqa", "Gluon forward, packed GQA", "gluon_pack_gqa.py",
              pack_gqa_section),
         Kind("fwd_bwd", "forward + backward", "fwd_bwd_bench.py", fwd_bwd_section),
         Kind("gluon_cudnn_train", "training step: Gluon forward + cuDNN backward",
              "gluon_cudnn_train_bench.py --time", hybrid_train_section, "time"),
         Kind("masked_fwd_bwd", "masked forward + backward", "masked_fwd_bwd_bench.py",
              masked_section),
         Kind("decode", "decode", "decode_bench.py", decode_section),
         Kind("blocksparse", "block-sparse", "blocksparse_bench.py", blocksparse_section),
         Kind("sweep", "tuner sweep", "tuner sweep --json", sweep_section, "problems"),
         Kind("decode_probe", "decode probe", "decode_grid.py's first probe", None,
              why_not="the first probe of flash_decode configs against cuDNN, before "
                      "decode_grid.py wrote the same measurement in the format reported here; "
                      "it records no GPU, torch or date"),
         Kind("dispatch", "tuner.attention vs SDPA", "dispatch_bench.py", dispatch_section),
         Kind("decode_loop", "decode loop", "decode_loop.py", decode_loop_section),
         Kind("decode_grid", "decode config grid", "decode_grid.py", decode_grid_section,
              rows_type=dict),
         Kind("e2e_hf", "end to end (transformers)", "e2e_hf.py", e2e_section, "results",
              dict),
         Kind("winners", "stored winners", "tuner winners --json", winners_section, ""),
         Kind("search_winners", "stored winners of a sweep of part of a suite",
              "tuner winners --json", None, "",
              why_not="issue 17's share of winners is about the whole `standard` suite; "
                      "notes/gluon_notes.md reads these")]


def kind_of(path: Path) -> Kind | None:
    return max((k for k in KINDS if path.name.startswith(k.prefix)),
               key=lambda k: len(k.prefix), default=None)


def load(results: Path) -> tuple[list[Section], list[str]]:
    """The sections of the files we know, and a note for every file left out."""
    sections, skipped = [], []
    # Forward first, then forward + backward, then decode; files of one kind by name.
    files = sorted(sorted(p for p in results.glob("*.json") if not p.name.endswith(META_SUFFIX)),
                   key=lambda p: KINDS.index(k) if (k := kind_of(p)) else len(KINDS))
    for meta in sorted(results.glob(f"*{META_SUFFIX}")):
        owner = meta.name.removesuffix(META_SUFFIX) + ".json"
        if not (results / owner).is_file():
            skipped.append(f"`{meta.name}`: sidecar of `{owner}`, which is missing")
    for path in files:
        kind = kind_of(path)
        if kind is None:
            skipped.append(f"`{path.name}`: format not known to report.py, skipped")
            continue
        if kind.build is None:
            skipped.append(f"`{path.name}`: {kind.label} data, not part of this report"
                           + (f" ({kind.why_not})" if kind.why_not else ""))
            continue
        try:
            data = json.loads(path.read_text())
            if kind.rows_key == "":  # the file is the rows
                if not isinstance(data, list):
                    raise FormatError("not a list of rows")
                data = {"rows": data}
            elif not isinstance(data, dict) or not isinstance(data.get(kind.rows_key),
                                                              kind.rows_type):
                raise FormatError(f"no '{kind.rows_key}' {kind.rows_type.__name__}")
            src = read_source(path, kind.label, data)
            read_meta(path, src)
            sections.append(kind.build(src, data))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, FormatError) as exc:
            skipped.append(f"`{path.name}`: not a {kind.script} result ({exc}), skipped")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # rows of another shape
            skipped.append(f"`{path.name}`: not a {kind.script} result "
                           f"({type(exc).__name__}: {exc}), skipped")
    return sections, skipped


# ----------------------------------------------------------------------------- plots
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        sys.exit(MATPLOTLIB_MISSING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


SERIES = [("best", "ours, best config", "C0", "-", "o"),
          ("default", "ours, default config", "C0", "--", "s"),
          ("cudnn", "SDPA cuDNN", "C3", "-", "^"),
          ("fa2", "SDPA FA2", "C2", "-", "v"),
          ("flex", "FlexAttention", "C4", ":", "D")]


def plot_tflops(path: Path, rows: list[FwdRow], title: str) -> None:
    """TFLOP/s against N: one panel per (causal, head dim)."""
    plt = _pyplot()
    dims = sorted({r.head_dim for r in rows})
    masks = sorted({r.causal for r in rows})
    top = 1.1 * max((getattr(r, s[0]) or 0.0 for r in rows for s in SERIES), default=1.0)
    fig, axes = plt.subplots(len(masks), len(dims), figsize=(4.6 * len(dims), 3.8 * len(masks)),
                             squeeze=False)
    handles: dict[str, Any] = {}
    for i, causal in enumerate(masks):
        for j, dim in enumerate(dims):
            ax = axes[i][j]
            panel = sorted((r for r in rows if r.causal == causal and r.head_dim == dim),
                           key=lambda r: r.seqlen)
            for attr, label, color, style, marker in SERIES:
                points = [(r.seqlen, getattr(r, attr)) for r in panel
                          if getattr(r, attr) is not None]
                if points:
                    (line,) = ax.plot([p[0] for p in points], [p[1] for p in points],
                                      color=color, linestyle=style, marker=marker, label=label)
                    handles.setdefault(label, line)
            seqlens = sorted({r.seqlen for r in panel})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [_n(n) for n in seqlens])
            ax.minorticks_off()
            if len(seqlens) == 1:
                ax.set_xlim(seqlens[0] / 1.5, seqlens[0] * 1.5)
            ax.set_title(f"d={dim}, {'causal' if causal else 'dense'}")
            ax.set_xlabel("sequence length N")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(0, top)  # one scale for every panel
            if j == 0:
                ax.set_ylabel("TFLOP/s")
    order = [s[1] for s in SERIES if s[1] in handles]
    fig.legend([handles[k] for k in order], order, loc="lower center", ncol=len(order),
               frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_decode(path: Path, rows: list[DecodeRow], copy: float | None, title: str) -> None:
    """TB/s of K and V read per row: ours default and best beside SDPA, the copy as a line."""
    plt = _pyplot()
    bars = [("default", "ours, default", "C0", ""), ("tuned", "ours, best", "C0", "//"),
            ("sdpa-cudnn", "SDPA cuDNN", "C3", ""), ("sdpa-fa2", "SDPA FA2", "C2", "")]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(rows)), 4.4))
    width = 0.8 / len(bars)
    for k, (what, label, color, hatch) in enumerate(bars):
        xs, ys = [], []
        for i, r in enumerate(rows):
            m = r.results.get(what)
            if m is not None and m.tb_per_s is not None:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(m.tb_per_s)
        if xs:
            ax.bar(xs, ys, width, label=label, color=color, hatch=hatch,
                   alpha=0.55 if what == "default" else 0.9, edgecolor="white")
    if copy:
        ax.axhline(copy, color="black", linewidth=1, label=f"copy {copy:.2f} TB/s")
        ax.axhline(DECODE_COPY_SHARE * copy, color="black", linestyle=":", linewidth=1,
                   label=f"{100 * DECODE_COPY_SHARE:.0f}% of copy")
    ax.set_xticks(range(len(rows)), [r.name for r in rows], rotation=20, ha="right")
    ax.set_ylabel("TB/s of K and V read")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.set_ylim(0, (copy or max((m.tb_per_s or 0 for r in rows for m in r.results.values()),
                                default=1.0)) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_blocksparse(path: Path, rows: list[BlockSparseRow], dense_ms: float | None,
                     title: str) -> None:
    """Milliseconds per pattern: ours default, ours best, FlexAttention."""
    plt = _pyplot()
    bars = [("default_ms", "ours, default", "C0", ""), ("best_ms", "ours, best", "C0", "//"),
            ("flex_ms", "FlexAttention", "C4", "")]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(rows)), 4.4))
    width = 0.8 / len(bars)
    top = max((getattr(r, b[0]) or 0.0 for r in rows for b in bars), default=1.0)
    for k, (attr, label, color, hatch) in enumerate(bars):
        xs, ys = [], []
        for i, r in enumerate(rows):
            if getattr(r, attr) is not None:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(getattr(r, attr))
        if xs:
            drawn = ax.bar(xs, ys, width, label=label, color=color, hatch=hatch,
                           alpha=0.55 if attr == "default_ms" else 0.9, edgecolor="white")
            ax.bar_label(drawn, [f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(rows)),
                  [f"{r.pattern}\n(density {r.density:.2f})" if r.density is not None
                   else r.pattern for r in rows])
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_title(title + (f"; our dense kernel, no mask: {dense_ms:.2f} ms" if dense_ms else ""),
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, top * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# ----------------------------------------------------------------------------- report
def provenance(sections: list[Section]) -> list[str]:
    def stated(s: Section, key: str, text: str) -> str:
        return f"{text} (from `{s.source.meta}`)" if key in s.source.meta_keys else text

    cells = [[f"`{s.source.path.name}`", s.source.kind, stated(s, "gpu", s.source.gpu or "-"),
              stated(s, "driver", s.source.driver or "-"),
              stated(s, "torch", s.source.torch or "-"),
              stated(s, "triton", s.source.triton or "-"),
              stated(s, "cuda", s.source.cuda or "-"),
              stated(s, "date", _date(s.source.date) or "-"),
              stated(s, "command", f"`{s.source.command}`" if s.source.command
                     else "(not recorded)")]
             for s in sections]
    return _table(["file", "benchmark", "GPU", "driver", "torch", "triton", "CUDA", "date",
                   "command"], cells)


def targets_table(targets: list[Target]) -> list[str]:
    verdict = {True: "**met**", False: "**not met**", None: "not measured"}
    return _table(["target", "threshold", "measured", "verdict", "margin", "file"],
                  [[t.what, t.threshold, t.measured, verdict[t.met], t.margin, f"`{t.source}`"]
                   for t in targets])


def render(sections: list[Section], skipped: list[str], images: dict[str, str],
           notes: Path) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/report.py` from the JSON files in "
             "`benchmarks/results/` (do not edit by hand: change the data or the script and "
             "run it again; the plots need `pip install -e '.[report]'`). Every number below "
             "is read from those files; the benchmark scripts and the protocol they follow "
             "(`docs/PROTOCOL.md`) say how each was measured. Ratios compare "
             "implementations timed side by side in one process; files are separate runs.", ""]
    lines += ["## Where the numbers come from", ""]
    lines += provenance(sections) if sections else ["No result files were found."]
    lines.append("")
    if skipped:
        lines += ["Not in this report:", "", *(f"- {s}" for s in skipped), ""]
    targets = [t for s in sections for t in s.targets]
    lines += ["## Targets", "",
              "The targets of the project's performance issues, computed from the files "
              "(\"best\" is our fastest measured config; a ratio target must hold on every row "
              "it names, so the worst row decides). Issue 16's targets (the drop-in "
              "`tuner.attention` and `tuner.decode` never slower than the torch SDPA they "
              "replace, cuDNN on the H100) compare times: ours over SDPA's, at most 1.00x "
              "(dispatch_bench's rows: beyond the file's own noise floor; files with paired "
              "rounds, of dispatch_bench and e2e_hf: no row's paired verdict slower, each "
              "against its own A/A floor). Issue 17's targets (gluon_fwd_bench files) take per "
              "problem the fastest Gluon variant that passed its check, named in the row, over "
              f"cuDNN timed in the same run, at N = {' and '.join(map(_n, GLUON_FWD_SEQLENS))} "
              "only.", ""]
    lines += targets_table(targets) if targets else ["No data for any target."]
    lines.append("")
    for t in targets:
        if t.rows:
            lines.append(f"- {t.what}: {t.rows}")
    lines += ["", "## Results", ""]
    for s in sections:
        lines += s.markdown
        if s.plot_name in images:
            lines += [f"![{s.source.kind}, {s.source.gpu}]({images[s.plot_name]})", ""]
    lines += ["## Why targets are missed", ""]
    if notes.is_file():
        lines += [f"<!-- included verbatim from {notes.name}, written by hand -->",
                  notes.read_text().rstrip("\n"), ""]
    else:
        lines += [f"(no `{notes.name}` was found: `--notes` names the hand-written "
                  "analysis)", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="directory of result JSON files (default benchmarks/results)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the Markdown report to write (default build/benchmarks.md)")
    parser.add_argument("--img-dir", type=Path, default=DEFAULT_IMG,
                        help="where the PNG plots go (default build/img)")
    parser.add_argument("--notes", type=Path, default=DEFAULT_NOTES,
                        help="hand-written analysis included verbatim "
                             "(default notes/benchmarks_notes.md)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write the tables only (no matplotlib needed)")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results must be a directory, but got {str(args.results)!r}")
    if not args.no_plots:
        _pyplot()  # fail before writing anything when matplotlib is missing
    sections, skipped = load(args.results)
    images: dict[str, str] = {}
    if not args.no_plots:
        args.img_dir.mkdir(parents=True, exist_ok=True)
        for s in sections:
            if s.plot is not None:
                path = args.img_dir / s.plot_name
                s.plot(path)
                images[s.plot_name] = Path(os.path.relpath(path, args.out.parent)).as_posix()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(sections, skipped, images, args.notes))
    print(f"wrote {args.out} ({len(sections)} result files, {len(images)} plots"
          f"{f', {len(skipped)} files left out' if skipped else ''})")
    for t in (t for s in sections for t in s.targets):
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t.met]
        print(f"  {verdict:12} {t.what}: {t.measured} ({t.margin})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
