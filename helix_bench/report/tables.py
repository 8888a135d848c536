"""A titled table of already formatted rows, printed with rich (nothing without a console)."""

from __future__ import annotations

__all__ = ["print_rows"]


def print_rows(console, title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    if console is None:
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
