"""The user's own Python named in a config: `package.module:name` (importable from the working directory or the
environment) or `path/to/file.py:name` (reward functions, tools)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.common.errors import ConfigError


def load_callable(spec: str, *, setting: str) -> tuple[str, Callable]:
    """(name, the callable) that `spec` names; ConfigError naming `setting` when it cannot be found or imported."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{setting}: {spec!r} is neither package.module:name nor path/to/file.py:name")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{setting}: {spec!r} names {where}, no such file")
            module_spec = importlib.util.spec_from_file_location(f"user_file_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises on import
        raise ConfigError(f"{setting}: {spec!r} could not be imported: {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{setting}: {where} has no function {name!r}")
    return name, function
