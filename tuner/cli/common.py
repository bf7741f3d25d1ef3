"""What the commands share: option aliases, the database URL, output for people and machines."""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from tuner.errors import TunerError
from tuner.settings import SettingsError, get_settings, load_settings

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from tuner.settings import Settings

__all__ = [
    "DbOption",
    "checked_dtype",
    "checked_template",
    "checked_variant",
    "GpuLockDirOption",
    "JsonOption",
    "console",
    "database_url",
    "err_console",
    "fmt_tflops",
    "gpu_lock_dir",
    "plain_table",
    "print_json",
    "print_table",
    "problem_label",
    "settings_with",
]

# Piped output (not a terminal) is read by scripts and grep: rich's default of 80 columns there
# split a config's text over lines ("use_tma=Fals" / "e"), so it gets room for whole lines.
PIPED_WIDTH = 10_000
console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else PIPED_WIDTH)
# Between the columns of a table printed piped (``plain_table``): a cell's own spaces are single.
PLAIN_GAP = "  "

DbOption = Annotated[str | None, typer.Option(
    "--db", help="SQLAlchemy database URL (default: TUNER_DATABASE_URL, else sqlite:///tuner.db)",
    show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON for machines")]
GpuLockDirOption = Annotated[str | None, typer.Option(
    "--gpu-lock-dir", help="claim GPUs through locks in this folder, shared by the sweeps of one "
                           "host, one GPU per worker (default: TUNER_GPU_LOCK_DIR; unset: use "
                           "every visible GPU)", show_default=False)]

INTERPRETER_WARNING = ("device cpu-interpreter: kernels ran under the Triton interpreter on the "
                       "CPU; these timings are NOT GPU timings (they only show that the "
                       "pipeline and the kernels compute the right thing)")


def database_url(db: str | None) -> str:
    """``--db`` if given, else the settings' URL (TUNER_DATABASE_URL)."""
    return settings_with(db).database_url


def settings_with(db: str | None) -> Settings:
    """The settings, with ``--db`` in place of TUNER_DATABASE_URL where given; a bad value is
    a TunerError whose fix names what to change."""
    try:
        return load_settings(database_url=db) if db else get_settings()
    except SettingsError as exc:
        if "TUNER_DATABASE_URL" in exc.variables:
            fix = "pass --db sqlite:///tuner.db or --db postgresql+psycopg://user@host/db"
        else:
            fix = exc.fix
        raise TunerError(exc.message, fix) from None


def gpu_lock_dir(flag: str | None) -> str | None:
    """``--gpu-lock-dir`` if given, else the settings' folder (TUNER_GPU_LOCK_DIR)."""
    return flag if flag is not None else get_settings().gpu_lock_dir


def checked_dtype(dtype: str | None) -> str | None:
    """``--dtype`` as given, if it names a dtype; a typo is an error, not an empty answer."""
    # The templates (torch, triton: 3-4 s) are imported by the commands that use them, when
    # they run: every command's --help and start-up paid them (issue 41, item 1).
    from templates.base import DTYPES

    if dtype is None or dtype in DTYPES:
        return dtype
    raise TunerError(f"--dtype must be one of {', '.join(DTYPES)}, but got {dtype!r}",
                     _did_you_mean("--dtype", dtype, DTYPES))


def checked_variant(variant: str | None) -> str | None:
    """``--variant`` as given, if it is a variant name as ``Problem.variant`` writes it
    (dense, causal-<mode>, sparse-<mask>, causal-<mode>+sparse-<mask>, any of them but dense
    followed by +softcap<cap>, or softcap<cap> alone)."""
    # lazy: torch+triton +1.4 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.base import CAUSAL_MODES

    causal = "|".join(m for m in CAUSAL_MODES if m != "none")
    cap = r"softcap\d[\d.e+-]*"  # the cap as Problem.variant writes it ({:g})
    shaped = rf"causal-(?:{causal})(?:\+sparse-[^+\s]+)?|sparse-[^+\s]+"
    if variant is None or re.fullmatch(rf"dense|{cap}|(?:{shaped})(?:\+{cap})?", variant):
        return variant
    examples = ["dense", *(f"causal-{m}" for m in CAUSAL_MODES if m != "none")]
    raise TunerError(f"--variant must be dense, causal-<mode> (mode: {causal.replace('|', ', ')}),"
                     f" sparse-<mask> or causal-<mode>+sparse-<mask>, each may end in "
                     f"+softcap<cap> (softcap<cap> alone: dense), but got {variant!r}",
                     _did_you_mean("--variant", variant, examples))


def checked_template(template: str | None, stored: Iterable[str]) -> str | None:
    """``--template`` as given, if it is registered here or has rows in the database
    (``stored``: the names there)."""
    # lazy: torch+triton +1.6 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.registry import all_templates

    known = sorted({t.name for t in all_templates()} | set(stored))
    if template is None or template in known:
        return template
    raise TunerError(f"no template {template!r} is registered or stored; known: "
                     f"{', '.join(known)}", _did_you_mean("--template", template, known))


def _did_you_mean(flag: str, given: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(given, allowed, n=1, cutoff=0.5)
    return f"did you mean {flag} {close[0]}?" if close else f"e.g. {flag} {allowed[0]}"


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_table(table: Table) -> None:
    """``table`` for people: rich's boxed table on a terminal; piped, plain lines
    (``plain_table``). Boxed at ``PIPED_WIDTH``, every row of ``tuner best`` was padded to its
    widest cells, ~270 columns (issue 41, item 10); ``--json`` is the format for programs."""
    if console.file.isatty():
        console.print(table)
    else:
        console.file.write(plain_table(table))


def plain_table(table: Table) -> str:
    """``table`` as lines that grep, cut and less read: the title, a header, one line per row,
    the caption. Columns are aligned, ``PLAIN_GAP`` apart (numbers to the right, as on a
    terminal), without borders and with nothing after a row's last cell. A cell's own spaces
    are single ones and an empty cell reads "-", so splitting a line at two or more spaces
    gives its cells."""
    columns = [[_one_line(column.header) or "-",
                *(_one_line(cell) or "-" for cell in column.cells)]
               for column in table.columns]
    widths = [max(map(len, cells)) for cells in columns]
    lines = [_plain(table.title)] if table.title else []
    for row in zip(*columns, strict=True):
        lines.append(PLAIN_GAP.join(
            cell.rjust(width) if column.justify == "right" else cell.ljust(width)
            for cell, width, column in zip(row, widths, table.columns, strict=True)).rstrip())
    if table.caption:
        lines.append(_plain(table.caption))
    return "\n".join(lines) + "\n"


def _plain(renderable: RenderableType) -> str:
    """The text of a cell, title or caption as rich shows it, without its markup."""
    if isinstance(renderable, str):
        return Text.from_markup(renderable).plain
    return renderable.plain if isinstance(renderable, Text) else str(renderable)


def _one_line(renderable: RenderableType) -> str:
    return " ".join(_plain(renderable).split())


def fmt_tflops(value: float | None) -> str:
    if value is None:
        return "-"
    # Interpreter "TFLOP/s" are tiny numbers; GPU ones hundreds: 3 significant digits fit both.
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def problem_label(problem: dict[str, Any]) -> str:
    """A stored problem (``Problem.to_dict``'s form) as ``Problem.label`` writes it."""
    if not problem:
        return "-"
    # lazy: torch+triton +1.4 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.base import Problem

    return Problem.from_dict(problem).label


def config_text(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())
