"""`--help` that helps: every field of every recipe's config class carries its description in
`dataclasses.field(metadata={"help": ...})` (the transformers / TRL convention, which HfArgumentParser reads), and
`python recipes/<name>.py --help` prints each flag with it. In-process and cheap: no model, no data, no launcher."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fsdp_recipes.common.errors import exit_on_user_error
from fsdp_recipes.train.config import TrainingConfig
from helpers.paths import REPO
from helpers.recipes import load_recipe

RECIPES = sorted(path.stem for path in (REPO / "recipes").glob("*.py") if not path.name.startswith("_"))


def config_class(module) -> type:
    """The recipe's config class: the dataclass it defines that subclasses TrainingConfig (eval.py's does not: there
    it is the one named *Config)."""
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == module.__name__
        and (issubclass(obj, TrainingConfig) or obj.__name__.endswith("Config"))
    ]
    assert len(found) == 1, f"{module.__file__}: expected one config dataclass, found {[c.__name__ for c in found]}"
    return found[0]


def help_problems(cls) -> list[str]:
    """Fields of `cls` whose help is missing, empty, or has a % that argparse would read as a format (write %%)."""
    problems = []
    for field in dataclasses.fields(cls):
        text = field.metadata.get("help")
        if not isinstance(text, str) or not text.strip():
            problems.append(f"{field.name}: no help (dataclasses.field(..., metadata={{'help': ...}}))")
        elif "%" in text.replace("%%", ""):
            problems.append(f"{field.name}: unescaped % in its help (argparse needs %%)")
    return problems


def squeeze(text: str) -> str:
    """Without whitespace: argparse re-wraps help to the terminal width (and may break lines at hyphens)."""
    return "".join(text.split())


def test_every_recipe_is_checked():
    assert {"sft", "dpo", "pretrain", "classify", "eval"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_config_field_has_help(recipe):
    cls = config_class(load_recipe(recipe))
    assert help_problems(cls) == []


def test_a_field_without_help_is_caught():
    @dataclasses.dataclass
    class Bare(TrainingConfig):
        undocumented: int = 0  # a comment is not help
        percent: float = dataclasses.field(default=0.5, metadata={"help": "50% of it"})

    assert help_problems(Bare) == [
        "undocumented: no help (dataclasses.field(..., metadata={'help': ...}))",
        "percent: unescaped % in its help (argparse needs %%)",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_prints_every_flag_with_its_help(recipe, capsys, monkeypatch):
    module = load_recipe(recipe)
    cls = config_class(module)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr("sys.argv", [f"recipes/{recipe}.py", "--help"])
    with pytest.raises(SystemExit) as exited:  # as `python recipes/<recipe>.py --help` runs it
        exit_on_user_error(lambda: module.main(["--help"]))
    assert exited.value.code == 0
    printed = squeeze(capsys.readouterr().out)
    assert squeeze("--config CONFIG YAML file with the recipe's settings") in printed
    missing = []
    for field in dataclasses.fields(cls):
        # argparse lists `--name NAME, --name-with-dashes NAME` (bools: `[NAME]`, lists: `NAME [NAME ...]`), then the
        # help, with %% printed as %.
        flag = re.escape("--" + field.name.replace("_", "-")) + r"[A-Z0-9_\[\].,]*"
        text = squeeze(field.metadata.get("help") or "").replace("%%", "%")
        if not text or not re.search(flag + re.escape(text), printed):
            missing.append(field.name)
    assert missing == [], f"--help does not print these flags with their help: {missing}"


def test_the_tools_help_opens_with_what_the_command_is_for(capsys):
    from fsdp_recipes.tools.cli import build_parser

    build_parser().print_help()
    opening = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert "estimate the memory per GPU" in opening and "export a training checkpoint" in opening
    assert "decorated" not in opening and "argparse" not in opening
