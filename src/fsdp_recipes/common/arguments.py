"""A config dataclass from a YAML file plus `--field value` flags (`parse_config`): every problem found, unknown keys
with a "did you mean", values of the wrong type and what the config's `validate()` reports (each field's declared
check, each settings group's rules: `fsdp_recipes.common.checks`), collected and raised together as one ConfigError
before anything expensive starts. Command-line values win over the file; `--field null`
sets a nullable field to None as `null` does in YAML."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable
from typing import Any

from transformers import HfArgumentParser

from fsdp_recipes.common import key_translation
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.yaml_json import load_yaml_mapping


def _field_kinds(cls) -> dict[str, tuple[type, bool]]:
    """field name -> (base type, accepts None). A union of types (`str | list[str]`: one name or several) keeps them
    all, as a tuple, tried in order."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            bases = tuple(a for a in args if a is not type(None))
            kinds[field.name] = (bases[0] if len(bases) == 1 else bases, type(None) in args)
        else:
            kinds[field.name] = (hint, False)
    return kinds


def _coerce(value: Any, base: type, nullable: bool) -> Any:
    """YAML value -> field type. YAML reads `1e-5` as a string, so numbers written that way are converted."""
    if value is None:
        if nullable:
            return None
        raise ValueError("may not be null")
    if isinstance(base, tuple):  # a union (`str | list[str]`): the first of its types the value fits
        for option in base:
            try:
                return _coerce(value, option, nullable)
            except ValueError:
                continue
        raise ValueError(f"expected one of {' or '.join(map(str, base))}, got {value!r}")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if base is dict or typing.get_origin(base) is dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping (key: value lines, or {{...}}), got {value!r}")
        return value
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, e.g. [{value!r}], got {value!r}")
        return [_coerce(item, typing.get_args(base)[0], False) for item in value]
    if base is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return str(value)
    return value


def _unknown_key_message(key: str, valid: list[str], where: str) -> str:
    if where == "the command line" and key_translation.command_line_message(key):
        return key_translation.command_line_message(key)
    if key.startswith("fsdp") or key in ("mixed_precision", "num_processes", "distributed_type"):
        return (
            f"{key!r} in {where} is an Accelerate setting: FSDP and precision settings live only in the Accelerate "
            "config (accelerate launch --config_file accelerate_configs/<topology>.yaml); remove it here"
        )
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; run with --help to list the valid ones"
    return f"unknown key {key!r} in {where}{hint}"


def typed_values(
    cls, values: dict[str, Any], *, where: str, unknown_keys_are_errors: bool = True
) -> tuple[dict[str, Any], list[str]]:
    """(each value converted to its field's type, the problems found): values of the wrong type, and keys that are no
    field of `cls` unless told otherwise. Upstream keys (TRL / TrainingArguments names) are read as parse_config
    reads them."""
    return _typed_upstream_values(cls, values, where=where, unknown_keys_are_errors=unknown_keys_are_errors)[::2]


def _typed_upstream_values(
    cls, values: dict[str, Any], *, where: str, unknown_keys_are_errors: bool = True
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """typed_values, plus the notes on upstream keys (renamed or ignored) for the run summary."""
    kinds = _field_kinds(cls)
    values, notes, problems = key_translation.translate(values, set(kinds), where)
    problems = problems if unknown_keys_are_errors else []
    if isinstance(values.get("report_to"), list):  # TrainingArguments takes a list of trackers
        values["report_to"] = ",".join(str(name) for name in values["report_to"]) or "none"
    if values.get("lora_target_modules") == "all-linear":  # peft's keyword, a string in TRL's configs
        values["lora_target_modules"] = ["all-linear"]
    known = {}
    for key, value in values.items():
        if key not in kinds:
            if unknown_keys_are_errors:
                problems.append(_unknown_key_message(str(key), list(kinds), where))
            continue
        try:
            known[key] = _coerce(value, *kinds[key])
        except ValueError as error:
            problems.append(f"{key} in {where}: {error}")
    return known, notes, problems


RESUME_KINDS = ("sensitive", "fixed", "free")


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    resume: str | None = None,
    check: Callable[[str, Any], str | None] | None = None,
    default_factory: Any = dataclasses.MISSING,
    flag_value: str | None = None,
) -> Any:
    """A config field with its `--help` text, its `check` (`fsdp_recipes.common.checks`: (name, value) -> the problem
    or None) and, in a training recipe's settings, what a resume may do with it: "sensitive" (the objective or the
    data depend on it: a resume keeps the checkpoint's value unless allow_config_change names it), "fixed" (the
    checkpoint's tensors depend on it: never changed on resume) or "free". Declared here, with the field, so that a
    new field cannot be left out of the resume check, nor its check out of the validation, in silence.
    `flag_value`: what the flag alone on the command line means (`--torch_compile` is `true`, as a boolean's is)."""
    if resume is not None and resume not in RESUME_KINDS:
        raise ValueError(f"resume={resume!r} is not one of {RESUME_KINDS}")
    metadata = {"help": help} | ({"resume": resume} if resume else {}) | ({"check": check} if check else {})
    if flag_value is not None:  # argparse: the flag may come without a value
        metadata |= {"nargs": "?", "const": flag_value}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


