"""Shared fixtures: a tiny model config, the repo's local tokenizer, small chat datasets, and a launcher that runs
real multi-process jobs with `accelerate launch` (gloo on CPU)."""

from __future__ import annotations

import json
import os
import re
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
    return run_process_group(command, timeout=timeout, env=full_env)


def run_process_group(command: list[str], *, timeout: float, env: dict[str, str] | None = None):
    """subprocess.run, but a timeout kills the launcher's whole process group: ranks left behind would keep the
    CPU busy for the rest of the suite."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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


def rank_reports(stdout: str) -> list[dict]:
    """The `REPORT {json}` lines that ranks print, sorted by rank. Ranks share one stdout pipe and `print` writes the
    text and its newline separately, so two reports can share a line: each is decoded from where it starts."""
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(stdout, match.end())[0] for match in re.finditer(r"REPORT ", stdout)]
    return sorted(reports, key=lambda report: report["rank"])
