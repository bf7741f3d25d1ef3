"""``tuner best --shape``'s comparison table: which implementation runs the asked problem, the
runner-up, every implementation's time and each SDPA backend's (``tuner.dispatch.comparison``)."""

from __future__ import annotations

from rich.table import Table

from tuner.cli.common import config_text
from tuner.wire import ImplementationsCompared, backends_text, readings_text

__all__ = ["compared_table"]


def compared_table(compared: ImplementationsCompared, problem: str, device: str) -> Table:
    """One row per implementation compared, fastest first; the caption says why the winner
    runs, where the times were measured and each SDPA backend's time."""
    table = Table(title=f"{problem} on {device}: runs {compared.winner}")
    for column in ("implementation", "ms", "vs winner", "measured on", "readings", "config"):
        table.add_column(column, justify="right" if column in ("ms", "vs winner", "readings")
                         else "left", overflow="fold")
    winner = compared.times.get(compared.winner)
    for name, t in compared.times.items():
        versus = ("winner" if name == compared.winner else
                  f"{t.ms / winner.ms:.2f}x" if winner is not None else "-")
        readings = readings_text(t.readings, None) + (
            f", head-to-head {t.head_to_head}" if t.head_to_head is not None else "")
        table.add_row(name, f"{t.ms:.4g}", versus, t.problem_key, readings,
                      config_text(t.config))
    notes = [compared.why]
    if compared.sdpa_backends:
        notes.append(f"sdpa backends: {backends_text(compared.sdpa_backends)}")
    if any(t.head_to_head is not None for t in compared.times.values()):
        notes.append("head-to-head N: the time is the median of that head-to-head's "
                     "side-by-side readings")
    table.caption = "\n".join(notes)
    return table
