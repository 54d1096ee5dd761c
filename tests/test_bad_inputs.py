"""Bad input gives one clear error, a nonzero exit, no hang, and leaves existing files alone — under a real
2-process launch, so a rank that failed alone would show up as a hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FSDP_CPU_CONFIG, SFT, TOKENIZER, base_recipe_values, launch, recipe_config, write_jsonl

pytestmark = pytest.mark.slow


def run_failing(tmp: Path, values: dict, env: dict | None = None, accelerate_config: Path = FSDP_CPU_CONFIG):
    config = recipe_config(tmp / "recipe.yaml", **values)
    result = launch(SFT, ["--config", str(config)], env=env, timeout=180, accelerate_config=accelerate_config)
    assert result.returncode != 0, result.stdout[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-4000:]  # printed once, not once per rank
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    return errors[0]


@pytest.fixture
def values(tmp_path, tiny_model_config, chat_data):
    return base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")


def test_unknown_config_key(tmp_path, values):
    values["learning_rat"] = 1e-3
    error = run_failing(tmp_path, values)
    assert "unknown key 'learning_rat'" in error and "did you mean 'learning_rate'" in error
    assert not Path(values["output_dir"]).exists()


def test_missing_messages_column(tmp_path, values):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [{"text": "hello", "label": 1}] * 8)
    values["dataset_name"] = str(data)
    error = run_failing(tmp_path, values)
    assert "'messages'" in error and "['label', 'text']" in error
    assert not Path(values["output_dir"]).exists()


def test_empty_dataset(tmp_path, values):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    values["dataset_name"] = str(data)
    error = run_failing(tmp_path, values)
    assert "empty" in error.lower() or "no data" in error.lower(), error
    assert not Path(values["output_dir"]).exists()


def test_tokenizer_without_chat_template(tmp_path, values):
    bare = tmp_path / "tokenizer"
    bare.mkdir()
    for file in TOKENIZER.iterdir():
        if file.name != "chat_template.jinja":
            (bare / file.name).write_bytes(file.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    values["tokenizer_name_or_path"] = str(bare)
    error = run_failing(tmp_path, values)
    assert "no chat template" in error and "chat_template" in error


def test_non_empty_output_dir_is_left_alone(tmp_path, values):
    out = Path(values["output_dir"])
    out.mkdir()
    (out / "model.safetensors").write_text("someone's weights")
    error = run_failing(tmp_path, values)
    assert "not empty" in error and "--overwrite_output_dir" in error
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "someone's weights"


def test_push_without_token(tmp_path, values):
    values.update(push_to_hub=True, hub_model_id="someone/tiny")
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    error = run_failing(tmp_path, values, env=env)
    assert "no Hugging Face token" in error and "HF_TOKEN" in error
    assert not Path(values["output_dir"]).exists()


def test_two_activation_checkpointing_mechanisms_are_refused(tmp_path, values):
    both = tmp_path / "fsdp_ac.yaml"
    both.write_text(FSDP_CPU_CONFIG.read_text().replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true"))
    assert both.read_text() != FSDP_CPU_CONFIG.read_text()
    values["gradient_checkpointing"] = True
    error = run_failing(tmp_path, values, accelerate_config=both)
    assert "gradient_checkpointing" in error and "fsdp_activation_checkpointing" in error and "use one" in error
    assert not Path(values["output_dir"]).exists()