# Field metadata keys that are this project's, not argparse's: HfArgumentParser passes every key to add_argument.
OWN_METADATA = ("resume", "check")  # what a resume may do with the field (train/recipe_interface.py), its check


class _RecipeArgumentParser(HfArgumentParser):
    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        if any(key in field.metadata for key in OWN_METADATA):
            field = copy.copy(field)
            field.metadata = types.MappingProxyType(
                {key: value for key, value in field.metadata.items() if key not in OWN_METADATA}
            )
        HfArgumentParser._parse_dataclass_field(parser, field)


def parse_config(cls, argv: list[str] | None = None):
    """`--config FILE` plus `--field value` overrides -> a validated `cls` instance, or ConfigError listing all
    problems. Command-line values win over the file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    file_values = load_yaml_mapping(known.config) if known.config else {}
    where = f"config file {known.config!r}"

    kinds = _field_kinds(cls)
    defaults, upstream_notes, problems = _typed_upstream_values(cls, file_values, where=where)

    rest, null_overrides = _take_null_overrides(rest, kinds)
    rest, mapping_overrides = _take_mapping_overrides(rest, kinds, problems)
    parser = _RecipeArgumentParser(cls, allow_abbrev=False)  # --max_step must not silently mean --max_steps
    parser.add_argument("--config", help="YAML file with the recipe's settings; command-line flags override it")
    parser.set_defaults(**defaults)
    try:
        *parsed, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    except SystemExit as err:  # argparse already printed what was wrong with the value
        if err.code == 0:  # --help
            raise
        raise ConfigError("invalid command-line value (see the message above)") from None
    previous_was_flag = False
    for arg in remaining:
        if arg.startswith("--"):
            problems.append(_unknown_key_message(arg[2:].split("=")[0], list(kinds), "the command line"))
            previous_was_flag = "=" not in arg
        elif not previous_was_flag:  # a value right after an unknown flag is that flag's value
            problems.append(f"unexpected command-line argument {arg!r}: flags take the form --field value")
        else:
            previous_was_flag = False
    config = dataclasses.replace(parsed[0], **null_overrides, **mapping_overrides)
    config.upstream_notes = upstream_notes  # listed once in the run summary; not a field, so no resume compares it
    if not problems:
        problems.extend(config.validate())
    if problems:
        raise ConfigError(problems)
    return config


def _take_null_overrides(argv: list[str], kinds) -> tuple[list[str], dict[str, None]]:
    """`--save_steps null` (or none, or `--save_steps=null`) on the command line sets a nullable field to None, as
    `null` does in YAML. The last flag for a field wins, as argparse has it for every other value: a null before
    `--save_steps 2` is dropped, and a value before a null is overridden by it (nulls are applied after parsing)."""
    kept, nulls, index = [], {}, 0
    while index < len(argv):
        argument = argv[index]
        name, has_equals, inline = argument[2:].partition("=") if argument.startswith("--") else (None, False, None)
        nullable = name in kinds and kinds[name][1]
        value = inline if has_equals else argv[index + 1] if index + 1 < len(argv) else None
        if nullable and value is not None and value.lower() in ("null", "none"):
            nulls[name] = None
            index += 1 if has_equals else 2
            continue
        if name is not None:
            nulls.pop(name, None)  # a later value wins over an earlier null
        kept.append(argument)
        index += 1
    return kept, nulls


def _take_mapping_overrides(argv: list[str], kinds, problems: list[str]) -> tuple[list[str], dict[str, dict]]:
    """`--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'`: a mapping field's value on the command line, as JSON."""
    kept, mappings, index = [], {}, 0
    while index < len(argv):
        name, has_equals, inline = argv[index][2:].partition("=") if argv[index].startswith("--") else ("", "", "")
        base = kinds[name][0] if name in kinds else None
        if base is dict or typing.get_origin(base) is dict:
            text = inline if has_equals else argv[index + 1] if index + 1 < len(argv) else ""
            try:
                mappings[name] = json.loads(text)
                if not isinstance(mappings[name], dict):
                    raise ValueError
            except ValueError:
                problems.append(f"--{name} takes a JSON mapping, e.g. --{name} '{{\"key\": 1}}', got {text!r}")
            index += 1 if has_equals else 2
            continue
        kept.append(argv[index])
        index += 1
    return kept, mappings
