"""`fsdp-recipes ls` and `cp`, and every shipped config checked the way its opening comment says it runs.

In-process: discovery from folders, the checks of each shipped config (launch command, Accelerate config through the
linter with the command's flags, the model's wrap classes, the memory estimate against the GPU memory it names), the
model shapes the estimator ships (fsdp_recipes/tools/estimator/model_shapes), the chat templates configs set, every `cp`
mode and refusal, and what the wheel bundles. One launch: after a pip install of the wheel, outside any clone, `ls`
lists, `cp` copies, and the copied recipe, edited, runs the copied demo config from its folder."""

from __future__ import annotations

import ast
import dataclasses
import filecmp
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.tools import cli
from fsdp_recipes.tools.catalog import Catalog, model_info
from fsdp_recipes.tools.estimator import MODEL_SHAPES
from fsdp_recipes.tools.listing import listing
from helpers.launch import launch, require_success, run_process_group
from helpers.paths import REPO
from helpers.recipes import read_metrics

CATALOG = Catalog(REPO)
SHIPPED = CATALOG.configs()
SFT_CONFIGS = REPO / "recipes" / "configs" / "sft"

# Sizes the model cards (or the Hub's safetensors metadata) give, in billions: the shapes in MODEL_SHAPES
# were written by hand from the published hyperparameters, and a wrong number of layers or width shows here.
PUBLISHED_BILLIONS = {
    "meta-llama/Llama-3.2-1B": 1.24,
    "meta-llama/Llama-3.2-3B": 3.21,
    "meta-llama/Llama-3.1-8B": 8.03,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "meta-llama/Llama-3.1-70B": 70.6,
    "Qwen/Qwen2.5-0.5B": 0.49,
    "Qwen/Qwen2.5-1.5B": 1.54,
    "Qwen/Qwen2.5-1.5B-Instruct": 1.54,
    "Qwen/Qwen2.5-3B": 3.09,
    "Qwen/Qwen2.5-7B": 7.61,
    "Qwen/Qwen2.5-14B": 14.7,
    "Qwen/Qwen2.5-32B": 32.5,
    "Qwen/Qwen2.5-72B": 72.7,
    "Qwen/Qwen3-0.6B-Base": 0.6,
    "Qwen/Qwen3-1.7B-Base": 1.7,
    "Qwen/Qwen3-4B-Base": 4.0,
    "Qwen/Qwen3-8B-Base": 8.2,
    "Qwen/Qwen3-14B-Base": 14.8,
    "Qwen/Qwen3-32B": 32.8,
    "Qwen/Qwen3-30B-A3B": 30.5,  # 3.3B active (the model card)
    "Qwen/Qwen3-235B-A22B": 235.0,  # 22B active
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29,  # 0.68B of it the vision tower with its merger
    "Qwen/Qwen3-VL-8B-Instruct": 8.77,  # 0.58B of it the vision tower with its mergers
    "openai/gpt-oss-20b": 21.0,  # 3.6B active besides the embedding table
    "mistralai/Mistral-7B-v0.3": 7.25,
    "google/gemma-2-2b": 2.61,
    "google/gemma-2-9b": 9.24,
    "google/gemma-2-27b": 27.2,
    "google/gemma-3-1b-pt": 1.0,
    "google/gemma-3-4b-pt": 4.3,
    "google/gemma-3-12b-pt": 12.2,
    "google/gemma-3-27b-pt": 27.4,
    "microsoft/Phi-3-mini-4k-instruct": 3.82,
    "microsoft/Phi-3-medium-4k-instruct": 14.0,
    "microsoft/phi-4": 14.7,
    "microsoft/Phi-4-mini-instruct": 3.84,
    "TinyLlama/TinyLlama_v1.1": 1.10,
}


def trained_by_another_config(config) -> bool:
    """A model under outputs/ is what another recipe's run writes there (eval configs evaluate it)."""
    return str(config.values.get("model_name_or_path") or "").startswith("outputs/")


