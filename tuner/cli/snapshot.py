"""``tuner snapshot create|list``: freeze the best configs under the hash of their content.

Against the database (``--db``, TUNER_DATABASE_URL) or, with ``--url``, through the config
service (``POST /v1/snapshots``, which needs TUNER_TOKEN). A job pins one with
``TUNER_SNAPSHOT=<id>``; ``tuner export --snapshot ID`` writes one as a bundle file.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tuner.cli.common import DbOption, JsonOption, console, database_url, print_json
from tuner.errors import TunerError

__all__ = ["app"]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Freeze the best configs into immutable snapshots a job can pin.")

UrlOption = Annotated[str | None, typer.Option(
    "--url", help="through the config service at this URL (writes need TUNER_TOKEN) instead "
                  "of the database", show_default=False)]


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
        if db is not None:
            raise TunerError("--url and --db name two places to freeze from",
                             "pass one of them")
        with _client(url) as client:
            answer = _service_call(url, lambda: client.create_snapshot(**filters))
        result = {"id": answer.id, "items": answer.items, "created": answer.created,
                  "created_at": answer.created_at.isoformat(), "where": url}
    else:
        from tuner.snapshot import freeze

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
        with _client(url) as client:
            page = _service_call(url, lambda: client.snapshots(limit=1000))
        rows = [(s.id, s.items, s.created_at) for s in page.items]
    else:
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


def _client(url: str) -> Any:
    from tuner.client import TunerClient
    from tuner.settings import get_settings

    try:
        return TunerClient(url, token=get_settings().token or "")
    except ValueError as exc:
        raise TunerError(str(exc), "pass --url http://host:8000") from None


def _service_call(url: str, call: Any) -> Any:
    from tuner.client import TunerError as ServiceError

    try:
        return call()
    except ServiceError as exc:
        fix = ("set TUNER_TOKEN to the service's write token" if exc.status in (401, 403)
               else "check --url and that the service runs (tuner serve)")
        raise TunerError(str(exc), fix) from None
