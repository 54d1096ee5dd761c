"""`fsdp-recipes rehearse`: a user's own launch line run on CPU in minutes, before it spends GPU hours.

The real sizes are checked first, as the real run would check them (the Accelerate config's linter with the real
model, the TP/EP split of the real model, the memory estimate); then the job runs for real, on stand-ins made from
its own model config, tokenizer and data (`stand_ins`), under its own Accelerate config scaled to a few processes
(`layout`): `--steps` steps with a checkpoint halfway, its export read back by the recipe itself, then a resume from
the checkpoint whose last step must reproduce the uninterrupted run's loss. The recipe is the user's script, so what
it refuses it refuses here with the same `error:` line. A thin driver: no second training path."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.yaml_json import load_yaml_mapping
from fsdp_recipes.tools.estimator.recipe import config_class
from fsdp_recipes.tools.rehearsal import launch_line, layout, stand_ins
from fsdp_recipes.train.config import TrainingConfig

_MARKER = ".fsdp-recipes-rehearsal"
_MODEL_FIELDS = ("model_name_or_path", "teacher_model_name_or_path")
# the split fields a training recipe and eval.py read, with their defaults
_SPLITS = {"dataset_train_split": "train", "dataset_test_split": "test"}
_EVAL_SPLITS = {"dataset_split": "test"}


def cpu_overrides(values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(recipe flags, notes) for what a CPU cannot run as the GPU run would: each changed, and why."""
    flags, notes = [], []
    attention = str(values.get("attn_implementation") or "")
    if attention.startswith("flash") or attention.startswith("kernels"):
        flags += ["--attn_implementation", "sdpa"]
        notes.append(f"attn_implementation {attention} -> sdpa (flash kernels need CUDA; the masks are the same)")
    if values.get("use_liger_kernel"):
        flags += ["--use_liger_kernel", "false"]
        notes.append("use_liger_kernel -> false (liger's Triton kernels need CUDA; the same operations run unfused)")
    if values.get("loss_implementation") == "liger":
        flags += ["--loss_implementation", "chunked"]
        notes.append("loss_implementation liger -> chunked (Triton needs CUDA)")
    for quantized in ("load_in_4bit", "load_in_8bit"):
        if values.get(quantized):
            flags += [f"--{quantized}", "false"]
            notes.append(f"{quantized} -> false (bitsandbytes' quantized layers need CUDA under FSDP here)")
    if str(values.get("torch_compile", "false")).lower() == "true":
        flags += ["--torch_compile_backend", "eager"]
        notes.append("torch_compile: the eager backend (it traces and checks recompiles; no kernels generated)")
    for length in ("max_completion_length", "max_new_tokens"):  # a random model writes to the limit, each token slow
        if int(values.get(length) or 0) > 32:
            flags += [f"--{length}", "32"]
            notes.append(f"{length} {values[length]} -> 32 (the stand-in's random weights generate to the limit)")
    if int(values.get("gradient_accumulation_steps") or 1) > 2:
        flags += ["--gradient_accumulation_steps", "2"]
        notes.append(f"gradient_accumulation_steps {values['gradient_accumulation_steps']} -> 2 (a smaller batch)")
    return flags, notes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(recipe: Path, config_file: Path | None, args: list[str], log: Path) -> tuple[int, str]:
    if config_file is None:
        command = [sys.executable, str(recipe), *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
        command += ["--main_process_port", str(_free_port()), str(recipe), *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("error:") or "] error:" in line]
    return code, (errors[0] if errors else "\n".join(text.splitlines()[-15:]))


def _last_loss(output_dir: Path) -> tuple[int, float] | None:
    try:
        records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return None
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]
    return max(steps) if steps else None


