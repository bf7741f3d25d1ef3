"""The dashboard page: plain HTML with inline SVG charts, no JavaScript, no external assets.

Everything shown comes from the database (device names, problem dicts, configs): all of it is
escaped, since anyone holding the write token could have put markup into a name.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import TYPE_CHECKING, Any

from templates.device import CPU_INTERPRETER
from tuner.wire import backends_text, readings_text

if TYPE_CHECKING:
    from db.finalists import Readings
    from tuner.wire import WinnersOut

SERIES_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass(frozen=True)
class Chart:
    title: str  # device and template
    subtitle: str  # dtype, variant, head dim, GQA
    # series name -> [(sequence length, TFLOP/s)], sorted by length
    series: Mapping[str, Sequence[tuple[int, float]]]


def charts_from_rows(rows: Iterable[Any]) -> list[Chart]:
    """One chart per device x template x dtype x variant x head dim: TFLOP/s by sequence length,
    the tuned config against the template's default (where the default was measured)."""
    groups: dict[tuple[Any, ...], dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict))
    for r in rows:
        p = r.problem
        seqlen = int(p.get("seqlen_kv", 0))
        if seqlen <= 0:
            continue
        gqa = int(p.get("heads_q", 1)) // max(1, int(p.get("heads_kv", 1)))
        # Numbers stay numbers until the title: charts of d64 then d128, not "d128" < "d64".
        key = (r.device.name, r.template.name, r.dtype, r.variant, int(p.get("head_dim", 0)),
               gqa)
        tuned = groups[key]["tuned"]
        tuned[seqlen] = max(tuned.get(seqlen, 0.0), float(r.tflops))
        if r.default_tflops:
            default = groups[key]["default config"]
            default[seqlen] = max(default.get(seqlen, 0.0), float(r.default_tflops))
    charts = []
    for key in sorted(groups):
        device, template, dtype, variant, head_dim, gqa = key
        # The default drawn first, the tuned line over it: where tuning found nothing better
        # the two coincide, and the tuned points must stay visible.
        series: dict[str, list[tuple[int, float]]] = {
            name: sorted(groups[key][name].items())
            for name in ("default config", "tuned") if name in groups[key]}
        subtitle = [dtype, variant, f"d{head_dim}"] + ([f"gqa{gqa}"] if gqa > 1 else [])
        if device == CPU_INTERPRETER:
            subtitle.append("Triton interpreter timings, NOT GPU timings")
        charts.append(Chart(f"{device} · {template}", " · ".join(subtitle), series))
    return charts


