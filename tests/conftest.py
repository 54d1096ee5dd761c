"""What every test shares: the repo's local tokenizer, a tiny model (its config, and a pretrained folder of it for
LoRA and DPO), small chat datasets. Each recipe's shared launches are in tests/fixtures/<recipe>.py, registered here;
plain helpers (launching, running a recipe in this process, paths, data files) are in tests/helpers/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # before the first import: their asserts report as a test's own do

from helpers.data import write_jsonl, write_tiny_model_config  # noqa: E402
from helpers.paths import DEMO_DATA, TOKENIZER  # noqa: E402

pytest_plugins = [
    "fixtures.sft",
    "fixtures.lora",
    "fixtures.classify",
    "fixtures.dpo",
    "fixtures.reward_distill",
    "fixtures.preference",
    "fixtures.grpo",
    "fixtures.every_recipe",
    "fixtures.four_processes",
    "fixtures.vllm",
]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="session")
def tiny_model_config(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model_config(tmp_path_factory.mktemp("model") / "config.json", tokenizer)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """256 training conversations and 32 held-out ones from the demo task."""
    folder = tmp_path_factory.mktemp("chat")
    train = [json.loads(line) for line in (DEMO_DATA / "train.jsonl").read_text().splitlines()[:256]]
    test = [json.loads(line) for line in (DEMO_DATA / "test.jsonl").read_text().splitlines()[:32]]
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    return folder


@pytest.fixture(scope="session")
def small_chat_data(tmp_path_factory, chat_data) -> Path:
    folder = tmp_path_factory.mktemp("small_chat")
    lines = (chat_data / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (folder / "test.jsonl").write_text((chat_data / "test.jsonl").read_text())
    return folder


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