def real_size_checks(real_config, mesh: layout.Mesh, *, recipe: str, attn_implementation: str | None) -> list[str]:
    """What the real run would refuse before loading for the real model under the real mesh (its TP/EP/SP split)."""
    from fsdp_recipes.distributed import sequence_parallel, tensor_parallel
    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.models.experts import expert_routing
    from fsdp_recipes.models.modeling import model_class_for

    problems = []
    if mesh.tp > 1 or mesh.ep > 1:
        real = ParallelDims(dp_replicate=mesh.dp_replicate, dp_shard=mesh.dp_shard, tp=mesh.tp, ep=mesh.ep)
        routing = expert_routing(real_config)
        problems += tensor_parallel.model_problems(
            real, real_config, model_class_for(real_config, "causal-lm"), routing and routing.num_experts
        )
    problems += sequence_parallel.model_problems(
        mesh.sp, real_config, attn_implementation=attn_implementation, recipe=recipe
    )
    return problems


def real_size_estimate(
    launch: launch_line.Launch, values: dict[str, Any], locals_: dict[str, str], work_dir: Path, trust: bool
) -> str:
    """The memory estimator's verdict for the real model, layout and batch (`fsdp-recipes estimate`), one line; what
    kept it from estimating, when something did. It reads the recipe config as the launch line gives it (its
    overrides applied, Hub ids given --local folders resolved), with the recipe's own config class."""
    import argparse
    import contextlib
    import io

    from fsdp_recipes.common.errors import UserError
    from fsdp_recipes.tools.catalog import gpu_memory_line
    from fsdp_recipes.tools.config_comments import opening_comment
    from fsdp_recipes.tools.estimator.arguments import DEFAULT_GPU_MEMORY, DEFAULT_RESERVE
    from fsdp_recipes.tools.estimator.command import run_estimate

    if launch.accelerate_config is None:
        return "not estimated: no Accelerate config in the launch line"
    config = next((launch.recipe_args[i + 1] for i, a in enumerate(launch.recipe_args[:-1]) if a == "--config"), None)
    gpu_memory = DEFAULT_GPU_MEMORY
    if config and Path(config).is_file():  # the config's own `# GPU memory:` line, as `fsdp-recipes ls` reads it
        gpu_memory = gpu_memory_line(opening_comment(Path(config).read_text()))
    resolved = {
        key: stand_ins.resolve(value, locals_) if isinstance(value, str) else value for key, value in values.items()
    }
    real_config = work_dir / "recipe_config_as_launched.yaml"
    launched = f"accelerate launch --config_file {launch.accelerate_config} {launch.recipe} --config {real_config}"
    real_config.write_text(f"# {launched}\n" + yaml.safe_dump(resolved, sort_keys=False))
    args = argparse.Namespace(
        model=None, accelerate_config=str(launch.accelerate_config), recipe_config=str(real_config),
        max_length=None, batch_size=None, num_processes=launch.num_processes, gpu_memory=gpu_memory,
        reserve=DEFAULT_RESERVE,
        trust_remote_code=trust, json=True,
    )  # fmt: skip
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            run_estimate(args)
        figures = json.loads(printed.getvalue())
    except (UserError, ValueError, OSError) as error:
        return f"not estimated: {error}"
    per_gpu = figures["per_gpu_bytes"]["total"]
    usable = figures["usable_bytes"] / 2**30
    verdict = "fits" if figures["fits"] else "does NOT fit"
    return (
        f"{verdict}: {figures['parameters_total'] / 1e9:.1f}B parameters, {per_gpu / 2**30:.1f} GiB per GPU of "
        f"{usable:.1f} GiB usable on {gpu_memory} GPUs (`fsdp-recipes estimate --gpu-memory` for others)"
    )


