"""The package's layers (docs/architecture.md): a module imports only its own layer and those below, no import cycle,
no module past the size a reader takes in. Imports inside functions count: they hide a dependency, they do not
remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fsdp_recipes"
LAYERS = ["common", "distributed", "data", "models", "train", "methods", "publish", "run", "tools"]
# A method's package (methods/<method>/) may use another method only where declared here: reward models train on
# preference pairs (methods/preference/paired.py). Everything else a method needs is in the generic layers below it.
METHOD_DEPENDENCIES = {"reward": {"preference"}}
# The one import upwards: a run prints the estimator's prediction beside the bytes its ranks measure.
ALLOWED_UPWARDS = {("fsdp_recipes.run.components", "fsdp_recipes.tools.estimator")}
MAX_LINES = 450


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: Path, known: set[str]) -> set[str]:
    """The package's modules `path` imports, anywhere in the file."""
    here = module_name(path, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != package.name:
                found.add(name)
                break
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    files = {module_name(path, package): path for path in package.rglob("*.py") if "metric_scripts" not in path.parts}
    return {name: imported_modules(path, package, set(files)) - {name} for name, path in files.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return LAYERS.index(top)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imports in sorted(graph.items()):
        if module.count(".") == 0:  # the package's own __init__
            continue
        for imported in sorted(imports):
            allowed = any(module == low and imported.startswith(high) for low, high in ALLOWED_UPWARDS)
            if layer_of(imported) > layer_of(module) and not allowed:
                problems.append(
                    f"{module} (layer {LAYERS[layer_of(module)]}) imports {imported} "
                    f"(layer {LAYERS[layer_of(imported)]}, above it)"
                )
    return problems


def undeclared_method_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imports in sorted(graph.items()):
        if not module.startswith("fsdp_recipes.methods."):
            continue
        method = module.split(".")[2]
        for imported in sorted(imports):
            if imported.startswith("fsdp_recipes.methods."):
                other = imported.split(".")[2]
                if other != method and other not in METHOD_DEPENDENCIES.get(method, set()):
                    problems.append(f"{module} (method {method}) imports {imported} (method {other}), undeclared")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once (Tarjan's strongly connected components of more than one module)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


GRAPH = import_graph(PACKAGE)


def test_every_module_belongs_to_a_layer():
    assert all(layer_of(module) >= 0 for module in GRAPH if "." in module)


def test_no_module_imports_a_layer_above_its_own():
    assert layering_violations(GRAPH) == []


def test_a_method_uses_another_only_where_declared():
    assert undeclared_method_imports(GRAPH) == []


def test_methods_live_in_packages_of_their_own_and_the_generic_layers_know_none():
    """`train/` and `data/` know no method (the layer order forbids the import; this names what each package holds),
    and every module under methods/ is in a method's package."""
    methods = {module.split(".")[2] for module in GRAPH if module.startswith("fsdp_recipes.methods.")}
    assert methods == {"sft", "preference", "reward", "classify", "distill", "grpo"}
    assert [path.name for path in (PACKAGE / "methods").glob("*.py")] == ["__init__.py"]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_readable_in_one_sitting(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{lines} lines: one concern per module, split it by what it does"


def test_the_checks_catch_a_back_import_and_a_cycle(tmp_path):
    package = tmp_path / "fsdp_recipes"
    for folder in ("common", "train"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "common" / "errors.py").write_text("def f():\n    from fsdp_recipes.train import loop\n")
    (package / "train" / "loop.py").write_text("from fsdp_recipes.train.other import x\n")
    (package / "train" / "other.py").write_text("from .loop import y\nfrom fsdp_recipes.common.errors import f\n")
    graph = import_graph(package)
    assert layering_violations(graph) == [
        "fsdp_recipes.common.errors (layer common) imports fsdp_recipes.train.loop (layer train, above it)"
    ]
    assert cycles(graph) == [["fsdp_recipes.common.errors", "fsdp_recipes.train.loop", "fsdp_recipes.train.other"]]


def test_the_check_catches_an_undeclared_import_between_methods(tmp_path):
    package = tmp_path / "fsdp_recipes"
    for folder in ("methods", "methods/grpo", "methods/sft", "methods/reward", "methods/preference"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "methods" / "sft" / "data.py").write_text("")
    (package / "methods" / "preference" / "paired.py").write_text("")
    (package / "methods" / "grpo" / "rollouts.py").write_text("from fsdp_recipes.methods.sft import data\n")
    (package / "methods" / "reward" / "model.py").write_text("from fsdp_recipes.methods.preference import paired\n")
    assert undeclared_method_imports(import_graph(package)) == [
        "fsdp_recipes.methods.grpo.rollouts (method grpo) imports fsdp_recipes.methods.sft.data (method sft), undeclared"
    ]