# --- ls -----------------------------------------------------------------------------------------------------------
def test_ls_lists_every_recipe_and_config_present_with_its_estimate(capsys):
    assert cli.main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    recipes = sorted(path.stem for path in (REPO / "recipes").glob("*.py"))
    configs = sorted(f"{p.parent.name}/{p.stem}" for p in (REPO / "recipes" / "configs").glob("*/*.yaml"))
    assert "sft" in recipes and len(configs) >= 29
    for recipe in recipes:
        assert any(line.startswith(f"{recipe}  recipes/{recipe}.py: ") for line in lines), recipe
    rows = {
        line.split()[0]: line
        for line in lines
        if line.startswith("  ") and "/" in line.split()[0] and not line.split()[0].endswith(":")
    }
    assert sorted(rows) == configs
    assert "8 x 80GB" in rows["sft/llama-3.1-8b_ultrachat"] and "fits" in rows["sft/llama-3.1-8b_ultrachat"]
    one_gpu = rows["sft/qwen2.5-0.5b_ultrachat_24gb"]
    assert "1 x 24GB" in one_gpu and "single_gpu.yaml" in one_gpu
    assert "host RAM" in rows["sft/qwen2.5-32b_ultrachat"]  # CPU offload: the state is on the host
    assert "2 CPU" in rows["sft/demo_reverse"]
    assert "--fsdp_transformer_layer_cls_to_wrap" in rows["sft/gemma-3-27b_ultrachat"]


def write_root(root: Path, configs: dict[str, str], recipes: dict[str, str]) -> Catalog:
    """A catalog folder of its own: the repository's Accelerate configs, the given recipes/configs (model shapes are
    the estimator's own)."""
    shutil.copytree(REPO / "accelerate_configs", root / "accelerate_configs")
    for name, text in recipes.items():
        (root / "recipes").mkdir(exist_ok=True)
        (root / "recipes" / f"{name}.py").write_text(text)
    for key, text in configs.items():
        path = root / "recipes" / "configs" / f"{key}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Catalog(root)


def config_text(
    key: str,
    model: str,
    accelerate_config: str = "fsdp_8gpu.yaml",
    *,
    flags: str = "",
    header: str = "",
    script: str | None = None,
    **values,
) -> str:
    recipe = key.split("/")[0]
    command = (
        f"#   accelerate launch --config_file accelerate_configs/{accelerate_config} {flags} "
        f"{script or f'recipes/{recipe}.py'} --config recipes/configs/{key}.yaml\n"
    )
    body = {
        "model_name_or_path": model,
        "dataset_name": "some/data",
        "max_length": 2048,
        "per_device_train_batch_size": 1,
        **values,
    }
    return f"# A test config.\n{command}{header}\n{yaml.safe_dump(body)}"


def test_recipes_and_configs_are_found_in_their_folders(tmp_path):
    catalog = write_root(
        tmp_path,
        recipes={
            "alpha": '"""Alpha: trains nothing.\n\nDetails."""\n',
            "beta": "print('no docstring')\n",
            "_shared": '"""Not a recipe: a leading underscore."""\n',
        },
        configs={"alpha/one": config_text("alpha/one", "meta-llama/Llama-3.2-1B")},
    )
    assert [(r.name, r.summary) for r in catalog.recipes()] == [
        ("alpha", "Alpha: trains nothing."),
        ("beta", "(no docstring)"),
    ]
    assert [c.key for c in catalog.configs()] == ["alpha/one"]
    (tmp_path / "recipes" / "configs" / "beta").mkdir()
    (tmp_path / "recipes" / "configs" / "beta" / "two.yaml").write_text(config_text("beta/two", "Qwen/Qwen2.5-7B"))
    text = "\n".join(listing(catalog))
    assert "alpha  recipes/alpha.py: Alpha: trains nothing." in text and "beta  recipes/beta.py: (no docstring)" in text
    assert "alpha/one" in text and "beta/two" in text and "_shared" not in text
    assert "\n".join(listing(catalog, "two")).count("recipes/") == 1  # the filter keeps beta only