def svg_chart(chart: Chart, width: int = 460, height: int = 270) -> str:
    """A line chart with a log2 x axis (sequence length) and a linear y axis from zero."""
    left, right, top, bottom = 52, 12, 58, 36
    xs = sorted({x for pts in chart.series.values() for x, _ in pts})
    ymax = max((y for pts in chart.series.values() for _, y in pts), default=1.0) or 1.0
    ymax = _nice_ceiling(ymax * 1.05)
    lo, hi = (math.log2(xs[0]), math.log2(xs[-1])) if xs else (0.0, 1.0)
    span = (hi - lo) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: int) -> float:
        return left + (math.log2(x) - lo) / span * plot_w if len(xs) > 1 else left + plot_w / 2

    def py(y: float) -> float:
        return top + plot_h - y / ymax * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(chart.title)} {escape(chart.subtitle)}">',
           f'<text x="8" y="16" font-size="12" font-weight="bold">{escape(chart.title)}</text>',
           f'<text x="8" y="31" font-size="11">{escape(chart.subtitle)}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
           'stroke="#444"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#444"/>']
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{left - 4}" y="{py(y) + 4:.1f}" font-size="10" '
                   f'text-anchor="end">{y:g}</text>')
        if i:
            out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + plot_w}" '
                       f'y2="{py(y):.1f}" stroke="#ddd"/>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_h + 14}" font-size="10" '
                   f'text-anchor="middle">{_short(x)}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 4}" font-size="10" '
               'text-anchor="middle">sequence length</text>')
    out.append(f'<text x="12" y="{top + plot_h / 2}" font-size="10" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + plot_h / 2})">TFLOP/s</text>')
    for i, (name, pts) in enumerate(chart.series.items()):
        color = SERIES_COLORS[i % len(SERIES_COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}">'
                       f'<title>{escape(name)}: N={x}, {y:.1f} TFLOP/s</title></circle>')
        out.append(f'<rect x="{left + 8 + 120 * i}" y="{top - 14}" width="10" height="3" '
                   f'fill="{color}"/><text x="{left + 22 + 120 * i}" y="{top - 10}" '
                   f'font-size="10">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def _nice_ceiling(y: float) -> float:
    # Floats throughout, capped at the largest one: with an int step (10 ** 308) a huge stored
    # TFLOP/s made `y / ymax` raise OverflowError, and the whole page a 500.
    if not math.isfinite(y) or y >= sys.float_info.max / 10:
        return sys.float_info.max
    if y <= 1e-300:  # a step of 10.0 ** -324 is zero
        return 1e-300 if y > 0 else 1.0
    step = 10.0 ** math.floor(math.log10(y))
    for m in (1, 2, 2.5, 5, 10):
        if m * step >= y:
            return m * step
    return 10 * step


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _config_text(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(config.items()))


def _readings_cell(readings: Readings | None) -> str:
    if readings is None:
        return "–"
    return readings_text(readings.count, readings.spread)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], empty: str) -> str:
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    if not body:
        return f'<p class="empty">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def winners_table(winners: Sequence[WinnersOut], limit: int) -> str:
    """Per stored problem of each device: the implementation ``tuner.attention`` runs, the
    runner-up and margin, each implementation's TFLOP/s and each SDPA backend's time (at
    most ``limit`` rows)."""
    names: list[str] = []
    for found in winners:
        for it in found.items:
            names.extend(n for n in it.tflops if n not in names)
    backends = any(it.sdpa_backends for found in winners for it in found.items)
    rows = [(found.device_name, it.problem_key, it.winner,
             f"{it.margin:.2f}x {it.runner_up}" if it.margin else it.why,
             *(f"{it.tflops[n]:.1f}" + (" (h2h)" if n in it.head_to_head else "")
               if n in it.tflops else "–" for n in names),
             *([backends_text(it.sdpa_backends)] if backends else []))
            for found in winners for it in found.items]
    table = html_table(("device", "problem", "runs", "margin over the runner-up", *names,
                    *(["SDPA backends (fastest first)"] if backends else [])),
                   rows[:limit], "No problem measured for any implementation yet: put "
                   "torch_sdpa beside flash_fwd (or gluon_fwd, flash_decode) in a sweep.")
    shown = (f"<p>Showing {limit} of {len(rows)} problems "
             "(<code>/v1/winners?device=...</code> lists a device's all).</p>"
             if len(rows) > limit else "")
    return (f"{shown}{table}<p>TFLOP/s of each implementation's stored best at this service's "
            "kernel versions; the winner is what <code>tuner.attention</code> runs "
            "(docs/DISPATCH.md); (h2h): the median of the problem's head-to-head, its "
            "implementations measured side by side"
            + ("; SDPA backends: each backend's best time for the problem (a failed one is "
               "not listed)" if backends else "") + ".</p>")


def snapshots_table(snapshots: Sequence[tuple[str, int, datetime]], total: int) -> str:
    """Stored snapshots, newest first: id, when frozen, best configs held (``snapshots`` the
    newest of ``total``)."""
    table = html_table(
        ("id", "created", "entries"),
        ((sid, created.strftime("%Y-%m-%d %H:%M:%S"), items)
         for sid, items, created in snapshots),
        "No snapshots yet: tuner snapshot create (or POST /v1/snapshots) freezes the best "
        "configs for jobs to pin.")
    shown = (f"<p>Showing the newest {len(snapshots)} of {total} "
             "(<code>/v1/snapshots</code> pages through all).</p>"
             if total > len(snapshots) else "")
    return (f"{shown}{table}<p>A job pins one with <code>TUNER_SNAPSHOT=&lt;id&gt;</code>; "
            "<code>tuner snapshot show ID</code> lists its configs.</p>")


