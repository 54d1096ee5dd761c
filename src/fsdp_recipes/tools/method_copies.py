"""`fsdp-recipes cp RECIPE DEST --with-method`: the method packages a recipe uses (`fsdp_recipes/methods/<method>/`,
and those they use in turn) copied beside it as a local package, `recipes/methods/`, with the recipe's and the
packages' imports pointed there. Changing a method (GRPO's advantages, a DPO loss type) is then an edit in one folder
next to the recipe; everything generic still comes from the installed fsdp_recipes. A script's own folder comes first
on Python's path, so `accelerate launch ... recipes/<recipe>.py` imports the local copy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fsdp_recipes.methods

PACKAGE = Path(fsdp_recipes.methods.__file__).resolve().parent
LOCAL_PACKAGE = "methods"  # the copy's name, beside the recipe: `from methods.grpo import rollouts`
_IMPORTED_NAME = re.compile(r"\bfsdp_recipes\.methods\b")


def methods_imported(source: str) -> set[str]:
    """The method packages a Python source imports (`fsdp_recipes.methods.<method>...`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_recipes.methods"):
            parts = node.module.split(".")
            found |= {alias.name for alias in node.names} if len(parts) == 2 else {parts[2]}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("fsdp_recipes.methods.")}
    return found


def methods_needed(recipe_source: str) -> list[str]:
    """The recipe's methods and, transitively, those their modules import."""
    needed, pending = set(), sorted(methods_imported(recipe_source))
    while pending:
        method = pending.pop()
        if method in needed:
            continue
        needed.add(method)
        for module in (PACKAGE / method).glob("*.py"):
            pending += sorted(methods_imported(module.read_text()) - needed)
    return sorted(needed)


def localised(source: str) -> str:
    """`source` with its imports of fsdp_recipes.methods pointed at the local copy."""
    return _IMPORTED_NAME.sub(LOCAL_PACKAGE, source)


def copy_plan(recipe_source: str, recipe_folder: Path) -> list[tuple[Path, Path, str]]:
    """(packaged file, its place relative to the destination, why) for every file of the local package."""
    local = recipe_folder / LOCAL_PACKAGE
    plan = [(PACKAGE / "__init__.py", local / "__init__.py", "the local methods package")]
    for method in methods_needed(recipe_source):
        plan += [
            (path, local / method / path.name, f"the {method} method, to edit here")
            for path in sorted((PACKAGE / method).glob("*.py"))
        ]
    return plan
