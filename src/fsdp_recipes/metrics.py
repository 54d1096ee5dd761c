"""Run records: the metrics log (`metrics.jsonl`, one JSON object per logging step) and the run summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records to `output_dir/metrics.jsonl` and prints them; a no-op on non-main processes."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, printer=print):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.printer = printer
        self.records: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {key: _plain(value) for key, value in record.items()}
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.printer(" ".join(f"{key}={_short(value)}" for key, value in record.items()))

    def last(self, key: str) -> Any:
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return None


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
