"""DeepSeek-V3's auxiliary-loss-free balancing (train/expert_bias.py): each router's `e_score_correction_bias` moves by
`router_bias_update_rate` x sign(mean load - load) after every optimizer step, from the experts the router chose over
the step's forwards with gradients; in-process, a tiny DeepSeek-V3. (2 ranks against 1 process, the loads summed over
ranks: tests/test_two_ranks_in_one_launch.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fsdp_recipes.distributed.parallel_dims import ParallelDims
from helpers.recipes import base_recipe_values, read_metrics, recipe_error_in_process, run_recipe_in_process
from helpers.tiny_moe import COMMON, FAMILIES, tiny_moe

FAMILIES_SHOWN = ("deepseek_v3", "qwen3_moe")

ONE_PROCESS = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
ONE_LAYOUT = ParallelDims()  # one process: every size 1


def deepseek(**overrides):
    return tiny_moe("deepseek_v3", num_hidden_layers=3, **overrides)  # layer 0 dense, layers 1 and 2 routed


def settings(rate=None, **overrides):
    defaults = dict(gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    return SimpleNamespace(router_bias_update_rate=rate, **{**defaults, **overrides})


def test_each_layers_bias_moves_by_the_rate_towards_its_own_global_mean_load_and_logs_the_worst_imbalance(monkeypatch):
    from fsdp_recipes.train import expert_bias

    model = deepseek()
    updates = expert_bias.attach(model, settings(0.01))
    assert [type(router).__name__ for router in updates.routers] == ["DeepseekV3TopkRouter"] * 2
    start = torch.tensor([[0.9, -0.3, 0.0, -0.6], [0.1, 0.2, 0.3, 0.4]])
    with torch.no_grad():
        for router, bias in zip(updates.routers, start):
            router.e_score_correction_bias.copy_(bias)
    updates.counts = torch.tensor([[5.0, 1.0, 3.0, 3.0], [0.0, 6.0, 4.0, 2.0]], dtype=torch.float64)  # means 3, 3
    updates.update(ONE_PROCESS, ONE_LAYOUT)
    moved = torch.stack([router.e_score_correction_bias for router in updates.routers]) - start
    expected = torch.tensor([[-1.0, 1.0, 0.0, 0.0], [1.0, -1.0, -1.0, 1.0]]) * 0.01  # under-loaded up, over-loaded down
    torch.testing.assert_close(moved, expected, rtol=0, atol=1e-7)
    assert updates.figures() == {"moe/load_imbalance": pytest.approx(2.0)}  # max(5/3, 6/3): the worst layer's
    assert updates.counts is None  # the next step counts afresh
    # the loads are those summed over the ranks: another rank's [0, 6, 3, 3] turns the first layer's signs around
    other_rank = torch.tensor([[0.0, 6.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    monkeypatch.setattr(expert_bias, "sum_tensor_over_ranks", lambda accelerator, loads, parallel: loads + other_rank)
    before = torch.stack([router.e_score_correction_bias.clone() for router in updates.routers])
    updates.counts = torch.tensor([[5.0, 1.0, 3.0, 3.0], [0.0, 6.0, 4.0, 2.0]], dtype=torch.float64)
    updates.update(ONE_PROCESS, ONE_LAYOUT)
    moved = torch.stack([router.e_score_correction_bias for router in updates.routers]) - before
    expected = torch.tensor([[1.0, -1.0, 0.0, 0.0], [1.0, -1.0, -1.0, 1.0]]) * 0.01  # global mean 6: [5, 7, 6, 6]
    torch.testing.assert_close(moved, expected, rtol=0, atol=1e-7)
    monkeypatch.undo()
    # rate 0, or a model whose routers keep no bias: nothing attached, nothing moves
    assert expert_bias.attach(model, settings(0.0)) is None
    assert expert_bias.attach(tiny_moe("qwen3_moe"), settings(0.01)) is None
    still = expert_bias.ExpertBias(model, 0.0)
    before = [router.e_score_correction_bias.clone() for router in still.routers]
    still.counts = torch.tensor([[5.0, 1.0, 3.0, 3.0], [0.0, 6.0, 4.0, 2.0]], dtype=torch.float64)
    still.update(ONE_PROCESS, ONE_LAYOUT)
    assert all(torch.equal(a, router.e_score_correction_bias) for a, router in zip(before, still.routers))
    assert expert_bias.resolved_rate(None, "deepseek_v3") == 0.001  # the default: DeepSeek-V3's, for DeepSeek-V3
    assert expert_bias.resolved_rate(None, "glm4_moe") == 0.0  # keeps the bias, untested here: only when set
    assert expert_bias.resolved_rate(0.002, "glm4_moe") == 0.002


def test_zero_computation_experts_are_refused_and_a_checkpoint_from_before_the_field_is_not_resumed_silently(tmp_path):
    """LongCat-Flash's router also chooses zero-computation experts, which the update would balance as ordinary
    ones: a rate set on it is refused. A checkpoint whose saved config predates router_bias_update_rate moved no
    bias: resuming a DeepSeek-V3 one with the default (DeepSeek-V3's rate) is refused with the two ways on."""
    from transformers import AutoConfig

    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train import expert_bias
    from fsdp_recipes.train.config import TrainingConfig

    longcat = AutoConfig.for_model("longcat_flash", zero_expert_num=2, n_routed_experts=4)
    settings = TrainingConfig(output_dir=str(tmp_path), router_bias_update_rate=0.001)
    assert "2 zero-computation experts" in expert_bias.rate_problem(longcat, settings)
    resumed = TrainingConfig(output_dir=str(tmp_path))  # router_bias_update_rate null: the default
    deepseek_v3, qwen3_moe = (
        AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]}) for family in FAMILIES_SHOWN
    )
    assert "Set router_bias_update_rate: 0 to resume" in expert_bias.resume_problem(deepseek_v3, resumed, {})
    assert expert_bias.resume_problem(qwen3_moe, resumed, {}) is None  # no bias: nothing changes
    assert expert_bias.resume_problem(deepseek_v3, resumed, {"router_bias_update_rate": None}) is None
    stopped = TrainingConfig(output_dir=str(tmp_path), router_bias_update_rate=0.0)
    assert expert_bias.resume_problem(deepseek_v3, stopped, {}) is None
    # a router whose output holds no chosen experts: one error line (a user error), not a traceback
    updates = expert_bias.ExpertBias(tiny_moe("deepseek_v3"), 0.001)
    with pytest.raises(ConfigError, match="returned no integer tensor of chosen experts"):
        updates._count(0, (torch.zeros(2, 4),))


