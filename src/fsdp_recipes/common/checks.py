"""The checks a config field declares with itself (`arguments.setting(..., check=...)`), and `config_problems`, which
runs them all: every field's declared checks (those of the classes it is inherited from included, so a recipe that
changes a default keeps the check), then each settings group's `cross_field_problems` (rules between its own fields),
each group called once, none calling another. A check takes (field name, value) and returns the problem or None."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

Check = Callable[[str, Any], "str | None"]


def _null_text(or_null: bool) -> str:
    return " or null" if or_null else ""


def at_least(bound: float, *, or_null: bool = False, note: str = "") -> Check:
    def check(name: str, value: Any) -> str | None:
        if (value is None and or_null) or (value is not None and value >= bound):
            return None
        return f"{name} must be >= {bound}{_null_text(or_null)}, got {value}{note}"

    return check


def above(bound: float, *, note: str = "") -> Check:
    """A finite number > bound (e.g. a temperature)."""

    def check(name: str, value: Any) -> str | None:
        if math.isfinite(value) and value > bound:
            return None
        return f"{name} must be a number > {bound}, got {value}{note}"

    return check


def non_negative(*, or_null: bool = False, note: str = "") -> Check:
    """A finite number >= 0."""

    def check(name: str, value: Any) -> str | None:
        if (value is None and or_null) or (value is not None and math.isfinite(value) and value >= 0):
            return None
        return f"{name} must be a finite number >= 0{_null_text(or_null)}, got {value}{note}"

    return check


def within(low: float, high: float, *, include_high: bool = False, note: str = "") -> Check:
    """low <= value < high ([low, high)), or <= high with include_high."""

    def check(name: str, value: Any) -> str | None:
        if math.isfinite(value) and low <= value and (value <= high if include_high else value < high):
            return None
        return f"{name} must be in [{low}, {high}{']' if include_high else ')'}, got {value}{note}"

    return check


def one_of(choices: Iterable[Any], *, or_null: bool = False, note: str = "") -> Check:
    choices = tuple(choices)

    def check(name: str, value: Any) -> str | None:
        if value in choices or (value is None and or_null):
            return None
        listed = ", ".join(str(choice) for choice in choices)
        return f"{name} {value!r} is not one of {listed}{' (or null)' if or_null else ''}{note}"

    return check


def required(why: str) -> Check:
    """A value that is not empty (a path, an id, a list)."""

    def check(name: str, value: Any) -> str | None:
        return None if value else f"{name} is required: {why}"

    return check


def declared_checks(cls) -> dict[str, list[Check]]:
    """field name -> its checks, from every dataclass in `cls`'s bases that declares the field (base first)."""
    checks: dict[str, list[Check]] = {}
    for klass in reversed(cls.__mro__):
        for name, field in vars(klass).get("__dataclass_fields__", {}).items():
            check = field.metadata.get("check")
            if check is not None and check not in checks.setdefault(name, []):
                checks[name].append(check)
    return checks


def config_problems(config) -> list[str]:
    """Every problem with a config's values (no file system or network access beyond what a group's rules read):
    each field's declared checks, then each class's own `cross_field_problems`, bases first."""
    problems = []
    for name, checks in declared_checks(type(config)).items():
        if name not in {field.name for field in dataclasses.fields(config)}:
            continue
        for check in checks:
            problem = check(name, getattr(config, name))
            if problem:
                problems.append(problem)
    for klass in reversed(type(config).__mro__):
        rules = vars(klass).get("cross_field_problems")
        if rules is not None:
            problems.extend(rules(config))
    return problems
