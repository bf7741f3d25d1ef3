"""Reading a table that the ``tuner`` command printed piped (``tuner.cli.common.plain_table``),
and failing where its layout is not that one: no borders, no line padded past its last cell,
every row as many cells as the header."""

from __future__ import annotations

import re

BOX_DRAWING = re.compile("[\u2500-\u257f]")  # rich's borders: │ ┃ ━ ┏ ╇ ...
GAP = re.compile(" {2,}")  # between two cells; a cell's own spaces are single ones


def cells_of(line: str) -> list[str]:
    return GAP.split(line.strip())


def piped_table(out: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the table in ``out`` whose header line begins with
    ``first_column``: the lines after the header that have as many cells as it."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if cells_of(line)[0] == first_column]
    assert starts, f"no plain header line begins with {first_column!r}:\n{out}"
    header = cells_of(lines[starts[0]])
    table = [lines[starts[0]]]
    rows = []
    for line in lines[starts[0] + 1:]:
        cells = cells_of(line)
        if len(cells) != len(header):
            break
        table.append(line)
        rows.append(cells)
    for line in table:
        assert not BOX_DRAWING.search(line), f"a border in a piped table: {line!r}"
        assert line == line.rstrip(), f"a piped table's line padded with spaces: {line!r}"
    return header, rows
