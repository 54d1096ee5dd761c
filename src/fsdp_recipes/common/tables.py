"""Aligned two-column tables for the terminal: run summaries, final metrics, reports."""

from __future__ import annotations

from typing import Any


def format_table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {format_value(value)}" for name, value in rows)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)
