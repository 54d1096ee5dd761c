"""Aligned tables for the terminal: run summaries, final metrics, reports, `fsdp-recipes ls`."""

from __future__ import annotations

from typing import Any


def format_table(rows: list[tuple[Any, ...]]) -> str:
    """One line per row, indented by two spaces, cells two spaces apart; every column but the last padded to its
    widest cell. Rows of (name, value) are the usual two-column table; cells are shown with `format_value`."""
    cells = [[format_value(cell) for cell in row] for row in rows]
    columns = max((len(row) for row in cells), default=0)
    widths = [max((len(row[i]) for row in cells if i < len(row)), default=0) for i in range(columns - 1)]
    return "\n".join(
        "  " + "  ".join([*(cell.ljust(width) for cell, width in zip(row[:-1], widths)), row[-1]]) for row in cells
    )


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)
