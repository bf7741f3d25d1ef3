"""``tuner snapshot create|list|show|delete``: freeze the best configs under the hash of their
content, look at what a snapshot holds, remove one no job pins any more.

Against the database (``--db``, TUNER_DATABASE_URL) or, with ``--url``, through the config
service (``/v1/snapshots``; creating and deleting need TUNER_TOKEN). A job pins one with
``TUNER_SNAPSHOT=<id>``; ``tuner export --snapshot ID`` writes one as a bundle file.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import (
    DbOption,
    JsonOption,
    config_text,
    console,
    database_url,
    fmt_tflops,
    print_json,
    print_table,
    problem_label,
)
from tuner.errors import ServiceError, TunerError
from tuner.lookup.snapshot import (
    StoredSnapshot,
    check_snapshot_id,
    delete_snapshot,
    freeze,
    read_snapshot,
    snapshot_id_of,
)
from tuner.settings import get_settings

__all__ = ["app"]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Freeze the best configs into immutable snapshots a job can pin.")

UrlOption = Annotated[str | None, typer.Option(
    "--url", help="through the config service at this URL (writes need TUNER_TOKEN) instead "
                  "of the database", show_default=False)]
IdArgument = Annotated[str, typer.Argument(
    help="the snapshot's id (64 hex digits, as `tuner snapshot list` prints it)",
    show_default=False)]


@app.command("create")
def create(
    device: Annotated[str | None, typer.Option("--device", help="device name or key")] = None,
    template: Annotated[str | None, typer.Option("--template", help="template name")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    variant: Annotated[str | None, typer.Option("--variant", help="e.g. dense")] = None,
    url: UrlOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Freeze the current best configs (all of them, or those the filters match) into a
    snapshot, and print its id: the SHA-256 of its content, so the same configs frozen again
    give the same id. Pin a job to it with TUNER_SNAPSHOT=<id>."""
    filters = {"device": device, "template": template, "dtype": dtype, "variant": variant}
    if url is not None:
        _one_place(url, db)
        with _client(url) as client:
            answer = _service_call(url, lambda: client.create_snapshot(**filters))
        result = {"id": answer.id, "items": answer.items, "created": answer.created,
                  "created_at": answer.created_at.isoformat(), "where": url}
    else:
        where = database_url(db)
        frozen = freeze(where, **filters)
        result = {"id": frozen.id, "items": frozen.items, "created": frozen.created,
                  "created_at": frozen.created_at.isoformat(), "where": "database"}
    if json_out:
        print_json(result)
        return
    what = "new snapshot" if result["created"] else "snapshot (this content was frozen before)"
    console.print(f"{what} of {result['items']} best config(s): {result['id']}",
                  highlight=False)
    console.print(f"pin a job to it: TUNER_SNAPSHOT={result['id']}", highlight=False)