def test_problems_name_what_would_go_wrong(tmp_path):
    """The checks the shipped configs pass, shown failing: each bad config gets its own reason, the good one none."""
    catalog = write_root(
        tmp_path,
        recipes={"sft": '"""SFT."""\n'},
        configs={
            "sft/good": config_text("sft/good", "meta-llama/Llama-3.1-8B"),
            "sft/too_big": config_text("sft/too_big", "meta-llama/Llama-3.1-70B"),
            "sft/small_gpu": config_text("sft/small_gpu", "meta-llama/Llama-3.1-8B", header="# GPU memory: 24GB\n"),
            "sft/wrap": config_text(
                "sft/wrap", "meta-llama/Llama-3.1-8B", flags="--fsdp_transformer_layer_cls_to_wrap GPT2Block"
            ),
            "sft/gemma3": config_text("sft/gemma3", "google/gemma-3-4b-pt"),
            "sft/unknown_model": config_text("sft/unknown_model", "someone/unknown"),
            "sft/other_script": config_text("sft/other_script", "meta-llama/Llama-3.1-8B", script="recipes/dpo.py"),
            "sft/missing_accelerate": config_text("sft/missing_accelerate", "meta-llama/Llama-3.1-8B", "nope.yaml"),
            "sft/no_command": "# No command here.\n\nmodel_name_or_path: x\n",
            "orphan/lost": config_text("orphan/lost", "meta-llama/Llama-3.1-8B"),
        },
    )
    problems = {config.key: "\n".join(catalog.problems(config)) for config in catalog.configs()}
    assert problems.pop("sft/good") == ""
    assert "over the 67.1 GiB usable of 80GB" in problems.pop("sft/too_big")
    assert "GiB usable of 24GB" in problems.pop("sft/small_gpu")
    assert "GPT2Block not in this llama model; set it to LlamaDecoderLayer" in problems.pop("sft/wrap")
    # its _no_split_modules name SigLIP classes it lacks: the recipes wrap those it has and its vision blocks
    assert problems.pop("sft/gemma3") == ""
    assert "no local config.json for model 'someone/unknown'" in problems.pop("sft/unknown_model")
    assert "runs recipes/dpo.py, not recipes/sft.py" in problems.pop("sft/other_script")
    assert "names accelerate_configs/nope.yaml, which does not exist" in problems.pop("sft/missing_accelerate")
    assert "no `accelerate launch ...` command" in problems.pop("sft/no_command")
    assert "recipes/orphan.py does not exist" in problems.pop("orphan/lost")
    assert problems == {}
    assert "orphan  recipes/orphan.py: (missing: these configs have no recipe)" in listing(catalog, "orphan")


# --- the shipped configs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", SHIPPED, ids=[config.key for config in SHIPPED])
def test_every_shipped_config_fits_and_passes_its_checks(config):
    if trained_by_another_config(config):  # its shapes are those of the config that writes it, checked there
        writers = [
            other.key for other in SHIPPED if other.values.get("output_dir") == config.values["model_name_or_path"]
        ]
        assert writers, f"{config.key}: no shipped config writes {config.values['model_name_or_path']}"
        return
    assert CATALOG.model_file(config) is not None, (
        f"add {MODEL_SHAPES}/{config.model}/config.json (the model's published shapes) for {config.key}"
    )
    assert CATALOG.problems(config) == []
    assert CATALOG.estimate(config).fits


def test_the_gpu_memory_line_sets_what_a_config_must_fit():
    by_key = {config.key: config for config in SHIPPED}
    assert CATALOG.estimate(by_key["sft/qwen2.5-0.5b_ultrachat_24gb"]).gpu_memory == 24 * 10**9
    assert CATALOG.estimate(by_key["sft/qwen2.5-7b_ultrachat"]).gpu_memory == 80 * 10**9