_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:left}th{background:#f3f3f3}.charts{display:flex;flex-wrap:wrap;gap:16px}
.charts svg{border:1px solid #eee;background:#fff}.empty{color:#777}.num{text-align:right}
"""


def render_dashboard(*, devices: Sequence[Any], templates: Sequence[Any], rows: Sequence[Any],
                     total_rows: int, sweeps: Sequence[Any],
                     readings: Mapping[int, Readings] | None = None,
                     winners: Sequence[WinnersOut] = (), winners_limit: int = 500,
                     demand_html: str = "",
                     snapshots: Sequence[tuple[str, int, datetime]] = (),
                     total_snapshots: int = 0) -> str:
    """The whole page. ``rows`` are BestConfig rows with device and template loaded;
    ``readings`` what each rests on, by row id (``db.crud.best_readings``); ``winners`` the
    implementations' ranking per device (``tuner.dispatch.winners``), at most ``winners_limit``
    rows; ``demand_html`` the demand sections (``api.dashboard_demand``), HTML already escaped;
    ``snapshots`` the newest (id, entries, created) of ``total_snapshots``."""
    readings = readings or {}
    device_table = html_table(
        ("name", "compute capability", "SMs", "triton", "torch", "CUDA", "cuDNN", "key"),
        ((d.name, d.compute_capability, d.sm_count, d.triton_version, d.torch_version,
          d.cuda_version, d.cudnn_version or "–", d.key) for d in devices),
        "No device has stored results yet: run `tuner sweep`, or upload a bundle.")
    template_table = html_table(
        ("name", "version", "configs in space", "description"),
        ((t["name"], t["version"], t["grid_size"], t["description"]) for t in templates),
        "No templates registered.")
    best_table = html_table(
        ("device", "template", "dtype", "variant", "problem", "config", "TFLOP/s",
         "readings (spread)", "default TFLOP/s", "speedup", "sweep"),
        ((r.device.name, r.template.name, r.dtype, r.variant, r.problem_key,
          _config_text(r.config), f"{r.tflops:.1f}", _readings_cell(readings.get(r.id)),
          f"{r.default_tflops:.1f}" if r.default_tflops else "–",
          f"{r.speedup:.2f}x" if r.speedup else "–", r.sweep_id or "–") for r in rows),
        "No tuned configs stored yet.")
    shown = (f"<p>Showing {len(rows)} of {total_rows} best configs (the API pages through all: "
             f"<code>/v1/configs</code>).</p>" if total_rows > len(rows) else "")
    sweep_table = html_table(
        ("id", "name", "host", "status", "started", "finished"),
        ((s.id, s.name, s.host, getattr(s.status, "value", s.status), s.started_at,
          s.finished_at or "–") for s in sweeps),
        "No sweeps yet.")
    charts = charts_from_rows(rows)
    chart_html = ("".join(svg_chart(c) for c in charts) if charts
                  else '<p class="empty">Nothing to plot yet.</p>')
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>attention-tuner dashboard</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>attention-tuner: tuned attention kernels</h1>"
        "<p>API: <a href=\"/docs\">/docs</a> · <a href=\"/v1/configs\">/v1/configs</a> · "
        "<a href=\"/healthz\">/healthz</a></p>"
        f"<h2>TFLOP/s by sequence length: tuned vs default config</h2>"
        f"<div class=\"charts\">{chart_html}</div>"
        f"<h2>Which implementation runs each problem</h2>"
        f"{winners_table(winners, winners_limit)}"
        f"<h2>Best configs</h2>{shown}{best_table}"
        f"{demand_html}"
        f"<h2>Snapshots: frozen best configs jobs can pin</h2>"
        f"{snapshots_table(snapshots, total_snapshots)}"
        f"<h2>Devices</h2>{device_table}"
        f"<h2>Templates</h2>{template_table}"
        f"<h2>Recent sweeps</h2>{sweep_table}"
        "</body></html>")
