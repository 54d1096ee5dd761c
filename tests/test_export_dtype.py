"""Exports in the base model's dtype (fsdp_recipes.models.export_dtype): full SFT, offline export of its checkpoint
and a merged LoRA model of a bf16 base come back bf16, with a config.json that says so. In-process runs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fsdp_recipes.models.export_dtype import recipe_dtype_override, resolve_export_dtype
from fsdp_recipes.publish.checkpoint_export import export_checkpoint
from fsdp_recipes.train.checkpoint import latest_checkpoint
from helpers.data import write_tiny_model_config
from helpers.recipes import base_recipe_values, recipe_error_in_process, run_recipe_in_process


def floating_dtypes(folder: Path) -> set[torch.dtype]:
    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as reader:
            dtypes |= {reader.get_tensor(k).dtype for k in reader.keys() if reader.get_tensor(k).is_floating_point()}
    return dtypes


def declared_dtype(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["dtype"]


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory, tokenizer) -> Path:
    """A pretrained tiny Llama saved in bf16, as most Hub checkpoints are."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("bf16_base")
    config = LlamaConfig.from_json_file(write_tiny_model_config(folder / "source.json", tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    assert declared_dtype(folder / "model") == "bfloat16"
    return folder / "model"


def bf16_values(base: Path, data: Path, output_dir: Path, **overrides) -> dict:
    values = base_recipe_values(Path("unused"), data, output_dir, **{"max_steps": 2, "save_steps": 2, **overrides})
    values.pop("model_config")
    values.pop("tokenizer_name_or_path")
    return {**values, "model_name_or_path": str(base)}


@pytest.fixture(scope="module")
def bf16_sft_run(tmp_path_factory, bf16_base, small_chat_data) -> Path:
    tmp = tmp_path_factory.mktemp("bf16_sft")
    run_recipe_in_process("sft", tmp, "bf16", bf16_values(bf16_base, small_chat_data, tmp / "out"))
    return tmp / "out"


def test_a_bf16_base_exports_bf16_and_says_so(bf16_sft_run):
    assert floating_dtypes(bf16_sft_run) == {torch.bfloat16}
    assert declared_dtype(bf16_sft_run) == "bfloat16"
    summary = json.loads((bf16_sft_run / "run_summary.json").read_text())
    assert summary["export_dtype"] == "bfloat16"


def test_training_kept_fp32_master_weights(bf16_sft_run):
    """The checkpoint (the optimizer's weights) stays fp32: only the exported folder is cast."""
    checkpoint = latest_checkpoint(bf16_sft_run)
    assert floating_dtypes(checkpoint) == {torch.float32}


def test_offline_export_follows_the_same_rule(tmp_path, bf16_sft_run):
    checkpoint = latest_checkpoint(bf16_sft_run)
    folder = export_checkpoint(checkpoint, tmp_path / "auto")
    assert floating_dtypes(folder) == {torch.bfloat16} and declared_dtype(folder) == "bfloat16"
    from safetensors.torch import load_file

    assert all(
        torch.equal(load_file(folder / "model.safetensors")[k], v)
        for k, v in load_file(bf16_sft_run / "model.safetensors").items()
    )
    asked = export_checkpoint(checkpoint, tmp_path / "fp32", dtype="float32")
    assert floating_dtypes(asked) == {torch.float32} and declared_dtype(asked) == "float32"


def test_export_dtype_float32_is_honoured(tmp_path, bf16_base, small_chat_data):
    run_recipe_in_process(
        "sft",
        tmp_path,
        "fp32",
        bf16_values(bf16_base, small_chat_data, tmp_path / "out", save_steps=None, export_dtype="float32"),
    )
    assert floating_dtypes(tmp_path / "out") == {torch.float32}
    assert declared_dtype(tmp_path / "out") == "float32"


def test_merged_lora_of_a_bf16_base_is_bf16(tmp_path, bf16_base, small_chat_data):
    values = bf16_values(
        bf16_base,
        small_chat_data,
        tmp_path / "out",
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        export_merged_model=True,
        learning_rate=1e-2,
    )
    run_recipe_in_process("sft", tmp_path, "lora", values)
    merged = tmp_path / "out" / "merged"
    assert floating_dtypes(merged) == {torch.bfloat16} and declared_dtype(merged) == "bfloat16"
    offline = export_checkpoint(latest_checkpoint(tmp_path / "out"), tmp_path / "offline", merged=True)
    assert floating_dtypes(offline / "merged") == {torch.bfloat16}


def test_resolution_order(tokenizer, tmp_path):
    from transformers import LlamaConfig

    bf16 = LlamaConfig(dtype="bfloat16")
    assert resolve_export_dtype("auto", bf16) == torch.bfloat16
    assert resolve_export_dtype("float32", bf16) == torch.float32
    assert resolve_export_dtype("auto", bf16, override="float16") == torch.float16
    assert resolve_export_dtype("auto", LlamaConfig()) == torch.float32  # a config naming no dtype
    assert recipe_dtype_override({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert recipe_dtype_override({"dtype": "auto"}) is None


def test_an_unknown_export_dtype_is_one_error(tmp_path, tiny_model_config, small_chat_data, capsys):
    values = base_recipe_values(tiny_model_config, small_chat_data, tmp_path / "out", export_dtype="int8")
    assert "export_dtype 'int8' is not one of auto, float32" in recipe_error_in_process("sft", tmp_path, values, capsys)


def test_what_transformers_keeps_in_fp32_is_exported_in_fp32():
    """DeepSeek-V3's router weight and its trained e_score_correction_bias (steps of 0.001, which bf16 rounds away
    near 1) stay float32 in a bf16 or fp16 export, as transformers keeps them on loading; the rest is cast, and
    `gate_proj` is not taken for `gate`."""
    from fsdp_recipes.models.export_dtype import cast_floating, kept_in_fp32
    from helpers.tiny_moe import tiny_moe

    model = tiny_moe("deepseek_v3")
    model.model.layers[-1].mlp.gate.e_score_correction_bias.fill_(0.751)
    state = model.state_dict()
    cast = cast_floating(state, torch.bfloat16, kept_in_fp32(model, torch.bfloat16))
    bias = next(name for name in cast if name.endswith("e_score_correction_bias") and "layers.1." in name)
    kept = {name for name, tensor in cast.items() if tensor.dtype == torch.float32}
    assert kept == {n for n in state if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))} and bias in kept
    assert torch.equal(cast[bias], state[bias])  # 0.751, where bf16 would write 0.75
    assert any(name.endswith("gate_proj.weight") and cast[name].dtype == torch.bfloat16 for name in cast)
    assert kept_in_fp32(model, torch.float32) == [] and cast_floating(state, torch.bfloat16).keys() == state.keys()