def test_every_hub_model_a_config_names_has_its_shapes_here():
    """The mapping is the folder name: MODEL_SHAPES/<hub id>/config.json."""
    named = {
        config.values["model_name_or_path"]
        for config in SHIPPED
        if config.values.get("model_name_or_path") and not trained_by_another_config(config)
    }
    kept = {str(path.parent.relative_to(MODEL_SHAPES)) for path in MODEL_SHAPES.glob("*/*/config.json")}
    assert named <= kept
    assert kept == set(PUBLISHED_BILLIONS)


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED_BILLIONS))
def test_model_shapes_add_up_to_the_published_size(hub_id):
    info = model_info(MODEL_SHAPES / hub_id / "config.json")
    assert info.num_params / 1e9 == pytest.approx(PUBLISHED_BILLIONS[hub_id], rel=0.02)


def test_no_shipped_config_replaces_a_models_template_without_saying_why():
    """The model keeps its own chat template (the recipe finds the replies in any template's rendering): a config that
    sets another one on purpose says why in the comment right above it."""
    for config in SHIPPED:
        lines = config.path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.startswith(("chat_template:", "chat_template_path:")):
                assert number > 0 and lines[number - 1].startswith("#"), f"{config.path}:{number + 1}"


def files_under(folder: Path) -> set[str]:
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}


def test_cp_leaves_out_what_runs_wrote_under_outputs(tmp_path):
    """After `make demo` the DPO demo's model exists under outputs/ (checkpoints and all), and a run may have written
    a config's output_dir: neither is an input `cp` copies; the data a config names still is."""
    catalog = write_root(
        tmp_path,
        {
            "dpo/demo": config_text(
                "dpo/demo", "outputs/demo_reverse/latest", dataset_name="data/pairs", output_dir="outputs/dpo_run"
            )
        },
        {"dpo": '"""A recipe."""\n'},
    )
    for written in ("outputs/demo_reverse/latest/checkpoints/step-1/model.safetensors", "outputs/dpo_run/x.json"):
        (tmp_path / written).parent.mkdir(parents=True)
        (tmp_path / written).write_text("{}")
    (tmp_path / "data" / "pairs").mkdir(parents=True)
    (tmp_path / "data" / "pairs" / "train.jsonl").write_text("{}\n")
    planned = {path.as_posix() for path, _, _ in catalog.copy_plan(catalog.find("dpo/demo"))}
    assert "data/pairs/train.jsonl" in planned
    assert not [path for path in planned if path.startswith("outputs/")]


def test_cp_config_copies_it_with_its_recipe_and_what_it_names(tmp_path, capsys):
    dest = tmp_path / "project"
    assert cli.main(["cp", "sft/demo_reverse", str(dest)]) == 0
    out = capsys.readouterr().out
    demo = {
        path.relative_to(REPO).as_posix()
        for folder in ("reverse", "tokenizer")  # what demo_reverse.yaml names
        for path in (REPO / "demo" / "assets" / folder).rglob("*")
        if path.is_file()
    }
    assert files_under(dest) == {
        "recipes/configs/sft/demo_reverse.yaml",
        "recipes/sft.py",
        "demo/tiny_llama.json",
        "accelerate_configs/fsdp_2proc_cpu.yaml",
        *demo,
    }
    assert all(filecmp.cmp(REPO / name, dest / name, shallow=False) for name in files_under(dest))
    assert (
        f"cd {dest} && accelerate launch --config_file accelerate_configs/fsdp_2proc_cpu.yaml recipes/sft.py "
        "--config recipes/configs/sft/demo_reverse.yaml"
    ) in out


def test_cp_of_a_config_with_pictures_copies_the_pictures_its_rows_name_and_reports_them_in_one_line(tmp_path, capsys):
    dest = tmp_path / "project"
    assert cli.main(["cp", "sft/demo_shapes", str(dest)]) == 0
    out = capsys.readouterr().out
    row = json.loads((dest / "demo" / "assets" / "shapes" / "train.jsonl").read_text().splitlines()[0])
    assert (dest / "demo" / "assets" / "shapes" / row["images"][0]).is_file()  # ../shapes_images/..., beside it
    assert len(list((dest / "demo" / "assets" / "shapes_images").glob("*.png"))) == 1320
    assert "demo/assets/shapes_images/ (1320 files)" in out and out.count("shapes_images") == 1


