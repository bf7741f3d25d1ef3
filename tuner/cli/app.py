"""The ``tuner`` command: assembles the commands and owns the one error path.

Every command raises ``TunerError`` (what is wrong, and the fix) for problems the user can
fix, a bad ``TUNER_*`` setting (``SettingsError``) among them; ``main`` prints it (as JSON
with ``--json``) and exits 2, and so it does with the database layer's error that a user fixes
too: a database that cannot be opened (``DatabaseUnavailableError``).
Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from types import FrameType

import typer

from db.errors import DatabaseUnavailableError
from tuner.cli import (
    best,
    compile_check,
    database,
    demand_worker,
    export,
    importing,
    listing,
    replay,
    serve,
    ship,
    snapshot,
    sweep,
    verify,
    winners,
)
from tuner.cli.common import err_console
from tuner.errors import TunerError
from tuner.logs import configure_logging
from tuner.settings import load_log_settings

__all__ = ["app", "main"]

app = typer.Typer(name="tuner", no_args_is_help=True, add_completion=False,
                  help="Autotune Triton attention kernels and serve the best configs.")
app.command("sweep")(sweep.sweep)
app.command("best")(best.best)
app.command("verify")(verify.verify)
app.command("compile-check")(compile_check.compile_check)
app.command("list")(listing.list_things)
app.command("export")(export.export)
app.command("import")(importing.import_bundle)
app.command("replay")(replay.replay)
app.command("serve")(serve.serve)
app.command("winners")(winners.winners)
app.command("ship")(ship.ship)
app.command("worker")(demand_worker.worker)
app.add_typer(database.app, name="db")
app.add_typer(snapshot.app, name="snapshot")

EXIT_USER_ERROR = 2
EXIT_TERMINATED = 128 + signal.SIGTERM  # the shell's status of a process ended by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``docker stop``), raised where Ctrl-C raises KeyboardInterrupt:
    every command winds down as on Ctrl-C (a sweep is marked interrupted and says how to
    resume, a worker gives its claim back), and the process then exits 143."""


_terminated = threading.Event()


def _terminate(signum: int, frame: FrameType | None) -> None:
    _terminated.set()
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is not threading.main_thread():
        _run(args)  # signal handlers belong to the main thread (tests call main on others)
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    try:
        _run(args)
    except (Terminated, SystemExit):
        # A command that handled the interruption exits with its own status (130) or click's
        # "Aborted!" (1); the process was terminated all the same.
        if _terminated.is_set():
            sys.exit(EXIT_TERMINATED)
        raise
    finally:
        signal.signal(signal.SIGTERM, before)


def _run(args: list[str]) -> None:
    try:
        logs = load_log_settings()
        if logs.log_level_set:
            configure_logging(logs.log_level)
        app(args=args, prog_name="tuner")
    except (TunerError, DatabaseUnavailableError) as exc:
        message, fix = exc.message, exc.fix
        if "--json" in args:
            sys.stdout.write(json.dumps({"error": message, "fix": fix}) + "\n")
        else:
            err_console.print(f"[bold red]error:[/] {message}", highlight=False)
            if fix:
                err_console.print(f"[bold]fix:[/] {fix}", highlight=False)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    main()
