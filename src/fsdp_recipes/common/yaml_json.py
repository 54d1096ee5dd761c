"""The small files the project reads and writes: YAML mappings (configs) and JSON records."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError


def load_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of key: value, got {type(values).__name__}")
    return values


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line."""
    Path(path).write_text("".join(json.dumps(record) + "\n" for record in records))
