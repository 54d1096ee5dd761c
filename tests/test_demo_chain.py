"""The demos chain as documented: `make demo` (the SFT demo, into a dated folder, then `latest` pointed at it), then
the preference demos (DPO, LoRA DPO, SimPO, KTO) and the eval demo as their configs' opening comments launch them,
each finding the previous one's output.

In this process, in a temporary working directory that links the repo's recipes/, demo/ and accelerate_configs/ (the
demo configs name paths relative to the repo root), so nothing is written to the repo's own outputs/. The SFT
command and the linking are read from `make -n demo`, the others from the configs' comments, and run as typed plus a
few overrides that make each a couple of steps (`STEPS`): one process, no launcher, as the other in-process tests."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.paths import REPO
from helpers.recipes import run_recipe_main

LAUNCH_CONFIG = "accelerate_configs/fsdp_2proc_cpu.yaml"
STEPS = {  # what makes each run cost seconds; everything else is as typed
    "sft": ["--max_steps", "2", "--eval_steps", "2", "--exact_match_eval_samples", "4", "--report_to", "none"],
    "dpo": ["--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--report_to", "none"],
    "kto": ["--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--report_to", "none"],
    "eval": ["--max_eval_samples", "4", "--report_to", "none"],
}


def make_demo_commands() -> list[list[str]]:
    """The demo target's commands as `make -n demo` prints them (without the venv's, which may come first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    printed = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout
    commands = [shlex.split(line) for line in printed.replace("\\\n", " ").splitlines() if line.strip()]
    return [c for c in commands if any(w.startswith("recipes/") or w.startswith("demo/") for w in c)]


def documented_launches(config: str) -> list[list[str]]:
    """The `accelerate launch` commands in a config's opening comment, each as its words."""
    comment = (REPO / config).read_text().split("\n\n")[0]
    text = "\n".join(line.removeprefix("#").strip() for line in comment.splitlines()).replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("accelerate launch")]


def config_value(config: str, key: str):
    return yaml.safe_load((REPO / config).read_text())[key]


def recipe_argv(words: list[str]) -> tuple[str, list[str]]:
    """(recipe, its arguments) of an `accelerate launch --config_file C recipes/<recipe>.py ...` command."""
    script = next(i for i, word in enumerate(words) if word.startswith("recipes/") and word.endswith(".py"))
    assert words[script - 2 : script] == ["--config_file", LAUNCH_CONFIG], words
    return Path(words[script]).stem, words[script + 1 :]


def run_documented(words: list[str]) -> None:
    recipe, argv = recipe_argv(words)
    run_recipe_main(recipe, argv + STEPS[recipe])


def run_python(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A Makefile line `.venv/bin/python demo/<script>.py ...`, run with this interpreter (the script needs only the
    standard library)."""
    assert words[0].endswith("/python") and words[1].startswith("demo/"), words
    return subprocess.run([sys.executable, *words[1:]], cwd=cwd, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="reads the demo's commands from `make -n demo`")
def test_make_demo_then_the_dpo_and_eval_demos_as_documented(tmp_path, monkeypatch):
    for folder in ("recipes", "demo", "accelerate_configs"):
        (tmp_path / folder).symlink_to(REPO / folder)
    monkeypatch.chdir(tmp_path)
    repo_outputs = sorted(os.listdir(REPO / "outputs")) if (REPO / "outputs").exists() else None

    # make demo: check, train into the dated folder, point latest at it
    check, launch, link = make_demo_commands()
    assert check[1:3] == ["demo/link_latest.py", "--check"] and launch[0] == "CUDA_VISIBLE_DEVICES="
    recipe, argv = recipe_argv(launch)
    assert (recipe, argv[:2]) == ("sft", ["--config", "recipes/configs/sft/demo_reverse.yaml"])
    run = Path(argv[argv.index("--output_dir") + 1])
    assert run.parent == Path("outputs/demo_reverse") and link[1:] == ["demo/link_latest.py", str(run)]
    assert run_python(check, tmp_path).returncode == 0
    run_recipe_main("sft", argv + STEPS["sft"])
    linked = run_python(link, tmp_path)
    assert linked.returncode == 0, linked.stderr
    latest = tmp_path / "outputs" / "demo_reverse" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == run.name  # relative: the outputs folder may move
    assert (latest / "config.json").is_file()

    # the preference demos read latest: as their comments launch them, after `make demo` or the SFT command they show
    # (which writes to latest itself)
    sft_output_dir = config_value("recipes/configs/sft/demo_reverse.yaml", "output_dir")
    for config, output_dir in [
        ("recipes/configs/dpo/demo_reverse.yaml", "outputs/demo_reverse_dpo/latest"),
        ("recipes/configs/dpo/demo_reverse_lora.yaml", "outputs/demo_reverse_dpo_lora/latest"),
        ("recipes/configs/dpo/demo_reverse_simpo.yaml", "outputs/demo_reverse_simpo/latest"),
        ("recipes/configs/kto/demo_reverse.yaml", "outputs/demo_reverse_kto/latest"),
    ]:
        launches = documented_launches(config)
        recipe = config.split("/")[2]
        assert [recipe_argv(words)[0] for words in launches] == ["sft", recipe]  # "run the SFT demo first", then this
        assert recipe_argv(launches[0])[1] == ["--config", "recipes/configs/sft/demo_reverse.yaml"]
        assert sft_output_dir == config_value(config, "model_name_or_path") == "outputs/demo_reverse/latest"
        run_documented(launches[1])
        assert (tmp_path / output_dir / "run_summary.json").is_file()
    assert (tmp_path / "outputs/demo_reverse_dpo/latest/config.json").is_file()
    adapter = json.loads((tmp_path / "outputs/demo_reverse_dpo_lora/latest/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "outputs/demo_reverse/latest"

    # the eval demo, on the SFT model (latest) and on the DPO demo's, as its comment says
    launches = documented_launches("recipes/configs/eval/demo_reverse.yaml")
    assert len(launches) == 2
    for words, model in zip(launches, [run, Path("outputs/demo_reverse_dpo/latest")]):
        (tmp_path / model / "eval_results.json").unlink(missing_ok=True)  # the training runs' own held-out figures
        run_documented(words)
        results = json.loads((tmp_path / model / "eval_results.json").read_text())
        assert {"eval_perplexity", "eval_exact_match", "eval_chrf"} <= set(results), results

    assert (sorted(os.listdir(REPO / "outputs")) if (REPO / "outputs").exists() else None) == repo_outputs
    # a second `make demo` replaces the link; a `latest` that is a real folder is refused before anything is trained
    (tmp_path / "outputs/demo_reverse/second").mkdir()
    (tmp_path / "outputs/demo_reverse/second/config.json").write_text("{}")
    assert run_python([link[0], link[1], "outputs/demo_reverse/second"], tmp_path).returncode == 0
    assert os.readlink(latest) == "second"
    latest.unlink()
    latest.mkdir()
    refused = run_python(check, tmp_path)
    assert refused.returncode == 2 and "outputs/demo_reverse/latest is a folder, not the link" in refused.stderr
