"""``tuner export FILE``: best configs as a JSON bundle (or every trial, for replays, or a
snapshot as it was frozen)."""

from __future__ import annotations

import json
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import DbOption, JsonOption, console, database_url, print_json
from tuner.errors import TunerError
from tuner.lookup.snapshot import read_snapshot

__all__ = ["export"]


def export(
    file: Annotated[str, typer.Argument(help="JSON file to write ('-' for stdout)")],
    device: Annotated[str | None, typer.Option("--device", help="device name or key")] = None,
    template: Annotated[str | None, typer.Option("--template", help="template name")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    variant: Annotated[str | None, typer.Option("--variant")] = None,
    trials: Annotated[bool, typer.Option(
        "--trials", help="write every recorded trial and its re-measurements (for `tuner "
                         "replay`) instead of the best-config bundle")] = False,
    snapshot: Annotated[str | None, typer.Option(
        "--snapshot", help="write this snapshot (its id, from `tuner snapshot create`) as it "
                           "was frozen, instead of the best configs stored now; the file "
                           "hashes to the same id (TUNER_SNAPSHOT can name the file)",
        show_default=False)] = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Write the stored best configs as a JSON bundle for `tuner import`.

    Each item: device, template name and version, problem, config, TFLOP/s, default TFLOP/s,
    and the readings of the config and the default where they were re-measured as finalists.
    """
    # lazy: optuna, sqlalchemy, torch+triton +3.2 s (2-core CPU); keeps `tuner --help` < 1 s
    from db.session import session_scope
    from tuner.lookup.bundle import make_bundle
    from tuner.tuning.replay import dump_recorded, load_recorded_from_db

    url = database_url(db)
    if snapshot is not None:
        filters = {"--device": device, "--template": template, "--dtype": dtype,
                   "--variant": variant, "--trials": trials or None}
        given = [name for name, value in filters.items() if value is not None]
        if given:
            raise TunerError(f"--snapshot writes the snapshot whole; {', '.join(given)} "
                             "cannot be combined with it",
                             "freeze a snapshot of just those configs with `tuner snapshot "
                             "create` and its filters, and export that")
        data = read_snapshot(url, snapshot).bundle
        count = len(data["items"])
        what = f"best config(s) of snapshot {snapshot}"
    elif trials:
        data = dump_recorded(load_recorded_from_db(url, template=template, device=device))
        count = len(data["problems"])
        what = "problem(s) of recorded trials"
    else:
        with session_scope(url, write=False) as s:
            data = make_bundle(s, device=device, template=template, dtype=dtype,
                               variant=variant, host=socket.gethostname(),
                               exported_at=datetime.now(UTC))
        count = len(data["items"])
        what = "best config(s)"
    text = json.dumps(data, indent=2, default=str) + "\n"
    if file == "-":
        sys.stdout.write(text)
        return
    try:
        Path(file).write_text(text)
    except OSError as exc:
        raise TunerError(f"cannot write {file!r}: {exc}", "choose a writable path") from None
    if json_out:
        print_json({"file": file, "count": count, "kind": "trials" if trials else "bundle"})
    else:
        console.print(f"wrote {count} {what} to {file}")
