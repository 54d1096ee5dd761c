"""The recipes and their configs, found in folders: nothing here lists them by hand. A recipe is
`recipes/<name>.py`, its configs `recipes/configs/<name>/*.yaml`. `fsdp-recipes ls` lists them
(fsdp_recipes.tools.listing); `fsdp-recipes cp` copies a recipe or a config, with what it needs, for editing.

What a config is meant for is read from its opening comment, which every config has: the command that launches it
(fsdp_recipes.tools.config_comments), and optionally a line `# GPU memory: 24GB`, the memory per GPU the config must
fit (80GB otherwise). A config is estimated as its recipe reads it: with the config class the recipe script defines.
Shapes of Hub models come from the estimator's own `model_shapes/<hub id>/config.json` (fsdp_recipes.tools.estimator,
package data), so estimates need no network.

In a checkout, the folders are read in place; an installed wheel carries copies of them under fsdp_recipes/bundled/
(setup.py puts them there), at the same relative paths."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import filecmp
import functools
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from accelerate.commands.config.config_args import ClusterConfig

from fsdp_recipes.common.errors import ConfigError, UserError
from fsdp_recipes.common.sizes import parse_size
from fsdp_recipes.data import images
from fsdp_recipes.distributed.accelerate_config import LaunchLayout, fsdp_settings, read_accelerate_yaml
from fsdp_recipes.distributed.launch_checks import ERROR
from fsdp_recipes.tools import method_copies
from fsdp_recipes.tools.config_comments import LaunchCommand, opening_comment, parse_launch_command
from fsdp_recipes.tools.estimator import MODEL_SHAPES
from fsdp_recipes.tools.estimator.arguments import DEFAULT_GPU_MEMORY


def source_root() -> Path:
    """The folder holding recipes/, accelerate_configs/, demo/: the checkout this package runs from, or the copy
    packaged in the wheel."""
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "recipes").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout
    bundled = Path(__file__).resolve().parents[1] / "bundled"  # fsdp_recipes/bundled, written by setup.py
    if not (bundled / "recipes").is_dir():
        raise UserError(
            f"no recipes found in {bundled}: this installation was built without them. Install "
            "fsdp-recipes from a wheel built by `pip wheel` (setup.py bundles them), or run from a clone."
        )
    return bundled


RUN_OUTPUTS = "outputs"  # where runs write (git-ignored): results, never inputs a copy needs


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    summary: str  # the first line of the module docstring


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    recipe: str
    name: str
    path: Path
    values: dict[str, Any]
    launch: LaunchCommand | None
    gpu_memory: str  # as written, e.g. "80GB"

    @property
    def key(self) -> str:
        return f"{self.recipe}/{self.name}"

    @property
    def model(self) -> str | None:
        return self.values.get("model_config") or self.values.get("model_name_or_path")

    @property
    def method(self) -> str:
        if self.values.get("load_in_4bit"):
            return "QLoRA"
        return "LoRA" if self.values.get("use_peft") else "full"


def read_summary(path: Path) -> str:
    """The first line of a script's docstring, read without importing it (recipes import torch)."""
    try:
        docstring = ast.get_docstring(ast.parse(path.read_text()))
    except SyntaxError:
        return "(does not parse)"
    return docstring.strip().splitlines()[0] if docstring else "(no docstring)"


def gpu_memory_line(comment: list[str]) -> str:
    for line in comment:
        if line.strip().lower().startswith("gpu memory:"):
            return line.split(":", 1)[1].split()[0]
    return DEFAULT_GPU_MEMORY


@functools.cache
def model_info(config_file: Path):
    """The estimator's shapes of a model config.json, built once per process (a weightless model per call)."""
    # Imported here, not above: the estimator imports torch, transformers and peft (seconds), which `cp` never needs.
    from fsdp_recipes.tools.estimator.shapes import load_model_info

    return load_model_info(str(config_file))


