"""End-to-end runs of recipes/sft.py under `accelerate launch`, with real processes sharding over gloo. The runs are
the shared session launches of tests/fixtures/sft.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures.sft import STEPS
from helpers.recipes import read_metrics

pytestmark = pytest.mark.slow


def test_two_ranks_each_hold_half_of_every_parameter(reference_run):
    summary = json.loads((reference_run / "run_summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["distributed_type"] == "FSDP"
    assert summary["fsdp"]["version"] == 2
    assert summary["fsdp"]["wrap_classes"] == ["LlamaDecoderLayer"]
    assert summary["parameter_placements"] == ["(Shard(dim=0),)"]  # every parameter is a DTensor shard
    per_rank, total = summary["parameters_per_rank"], summary["parameters_total"]
    assert sum(per_rank) == total
    for held in per_rank:
        assert abs(held - total / 2) / total < 0.02, per_rank
    assert summary["recipe"] == "sft" and summary["task"] == "causal-lm"
    assert summary["attn_implementation"].startswith("sdpa")


def test_two_ranks_print_each_line_and_progress_bar_once(reference_output):
    """Only each machine's main process logs and shows datasets' bars (the other logs warnings and errors only). A
    bar is absent when datasets serves the tokenised rows from its cache, so a bar is checked to show at most once."""
    for bar in ("Tokenizing train", "Tokenizing eval"):
        finished = [part for part in reference_output.replace("\r", "\n").splitlines() if part.startswith(bar)]
        assert sum("100%" in part for part in finished) <= 1, finished
    assert reference_output.count("run summary:") == 1 and "[RANK 1]" not in reference_output
    assert reference_output.count("final metrics") == 1 and "peak_memory_gib_max: measured" in reference_output
    # the loss, computed inside the output layer, is returned as no view: FSDP2's pre-backward hook stays attached
    assert "returned a view tensor" not in reference_output


def test_two_rank_losses_equal_one_process_with_the_same_global_batch(reference_run, one_process_run):
    """Also chunked cross-entropy under FSDP2 (the reference run) against whole logits (the 1-process run)."""
    assert json.loads((reference_run / "run_summary.json").read_text())["loss"].startswith("chunked cross-entropy")
    assert json.loads((one_process_run / "run_summary.json").read_text())["loss"] == "whole logits"
    two = [r["loss"] for r in read_metrics(reference_run) if "loss" in r]
    one = [r["loss"] for r in read_metrics(one_process_run) if "loss" in r]
    assert len(two) == len(one) == STEPS
    assert two[-1] < two[0]  # it trains
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)


def test_metrics_log_has_train_and_eval_records(reference_run, one_process_run, tiny_model_config):
    from transformers import AutoConfig

    records = read_metrics(reference_run)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "eval_loss" in r] == [STEPS]
    assert [r.get("warmup", False) for r in train] == [True] + [False] * (STEPS - 1)  # the first window only
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
        assert 1 <= width <= 64 and width == pytest.approx(round(width * 2) / 2)  # mean padded width of 2 batches
    with_peak = [r for r in read_metrics(one_process_run) if "loss" in r]
    for record in with_peak:
        assert record["mfu"] == pytest.approx(record["achieved_flops_per_device"] / 1e12)
    assert list((reference_run / "sft").glob("events.out.tfevents.*"))  # the TensorBoard tracker wrote
    assert (reference_run / "training_curves.png").stat().st_size > 10_000
    assert "training_curves.png" in (reference_run / "README.md").read_text()


def test_exact_match_is_measured_before_and_after(reference_run):
    results = json.loads((reference_run / "eval_results.json").read_text())
    assert {key for key in results if not key.startswith("benchmark/")} == {"exact_match_before", "exact_match_after"}
    assert [r["step"] for r in read_metrics(reference_run) if "exact_match" in r] == [0, STEPS]


def non_embedding_parameters(config) -> int:
    """Counted by hand from the Llama architecture, independently of the code under test."""
    hidden, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config.intermediate_size + 2 * hidden
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * hidden
    return config.num_hidden_layers * per_layer + hidden + lm_head


def eval_loss_of_exported_model(folder: Path, data: Path) -> float:
    """Recomputes the recipe's held-out loss from the exported folder alone, in this (single) process."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.data.chat import tokenize_dataset
    from fsdp_recipes.data.rows import build_rows, collate_rows
    from fsdp_recipes.train.losses import causal_lm_loss_sum, count_targets

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eval_raw = load_dataset(str(data))["test"]
    tokens, _ = tokenize_dataset(
        eval_raw, tokenizer, assistant_only_loss=True, completion_only_loss=True, max_length=64
    )
    rows = build_rows(tokens, max_length=64, packing=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            batch = collate_rows([rows[i] for i in range(start, min(start + 8, len(rows)))], tokenizer.pad_token_id)
            total += float(causal_lm_loss_sum(model, batch))
            count += count_targets(batch)
    return total / count


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_export_reloads_and_reproduces_the_trained_model(request, state_dict_type, small_chat_data):
    folder = request.getfixturevalue(
        "reference_run" if state_dict_type == "SHARDED_STATE_DICT" else "full_state_dict_run"
    )
    summary = json.loads((folder / "run_summary.json").read_text())
    assert summary["fsdp"]["state_dict_type"] == state_dict_type
    if state_dict_type == "FULL_STATE_DICT":  # that run also has the performance switches on
        assert summary["activation_checkpointing"] == "model (gradient_checkpointing)"
        assert summary["optim"] == "adamw_torch_fused"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert (folder / name).is_file(), name
    logged = [r["eval_loss"] for r in read_metrics(folder) if "eval_loss" in r][-1]
    assert eval_loss_of_exported_model(folder, small_chat_data) == pytest.approx(logged, rel=1e-5)
    card = (folder / "README.md").read_text()
    assert "FSDP_STATE_DICT_TYPE" in card and "learning_rate" in card and "eval_loss" in card
    assert "pipeline_tag: text-generation" in card and "AutoModelForCausalLM.from_pretrained" in card


def test_benchmarks_scored_on_the_sharded_model_equal_lm_eval_on_the_exported_folder(
    reference_run, reference_benchmarks, tmp_path
):
    """lm-eval every 3 steps on the 2-rank FSDP2 model (the documents split over the ranks, lockstep forwards), in
    the log, eval_results.json and the card; the last scores are those of `lm_eval --model hf` on the exported folder,
    run as a user runs it: its CLI, one process, the same options."""
    import subprocess
    import sys

    from helpers.paths import REPO

    scored = [r for r in read_metrics(reference_run) if "benchmark_time_s" in r]
    assert [r["step"] for r in scored] == [3, 6, 9, 12]
    last = scored[-1]
    names = ("demo_reverse/exact_match", "demo_first_letter/acc", "demo_first_letter/acc_norm")
    assert all(f"benchmark/{name}" in last for name in names)
    perplexities = [r["benchmark/reverse_rolling/word_perplexity"] for r in scored]
    assert perplexities == sorted(perplexities, reverse=True)  # training on these strings makes them likelier
    results = json.loads((reference_run / "eval_results.json").read_text())
    assert {k: v for k, v in last.items() if k.startswith("benchmark/")} == {
        k: v for k, v in results.items() if k.startswith("benchmark/")
    }
    card = (reference_run / "README.md").read_text()
    assert "demo_first_letter" in card and "lm-evaluation-harness" in card
    from matplotlib.image import imread

    figure = imread(reference_run / "training_curves.png")  # loss, speed, scores in [0, 1], perplexities: 4 panels
    assert figure.shape[1] == 4 * 550

    tasks = ",".join(reference_benchmarks["benchmark_tasks"])
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "hf",
        "--model_args", f"pretrained={reference_run},dtype=float32", "--tasks", tasks,
        "--include_path", str(REPO / "src" / "fsdp_recipes" / "train" / "benchmark_tasks"),
        "--limit", str(reference_benchmarks["benchmark_limit"]), "--apply_chat_template", "--batch_size", "8",
        "--device", "cpu", "--output_path", str(tmp_path / "lm_eval"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = (tmp_path / "lm_eval").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]
    assert last["benchmark/demo_reverse/exact_match"] == theirs["demo_reverse"]["exact_match,none"]
    assert last["benchmark/demo_first_letter/acc"] == theirs["demo_first_letter"]["acc,none"]
    assert last["benchmark/demo_first_letter/acc_norm"] == theirs["demo_first_letter"]["acc_norm,none"]
    for metric in ("word_perplexity", "bits_per_byte"):
        assert last[f"benchmark/reverse_rolling/{metric}"] == pytest.approx(
            theirs["reverse_rolling"][f"{metric},none"], rel=1e-5
        )
