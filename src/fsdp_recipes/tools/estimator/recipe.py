"""A recipe config (a YAML mapping) as an instance of its recipe's own config class, for the tools that ask it what a
run does (row_length(), micro_batch_rows(), frozen_model_copies(), memory_saving_alternatives()) instead of reading
fields only one recipe has.

Recipes are scripts, not a package: the class is the `TrainingConfig` subclass the script defines, found by loading
the script as a module (its `main` does not run). The instance is built from the mapping's values, converted as the
recipe converts them, without the recipe's `validate()`, which looks at files (the dataset, a model config) that an
estimate does not need. A mapping whose recipe is unknown gets the shared `TrainingConfig`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fsdp_recipes.common.arguments import typed_values
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.train.config import TrainingConfig

_LOADED: dict[Path, ModuleType] = {}


def load_recipe_script(script: str | Path) -> ModuleType:
    """The recipe script as a module, loaded once per process. Raises ConfigError if it cannot be loaded."""
    path = Path(script).resolve()
    if path not in _LOADED:
        # A name of its own per file: two scripts called sft.py (a checkout's and a copy's) are two modules.
        name = f"_fsdp_recipes_script_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"recipe {path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is being built
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - whatever stops the script from loading, said in one line
            del sys.modules[name]
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise ConfigError(
                f"recipe {path} cannot be loaded to read its config class: {type(error).__name__}: {first_line}"
            ) from None
        _LOADED[path] = module
    return _LOADED[path]


def config_class(script: str | Path | None) -> type[TrainingConfig]:
    """The config class a recipe script defines (the TrainingConfig subclass no other class of the script extends);
    TrainingConfig itself when there is no script or it defines none."""
    if script is None:
        return TrainingConfig
    module = load_recipe_script(script)
    defined = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, TrainingConfig) and value.__module__ == module.__name__
    ]
    leaves = [cls for cls in defined if not any(other is not cls and issubclass(other, cls) for other in defined)]
    if len(leaves) > 1:
        raise ConfigError(
            f"recipe {script} defines several config classes ({', '.join(c.__name__ for c in leaves)}): "
            "the tools cannot tell which one its configs are read with"
        )
    return leaves[0] if leaves else TrainingConfig


def config_from_mapping(
    cls: type[TrainingConfig], values: dict[str, Any], *, where: str, unknown_keys_are_errors: bool = True
) -> TrainingConfig:
    """An instance of `cls` from a config's values, each converted to its field's type; every problem (a value of the
    wrong type, and an unknown key unless told otherwise) is reported together as one ConfigError."""
    known, problems = typed_values(cls, values, where=where, unknown_keys_are_errors=unknown_keys_are_errors)
    if problems:
        raise ConfigError(problems)
    return cls(**known)


def recipe_config(
    values: dict[str, Any], *, script: str | Path | None = None, where: str = "the recipe config"
) -> TrainingConfig:
    """`values` read with the config class of `script` (the recipe that reads them). Without a recipe class the
    shared TrainingConfig reads them, and keys it does not know are left out rather than refused: they may be fields
    of the recipe that is not known here."""
    cls = config_class(script)
    return config_from_mapping(cls, values, where=where, unknown_keys_are_errors=cls is not TrainingConfig)