class Catalog:
    """Recipes and configs under `root` (default: `source_root()`)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else source_root()

    def shown(self, path: Path) -> Path:
        """`path` as messages show it: relative to the root when it is under it."""
        return path.relative_to(self.root) if path.is_relative_to(self.root) else path

    def recipes(self) -> list[Recipe]:
        return [
            Recipe(path.stem, path, read_summary(path))
            for path in sorted((self.root / "recipes").glob("*.py"))
            if not path.name.startswith("_")
        ]

    def configs(self, recipe: str | None = None) -> list[RecipeConfig]:
        folders = (
            [self.root / "recipes" / "configs" / recipe]
            if recipe
            else sorted((self.root / "recipes" / "configs").glob("*"))
        )
        found = []
        for folder in folders:
            for path in sorted(folder.glob("*.yaml")):
                found.append(self.read_config(path, recipe=folder.name))
        return found

    def read_config(self, path: Path, *, recipe: str) -> RecipeConfig:
        text = path.read_text()
        where = str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{where} is not valid YAML: {error}") from None
        comment = opening_comment(text)
        return RecipeConfig(
            recipe,
            path.stem,
            path,
            values if isinstance(values, dict) else {},
            parse_launch_command(comment, where=where, config_file=path),
            gpu_memory_line(comment),
        )

    def find(self, name: str) -> Recipe | RecipeConfig:
        """`sft` (a recipe), `sft/demo_reverse` or `demo_reverse` (a config, if only one recipe has that name); a
        trailing .py / .yaml is allowed."""
        recipes = {recipe.name: recipe for recipe in self.recipes()}
        configs = {config.key: config for config in self.configs()}
        wanted = name.removesuffix(".py").removesuffix(".yaml").strip("/")
        if wanted in recipes:
            return recipes[wanted]
        if wanted in configs:
            return configs[wanted]
        by_name = [config for config in configs.values() if config.name == wanted]
        if len(by_name) == 1:
            return by_name[0]
        if by_name:
            raise UserError(
                f"{name!r} is a config of several recipes: name one of {', '.join(config.key for config in by_name)}"
            )
        close = [key for key in configs if wanted in key][:3] or difflib.get_close_matches(
            wanted, [*recipes, *configs], n=3
        )
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise UserError(f"no recipe or config named {name!r}; {hint}`fsdp-recipes ls` lists them")

    # --- what a config runs with --------------------------------------------------------------------------------
    def accelerate_settings(self, config: RecipeConfig) -> dict[str, Any]:
        """The Accelerate YAML the launch command names, with the command's launcher flags applied over it (as
        `accelerate launch` applies them)."""
        launch = config.launch
        if launch is None or launch.accelerate_config is None:
            raise ConfigError(f"{config.key}: its opening comment has no `accelerate launch --config_file ...` line")
        path = self.root / launch.accelerate_config
        if not path.is_file():
            raise ConfigError(
                f"{config.key}: its launch command names {launch.accelerate_config}, which does not exist"
            )
        raw = read_accelerate_yaml(path)
        fsdp = fsdp_settings(raw)
        top_level = {f.name for f in dataclasses.fields(ClusterConfig)}
        for key, value in launch.overrides.items():
            if key.startswith("fsdp_"):
                fsdp[key] = value
            elif key in top_level:
                raw[key] = value
        if fsdp:
            raw["fsdp_config"] = fsdp
        return raw

    def model_file(self, config: RecipeConfig) -> Path | None:
        """A local config.json for the config's model: its model_config, or the shapes kept for its Hub id."""
        if config.values.get("model_config"):
            path = Path(config.values["model_config"])
            path = path if path.is_absolute() else self.root / path
        elif config.values.get("model_name_or_path"):
            path = MODEL_SHAPES / str(config.values["model_name_or_path"]) / "config.json"
        else:
            return None
        return path if path.is_file() else None

    def estimate(self, config: RecipeConfig):
        """The estimate for the config on the launch it is meant for, read with its recipe's config class. Raises
        ConfigError."""
        # Imported here, not above: the estimator imports torch, transformers and peft (seconds), which `cp` never
        # needs.
        from fsdp_recipes.tools.estimator.formulas import estimate_for_recipe
        from fsdp_recipes.tools.estimator.recipe import recipe_config

        model = self.model_file(config)
        if model is None:
            raise ConfigError(
                f"no local config.json for model {config.model!r}: add {self.shown(MODEL_SHAPES)}/"
                f"{config.model}/config.json, or run `fsdp-recipes estimate` where the Hub is reachable"
            )
        layout = LaunchLayout.from_mapping(self.accelerate_settings(config), where=f"{config.key}'s Accelerate config")
        script = next((recipe.path for recipe in self.recipes() if recipe.name == config.recipe), None)
        recipe = recipe_config(config.values, script=script, where=config.key)
        return estimate_for_recipe(
            model_info(model),
            layout,
            recipe,
            gpu_memory=parse_size(config.gpu_memory),
            model_name=str(config.model),
            frozen_model_info=lambda name: model_info(self.frozen_model_file(name)),
        )

    def frozen_model_file(self, name: str) -> Path:
        """A local config.json for a frozen model a config names (a distillation teacher): the shapes kept for its Hub
        id, its folder under the root, or the model of the shipped config whose output_dir it is. Raises ConfigError."""
        for path in (MODEL_SHAPES / name / "config.json", self.root / name / "config.json"):
            if path.is_file():
                return path
        writers = [config for config in self.configs() if config.values.get("output_dir") == name]
        found = next((self.model_file(config) for config in writers if self.model_file(config)), None)
        if found is not None:
            return found
        raise ConfigError(
            f"no local config.json for the frozen model {name!r}: add {self.shown(MODEL_SHAPES)}/{name}/config.json"
        )

    def problems(self, config: RecipeConfig) -> list[str]:
        """Why the config would not run as its opening comment says: the command names another recipe or config,
        the Accelerate config (with the command's flags) fails the linter, the model lacks the wrap classes, or the
        estimate exceeds the GPU memory. Empty if none."""
        # Imported here, not above: the linter imports torch and transformers (seconds), which `cp` never needs.
        from fsdp_recipes.tools.linter import lint_config_file

        launch = config.launch
        if launch is None:
            return ["no `accelerate launch ...` command in its opening comment"]
        relative = config.path.relative_to(self.root).as_posix()
        found = []
        if launch.script != f"recipes/{config.recipe}.py":
            found.append(f"its launch command runs {launch.script}, not recipes/{config.recipe}.py")
        if not (self.root / "recipes" / f"{config.recipe}.py").is_file():
            found.append(f"recipes/{config.recipe}.py does not exist: configs live in recipes/configs/<recipe>/")
        if launch.recipe_config != relative:
            found.append(f"its launch command passes --config {launch.recipe_config}, not {relative}")
        try:
            settings = self.accelerate_settings(config)
        except ConfigError as error:
            return found + [str(error)]
        model = self.model_file(config)
        if model is None:
            return found + [
                f"no local config.json for model {config.model!r} (add {self.shown(MODEL_SHAPES)}/<hub id>/config.json)"
            ]
        with tempfile.TemporaryDirectory() as folder:
            effective = Path(folder) / "accelerate.yaml"
            effective.write_text(yaml.safe_dump(settings))
            for finding in lint_config_file(effective, model=str(model)):
                if finding.severity == ERROR:
                    found.append(
                        f"{launch.accelerate_config} (with the command's flags): {finding.key}: {finding.message}"
                    )
        if found:
            return found
        try:
            estimate = self.estimate(config)
        except ConfigError as error:
            return [str(error)]
        if not estimate.fits:
            found.append(
                f"estimated {estimate.total / 2**30:.1f} GiB per GPU, over the {estimate.usable / 2**30:.1f} "
                f"GiB usable of {config.gpu_memory} (fsdp-recipes estimate shows what to change)"
            )
        return found

    # --- copies --------------------------------------------------------------------------------------------------
    def needs(self, config: RecipeConfig) -> list[tuple[Path, str]]:
        """Files the config's launch command and values name under the root (relative path, why). What runs wrote is
        not an input to copy: `output_dir`, and a model a run left under outputs/ (it would bring its checkpoints)."""
        found: list[tuple[Path, str]] = []
        if config.launch and config.launch.accelerate_config:
            found.append((Path(config.launch.accelerate_config), "the Accelerate config its launch command names"))
        for key, named in config.values.items():
            for value in named if isinstance(named, list) else [named]:
                found += self._named_files(config, key, value)
        return found

    def _named_files(self, config: RecipeConfig, key: str, value) -> list[tuple[Path, str]]:
        """A path a value names (a folder: its files); for user code (`file.py:name`), its file's folder."""
        where, _, name = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        value = str(Path(where).parent) if where.endswith(".py") and name else value
        if not isinstance(value, str) or Path(value).is_absolute() or ".." in Path(value).parts or key == "output_dir":
            return []
        source = self.root / value
        if Path(value).parts[:1] == (RUN_OUTPUTS,) or not (source.is_file() or value.strip("./")):
            return []
        root, why = self.root.resolve(), f"{config.name}.yaml names {value} as {key}"
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if "__pycache__" not in p.parts)
        if key == "dataset_name" and source.is_dir():  # the pictures its rows name, kept beside it
            files += [p for p in images.pictures_named_in(source) if p.is_relative_to(root)]
        return [(p.resolve().relative_to(root), why) for p in files if p.is_file()]

    def copy_plan(self, item: Recipe | RecipeConfig) -> list[tuple[Path, str, bool]]:
        """(path relative to the root, why, primary) for everything `cp` copies for `item`: a recipe with all its
        configs, or a config with its recipe; each config with what it names. Primary files are the ones asked for."""
        if isinstance(item, Recipe):
            plan = [(item.path.relative_to(self.root), "the recipe", True)]
            configs = self.configs(item.name)
        else:
            plan = [
                (item.path.relative_to(self.root), "the config", True),
                (Path("recipes") / f"{item.recipe}.py", "the recipe its launch command runs", False),
            ]
            configs = [item]
        for config in configs:
            if isinstance(item, Recipe):
                plan.append((config.path.relative_to(self.root), f"a config of {item.name}", False))
            plan += [(path, why, False) for path, why in self.needs(config)]
        unique: dict[Path, tuple[Path, str, bool]] = {}
        for path, why, primary in plan:
            unique.setdefault(path, (path, why, primary))
        return list(unique.values())

    def copy(self, name: str, dest: Path, *, force: bool = False, with_method: bool = False) -> list[str]:
        """Copies into folder `dest` at the same relative paths, so that every command written in the copied files
        runs from `dest`; or, when `dest` names a .py/.yaml file, only the recipe or config itself. `with_method`: the
        recipe's method packages too, beside it, imports pointed there (`method_copies`). A file that exists and
        differs is never replaced unless `force` (files it only needs are kept as they are: they may be yours).
        Returns the report lines. Raises UserError before writing anything."""
        item = self.find(name)
        if dest.suffix in (".py", ".yaml", ".yml"):
            if with_method:
                raise UserError("--with-method copies the method packages beside the recipe: give a folder as DEST")
            return self._copy_one(item, dest, force=force)
        if dest.exists() and not dest.is_dir():
            raise UserError(f"{dest} is a file: give a folder to copy into (or a .py/.yaml path for one file)")
        files = [(self.root / path, path, why, primary) for path, why, primary in self.copy_plan(item)]
        if with_method:
            recipe = self.root / "recipes" / f"{item.name if isinstance(item, Recipe) else item.recipe}.py"
            plan = method_copies.copy_plan(recipe.read_text(), Path("recipes"))
            files += [(source, path, why, True) for source, path, why in plan]

        def content(source: Path, path: Path) -> bytes:
            if with_method and path.suffix == ".py" and path.parts[0] == "recipes":
                return method_copies.localised(source.read_text()).encode()
            return source.read_bytes()

        conflicts = [
            path
            for source, path, _, primary in files
            if primary and (dest / path).exists() and (dest / path).read_bytes() != content(source, path)
        ]
        if conflicts and not force:
            raise UserError(
                f"{', '.join(str(dest / path) for path in conflicts)} exists and differs from the packaged "
                "file: pass --force to overwrite it, or copy into another folder (nothing was copied)"
            )
        report, groups = [f"into {dest}/:"], {}
        for source, path, why, primary in files:
            target, wanted = dest / path, content(source, path)
            if target.exists() and target.read_bytes() == wanted:
                status = "already there"
            elif target.exists() and not primary:
                status = "kept yours (it differs)"
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wanted)
                status = "copied"
            groups.setdefault((path.parent, why, status), []).append(path)
        for (folder, why, status), paths in groups.items():  # a folder of many (a dataset's pictures): one line
            listed = paths if len(paths) <= 10 else [f"{folder}/ ({len(paths)} files)"]
            report += [f"  {p}  ({why}; {status})" for p in listed]
        return report + self._how_to_run(item, dest)

    def _copy_one(self, item: Recipe | RecipeConfig, dest: Path, *, force: bool) -> list[str]:
        if isinstance(item, Recipe) != (dest.suffix == ".py"):
            raise UserError(f"{dest} has the wrong suffix for {item.path.name}: a recipe is a .py, a config a .yaml")
        if dest.exists() and not force and not filecmp.cmp(item.path, dest, shallow=False):
            raise UserError(f"{dest} exists and differs: pass --force to overwrite it (nothing was copied)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item.path, dest)
        report = [f"copied {item.path.relative_to(self.root)} to {dest}"]
        if isinstance(item, RecipeConfig):
            needs = self.needs(item)
            if needs:
                report.append(
                    "it names these files, relative to the folder you launch from (copy them too with "
                    f"`fsdp-recipes cp {item.key} FOLDER`, or edit the paths):"
                )
                report += [f"  {path}  (packaged at {self.root / path})" for path, _ in needs]
            report.append(
                f"its launch command runs recipes/{item.recipe}.py and passes --config "
                f"{item.path.relative_to(self.root)}: adjust both to where your copies are"
            )
        return report

    def _how_to_run(self, item: Recipe | RecipeConfig, dest: Path) -> list[str]:
        config = item if isinstance(item, RecipeConfig) else next(iter(self.configs(item.name)), None)
        if config is None or config.launch is None or config.launch.accelerate_config is None:
            return []
        launch = config.launch
        launcher = ["accelerate", "launch", "--config_file", launch.accelerate_config, *_flags(launch.overrides)]
        command = shlex.join([*launcher, launch.script, *launch.script_args])
        lines = [
            f"run from {dest}/ (the recipe imports fsdp_recipes: keep the package installed), e.g.:",
            f"  cd {dest} && {command}",
        ]
        hub = [
            str(config.values[key])
            for key in ("model_name_or_path", "tokenizer_name_or_path", "dataset_name")
            if isinstance(config.values.get(key), str) and not (self.root / config.values[key]).exists()
        ]
        if isinstance(item, RecipeConfig) and hub:
            lines.append(f"fetched from the Hub at run time (gated models need `hf auth login`): {', '.join(hub)}")
        return lines


def _flags(overrides: dict[str, Any]) -> list[str]:
    return [part for key, value in overrides.items() for part in (f"--{key}", str(value))]
