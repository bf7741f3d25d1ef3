"""``tuner import FILE``: store a bundle of best configs, all of it or nothing."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import DbOption, JsonOption, console, database_url, print_json
from tuner.errors import TunerError

__all__ = ["import_bundle"]


def import_bundle(
    file: Annotated[Path, typer.Argument(help="bundle written by `tuner export`")],
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Store a bundle of best configs from `tuner export`: all items or none.

    Every item is validated first (template and version known here, problem, config inside
    the space and its constraints); one bad item rejects the file with its index.
    """
    # lazy: sqlalchemy, torch+triton +1.7 s (2-core CPU); keeps `tuner --help` < 1 s
    import templates  # noqa: F401  (registers the templates the items name)
    from tuner.lookup.bundle import BundleError, store_bundle_in_batches, validate_bundle

    url = database_url(db)
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise TunerError(f"cannot read {str(file)!r}: {exc}", "give the path of a bundle "
                         "written by `tuner export`") from None
    except json.JSONDecodeError as exc:
        raise TunerError(f"{str(file)!r} is not JSON: {exc}",
                         "give a bundle written by `tuner export`") from None
    try:
        items = validate_bundle(data)
    except BundleError as exc:
        raise TunerError(f"import rejected, nothing stored: {exc}",
                         "fix or remove that item and import again") from None
    host = data.get("host") if isinstance(data.get("host"), str) else socket.gethostname()
    # In batches, as the service stores uploads: a large file never holds SQLite's write lock
    # for long, so a sweep on the same database keeps its pace (issue 19, item 5).
    summary = store_bundle_in_batches(url, items, host=host)
    result = {"file": str(file), "items": summary.items, "trials": summary.trials,
              "remeasurements": summary.remeasurements, "best_updated": summary.best_updated}
    if json_out:
        print_json(result)
    else:
        console.print(f"imported {summary.items} item(s) from {file}: {summary.trials} trial "
                      f"row(s) and {summary.remeasurements} re-measurement(s) written, "
                      f"{summary.best_updated} best config(s) created or changed")
