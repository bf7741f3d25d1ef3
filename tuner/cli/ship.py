"""``tuner ship``: regenerate the shipped measurements of a GPU model (``tuner.lookup.shipped``)
from a sweep's database or a bundle file, for the problems of a suite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import JsonOption, console, database_url, print_json

__all__ = ["ship"]


def ship(
    source: Annotated[str | None, typer.Option(
        "--from", help="a database URL (default: TUNER_DATABASE_URL), or a bundle file that "
                       "`tuner export` wrote", show_default=False)] = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="the stored device: its key, its name or a part of it (e.g. h200); "
                         "needed where the source holds several", show_default=False)] = None,
    suite: Annotated[str, typer.Option(
        "--suite", help="ship the bests in the buckets of this suite's problems (a built-in "
                        "suite or a spec file)")] = "ship",
    out: Annotated[Path | None, typer.Option(
        "--out", help="the file to write (default: the package's tables, "
                      "tuner/lookup/shipped/<device>.json)", show_default=False)] = None,
    partial: Annotated[bool, typer.Option(
        "--partial", help="write the table even where the suite's templates lack a "
                          "problem's best (those problems are then priced by their "
                          "neighbours' records)")] = False,
    json_out: JsonOption = False,
) -> None:
    """Write a shipped table: what a fresh install runs before any sweep.

    Each record is a stored best of the device (config, TFLOP/s, kernel version, the
    head-to-head median it is priced at), as the dispatcher prices it from a database. Bests
    tuned for another version of a kernel than the installed one are dropped, and listed.
    A table that lacks some of the suite's bests (a sweep stopped by its budget) is refused
    unless --partial: a problem nothing measured is priced by its neighbours, which can run
    ours where SDPA is faster.
    """
    # The kernels, torch and SQLAlchemy are imported here, when the command runs: `tuner
    # --help` stays free of them (tests/tuner/cli/test_cli_new_user.py).
    from templates.registry import get_template
    from tuner.errors import TunerError
    from tuner.lookup.shipped import PACKAGED_DIR, file_name
    from tuner.tuning.ship import (
        as_json,
        build_table,
        dropped_lines,
        from_bundle,
        from_database,
        table_winners,
    )
    from tuner.tuning.suites import resolve_spec

    given = source or database_url(None)
    bests = from_database(given, device) if "://" in given else from_bundle(Path(given), device)
    spec, _ = resolve_spec(suite, interpreter=bests.device.is_interpreter)
    shipped = build_table(bests, spec, lambda name: get_template(name).version())
    if not shipped.table.records:
        raise TunerError(
            f"nothing to ship: no best of {bests.device.key} in {bests.source} is in the "
            f"buckets of suite {spec.name!r} at the installed kernel versions"
            + "".join(f"\n  {line}" for line in dropped_lines(shipped.dropped)),
            f"sweep them with this checkout (`tuner sweep {suite}`), then ship again")
    if shipped.missing and not partial:
        raise TunerError(
            f"the table would lack {len(shipped.missing)} of suite {spec.name!r}'s bests of "
            f"{bests.device.key} at the installed kernel versions: "
            + ", ".join(f"{t} {k}" for k, t in shipped.missing)
            + "".join(f"\n  {line}" for line in dropped_lines(shipped.dropped)),
            f"run the sweep again (`tuner sweep {suite} --budget ...` on the same database "
            "measures what it did not reach first), or pass --partial to ship what is there")
    path = out if out is not None else PACKAGED_DIR / file_name(bests.device.name)
    if path.is_dir():
        path = path / file_name(bests.device.name)
    try:
        path.write_text(shipped.table.to_json())
    except OSError as exc:
        raise TunerError(f"cannot write {str(path)!r}: {exc}", "choose a writable --out") from None
    if json_out:
        print_json(as_json(shipped, path))
        return
    winners = Counter(table_winners(shipped.table.records).values())
    console.print(f"wrote {len(shipped.table.records)} records of {bests.device.key} to {path}",
                  highlight=False)
    console.print(f"inference calls of its {winners.total()} problems run, by its prices: "
                  + ", ".join(f"{name} on {n}" for name, n in winners.most_common()),
                  highlight=False)
    for line in dropped_lines(shipped.dropped):
        console.print(f"dropped: {line}", highlight=False)
    if shipped.missing:
        console.print(f"not measured ({len(shipped.missing)}): "
                      + ", ".join(f"{t} {k}" for k, t in shipped.missing), highlight=False)
