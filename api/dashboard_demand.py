"""The dashboard's demand sections: the queue of problems jobs ran untuned, and what each
worker holds (``db.demand``). Plain HTML tables, every value escaped (``html_table``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from api.dashboard_html import html_table
from db.demand import EXPIRED, demand_status

__all__ = ["render_demand"]


def _device_name(key: str) -> str:
    return key.split("|", 1)[0]


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "–"


def render_demand(rows: Sequence[Any], held: Sequence[Any], total: int, now: datetime) -> str:
    """The two sections: ``rows`` the most reported demand rows, ``total`` how many there
    are; ``held`` the claimed ones (live or with their lease passed)."""
    queue = html_table(
        ("device", "template", "problem bucket", "reports", "status", "worker", "claimed",
         "attempts", "note"),
        ((_device_name(r.device_key), r.template, r.problem_key, r.reports,
          demand_status(r, now), r.worker or "–", _when(r.claimed_at), r.attempts,
          r.note or "–") for r in rows),
        "No demand yet: jobs report what they run without a tuned config (TUNER_URL set).")
    shown = (f"<p>Showing the {len(rows)} most reported of {total} (the API pages through "
             f"all: <code>/v1/demand</code>).</p>" if total > len(rows) else "")
    workers = html_table(
        ("worker", "device", "template", "problem bucket", "since", "lease"),
        ((r.worker, _device_name(r.device_key), r.template, r.problem_key, _when(r.claimed_at),
          "lease passed: the next worker takes it over" if demand_status(r, now) == EXPIRED
          else f"until {_when(r.lease_until)}") for r in held),
        "No worker holds a problem now (tuner worker).")
    return (f"<h2>Demand: problems jobs ran without a tuned config</h2>{shown}{queue}"
            f"<h2>Workers: what each one tunes</h2>{workers}")

