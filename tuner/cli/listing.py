"""``tuner list devices|templates|sweeps``: what the database (and this checkout) holds."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import DbOption, JsonOption, console, database_url, print_json, print_table

__all__ = ["list_things"]


class What(StrEnum):
    devices = "devices"
    templates = "templates"
    sweeps = "sweeps"


def list_things(
    what: Annotated[What, typer.Argument(help="devices, templates or sweeps")],
    limit: Annotated[int, typer.Option("--limit", help="sweeps: newest N")] = 50,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """List the devices, templates (registered here and stored) or sweeps."""
    # lazy: sqlalchemy +0.17 s (2-core CPU); keeps `tuner --help` < 1 s
    from db.session import session_scope

    url = database_url(db)
    with session_scope(url, write=False) as s:
        if what == What.devices:
            rows, columns = _devices(s)
        elif what == What.templates:
            rows, columns = _templates(s)
        else:
            rows, columns = _sweeps(s, max(1, limit))
    if json_out:
        print_json(rows)
        return
    if not rows:
        console.print(f"no {what.value} in {url}")
        return
    table = Table(title=f"{what.value} ({len(rows)})")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    print_table(table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{v} {k}" for k, v in value.items() if v) or "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def _devices(s: Any) -> tuple[list[dict[str, Any]], list[str]]:
    # lazy: sqlalchemy +0.24 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud

    rows = [{"id": d.id, "name": d.name, "key": d.key,
             "compute_capability": d.compute_capability or "-", "sm_count": d.sm_count,
             "memory_gib": round(d.total_memory / 2**30, 1), "triton": d.triton_version,
             "torch": d.torch_version, "cuda": d.cuda_version or "-",
             "cudnn": d.cudnn_version or "-", "driver": d.driver_version}
            for d in crud.list_devices(s)]
    return rows, ["id", "name", "compute_capability", "sm_count", "memory_gib", "triton",
                  "torch", "cuda", "cudnn", "driver"]


def _templates(s: Any) -> tuple[list[dict[str, Any]], list[str]]:
    # lazy: sqlalchemy, torch+triton +1.8 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud
    from templates import all_templates

    stored: dict[str, list[str]] = {}
    for row in crud.list_templates(s):
        stored.setdefault(row.name, []).append(row.version)
    rows = []
    for t in all_templates():
        version = t.version()
        rows.append({"name": t.name, "version": version, "registered": True,
                     "grid_size": t.config_cls.grid_size(),
                     "knobs": [k.name for k in t.config_cls.knobs()],
                     "stored_versions": stored.pop(t.name, []),
                     "description": _first_clause(t.description)})
    for name, versions in sorted(stored.items()):  # in the database, not in this checkout
        rows.append({"name": name, "version": None, "registered": False, "grid_size": None,
                     "knobs": [], "stored_versions": versions, "description": ""})
    return rows, ["name", "version", "registered", "grid_size", "stored_versions",
                  "description"]


def _sweeps(s: Any, limit: int) -> tuple[list[dict[str, Any]], list[str]]:
    # lazy: sqlalchemy +0.23 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud

    rows = []
    for sw in crud.list_sweeps(s, limit=limit):
        rows.append({"id": sw.id, "name": sw.name, "host": sw.host,
                     "status": getattr(sw.status, "value", sw.status),
                     "started_at": sw.started_at, "finished_at": sw.finished_at,
                     "trials": crud.trial_counts(s, sweep_id=sw.id)})
    return rows, ["id", "name", "host", "status", "started_at", "finished_at", "trials"]


def _first_clause(text: str, width: int = 60) -> str:
    head = text.split(":")[0].split(". ")[0].strip()
    return head if len(head) <= width else head[: width - 3] + "..."