@app.command("list")
def list_snapshots(
    url: UrlOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Stored snapshots, newest first: id, best configs held, when frozen."""
    if url is not None:
        _one_place(url, db)
        with _client(url) as client:
            page = _service_call(url, lambda: client.snapshots(limit=1000))
        rows = [(s.id, s.items, s.created_at) for s in page.items]
    else:
        # lazy: sqlalchemy +0.22 s (2-core CPU); keeps `tuner --help` < 1 s
        from db import crud
        from db.session import session_scope

        with session_scope(database_url(db), write=False) as s:
            rows = crud.list_snapshots(s, limit=1000)
    if json_out:
        print_json([{"id": sid, "items": items, "created_at": created.isoformat()}
                    for sid, items, created in rows])
        return
    if not rows:
        console.print("no snapshots yet (tuner snapshot create)")
    for sid, items, created in rows:
        console.print(f"{sid}  {items:>6} config(s)  {created:%Y-%m-%d %H:%M:%S}",
                      highlight=False)


@app.command("show")
def show(
    snapshot_id: IdArgument,
    url: UrlOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Print what a snapshot holds: per device, template and problem, the frozen config and
    its TFLOP/s (its content is checked against its id first)."""
    found = _read(snapshot_id, url, db)
    if json_out:
        print_json({"id": found.id, "items": found.items,
                    "created_at": found.created_at.isoformat(), "bundle": found.bundle})
        return
    table = Table(title=f"snapshot {found.id}: {found.items} best config(s), frozen "
                        f"{found.created_at:%Y-%m-%d %H:%M:%S}")
    for column in ("device", "template", "problem", "config", "TFLOP/s", "default TFLOP/s",
                   "speedup"):
        table.add_column(column, overflow="fold",
                         justify="right" if "TFLOP/s" in column or column == "speedup"
                         else "left")
    for entry in sorted(found.bundle.get("items", []), key=_entry_order):
        tflops, default = entry.get("tflops"), entry.get("default_tflops")
        table.add_row(entry["device"]["name"], entry["template"],
                      problem_label(entry["problem"]), config_text(entry["config"]),
                      fmt_tflops(tflops), fmt_tflops(default),
                      f"{tflops / default:.2f}x" if tflops and default else "-")
    print_table(table)
    console.print(f"pin a job to it: TUNER_SNAPSHOT={found.id}", highlight=False)


@app.command("delete")
def delete(
    snapshot_id: IdArgument,
    yes: Annotated[bool, typer.Option(
        "--yes", "-y", help="delete without asking (needed with --json)")] = False,
    url: UrlOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Delete a snapshot that no job pins any more. A running job keeps the copy it loaded;
    a job started later with TUNER_SNAPSHOT=<id> stops at its first lookup, saying the id is
    unknown. Keep a file of it first if unsure: tuner export FILE --snapshot ID."""
    if json_out and not yes:
        raise TunerError("--json deletes without asking, so it needs --yes",
                         f"tuner snapshot delete {snapshot_id} --yes --json")
    if not yes:
        found = _read(snapshot_id, url, db)
        console.print(f"snapshot {found.id}: {found.items} best config(s), frozen "
                      f"{found.created_at:%Y-%m-%d %H:%M:%S}", highlight=False)
        if not typer.confirm("Delete it? Jobs started later with it pinned will stop at "
                             "their first lookup"):
            console.print("kept")
            raise typer.Exit(1)
    if url is not None:
        _one_place(url, db)
        with _client(url) as client:
            answer = _service_call(url, lambda: client.delete_snapshot(snapshot_id))
        sid, items, created = answer.id, answer.items, answer.created_at
    else:
        sid, items, created = delete_snapshot(database_url(db), snapshot_id)
    if json_out:
        print_json({"id": sid, "items": items, "created_at": created.isoformat(),
                    "deleted": True, "where": url or "database"})
        return
    console.print(f"deleted snapshot {sid} ({items} best config(s), frozen "
                  f"{created:%Y-%m-%d %H:%M:%S})", highlight=False)


def _entry_order(entry: dict[str, Any]) -> tuple[Any, ...]:
    # Numbers as numbers: N=512 before N=2048 (the canonical order sorts them as text).
    p = entry["problem"]
    return (entry["device"]["name"], entry["template"], p.get("dtype"), p.get("causal"),
            p.get("mask"), p.get("head_dim"), p.get("heads_q"), p.get("heads_kv"),
            p.get("seqlen_q"), p.get("seqlen_kv"), p.get("batch"))


def _read(snapshot_id: str, url: str | None, db: str | None) -> StoredSnapshot:
    """The snapshot, from the service (``--url``) or the database, checked against its id."""
    check_snapshot_id(snapshot_id)
    if url is None:
        return read_snapshot(database_url(db), snapshot_id)
    _one_place(url, db)
    with _client(url) as client:
        answer = _service_call(url, lambda: client.snapshot(snapshot_id))
    if snapshot_id_of(answer.bundle) != snapshot_id:
        raise TunerError(f"snapshot {snapshot_id} from service {url} does not hash to its id: "
                         "the service sent other content",
                         "check that --url names the config service")
    return StoredSnapshot(answer.id, answer.created_at, answer.bundle)


def _one_place(url: str | None, db: str | None) -> None:
    if url is not None and db is not None:
        raise TunerError("--url and --db name two places holding snapshots",
                         "pass one of them")


def _client(url: str) -> Any:
    # lazy: httpx, torch+triton +1.4 s (2-core CPU); keeps `tuner --help` < 1 s
    from tuner.client import TunerClient

    try:
        return TunerClient(url, token=get_settings().token or "")
    except ValueError as exc:
        raise TunerError(str(exc), "pass --url http://host:8000") from None


def _service_call(url: str, call: Any) -> Any:
    try:
        return call()
    except ServiceError as exc:
        raise TunerError(str(exc), service_fix(exc, url)) from None


def service_fix(exc: ServiceError, url: str) -> str:
    """What to do about the service's refusal: by its status, and by its explanation where
    one status has several causes (a 503 of a service that serves reads only)."""
    detail = str(exc.detail or "")
    if exc.status is None:
        return f"check that --url {url} names the config service and that it runs (tuner serve)"
    if exc.status in (401, 403):
        return "set TUNER_TOKEN here to the service's write token"
    if exc.status == 404:
        return "list them with `tuner snapshot list --url ...`"
    if exc.status == 503 and "writes are disabled" in detail:
        return ("the service serves reads only: start it with TUNER_TOKEN set to a random "
                "secret, and set the same TUNER_TOKEN here")
    if exc.status == 503:
        return "the service cannot use its database: see its log and `curl URL/healthz`"
    if exc.status >= 500:
        return "the service failed: see its log"
    return "the service refused the request as sent: its answer above says why"
