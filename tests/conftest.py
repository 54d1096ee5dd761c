"""Shared fixtures: a tiny model config, the repo's local tokenizer, small chat datasets, and a launcher that runs
real multi-process jobs with `accelerate launch` (gloo on CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "demo" / "assets" / "tokenizer"
DEMO_DATA = REPO / "demo" / "assets" / "reverse"
FSDP_CPU_CONFIG = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
SFT = REPO / "recipes" / "sft.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCH_TIMEOUT_S = 240


def load_recipe(name: str):
    """recipes/<name>.py as a module, for its config class and `main` (recipes are scripts, not a package)."""
    import importlib.util

    module_name = f"recipe_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the class is being built
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def run_recipe_in_process(recipe: str, tmp: Path, name: str, values: dict) -> None:
    """recipes/<recipe>.py's main on this one process (no launcher, no FSDP), as `python recipes/<recipe>.py` runs it."""
    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.errors import exit_on_user_error

    config = recipe_config(tmp / f"{name}.yaml", **values)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        exit_on_user_error(lambda: load_recipe(recipe).main(["--config", str(config)]))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def recipe_error_in_process(recipe: str, tmp: Path, values: dict, capsys, extra_argv: tuple[str, ...] = ()) -> str:
    """recipes/<recipe>.py's main in this process, under the same wrapper as `python recipes/<recipe>.py`, with a
    config that must be refused before weights load: returns its one `error:` line (exit 2, no traceback). The checks
    before loading need no processes, so this costs well under a second instead of a ~15 s launch."""
    from accelerate.state import AcceleratorState

    from fsdp_recipes.common.errors import exit_on_user_error

    config = recipe_config(tmp / "recipe.yaml", **values)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: load_recipe(recipe).main(["--config", str(config), *extra_argv]))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    return errors[0]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def write_tiny_model_config(path: Path, tokenizer, **overrides) -> Path:
    """A Llama of about 0.1M parameters: big enough to have every real part, small enough for 2 CPU cores."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    settings.update(overrides)
    LlamaConfig(**settings).to_json_file(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_config(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model_config(tmp_path_factory.mktemp("model") / "config.json", tokenizer)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """256 training conversations and 32 held-out ones from the demo task."""
    folder = tmp_path_factory.mktemp("chat")
    train = [json.loads(line) for line in (DEMO_DATA / "train.jsonl").read_text().splitlines()[:256]]
    test = [json.loads(line) for line in (DEMO_DATA / "test.jsonl").read_text().splitlines()[:32]]
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    return folder


def recipe_config(path: Path, **values) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def base_recipe_values(tiny_model_config: Path, chat_data: Path, output_dir: Path, **overrides) -> dict:
    values = dict(
        model_config=str(tiny_model_config),
        tokenizer_name_or_path=str(TOKENIZER),
        dataset_name=str(chat_data),
        max_length=64,
        max_steps=10,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        output_dir=str(output_dir),
        seed=7,
        report_to="none",  # the tracker costs every launch an import; the reference run turns it on and checks it
    )
    values.update(overrides)
    return values


def launch(
    script: Path | str,
    args: list[str],
    *,
    num_processes: int = 2,
    accelerate_config: Path | None = FSDP_CPU_CONFIG,
    env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
    launcher_args: list[str] = (),
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """`accelerate launch` with real processes; a hang fails the test at `timeout` instead of blocking the suite."""
    command = [str(ACCELERATE), "launch"]
    if accelerate_config is not None:
        command += ["--config_file", str(accelerate_config)]
    command += ["--num_processes", str(num_processes)]
    if num_processes > 1:
        command += ["--main_process_port", str(free_port())]
    command += [*launcher_args, str(script), *args]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_process_group(command, timeout=timeout, env=full_env, cwd=cwd)


def run_process_group(command: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO):
    """subprocess.run, but a timeout kills the launcher's whole process group: ranks left behind would keep the
    CPU busy for the rest of the suite."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def concurrently(*runs):
    """Calls each of `runs` (launches) in a thread of its own and returns their results in order. A launch leaves a
    core idle a quarter of its time (start-up, rendezvous, teardown), so two at once take ~30% less than in turn."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        return [future.result() for future in futures]


def alongside(in_process, *launches):
    """Runs each of `launches` in a thread of its own while `in_process` (a recipe run in this process, which must stay
    in the main thread) runs here; returns its result and theirs. They share the cores the launches leave idle."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = [pool.submit(launch) for launch in launches]
        here = in_process()
        return here, [future.result() for future in futures]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def require_success(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        pytest.fail(f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}")


# ----------------------------------------------------------------------------------------------- shared SFT launches
# Process start-up dominates the suite's time (a 2-process launch costs ~15 s here), so these few real launches are
# shared by every test module that needs a trained run: one reference run serves sharding, metrics, export and
# checkpoint tests; one run killed while saving serves the fault tests and every resume.
STEPS = 12


def resume_values(tiny_model_config: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """2 processes x 4 rows x 2 accumulation steps over 64 rows: steps 1-4 are epoch 0, so the interruption at step 6
    falls mid-epoch and the run crosses two epoch boundaries. A checkpoint every 3 steps; exact match on 4 held-out
    examples (it runs before training, and a resumed run must read it from the log)."""
    values = dict(max_steps=STEPS, save_steps=3, gradient_accumulation_steps=2, eval_steps=None, packing=False,
                  exact_match_eval_samples=4, max_new_tokens=4)
    values.update(overrides)
    return base_recipe_values(tiny_model_config, data, output_dir, **values)


@pytest.fixture(scope="session")
def small_chat_data(tmp_path_factory, chat_data) -> Path:
    folder = tmp_path_factory.mktemp("small_chat")
    lines = (chat_data / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (folder / "test.jsonl").write_text((chat_data / "test.jsonl").read_text())
    return folder


def run_launched(script: Path, tmp: Path, name: str, values: dict, *, expect_success: bool = True, **launch_options):
    """A recipe under `accelerate launch` with `values` as its config (written to tmp/<name>.yaml)."""
    result = launch(script, ["--config", str(recipe_config(tmp / f"{name}.yaml", **values))], **launch_options)
    if expect_success:
        require_success(result)
    return result


def run_sft(tmp: Path, name: str, values: dict, **options):
    return run_launched(SFT, tmp, name, values, **options)


@pytest.fixture(scope="session")
def sft_launches(tmp_path_factory, tiny_model_config, small_chat_data) -> dict:
    """The reference run and the killed one (below), launched side by side."""
    import time

    reference, killed = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("killed")
    reference_values = resume_values(tiny_model_config, small_chat_data, reference / "out", save_total_limit=2,
                                     report_to="tensorboard")
    killed_values = resume_values(tiny_model_config, small_chat_data, killed / "out", save_total_limit=2)

    def killed_run():
        result = run_sft(killed, "killed", killed_values, expect_success=False,
                         env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"})
        return killed / "out", killed_values, result, time.time()

    _, killed_outcome = concurrently(lambda: run_sft(reference, "reference", reference_values), killed_run)
    return {"reference": reference / "out", "killed": killed_outcome}


@pytest.fixture(scope="session")
def reference_run(sft_launches) -> Path:
    """The uninterrupted 2-process FSDP2 run (SHARDED_STATE_DICT, fp32), keeping its newest 2 checkpoints."""
    return sft_launches["reference"]


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, tiny_model_config, small_chat_data) -> Path:
    """The reference run's global batch on 1 process (8 rows per micro-batch), in this process (no launcher, no FSDP),
    with a peak FLOP/s for MFU, and the loss from whole logits where the reference run uses the (default) chunked
    cross-entropy."""
    tmp = tmp_path_factory.mktemp("one_process")
    values = resume_values(tiny_model_config, small_chat_data, tmp / "out", per_device_train_batch_size=8,
                           peak_flops_per_device=1e12, save_steps=None, exact_match_eval_samples=0,
                           loss_implementation="full_logits")
    run_recipe_in_process("sft", tmp, "one", values)
    return tmp / "out"


@pytest.fixture(scope="session")
def killed_during_save(sft_launches):
    """The reference run, but rank 1 is SIGKILLed while step 6's checkpoint is being written: the launcher must stop
    rank 0, and the latest complete checkpoint is step 3's. Returns (output_dir, values, result, finished_at)."""
    return sft_launches["killed"]


@pytest.fixture(scope="session")
def full_state_dict_run(tmp_path_factory, tokenizer, small_chat_data) -> Path:
    """2 processes with FULL_STATE_DICT, a model with tied embeddings, the model's own activation checkpointing and
    the fused AdamW kernel."""
    tmp = tmp_path_factory.mktemp("full_state_dict")
    tied_config = write_tiny_model_config(tmp / "tied.json", tokenizer, tie_word_embeddings=True)
    full_yaml = full_state_dict_config(tmp)
    values = resume_values(tied_config, small_chat_data, tmp / "out", max_steps=4, save_steps=4,
                           gradient_checkpointing=True, optim="adamw_torch_fused", exact_match_eval_samples=0)
    run_sft(tmp, "full", values, accelerate_config=full_yaml)
    return tmp / "out"


# ----------------------------------------------------------------------------------- classify and eval: shared launch
CLASSIFY = REPO / "recipes" / "classify.py"
EVAL = REPO / "recipes" / "eval.py"
CLASSIFY_STEPS = 40
CLASSIFY_TEST_ROWS = 45  # 2 ranks x 8 rows per eval batch: the last of 3 global batches holds 13 rows, so accelerate
# pads it with copies that gather_for_metrics must drop


def first_letter_examples(count: int, seed: int) -> list[dict]:
    """Random lowercase strings labelled by their first letter: "low" (a-i), "mid" (j-r) or "high" (s-z). The label
    is at the first token and the classifier pools the last, so attention must carry it."""
    import random
    import string

    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))
        examples.append({"text": text, "label": ["low", "mid", "high"][string.ascii_lowercase.index(text[0]) * 3 // 26]})
    return examples


@pytest.fixture(scope="session")
def classify_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("classify_data")
    write_jsonl(folder / "train.jsonl", first_letter_examples(384, seed=0))
    write_jsonl(folder / "test.jsonl", first_letter_examples(CLASSIFY_TEST_ROWS, seed=1))
    return folder


def classify_values(tiny_model_config: Path, data: Path, output_dir: Path, **overrides) -> dict:
    values = base_recipe_values(tiny_model_config, data, output_dir, max_length=32, max_steps=CLASSIFY_STEPS,
                                per_device_train_batch_size=8, per_device_eval_batch_size=8, logging_steps=5,
                                eval_steps=20, save_steps=CLASSIFY_STEPS, report_to="none")
    values.update(overrides)
    return values


@pytest.fixture(scope="session")
def classify_run(tmp_path_factory, tiny_model_config, classify_data) -> Path:
    """recipes/classify.py under a real 2-process FSDP2 launch: 40 steps of 16 rows, metrics at steps 20 and 40, a
    checkpoint at the last step (evaluated again by the eval recipe's tests)."""
    tmp = tmp_path_factory.mktemp("classify")
    values = classify_values(tiny_model_config, classify_data, tmp / "out")
    require_success(launch(CLASSIFY, ["--config", str(recipe_config(tmp / "classify.yaml", **values))]))
    return tmp / "out"


# ------------------------------------------------------------------------------------------------ LoRA: shared launches
@pytest.fixture(scope="session")
def pretrained_tiny_model(tmp_path_factory, tokenizer) -> Path:
    """A model folder with weights (LoRA adapts pretrained weights, and its adapter is reloaded onto them)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("pretrained")
    config = LlamaConfig.from_json_file(write_tiny_model_config(folder / "source.json", tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def lora_values(model: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """resume_values with LoRA on a pretrained model: rank 4 on every linear layer of the decoder blocks, no dropout
    (dropout draws differ between one and two processes)."""
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2)
    values = resume_values(model, data, output_dir, **{**lora, **overrides})
    values.pop("model_config")
    values.pop("tokenizer_name_or_path")
    return {**values, "model_name_or_path": str(model)}


@pytest.fixture(scope="session")
def lora_launches(tmp_path_factory, pretrained_tiny_model, small_chat_data) -> dict:
    """The LoRA reference run and the killed one (below), launched side by side."""
    reference, killed = tmp_path_factory.mktemp("lora_reference"), tmp_path_factory.mktemp("lora_killed")
    values = lora_values(pretrained_tiny_model, small_chat_data, killed / "out", export_merged_model=True)
    full = full_state_dict_config(killed)
    concurrently(
        lambda: run_sft(reference, "lora", lora_values(pretrained_tiny_model, small_chat_data, reference / "out",
                                                       export_merged_model=True)),
        lambda: run_sft(killed, "killed", values, expect_success=False, accelerate_config=full,
                        env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"}),
    )
    return {"reference": reference / "out", "killed": (killed / "out", values, full)}


@pytest.fixture(scope="session")
def lora_reference_run(lora_launches) -> Path:
    """2 processes, SHARDED_STATE_DICT, the merged model exported too; checkpoints every 3 steps."""
    return lora_launches["reference"]


@pytest.fixture(scope="session")
def lora_one_process_run(tmp_path_factory, pretrained_tiny_model, small_chat_data) -> Path:
    """The reference's global batch on 1 process, in this process (no launcher, no FSDP)."""
    tmp = tmp_path_factory.mktemp("lora_one_process")
    values = lora_values(pretrained_tiny_model, small_chat_data, tmp / "out", per_device_train_batch_size=8,
                         exact_match_eval_samples=0)
    run_recipe_in_process("sft", tmp, "lora_one", values)
    return tmp / "out"


def full_state_dict_config(folder: Path) -> Path:
    """The 2-process CPU FSDP2 config with FULL_STATE_DICT checkpoints (rank 0 writes the whole state)."""
    path = folder / "fsdp_full_state_dict.yaml"
    path.write_text(FSDP_CPU_CONFIG.read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT"))
    return path


@pytest.fixture(scope="session")
def lora_killed_during_save(lora_launches):
    """The LoRA reference run, but with FULL_STATE_DICT checkpoints, and rank 1 killed while saving step 6.
    Returns (output_dir, values, accelerate config)."""
    return lora_launches["killed"]


@pytest.fixture(scope="session")
def lora_resumes(tmp_path_factory, lora_reference_run, lora_killed_during_save) -> dict[int, Path]:
    """Launched side by side: a copy of the killed LoRA run resumed (FULL_STATE_DICT, 2 processes) to the end; and a
    copy of the reference run resumed from its step-6 SHARDED_STATE_DICT checkpoint on 1 process with the same global
    batch (DCP reshards the adapters and their optimizer state). {processes: output_dir}."""
    import shutil

    source, values, full = lora_killed_during_save
    killed, reference = tmp_path_factory.mktemp("lora_resumed_on_2"), tmp_path_factory.mktemp("lora_resumed_on_1")
    shutil.copytree(source, killed / "out")
    shutil.copytree(lora_reference_run, reference / "out",  # without the newer checkpoints, which it would redo
                    ignore=shutil.ignore_patterns("step-00000009", "step-00000012"))
    checkpoint = reference / "out" / "checkpoints" / "step-00000006"
    on_one = {**values, "output_dir": str(reference / "out"), "resume_from_checkpoint": str(checkpoint),
              "per_device_train_batch_size": 8, "exact_match_eval_samples": 0}
    concurrently(
        lambda: run_sft(killed, "resumed", {**values, "output_dir": str(killed / "out"),
                                            "resume_from_checkpoint": "latest"}, accelerate_config=full),
        lambda: run_sft(reference, "resumed", on_one, num_processes=1),
    )
    return {2: killed / "out", 1: reference / "out"}


@pytest.fixture(scope="session")
def lora_resumed_run(lora_resumes) -> Path:
    """The killed LoRA run resumed on 2 processes."""
    return lora_resumes[2]


# ------------------------------------------------------------------------------------------------ DPO: shared launches
DPO = REPO / "recipes" / "dpo.py"
DPO_STEPS = 8


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory) -> Path:
    """64 training pairs and 16 held-out ones from the DPO demo's data (conversational, explicit prompt)."""
    folder = tmp_path_factory.mktemp("pairs")
    source = REPO / "demo" / "assets" / "reverse_preferences"
    (folder / "train.jsonl").write_text("\n".join((source / "train.jsonl").read_text().splitlines()[:64]) + "\n")
    (folder / "test.jsonl").write_text("\n".join((source / "test.jsonl").read_text().splitlines()[:16]) + "\n")
    return folder


def dpo_values(model: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """2 processes x 4 pairs x 2 accumulation steps = 16 pairs per step (8 rows of 2 x 4 per micro-batch), fp32, a
    checkpoint every 3 steps, held-out figures every 4."""
    values = dict(model_name_or_path=str(model), dataset_name=str(data), output_dir=str(output_dir), max_length=48,
                  max_steps=DPO_STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                  gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=0, logging_steps=1, eval_steps=4,
                  save_steps=3, seed=7, report_to="none", beta=0.5)
    values.update(overrides)
    return values


def run_dpo(tmp: Path, name: str, values: dict, **options):
    return run_launched(DPO, tmp, name, values, **options)


@pytest.fixture(scope="session")
def dpo_launches(tmp_path_factory, pretrained_tiny_model, preference_data) -> dict:
    """Full DPO on 2 processes, the reference a frozen copy sharded like the policy; the same run with rank 1 killed
    while saving step 6; and the same run with the reference's values precomputed (no checkpoints): launched side by
    side."""
    reference, killed, precomputed = (tmp_path_factory.mktemp(name) for name in ("dpo_reference", "dpo_killed",
                                                                                  "dpo_precomputed"))
    killed_values = dpo_values(pretrained_tiny_model, preference_data, killed / "out")
    _, killed_result, _ = concurrently(
        lambda: run_dpo(reference, "dpo", dpo_values(pretrained_tiny_model, preference_data, reference / "out")),
        lambda: run_dpo(killed, "killed", killed_values, expect_success=False,
                        env={"FSDP_RECIPES_FAULT": "kill-during-save:6@1"}),
        lambda: run_dpo(precomputed, "precomputed", dpo_values(pretrained_tiny_model, preference_data,
                                                               precomputed / "out", precompute_ref_log_probs=True,
                                                               save_steps=None)),
    )
    return {"reference": reference / "out", "killed": (killed / "out", killed_values, killed_result),
            "precomputed": precomputed / "out"}


@pytest.fixture(scope="session")
def dpo_reference_run(dpo_launches) -> Path:
    return dpo_launches["reference"]
