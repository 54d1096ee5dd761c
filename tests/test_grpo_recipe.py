"""recipes/grpo.py: 2-process FSDP2 runs equal their 1-process twins (completions, rewards, losses), with each
reference mode; an interrupted run resumes exactly; bad inputs are refused before weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.grpo import GRPO_STEPS, grpo_values, uneven_reward
from fsdp_recipes.common.faults import FAULT_ENV, InjectedFault
from fsdp_recipes.train.checkpoint import read_rank_state
from helpers.recipes import read_metrics, recipe_error_in_process, run_recipe_in_process

SAME_ON_ANY_SPLIT = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "tokens/generated",
    "dynamic_sampling/kept_groups",
    "dynamic_sampling/generation_rounds",
)
COMPUTED = ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm")


def step_records(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


def split_independent(record: dict) -> tuple[str, ...]:
    """The figures of a step that depend on neither the rank split nor a resume: SAME_ON_ANY_SPLIT and each reward's."""
    return SAME_ON_ANY_SPLIT + tuple(name for name in record if name.startswith("rewards/"))


def completions_of(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["full", "lora"])
def test_two_processes_generate_and_learn_as_one(grpo_runs, setting):
    """Completions, rewards and losses on 2 processes equal the 1-process run's (rtol 1e-5), with the reference a
    frozen copy sharded like the policy (full) or the policy with its adapters off (LoRA), and with the options past
    TRL's core (fixtures.grpo.new_options): full runs dynamic sampling (a second generation pass, then the bound),
    the sequence-level ratio, two-sided clipping and entropy masking; LoRA RLOO, SAPO, padding-free passes and an
    entropy bonus. The 2-process runs generate with the paged engine (full) and static_compiled (LoRA), the twins with
    generate."""
    two, one = grpo_runs[setting]
    twos, ones = step_records(two), step_records(one)
    assert sorted(twos) == sorted(ones) == list(range(1, GRPO_STEPS + 1))
    for step in ones:
        for name in split_independent(ones[step]):
            assert twos[step][name] == pytest.approx(ones[step][name], rel=1e-6), (step, name)
        for name in COMPUTED:
            assert twos[step][name] == pytest.approx(ones[step][name], rel=1e-5, abs=1e-7), (step, name)
    assert completions_of(two) == completions_of(one)  # rank 0's first 4 completions: the round's first 4 slots
    assert ones[1]["kl"] == 0 and ones[2]["kl"] > 0  # step 2 reuses step 1's completions with an updated policy
    assert ones[2]["clip_ratio/region_mean"] >= 0 and ones[1]["clip_ratio/region_mean"] == 0
    summary = json.loads((two / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and "Shard(dim=0)" in summary["parameter_placements"][0]
    assert "gathered once per generation pass" in summary["generation"]
    assert {"full": "continuous batching", "lora": "static KV cache"}[setting] in summary["generation"]
    assert summary["reference"] == {"full": "model", "lora": "adapters"}[setting]
    assert {"full": "sequence-level ratio", "lora": "rloo advantages"}[setting] in summary["loss"]
    if setting == "full":  # the first pass had one group with a reward spread of two: a second pass, then the bound
        assert (ones[1]["dynamic_sampling/generation_rounds"], ones[1]["dynamic_sampling/kept_groups"]) == (2, 1)
        assert ones[1]["tokens/generated"] > 8 and "rewards/completion_length_on_even_answers/mean" in ones[1]
    assert 0 < ones[1]["time/generation_share"] < 1 and ones[1]["tokens/generated_per_second"] > 0
    assert 0 < summary["step_time_shares"]["generation"] < 1


def assert_the_tracker_shows_the_logged_completions(output_dir: Path) -> None:
    """TensorBoard's text tab gets, at each logging step, a table of the completions.jsonl rows written then."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(output_dir.rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    tables = {
        event.step: event.tensor_proto.string_val[0].decode() for event in events.Tensors("completions/text_summary")
    }
    logged = completions_of(output_dir)
    assert sorted(tables) == sorted({row["step"] for row in logged}) and tables
    for row in logged:  # a pipe in a completion is escaped, so that it does not split the table's cell
        completion = row["completion"].replace("|", "\\|").replace("\n", " ")
        assert f"| {completion} | {row['reward']:.4g} |" in tables[row["step"]]


def test_an_interrupted_run_resumes_with_identical_completions_losses_and_weights(
    tmp_path, pretrained_tiny_model, prompt_data, monkeypatch
):
    """A run that fails after step 3 (its last checkpoint: step 2, between generation rounds) resumed: the same
    completions and losses as the uninterrupted run, bitwise-equal final weights. With dynamic sampling, the prompts
    drawn beyond their rounds are the only sampling state the checkpoint needs."""
    values = grpo_values(
        pretrained_tiny_model, prompt_data, tmp_path / "whole", per_device_train_batch_size=8, save_steps=2, max_steps=4,
        dynamic_sampling=True, reward_funcs=["partial_match", uneven_reward(prompt_data)],
    )  # fmt: skip
    run_recipe_in_process("grpo", tmp_path, "whole", {**values, "report_to": "tensorboard"})
    assert_the_tracker_shows_the_logged_completions(tmp_path / "whole")
    values["output_dir"] = str(tmp_path / "stopped")
    monkeypatch.setenv(FAULT_ENV, "raise-after-step:3")
    with pytest.raises(InjectedFault):
        run_recipe_in_process("grpo", tmp_path, "stopped", values)
    monkeypatch.delenv(FAULT_ENV)
    drawn = read_rank_state(tmp_path / "stopped" / "checkpoints" / "step-00000002", 0)["extra_prompts_drawn"]
    assert drawn > 0  # dynamic sampling drew beyond round 1's prompts: round 2 starts after them
    run_recipe_in_process("grpo", tmp_path, "resumed", {**values, "resume_from_checkpoint": "latest"})
    whole, resumed = step_records(tmp_path / "whole"), step_records(tmp_path / "stopped")
    assert [resumed[s]["loss"] for s in sorted(resumed)] == [whole[s]["loss"] for s in sorted(whole)]
    assert all(resumed[s][name] == whole[s][name] for s in whole for name in split_independent(whole[s]))
    assert completions_of(tmp_path / "stopped") == completions_of(tmp_path / "whole")  # steps 1 and 3 generated
    for name, tensor in load_file(tmp_path / "whole" / "model.safetensors").items():
        assert torch.equal(tensor, load_file(tmp_path / "stopped" / "model.safetensors")[name]), name


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"num_generations": 3}, "num_generations (3) must divide the global batch of completions"),
        ({"max_completion_length": 24}, "max_completion_length must be >= 1 and < max_length"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"epsilon": 0}, "epsilon must be > 0"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"reward_funcs": [], "reward_weights": None}, "reward_funcs is required: name at least one"),
        ({"reward_funcs": ["no_such_module_xyz:reward"], "reward_weights": None}, "could not be imported"),
        ({"reward_weights": [1.0]}, "reward_weights has 1 values for 2 reward_funcs"),
        ({"loss_type": "ppo"}, "loss_type 'ppo' is not one of"),
        ({"importance_sampling_level": "completion"}, "importance_sampling_level 'completion' is not one of"),
        ({"advantage_estimator": "gae"}, "advantage_estimator 'gae' is not one of"),
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile must be in (0, 1]"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in (0, 1]"),
        ({"dynamic_sampling": True, "max_generation_rounds": 0}, "max_generation_rounds must be >= 1"),
        ({"delta": 1.1}, "delta must be > 1 + epsilon_high"),
        ({"loss_type": "cispo"}, "loss_type cispo caps the ratio at epsilon_high itself"),
        ({"save_steps": 3}, "save_steps (3) must be a multiple of num_iterations (2)"),
        ({"dataset_name": "NO_PROMPTS"}, "no 'prompt' column"),
    ],
)
def test_bad_inputs_are_refused_before_weights_load(
    tmp_path, capsys, pretrained_tiny_model, prompt_data, overrides, words
):
    if overrides.get("dataset_name") == "NO_PROMPTS":
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n' * 8)
        overrides = {"dataset_name": str(tmp_path / "data")}
    values = grpo_values(pretrained_tiny_model, prompt_data, tmp_path / "out", **overrides)
    error = recipe_error_in_process("grpo", tmp_path, values, capsys)
    assert words in error
    assert not (tmp_path / "out").exists()


def test_the_memory_estimate_counts_the_generation_pass_and_the_reference_copy():
    from fsdp_recipes.distributed.accelerate_config import LaunchLayout
    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.tools.estimator.formulas import estimate_for_recipe
    from fsdp_recipes.tools.estimator.recipe import config_class
    from fsdp_recipes.tools.estimator.shapes import load_model_info
    from helpers.paths import REPO

    grpo = config_class(REPO / "recipes" / "grpo.py")
    assert (grpo(beta=0.0).frozen_model_copies(), grpo(beta=0.1).frozen_model_copies()) == (0, 1)
    assert grpo(beta=0.1, use_peft=True).frozen_model_copies() == 0  # the policy with its adapters off
    info = load_model_info(str(REPO / "src/fsdp_recipes/tools/estimator/model_shapes/Qwen/Qwen2.5-1.5B"))
    layout = LaunchLayout(ParallelDims(dp_shard=8))
    small, large = (
        estimate_for_recipe(
            info, layout, grpo(per_device_eval_batch_size=n, max_length=4096, beta=0.1, per_device_train_batch_size=1)
        )
        for n in (8, 256)
    )
    kv_per_sequence = 2 * info.num_layers * info.num_kv_heads * info.head_dim * layout.compute_bytes * 4096  # K and V
    assert large.generation - small.generation == 248 * (kv_per_sequence + 4 * info.vocab_size)
    assert small.per_gpu()["reference_model"] > 0
    assert large.total == large.device_state + max(large.generation, large.activations_used + sum(
        large.buffers[k] for k in ("all_gather", "reduce_scatter")
    ))  # fmt: skip
    assert large.generation > large.activations_used and large.total > small.total  # the KV cache bounds memory
