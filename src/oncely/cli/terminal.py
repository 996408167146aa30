"""What the operator CLI prints: stored text shown as it is stored.

Jobs, dead letters, outbox rows, keys and reports hold text that tenants,
providers and models wrote. Printed through a terminal library that reads
markup, such text could act: ``[/bold]`` crashes the command,
``[link=…]`` makes a live hyperlink, ``[conceal]`` hides what follows. And
raw, escape sequences and bidi overrides make the terminal show something
other than what is stored. So the CLI prints through consoles that read no
markup (``console``), and every piece of stored text through ``literal``:
control characters (C0, DEL, C1) and the invisible characters that reorder,
hide or disguise text (bidi embeddings, overrides, isolates and marks,
zero-width characters, tag characters, variation selectors, blank fillers)
are written as visible escapes (``\\x1b``, ``\\u202e``, ``\\U000e0041``).

Lists go through ``print_rows``: a table when it fits the terminal, else one
block of ``column: value`` lines per row, so no cell is ever left blank or
cut for lack of width.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from oncely.shown import literal

__all__ = ["console", "literal", "print_rows"]


def console(*, stderr: bool = False) -> Console:
    """A console that reads no markup, highlights nothing and makes no emoji
    of ``:names:``: what it is given is what it prints. Messages on stderr are
    one line however long."""
    return Console(stderr=stderr, markup=False, highlight=False, emoji=False, soft_wrap=stderr)


def print_rows(
    out: Console,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    ids: int = 0,
) -> None:
    """``rows`` under ``columns``, every value through ``literal``. The first
    ``ids`` columns are ids: never cut or wrapped (they are for copying).
    When the table's natural width is over the terminal's, each row is
    printed as a block of ``column: value`` lines instead."""
    cells = [[literal(value) for value in row] for row in rows]
    title = literal(title)  # it may name a tenant, a model, a workflow
    table = Table(title=title)
    for i, name in enumerate(columns):
        if i < ids:
            width = max([len(name), *(len(row[i]) for row in cells)])
            table.add_column(name, no_wrap=True, min_width=width)
        else:
            table.add_column(name, overflow="fold")
    for row in cells:
        table.add_row(*row)
    if _fits(out, table):
        out.print(table)
        return
    out.print(f"{title} (one block per row: the table is wider than {out.width} columns)")
    label = max((len(name) for name in columns), default=0)
    for row in cells:
        out.print("")
        for name, value in zip(columns, row, strict=True):
            out.print(f"{name.rjust(label)}: {value}", soft_wrap=True)


def _fits(out: Console, table: Table) -> bool:
    measured = out.measure(table, options=out.options.update(width=10_000))
    return measured.maximum <= out.width