def rehearse(
    words: list[str], *, processes: int | None, steps: int, rows: int, work_dir: Path, locals_: dict[str, str]
) -> int:
    started = time.monotonic()
    launch = launch_line.parse_launch(words)
    values = launch_line.recipe_values(launch)
    mapping = load_yaml_mapping(str(launch.accelerate_config)) if launch.accelerate_config else {}
    if launch.mixed_precision:
        mapping["mixed_precision"] = launch.mixed_precision
    if launch.num_processes and mapping:
        mapping["num_processes"] = launch.num_processes
    if launch.fsdp_options and mapping:  # the launch line's --fsdp_* flags (a shipped config's wrap classes)
        mapping["fsdp_config"] = {**(mapping.get("fsdp_config") or {}), **launch.fsdp_options}
    scaled, real_mesh, mesh, notes = layout.scaled_config(mapping, processes) if mapping else ({}, None, None, [])
    notes = launch.launcher_notes + notes
    if work_dir.exists() and any(work_dir.iterdir()):
        if not (work_dir / _MARKER).is_file():  # never delete a folder a rehearsal did not make
            raise ConfigError(
                f"--work-dir {work_dir} exists and holds files that are not a rehearsal's: choose another folder"
            )
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / _MARKER).write_text("made by fsdp-recipes rehearse: replaced by the next rehearsal into this folder\n")
    if launch.fsdp_options and mapping:  # the real sizes are checked and estimated with them too
        as_launched = work_dir / "accelerate_config_as_launched.yaml"
        as_launched.write_text(yaml.safe_dump(mapping, sort_keys=True))
        launch = dataclasses.replace(launch, accelerate_config=as_launched)
    trust = bool(values.get("trust_remote_code"))

    # --- the real sizes, as the real run checks them -------------------------------------------------------------------
    model_name = values.get("model_name_or_path") or values.get("model_config")
    if not model_name:
        raise ConfigError("the recipe config names no model (model_name_or_path or model_config)")
    real_name = stand_ins.resolve(str(model_name), locals_)
    real_config = stand_ins.load_real_config(real_name, trust_remote_code=trust)
    problems = (
        real_size_checks(
            real_config,
            real_mesh,
            recipe=Path(launch.recipe).stem,
            attn_implementation=values.get("attn_implementation"),
        )
        if real_mesh
        else []
    )
    if launch.accelerate_config and not problems:  # the linter would repeat a TP/EP problem in its own words
        from fsdp_recipes.distributed.launch_checks import ERROR
        from fsdp_recipes.tools.linter import lint_config_file

        findings = lint_config_file(launch.accelerate_config, model=real_name, trust_remote_code=trust)
        problems += [f"{launch.accelerate_config}: {finding}" for finding in findings if finding.severity == ERROR]
    if problems:
        raise ConfigError([f"for the real model and layout: {problem}" for problem in problems])
    training = config_class(launch.recipe) is not TrainingConfig  # eval.py measures once: no steps, no resume
    estimate = (
        real_size_estimate(launch, values, locals_, work_dir, trust)
        if training
        else "not estimated: the estimator models training (weights, gradients, optimizer state, activations)"
    )

    # --- stand-ins: model, data, layout --------------------------------------------------------------------------------
    flags, cpu_notes = cpu_overrides(values)
    notes += cpu_notes
    # heads and KV heads divisible by the scaled TP (or SP: the all-to-all splits them the same way)
    tp, ep = (max(mesh.tp, mesh.sp), mesh.ep) if mesh else (1, 1)
    for field in _MODEL_FIELDS:
        if values.get(field):
            tokenizer = values.get("tokenizer_name_or_path") if field == "model_name_or_path" else None
            folder, _, small = stand_ins.write_model(
                str(values[field]), tokenizer, work_dir / field, tp=tp, ep=ep, locals_=locals_, trust_remote_code=trust
            )
            flags += [f"--{field}", str(folder)]
    if values.get("model_config") and not values.get("model_name_or_path"):
        small = stand_ins.shrunk_config(real_config, tp=tp, ep=ep)
        small.to_json_file(work_dir / "model_config.json")
        flags += ["--model_config", str(work_dir / "model_config.json")]
    if values.get("tokenizer_name_or_path") and values.get("model_name_or_path"):
        flags += ["--tokenizer_name_or_path", str(work_dir / "model_name_or_path")]
    splits = {field: values.get(field, default) for field, default in (_SPLITS if training else _EVAL_SPLITS).items()}
    splits = {field: split for field, split in splits.items() if split}
    if values.get("dataset_name") or values.get("dataset_mixture"):
        renamed = stand_ins.write_data(
            values.get("dataset_name"), values.get("dataset_config"), values.get("dataset_mixture"), splits,
            work_dir / "data", rows=rows, locals_=locals_,
        )  # fmt: skip
        flags += ["--dataset_name", str(work_dir / "data"), "--dataset_mixture", "null", "--dataset_config", "null"]
        for field, split in renamed.items():
            flags += [f"--{field}", split]
    config_file = None
    if scaled:
        config_file = work_dir / "accelerate.yaml"
        config_file.write_text(yaml.safe_dump(scaled, sort_keys=True))
    count = mesh.processes if mesh else 1

    # --- the runs: steps with a checkpoint, export read back; a resume from the checkpoint ------------------------------
    rounds = int(values.get("num_iterations") or 1)  # GRPO: a checkpoint only between generation rounds
    halfway = rounds * max(steps // (2 * rounds), 1)
    steps = max(steps, 2 * halfway)
    run_flags = ["--report_to", "none", "--push_to_hub", "false"]
    if training:
        run_flags += ["--max_steps", str(steps), "--save_steps", str(halfway), "--logging_steps", "1",
                      "--save_total_limit", "null", "--repeat_small_dataset", "true"]  # fmt: skip
        notes.append(f"{steps} steps (repeat_small_dataset: the first --rows rows may pack into fewer than a step)")
    whole, resumed = work_dir / "run", work_dir / "resumed"
    code, said = _launch(
        launch.recipe, config_file, [*launch.recipe_args, *flags, *run_flags, "--output_dir", str(whole)],
        work_dir / "run.log",
    )  # fmt: skip
    report = {"recipe": str(launch.recipe), "processes": count, "steps": steps if training else 0}
    report.update(changed_for_cpu=notes, estimate_real_sizes=estimate)
    if code != 0 or not training:
        report["result"] = f"failed: {said}" if code else "ran: evaluated the stand-in (results in run/)"
        _print_report(report, time.monotonic() - started, work_dir)
        return 1 if code else 0
    checkpoint = whole / "checkpoints" / f"step-{halfway:08d}"
    code, said = _launch(
        launch.recipe, config_file,
        [*launch.recipe_args, *flags, *run_flags, "--output_dir", str(resumed), "--resume_from_checkpoint",
         str(checkpoint)],
        work_dir / "resumed.log",
    )  # fmt: skip
    first, again = _last_loss(whole), _last_loss(resumed)
    report["exported"] = str(whole / "model.safetensors") if (whole / "model.safetensors").is_file() else None
    if code != 0:
        report["result"] = f"the resume failed: {said}"
    elif first != again:
        report["result"] = f"the resume did not reproduce step {first and first[0]}: loss {first} vs {again}"
    else:
        report["result"] = f"ran: {steps} steps, checkpoint at {halfway}, resumed to the same loss {first[1]:.6g}"
    _print_report(report, time.monotonic() - started, work_dir)
    return 0 if report["result"].startswith("ran") else 1


def _print_report(report: dict, seconds: float, work_dir: Path) -> None:
    report["seconds"] = round(seconds, 1)
    (work_dir / "rehearsal.json").write_text(json.dumps(report, indent=1))
    print(f"rehearsal of {report['recipe']} on {report['processes']} CPU process(es): {report['result']}")
    print(f"  memory at the real sizes: {report['estimate_real_sizes']}")
    for note in report["changed_for_cpu"]:
        print(f"  changed: {note}")
    print(f"  {report['seconds']} s; logs and report in {work_dir}")