def test_the_loads_are_the_chosen_experts_of_real_tokens_in_forwards_with_gradients_counted_once():
    """What the router returned (its group-limited top-k of score + bias), the micro-batch's padding left out, a
    forward without gradients not counted, nor the recomputation activation checkpointing runs in the backward."""
    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.models.modeling import checkpoint_activations
    from fsdp_recipes.train import expert_bias

    model = deepseek(n_group=2, topk_group=1)  # group-limited: both chosen experts come from one group of 2
    checkpoint_activations(model, None)  # the recipes' default: non-reentrant
    model.train()
    updates = expert_bias.attach(model, settings())
    chosen = []
    for router in updates.routers:
        router.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
    batch = {"input_ids": torch.randint(3, 100, (2, 6)), "real_tokens": torch.tensor([6, 4])}
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert updates.counts is None and len(chosen) == 2
    chosen.clear()
    updates.micro_batch = batch
    model(input_ids=batch["input_ids"]).logits.sum().backward()
    real = torch.tensor([True] * 6 + [True] * 4 + [False] * 2)
    assert len(chosen) == 4  # 2 routers, each run again by the checkpointed backward
    expected = torch.stack([torch.bincount(indices[real].flatten(), minlength=4).double() for indices in chosen[:2]])
    assert torch.equal(updates.counts, expected) and updates.counts.sum() == 2 * 10 * 2
    assert all((indices // 2).unique(dim=1).shape[1] == 1 for indices in chosen[:2])  # one group per token
    reentrant = settings(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match="set use_reentrant: false"):  # no load would count
        expert_bias.attach(deepseek(), reentrant)


def test_an_sft_run_moves_the_bias_logs_the_imbalance_and_a_resume_continues_from_the_checkpointed_bias(
    tmp_path, small_chat_data
):
    config = {"model_type": "deepseek_v3", **COMMON, **FAMILIES["deepseek_v3"]}
    (tmp_path / "moe.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    values = base_recipe_values(
        tmp_path / "moe.json", small_chat_data, out, max_steps=2, save_steps=1, exact_match_eval_samples=0,
        eval_steps=1000, router_bias_update_rate=0.01,
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "run", values)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["router_bias_update"].startswith("rate 0.01: after each step, the e_score_correction_bias of 1 ")
    steps = [record for record in read_metrics(out) if "loss" in record and "eval_loss" not in record]
    assert len(steps) == 2 and all(record["moe/load_imbalance"] >= 1 for record in steps)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    exported = load_file(out / "model.safetensors")[bias]
    # two steps from zeros: each expert moved by 0, 1 or 2 steps of 0.01, and not all by 0
    assert exported.abs().max() > 0 and torch.allclose(exported * 100, (exported * 100).round(), atol=1e-4)
    saved = next((out / "checkpoints" / "step-00000002").rglob("model*.safetensors"))
    assert torch.equal(load_file(saved)[bias], exported)
    # step 2 again from the step-1 checkpoint: its bias (not zeros) is where the update continues
    again = tmp_path / "again"
    resumed = {**values, "output_dir": str(again), "resume_from_checkpoint": str(out / "checkpoints" / "step-00000001")}
    run_recipe_in_process("sft", tmp_path, "resumed", resumed)
    assert torch.equal(load_file(again / "model.safetensors")[bias], exported)
    step_2 = [record for record in read_metrics(again) if "loss" in record and "eval_loss" not in record]
    assert [record["step"] for record in step_2] == [2] and step_2[0]["loss"] == steps[-1]["loss"]


@pytest.mark.parametrize(
    "model, extra, expected",
    [
        ("dense", {}, "router_bias_update_rate 0.001 on Llama, a dense model (no router to balance): remove it"),
        ("deepseek_v3", {"use_peft": True}, "router_bias_update_rate 0.001 with use_peft: LoRA trains adapters on a"),
    ],
    ids=["dense", "lora"],
)
def test_a_rate_on_a_dense_model_or_under_lora_is_refused_before_loading(
    tmp_path, small_chat_data, tiny_model_config, capsys, model, extra, expected
):
    if model != "dense":  # LoRA adapts pretrained weights: a folder (its config is all the checks before loading read)
        (tmp_path / "base").mkdir()
        (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": model, **COMMON, **FAMILIES[model]}))
        extra = {**extra, "model_config": None, "model_name_or_path": str(tmp_path / "base")}
    values = base_recipe_values(
        tiny_model_config, small_chat_data, tmp_path / "out", router_bias_update_rate=0.001, **extra
    )
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert expected in error, error
