"""Tensor and expert parallelism through transformers' DistributedConfig, with real processes: every training recipe
(and eval) under TP 2 gives the losses, gradient norms and exported weights of one process, GRPO the same completions,
eval the same generations counted once, on-policy distillation (GKD) the same samples and losses, GRPO with a tool
(a scripted policy's calls answered, the answers masked) the same rounds; a mixture of experts under FSDP 2 x TP 2 x EP 2 (the experts split over 2
ranks, gradient accumulation, the model's activation checkpointing, the router's load-balancing loss) equals one
process too, its checkpoint resumes exactly on the same layout and on one process (DCP reshards the experts), and
exports offline to the end-of-run model.

Launches are few: one 2-process launch runs every recipe in turn (tests/scripts/recipes_in_sequence.py); the MoE's
SFT and its resume run in the suite's one 4-process launch (tests/fixtures/four_processes.py); the one-process
references run here meanwhile. The tiny models of the
other tests have 103 vocabulary entries, which TP 2 cannot split: this module's fixtures give them 104."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.every_recipe import TRAINING_RECIPES
from fixtures.four_processes import moe_values
from fixtures.grpo import tool_run_values
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.tools import cli
from helpers.data import write_tiny_model_config
from helpers.launch import alongside, launch, require_success
from helpers.paths import REPO
from helpers.recipes import read_metrics, recipe_config, run_recipe_in_process, run_recipe_launched_here
from helpers.scripted_tools import CONVERSATION_REWARD, TOOLS_FILE, scripted_generation

TP_VOCAB = 104  # the tokenizer's 103 entries, padded to what TP 2 divides
SEQUENCE = REPO / "tests" / "scripts" / "recipes_in_sequence.py"
TP_2 = REPO / "accelerate_configs" / "tp_2proc_cpu.yaml"
ONE_PROCESS_FSDP = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"


@pytest.fixture(scope="module")
def tiny_model_config(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model_config(tmp_path_factory.mktemp("tp_model") / "config.json", tokenizer, vocab_size=TP_VOCAB)


@pytest.fixture(scope="module")
def pretrained_tiny_model(tmp_path_factory, tokenizer) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tp_pretrained")
    config = LlamaConfig.from_json_file(write_tiny_model_config(folder / "source.json", tokenizer, vocab_size=TP_VOCAB))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


@pytest.fixture(scope="module")
def student_config(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tp_student")
    return write_tiny_model_config(
        folder / "config.json", tokenizer, hidden_size=32, intermediate_size=64, vocab_size=TP_VOCAB
    )


def step_values(output_dir: Path, keys=("loss", "grad_norm")) -> dict[tuple[int, str], float]:
    return {
        (row["step"], key): row[key] for row in read_metrics(output_dir) for key in keys if row.get(key) is not None
    }


def assert_same_run(launched: Path, one: Path, what: str, keys=("loss", "grad_norm")) -> None:
    got, expected = step_values(launched, keys), step_values(one, keys)
    assert got and got.keys() == expected.keys(), (what, sorted(got), sorted(expected))
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (what, key, got[key], expected[key])
    weights = sorted(one.glob("*.safetensors"))
    assert weights, f"{what}: no exported weights in {one}"
    for file in weights:
        mine, theirs = load_file(launched / file.name), load_file(file)
        assert mine.keys() == theirs.keys(), what
        for name in theirs:
            # AdamW's first steps move a weight whose gradient is near 0 by up to the learning rate (1e-3 here) times a
            # ratio the reduction order can tip: a few elements in 80,000 differ by up to 5e-5
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-4, msg=f"{what}: {name}")


def eval_values(model: Path, data: Path, output_dir: Path) -> dict:
    return dict(
        model_name_or_path=str(model), dataset_name=str(data), output_dir=str(output_dir), max_length=64,
        per_device_eval_batch_size=4, max_new_tokens=6, metrics=["perplexity", "exact_match", "chrf"],
    )  # fmt: skip


def test_every_recipe_under_tp_2_equals_one_process(
    tmp_path, request, short_run_values, pretrained_tiny_model, small_chat_data
):
    runs = {recipe: (recipe, short_run_values(recipe)) for recipe in TRAINING_RECIPES}
    runs["eval"] = ("eval", lambda output: eval_values(pretrained_tiny_model, small_chat_data, output))
    distill = short_run_values("distill")  # on-policy (GKD): step 2 on the student's samples, 1 on the teacher's
    runs["gkd"] = ("distill", lambda output: {**distill(output), "lmbda": 0.26, "seq_kd": True, "max_new_tokens": 6})
    (tmp_path / "my_tools.py").write_text(TOOLS_FILE)
    (tmp_path / "my_rewards.py").write_text(CONVERSATION_REWARD)
    data = request.getfixturevalue("prompt_data")
    runs["tools"] = ("grpo+scripted_tools", lambda out: tool_run_values(tmp_path, pretrained_tiny_model, data, out))
    arguments = []
    for name, (recipe, values) in runs.items():
        arguments += [recipe, str(recipe_config(tmp_path / f"tp_{name}.yaml", **values(tmp_path / "tp" / name)))]

    def one_process() -> None:
        for name, (recipe, values) in runs.items():
            recipe, _, option = recipe.partition("+")
            with scripted_generation() if option else contextlib.nullcontext():
                run_recipe_in_process(recipe, tmp_path, f"one_{name}", values(tmp_path / "one" / name))

    _, (result,) = alongside(one_process, lambda: launch(SEQUENCE, arguments, accelerate_config=TP_2))
    require_success(result)
    for name in (*TRAINING_RECIPES, "gkd", "tools"):
        assert_same_run(tmp_path / "tp" / name, tmp_path / "one" / name, name)
    tool_rounds = step_values(tmp_path / "tp" / "tools", ("tools/call_frequency", "tools/failure_frequency"))
    assert tool_rounds == step_values(tmp_path / "one" / "tools", ("tools/call_frequency", "tools/failure_frequency"))
    assert tool_rounds[(1, "tools/call_frequency")] == 1.0
    assert step_values(tmp_path / "tp" / "gkd", ("on_policy",)) == {(1, "on_policy"): 0.0, (2, "on_policy"): 1.0}
    summary = json.loads((tmp_path / "tp" / "sft" / "run_summary.json").read_text())
    assert summary["tensor_parallel"]["layout"] == "tp 2" and summary["global_batch_rows"] == 4
    # the layout each rank read at start-up is the one the linter and the estimator read from the YAML
    assert summary["parallel_dims"] == LaunchLayout.from_file(TP_2).parallel.describe()
    assert "tensor_parallel" in summary["checks_before_loading"] and "positions" in summary["checks_before_loading"]
    assert "Shard(dim=0)" in str(summary["parameter_placements"])  # sharded, not replicated
    # the estimator's TP shapes: what each rank holds, exactly (parameters, gradients, AdamW state)
    assert summary["state_bytes_per_rank"] == summary["memory_estimate"]["rank_state_bytes_per_rank"]
    # GRPO: the same completions, generated by the TP group together
    completions = [(tmp_path / side / "grpo" / "completions.jsonl").read_text() for side in ("tp", "one")]
    assert completions[0] == completions[1] and completions[0]
    # eval: the same held-out loss, and the same generations counted once (not once per TP rank)
    results = [json.loads((tmp_path / side / "eval" / "eval_results.json").read_text()) for side in ("tp", "one")]
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-6)
    for key in ("eval_exact_match", "eval_chrf", "eval_samples"):
        assert results[0][key] == results[1][key], key
    predictions = [(tmp_path / side / "eval" / "eval_predictions.jsonl").read_text() for side in ("tp", "one")]
    assert predictions[0] == predictions[1]


def test_an_moe_under_fsdp_2_x_tp_2_x_ep_2_equals_one_process_and_its_checkpoint_resumes_on_the_same_layout_and_on_one(
    tmp_path, four_process_launch, chat_data
):
    """Run in the suite's 4-process launch (tests/fixtures/four_processes.py): SFT of the MoE for 3 steps with a
    checkpoint at 2 under FSDP 2 x TP 2 x EP 2, then resumed from it; the one-process twin ran alongside."""
    launched = four_process_launch
    assert_same_run(
        launched / "nd", launched / "one_moe", "fsdp 2 x tp 2 x ep 2", keys=("loss", "aux_loss", "grad_norm")
    )
    summary = json.loads((launched / "nd" / "run_summary.json").read_text())
    # ep reached every rank (here through the launch's environment; from a launched YAML, expert_parallel reads it)
    assert summary["tensor_parallel"]["layout"] == "fsdp 2 x tp 2 x ep 2" and summary["global_batch_rows"] == 16
    assert summary["parallel_dims"] == ParallelDims(dp_shard=2, tp=2, ep=2).describe()
    assert "('efsdp', 'ep')" in summary["parameter_meshes"], summary["parameter_meshes"]  # the experts' own mesh
    # the estimator's expert split: each rank holds 1/(ep x efsdp) of the routed experts, exactly as predicted
    held = [rank["routed_expert_parameters"] for rank in summary["state_bytes_per_rank"]]
    predicted = [rank["routed_expert_parameters"] for rank in summary["memory_estimate"]["rank_state_bytes_per_rank"]]
    assert held == predicted and held[0] > 0, (held, predicted)
    # resumed on the same layout: step 3 as the uninterrupted run had it, bitwise
    assert step_values(launched / "nd_resumed")[(3, "loss")] == step_values(launched / "nd")[(3, "loss")]
    for name, tensor in load_file(launched / "nd" / "model.safetensors").items():
        assert torch.equal(load_file(launched / "nd_resumed" / "model.safetensors")[name], tensor), name
    # the offline export of the last checkpoint (one CPU process) is the end-of-run export, bitwise
    exported = tmp_path / "exported"
    assert cli.main(["export", str(launched / "nd" / "checkpoints" / "step-00000003"), str(exported)]) == 0
    for name, tensor in load_file(launched / "nd" / "model.safetensors").items():
        assert torch.equal(load_file(exported / "model.safetensors")[name], tensor), name
    # resumed on one process (FSDP2 over 1 rank): DCP reshards the TP x FSDP checkpoint
    on_one = {
        **moe_values(chat_data, tmp_path / "resumed_on_one"),
        "resume_from_checkpoint": str(launched / "nd" / "checkpoints" / "step-00000002"),
        "per_device_train_batch_size": 8,
    }
    run_recipe_launched_here("sft", tmp_path, "resumed_on_one", on_one, ONE_PROCESS_FSDP)
    assert step_values(tmp_path / "resumed_on_one")[(3, "loss")] == pytest.approx(
        step_values(launched / "nd")[(3, "loss")], rel=1e-5
    )
