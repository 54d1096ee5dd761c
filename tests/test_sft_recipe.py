"""End-to-end runs of recipes/sft.py under `accelerate launch`, with real processes sharding over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import (
    FSDP_CPU_CONFIG,
    SFT,
    base_recipe_values,
    launch,
    read_metrics,
    recipe_config,
    require_success,
)

pytestmark = pytest.mark.slow


def run_recipe(tmp: Path, name: str, values: dict, **launch_options) -> Path:
    config = recipe_config(tmp / f"{name}.yaml", **values)
    result = launch(SFT, ["--config", str(config)], **launch_options)
    require_success(result)
    return Path(values["output_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_config, chat_data):
    """The same 10 optimizer steps, global batch 8 rows: 2 FSDP2 ranks x 4 rows, and 1 process x 8 rows. fp32."""
    tmp = tmp_path_factory.mktemp("sft_runs")
    sharded = run_recipe(tmp, "two", base_recipe_values(tiny_model_config, chat_data, tmp / "two_ranks"))
    single = run_recipe(
        tmp, "one",
        base_recipe_values(
            tiny_model_config, chat_data, tmp / "one_rank", per_device_train_batch_size=8, peak_flops_per_device=1e12
        ),
        num_processes=1,
    )
    return {"two_ranks": sharded, "one_rank": single, "tmp": tmp}


def test_two_ranks_each_hold_half_of_the_parameters(runs):
    summary = json.loads((runs["two_ranks"] / "run_summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["distributed_type"] == "FSDP"
    assert summary["fsdp"]["version"] == 2
    assert summary["fsdp"]["wrap_classes"] == ["LlamaDecoderLayer"]
    per_rank, total = summary["parameters_per_rank"], summary["parameters_total"]
    assert sum(per_rank) == total
    for held in per_rank:
        assert abs(held - total / 2) / total < 0.02, per_rank


def test_two_rank_losses_equal_one_process_with_the_same_global_batch(runs):
    two = [r["loss"] for r in read_metrics(runs["two_ranks"]) if "loss" in r]
    one = [r["loss"] for r in read_metrics(runs["one_rank"]) if "loss" in r]
    assert len(two) == len(one) == 10
    assert two[-1] < two[0]  # it trains
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)


def test_metrics_log_has_train_and_eval_records(runs, tiny_model_config):
    from transformers import AutoConfig

    records = read_metrics(runs["two_ranks"])
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert [r["step"] for r in records if "eval_loss" in r] == [10]
    config = AutoConfig.from_pretrained(tiny_model_config)
    head_dim = config.hidden_size // config.num_attention_heads
    for record in train:
        assert record["tokens_per_second"] > 0 and record["grad_norm"] > 0
        assert record["tokens_per_second_per_device"] == pytest.approx(record["tokens_per_second"] / 2)
        assert 0 <= record["padding_fraction"] < 1
        assert 0 <= record["data_wait_fraction"] < 1
        assert len(record["peak_memory_gib_per_rank"]) == 2 and min(record["peak_memory_gib_per_rank"]) > 0
        assert record["mfu"] is None  # a CPU has no entry in the peak-FLOPs table
        attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim
        width = (record["flops_per_token"] - 6 * non_embedding_parameters(config)) / attention
        assert 1 <= width <= 64 and width == pytest.approx(round(width * 4) / 4)  # mean padded width of 4 batches
    with_peak = [r for r in read_metrics(runs["one_rank"]) if "loss" in r]
    for record in with_peak:
        assert record["mfu"] == pytest.approx(record["achieved_flops_per_device"] / 1e12)
    assert list((runs["two_ranks"] / "sft").glob("events.out.tfevents.*"))  # the TensorBoard tracker wrote
    assert (runs["two_ranks"] / "training_curves.png").stat().st_size > 10_000
    assert "training_curves.png" in (runs["two_ranks"] / "README.md").read_text()


def non_embedding_parameters(config) -> int:
    """Counted by hand from the Llama architecture, independently of the code under test."""
    hidden, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config.intermediate_size + 2 * hidden
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * hidden
    return config.num_hidden_layers * per_layer + hidden + lm_head


def eval_loss_of_exported_model(folder: Path, chat_data: Path) -> float:
    """Recomputes the recipe's held-out loss from the exported folder alone, in this (single) process."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.data.chat import tokenize_dataset
    from fsdp_recipes.data.rows import build_rows, collate_rows
    from fsdp_recipes.losses import causal_lm_loss_sum, count_targets

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eval_raw = load_dataset(str(chat_data))["test"]
    tokens, _ = tokenize_dataset(eval_raw, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=64)
    rows = build_rows(tokens, max_length=64, packing=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            batch = collate_rows([rows[i] for i in range(start, min(start + 8, len(rows)))], tokenizer.pad_token_id)
            total += float(causal_lm_loss_sum(model, batch))
            count += count_targets(batch)
    return total / count


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_export_reloads_and_reproduces_the_trained_model(runs, state_dict_type, tiny_model_config, chat_data):
    if state_dict_type == "SHARDED_STATE_DICT":
        folder = runs["two_ranks"]
    else:
        tmp = runs["tmp"]
        full_config = tmp / "fsdp_full_state_dict.yaml"
        full_config.write_text(FSDP_CPU_CONFIG.read_text().replace("SHARDED_STATE_DICT", "FULL_STATE_DICT"))
        # Also the performance switches: the model's own activation checkpointing and the fused AdamW kernel.
        values = base_recipe_values(
            tiny_model_config, chat_data, tmp / "full", gradient_checkpointing=True, optim="adamw_torch_fused"
        )
        folder = run_recipe(tmp, "full", values, accelerate_config=full_config)
        summary = json.loads((folder / "run_summary.json").read_text())
        assert summary["fsdp"]["state_dict_type"] == "FULL_STATE_DICT"
        assert summary["activation_checkpointing"] == "model (gradient_checkpointing)"
        assert summary["optim"] == "adamw_torch_fused"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert (folder / name).is_file(), name
    logged = [r["eval_loss"] for r in read_metrics(folder) if "eval_loss" in r][-1]
    assert eval_loss_of_exported_model(folder, chat_data) == pytest.approx(logged, rel=1e-5)
    card = (folder / "README.md").read_text()
    assert "FSDP_STATE_DICT_TYPE" in card and "learning_rate" in card and "eval_loss" in card