def test_cp_recipe_copies_the_script_all_its_configs_and_what_they_name(tmp_path):
    assert cli.main(["cp", "sft", str(tmp_path)]) == 0
    configs = sorted(SFT_CONFIGS.glob("*.yaml"))
    named = {match for path in configs for match in re.findall(r"--config_file (\S+)", path.read_text())}
    copied = files_under(tmp_path)
    assert {"recipes/sft.py", "benchmarks/llama_1b.json", "demo/tiny_llama.json", *named} <= copied
    assert {f"recipes/configs/sft/{path.name}" for path in configs} <= copied
    assert not any(name.startswith(("tests/", "src/")) for name in copied)


def test_cp_never_overwrites_a_changed_file_unless_forced(tmp_path, capsys):
    dest = tmp_path / "project"
    assert cli.main(["cp", "sft/demo_reverse", str(dest)]) == 0
    config, recipe = dest / "recipes/configs/sft/demo_reverse.yaml", dest / "recipes/sft.py"
    config.write_text(config.read_text() + "max_steps: 5\n")
    recipe.write_text(recipe.read_text() + "# my edit\n")
    (dest / "demo" / "tiny_llama.json").unlink()
    capsys.readouterr()
    assert cli.main(["cp", "sft/demo_reverse", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "demo_reverse.yaml exists and differs" in err and "--force" in err
    assert config.read_text().endswith("max_steps: 5\n")
    assert not (dest / "demo" / "tiny_llama.json").exists()  # nothing at all was copied
    assert cli.main(["cp", "sft/demo_reverse", str(dest), "--force"]) == 0
    assert "recipes/sft.py  (the recipe its launch command runs; kept yours (it differs))" in capsys.readouterr().out
    assert filecmp.cmp(config, SFT_CONFIGS / "demo_reverse.yaml", shallow=False)
    assert recipe.read_text().endswith("# my edit\n")  # a file it only needs is the user's to keep
    assert (dest / "demo" / "tiny_llama.json").exists()


def test_cp_with_method_copies_the_methods_a_recipe_uses_beside_it_and_the_recipe_imports_them(tmp_path, capsys):
    """The reward recipe uses the reward method, which uses preference pairs, and the classify method's head: all
    three packages are copied, every import of fsdp_recipes.methods in them and the recipe points at the local copy,
    and importing the copied recipe loads the local modules. A second copy finds them already there."""
    import importlib.util

    assert cli.main(["cp", "reward", str(tmp_path), "--with-method"]) == 0
    local = tmp_path / "recipes" / "methods"
    assert {path.name for path in local.iterdir() if path.is_dir()} == {"reward", "preference", "classify"}
    copied = [tmp_path / "recipes" / "reward.py", *local.rglob("*.py")]
    assert not any("fsdp_recipes.methods" in path.read_text() for path in copied)
    assert "from methods.reward import reward_model" in (tmp_path / "recipes" / "reward.py").read_text()
    sys.path.insert(0, str(tmp_path / "recipes"))
    try:
        spec = importlib.util.spec_from_file_location("copied_reward", tmp_path / "recipes" / "reward.py")
        module = sys.modules["copied_reward"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        assert Path(module.reward_model.__file__) == local / "reward" / "reward_model.py"
        assert Path(sys.modules["methods.preference.paired"].__file__) == local / "preference" / "paired.py"
    finally:
        sys.path.remove(str(tmp_path / "recipes"))
        for name in [
            name for name in sys.modules if name in ("methods", "copied_reward") or name.startswith("methods.")
        ]:
            del sys.modules[name]
    capsys.readouterr()
    assert cli.main(["cp", "reward", str(tmp_path), "--with-method"]) == 0
    assert "recipes/methods/reward/reward_model.py  (the reward method, to edit here; already there)" in (
        capsys.readouterr().out
    )
    assert cli.main(["cp", "reward", str(tmp_path / "one.py"), "--with-method"]) == 2
    assert "give a folder as DEST" in capsys.readouterr().err


def test_cp_to_a_file_copies_only_that_file_and_says_what_it_names(tmp_path, capsys):
    assert cli.main(["cp", "sft/demo_reverse", str(tmp_path / "mine.yaml")]) == 0
    out = capsys.readouterr().out
    assert files_under(tmp_path) == {"mine.yaml"}
    assert f"demo/tiny_llama.json  (packaged at {REPO / 'demo/tiny_llama.json'})" in out
    assert "accelerate_configs/fsdp_2proc_cpu.yaml" in out
    assert cli.main(["cp", "sft", str(tmp_path / "my_sft.py")]) == 0
    assert filecmp.cmp(tmp_path / "my_sft.py", REPO / "recipes" / "sft.py", shallow=False)
    assert cli.main(["cp", "sft", str(tmp_path / "my_sft.yaml")]) == 2
    assert "a recipe is a .py, a config a .yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, message",
    [
        ("sfx", "no recipe or config named 'sfx'; did you mean 'sft'?"),
        ("qwen3-8b", "did you mean 'sft/qwen3-8b_ultrachat'?"),
    ],
)
def test_cp_unknown_names_are_one_error_with_a_suggestion(tmp_path, capsys, name, message):
    assert cli.main(["cp", name, str(tmp_path / "dest")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "dest").exists()


# --- packaging ----------------------------------------------------------------------------------------------------
def bundled_patterns() -> dict[str, list[str]]:
    """setup.py's BUNDLED, read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "BUNDLED")
    return ast.literal_eval(node.value)


def test_the_wheel_bundles_every_file_ls_and_cp_use():
    bundled = {
        (Path(folder) / path.relative_to(REPO / folder)).as_posix()
        for folder, patterns in bundled_patterns().items()
        for pattern in patterns
        for path in (REPO / folder).glob(pattern)
        if path.is_file()
    }
    needed = {path.as_posix() for recipe in CATALOG.recipes() for path, _, _ in CATALOG.copy_plan(recipe)}
    models = {CATALOG.model_file(config) for config in SHIPPED if not trained_by_another_config(config)}
    needed |= {path.relative_to(REPO).as_posix() for path in models if not path.is_relative_to(MODEL_SHAPES)}
    needed |= {"accelerate_configs/topologies.yaml"}
    assert needed <= bundled, sorted(needed - bundled)
    # the model shapes are package data of the estimator (pyproject.toml), not bundled copies
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    packaged = {
        path for pattern in package_data["fsdp_recipes.tools.estimator"] for path in MODEL_SHAPES.parent.glob(pattern)
    }
    assert {path for path in models if path.is_relative_to(MODEL_SHAPES)} <= packaged
    assert set(MODEL_SHAPES.glob("*/*/config.json")) <= packaged


@pytest.mark.slow
def test_after_pip_install_a_copied_and_edited_recipe_runs_outside_the_repository(tmp_path):
    """A wheel built from the repository, installed in a folder of its own, used from outside any clone: `cp
    --with-method` copies the SFT recipe with the demo config from the bundled files and the SFT method's package from
    the installed one, and the copy, its recipe and its method edited, runs from its folder with the installed package
    and the local method (under its FSDP2 config, on one process: enough to show which code runs). (`ls` reads the
    same bundled folders: tested in-process on the checkout.)"""
    source = tmp_path / "source"
    for name in ("src", "recipes", "accelerate_configs", "demo", "benchmarks"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path)], check=True)
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), *tmp_path.glob("fsdp_recipes-*.whl")], check=True
    )
    installed = {"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}  # the wheel's package, not the checkout's
    script = (
        "import sys; from fsdp_recipes.tools import catalog, cli; print('root', catalog.source_root()); "
        "sys.exit(cli.main(['cp', 'sft/demo_reverse', 'project', '--with-method']))"
    )
    result = run_process_group(
        [sys.executable, "-c", script], timeout=120, env={"PATH": "/usr/bin:/bin", **installed}, cwd=tmp_path
    )
    require_success(result)
    assert f"root {site / 'fsdp_recipes' / 'bundled'}" in result.stdout

    project = tmp_path / "project"
    recipe, method = project / "recipes" / "sft.py", project / "recipes" / "methods" / "sft" / "supervised.py"
    assert recipe.read_text() == (REPO / "recipes" / "sft.py").read_text().replace("fsdp_recipes.methods", "methods")
    method.write_text(method.read_text() + '\nprint("the edited method runs from", __file__)\n')
    recipe.write_text(
        recipe.read_text().replace(
            'if __name__ == "__main__":\n',
            'if __name__ == "__main__":\n    import fsdp_recipes\n'
            '    print("the edited copy runs with", fsdp_recipes.__file__)\n',
        )
    )
    command = CATALOG.read_config(project / "recipes/configs/sft/demo_reverse.yaml", recipe="sft").launch
    short = [
        "--max_steps",
        "4",
        "--logging_steps",
        "1",
        "--eval_steps",
        "null",
        "--save_steps",
        "null",
        "--exact_match_eval_samples",
        "0",
        "--output_dir",
        "out",
        "--report_to",
        "none",
    ]
    result = launch(
        Path(command.script),
        [*command.script_args, *short],
        num_processes=1,  # one is enough here
        accelerate_config=Path(command.accelerate_config),
        cwd=project,
        env=installed,
    )
    require_success(result)
    assert f"the edited copy runs with {site / 'fsdp_recipes' / '__init__.py'}" in result.stdout
    assert f"the edited method runs from {method}" in result.stdout
    assert [record["step"] for record in read_metrics(project / "out") if "loss" in record] == [1, 2, 3, 4]
    assert json.loads((project / "out" / "config.json").read_text())["hidden_size"] == 128  # demo/tiny_llama.json


def test_ls_counts_the_reference_model_copy_of_the_configs_that_keep_one():
    by_key = {config.key: config for config in SHIPPED}
    full = CATALOG.estimate(by_key["dpo/llama-3.1-8b_ultrafeedback"]).per_gpu()
    assert full["reference_model"] == full["parameters"] // 2  # a bf16 copy, sharded like the fp32 policy
    dpo = by_key["dpo/llama-3.1-8b_ultrafeedback"]
    for change in ({"use_peft": True}, {"precompute_ref_log_probs": True}):  # adapters off; values precomputed
        changed = dataclasses.replace(dpo, values={**dpo.values, **change})
        assert CATALOG.estimate(changed).per_gpu()["reference_model"] == 0
    assert CATALOG.estimate(by_key["sft/llama-3.1-8b_lora"]).per_gpu()["reference_model"] == 0


def test_a_config_whose_comment_first_gives_the_step_before_it_is_read_with_its_own_recipe():
    """The DPO demo's comment gives the SFT demo's command first (run it before): the config is still DPO's, for the
    command `cp` prints and for the recipe class the estimator reads it with (which counts the reference copy)."""
    from fsdp_recipes.tools.config_comments import launched_script

    config = CATALOG.find("dpo/demo_reverse")
    comment = config.path.read_text().split("\n\n")[0]
    assert comment.index("recipes/sft.py") < comment.index("recipes/dpo.py")
    assert config.launch.script == "recipes/dpo.py" and config.launch.recipe_config.endswith("dpo/demo_reverse.yaml")
    assert launched_script(config.path).name == "dpo.py"


@pytest.mark.parametrize(
    "hub_id, active, counts_embedding",
    [("Qwen/Qwen3-30B-A3B", 3.3, True), ("Qwen/Qwen3-235B-A22B", 22.0, True), ("openai/gpt-oss-20b", 3.6, False)],
)
def test_mixture_of_experts_shapes_give_the_published_active_size(hub_id, active, counts_embedding):
    """Qwen's active counts include the input embedding; OpenAI's leave it out (a lookup, not a matmul)."""
    info = model_info(MODEL_SHAPES / hub_id / "config.json")
    embedding = info.vocab_size * info.hidden_size
    assert (info.active_params - (0 if counts_embedding else embedding)) / 1e9 == pytest.approx(active, rel=0.02)
    width = getattr(info.config, "moe_intermediate_size", None) or info.config.intermediate_size
    assert info.mlp_width_per_token == info.routing.experts_per_token * width
