"""Bad input to the SFT recipe (recipes/sft.py) gives one clear `error:` line, a nonzero exit, no traceback, and
leaves existing files alone.

The checks run before any weights load, so they are exercised in this process (the recipe's `main`, as the launcher
would run it, on one process). That such an error stops every rank of a real launch, is printed once and does not
hang: tests/test_all_ranks_stop.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.data import write_tiny_model_config
from helpers.paths import TOKENIZER
from helpers.recipes import base_recipe_values, recipe_error_in_process


def run_failing_in_process(tmp: Path, values: dict, capsys, extra_argv: tuple[str, ...] = ()) -> str:
    return recipe_error_in_process("sft", tmp, values, capsys, extra_argv)


@pytest.fixture
def values(tmp_path, tiny_model_config, chat_data):
    return base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")


def test_unknown_config_key(tmp_path, values, capsys):
    values["learning_rat"] = 1e-3
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "unknown key 'learning_rat'" in error and "did you mean 'learning_rate'" in error
    assert not Path(values["output_dir"]).exists()


def test_empty_dataset(tmp_path, values, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    values["dataset_name"] = str(data)
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "empty" in error.lower() or "no data" in error.lower(), error
    assert not Path(values["output_dir"]).exists()


def test_tokenizer_without_chat_template(tmp_path, values, capsys):
    bare = tmp_path / "tokenizer"
    bare.mkdir()
    for file in TOKENIZER.iterdir():
        if file.name != "chat_template.jinja":
            (bare / file.name).write_bytes(file.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    values["tokenizer_name_or_path"] = str(bare)
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "no chat template" in error and "chat_template" in error


def test_non_empty_output_dir_is_left_alone(tmp_path, values, capsys):
    out = Path(values["output_dir"])
    out.mkdir()
    (out / "model.safetensors").write_text("someone's weights")
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "not empty" in error and "--overwrite_output_dir" in error
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "someone's weights"


def test_push_without_token(tmp_path, values, capsys, monkeypatch):
    values.update(push_to_hub=True, hub_model_id="someone/tiny")
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "no Hugging Face token" in error and "HF_TOKEN" in error
    assert not Path(values["output_dir"]).exists()


def fake_checkpoint(output_dir: Path, model_config: Path, **progress) -> Path:
    """What the checks before loading read of a checkpoint: its progress and its model's config."""
    folder = output_dir / "checkpoints" / "step-00000004"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(model_config.read_text())
    record = dict(
        step=4,
        epoch=0,
        batches_into_epoch=8,
        world_size=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
    )
    record.update(progress)
    (folder / "progress.json").write_text(json.dumps(record))
    (output_dir / "checkpoints" / "latest").write_text(folder.name + "\n")
    return folder


def test_resume_with_another_gradient_accumulation_is_refused(tmp_path, values, tiny_model_config, capsys):
    fake_checkpoint(Path(values["output_dir"]), tiny_model_config, gradient_accumulation_steps=2)
    values["resume_from_checkpoint"] = "latest"
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "gradient_accumulation_steps=2" in error and "--gradient_accumulation_steps 2" in error


def test_resume_with_another_global_batch_is_refused(tmp_path, values, tiny_model_config, capsys):
    fake_checkpoint(Path(values["output_dir"]), tiny_model_config)
    values.update(resume_from_checkpoint="latest", per_device_train_batch_size=3)
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "error: the checkpoint stopped 32 rows into epoch 0" in error
    assert "per_device_train_batch_size x processes equal to the original (4 x 1)" in error


def test_resume_onto_another_model_shape_is_one_error(tmp_path, values, tokenizer, capsys):
    wider = write_tiny_model_config(tmp_path / "wider.json", tokenizer, hidden_size=128)
    fake_checkpoint(Path(values["output_dir"]), wider)
    values["resume_from_checkpoint"] = "latest"
    error = run_failing_in_process(tmp_path, values, capsys)
    assert "the checkpoint holds a model of other shapes" in error
    vocab = len(tokenizer)
    assert f"model.embed_tokens.weight: ({vocab}, 128) in the checkpoint, ({vocab}, 64) now" in error


def test_a_max_length_past_the_model_s_positions_is_refused_before_loading(tmp_path, values, capsys):
    """An example of max_length tokens would be read past the model's positions (a rotary model: silently, where it
    was never trained): refused before loading with the two fixes. A packed row longer than the positions is fine,
    its positions restart at each example, so the bound is max_length, not packing_row_length: the sequence-parallel
    launch (tests/fixtures/four_processes.py) trains rows of 1023 tokens on a model of 256 positions, equal to one
    process. GPT-2's learned table is not rotary: it is told that only a model with more positions helps."""
    model = json.loads(Path(values["model_config"]).read_text())
    (short := tmp_path / "short.json").write_text(json.dumps(model | {"max_position_embeddings": 128}))
    values |= dict(model_config=str(short), max_length=512, packing=False)
    error = run_failing_in_process(tmp_path, values, capsys)
    assert error.startswith("error: max_length 512 is longer than the model's positions (max_position_embeddings 128)")
    assert "Set max_length <= 128, or extend them in the model config: rope scaling (rope_parameters" in error
    assert "factor 4 and original_max_position_embeddings 128), and max_position_embeddings 512" in error
    assert not Path(values["output_dir"]).exists()

    from transformers import GPT2Config

    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.models.positions import check_example_fits_positions

    with pytest.raises(ConfigError, match="they are not rotary: rope scaling does not extend them"):
        check_example_fits_positions(GPT2Config(n_positions=64), 65)
    check_example_fits_positions(GPT2Config(n_positions=64), 64)
    check_example_fits_positions(GPT2Config(n_positions=64), None)  # a recipe without max_length
