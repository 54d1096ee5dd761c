"""Mixture-of-experts models (issue 33, the FSDP-only part so far): transformers 5 holds experts fused in memory
(`mlp.experts.gate_up_proj`) and writes and reads them per expert (`mlp.experts.N.gate_proj.weight`) through its weight
conversion, so exports are checked by loading the folder back; generation works with router logits turned on. A tiny
model of each family transformers ships, no processes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fsdp_recipes.distributed.parallel_dims import ParallelDims
from helpers.paths import TOKENIZER
from helpers.recipes import base_recipe_values, read_metrics, recipe_error_in_process, run_recipe_in_process
from helpers.tiny_moe import COMMON, FAMILIES, FUSED_ON_DISK, tiny_moe

ONE_LAYOUT = ParallelDims()  # one process: every size 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_moe_is_checked_by_what_loads_back_and_a_changed_expert_is_caught(tmp_path, family):
    from fsdp_recipes.publish.export import (
        ExportVerificationError,
        verify_by_loading,
        verify_saved_weights,
        written_names,
    )

    model = tiny_moe(family)
    trained = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path, state_dict=dict(trained))
    on_disk = written_names(tmp_path)
    if family in FUSED_ON_DISK:  # gpt-oss's checkpoints hold the experts fused, as memory does: names match
        assert on_disk <= trained.keys() and verify_saved_weights(tmp_path, trained) == len(on_disk)
    else:  # per expert: the checkpoint format, not the fused one, so raw names cannot be compared
        assert any(".experts.0." in name for name in on_disk) and not on_disk <= trained.keys()
    assert verify_by_loading(tmp_path, trained, type(model)) == len(trained)
    fused = next(name for name in trained if name.endswith("experts.down_proj"))
    changed = {**trained, fused: trained[fused] + 1e-3}
    with pytest.raises(ExportVerificationError, match=f"{fused}: the model loaded back differs"):
        verify_by_loading(tmp_path, changed, type(model))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_works_with_router_logits_on(family):
    from fsdp_recipes.models.experts import generation_options

    model = tiny_moe(family, output_router_logits=True).eval()
    prompts = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (prompts != 0).long()
    assert generation_options(model) == {"output_router_logits": False}
    output = model.generate(
        input_ids=prompts, attention_mask=mask, max_new_tokens=3, do_sample=False, **generation_options(model)
    )
    assert output.shape == (2, 8)
    if family == "qwen3_moe":  # why the option exists: transformers 5.24 fails on the cached steps without it
        with pytest.raises(RuntimeError, match="must match the size"):
            model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert generation_options(tiny_moe(family)) == {}  # router logits off: nothing to say


def test_an_moe_sft_run_with_router_logits_exports_per_expert_and_fsdp_recipes_export_agrees(tmp_path, small_chat_data):
    """The whole SFT recipe on a tiny Qwen3-MoE with router logits on (exact-match generation before and after
    training), its end-of-run export in transformers' checkpoint format, loaded back equal to the trained weights, and
    `fsdp-recipes export` of its last checkpoint writing the same folder contents."""
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.publish.checkpoint_export import export_checkpoint

    config = {"model_type": "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"], "output_router_logits": True}
    (tmp_path / "moe.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    values = base_recipe_values(
        tmp_path / "moe.json", small_chat_data, out, max_steps=2, save_steps=2, exact_match_eval_samples=4,
        tokenizer_name_or_path=str(TOKENIZER),
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "moe", values)
    summary = json.loads((out / "run_summary.json").read_text())
    moe = summary["mixture_of_experts"]
    assert (moe["num_experts"], moe["experts_per_token"]) == (4, 2) and "router_aux_loss" not in moe
    assert summary["router_aux_loss"].startswith("added: 0.001 x aux")  # qwen3_moe's default coefficient
    steps = [record for record in read_metrics(out) if "loss" in record and "eval_loss" not in record]
    assert steps and all(record["aux_loss"] > 0 for record in steps)
    results = json.loads((out / "eval_results.json").read_text())
    assert {"exact_match_before", "exact_match_after"} <= results.keys()  # generation ran, before and after
    with safe_open(out / "model.safetensors", framework="pt") as reader:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in reader.keys()
    exported = export_checkpoint(out / "checkpoints" / "step-00000002", tmp_path / "exported")
    with safe_open(exported / "model.safetensors", framework="pt") as reader:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in reader.keys()
    end_of_run = AutoModelForCausalLM.from_pretrained(out).state_dict()
    offline = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert end_of_run.keys() == offline.keys()
    assert all(torch.equal(end_of_run[name], offline[name]) for name in end_of_run)


def test_flops_and_the_estimator_count_the_parameters_a_token_runs_through():
    """MFU's FLOPs per token and the estimator's `parameters_active`: the dense parameters and top-k / experts of the
    routed experts' (here 2 of 4: half), never the total; a dense model is unchanged."""
    from transformers import AutoConfig

    from fsdp_recipes.models.experts import ExpertRouting, expert_routing
    from fsdp_recipes.models.modeling import count_non_embedding_parameters
    from fsdp_recipes.tools.estimator.shapes import model_info_from_config

    model = tiny_moe("qwen3_moe")
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert routed > 0 and expert_routing(model.config) == ExpertRouting(num_experts=4, experts_per_token=2)
    assert count_non_embedding_parameters(model) == total - routed // 2 - embedding
    info = model_info_from_config(model.config)
    assert (info.num_params, info.active_params) == (total, total - routed // 2)
    dense = AutoConfig.for_model("llama", **COMMON)
    assert (
        expert_routing(dense) is None
        and model_info_from_config(dense).active_params == model_info_from_config(dense).num_params
    )


def test_lora_on_an_moe_adapts_the_experts_with_dropout_0_and_is_refused_before_loading_otherwise(
    tmp_path, capsys, small_chat_data
):
    """peft's all-linear wraps the fused expert weights (and the router's gate) of a mixture of experts; its wrapper
    takes no dropout: refused with the fix before any weights load. With lora_dropout 0 the SFT recipe trains
    adapters on the experts, exports them, and the estimate of the state a rank holds is exact to the byte."""
    from helpers.recipes import recipe_error_in_process

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    values = base_recipe_values(
        tmp_path / "unused.json", small_chat_data, tmp_path / "out", model_config=None, max_steps=1,
        model_name_or_path=str(tmp_path / "base"), use_peft=True, lora_r=2, lora_dropout=0.05,
    )  # fmt: skip
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert "peft wraps a mixture of experts' fused expert weights" in error and "lora_dropout: 0" in error
    assert not (tmp_path / "out").exists()
    run_recipe_in_process("sft", tmp_path, "lora", {**values, "lora_dropout": 0.0})
    with safe_open(tmp_path / "out" / "adapter_model.safetensors", framework="pt") as reader:
        names = list(reader.keys())
    assert any(".experts." in name and "lora_A" in name for name in names)
    assert any(".mlp.gate.lora_A" in name for name in names)  # the router's gate is a linear layer: adapted too
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["state_bytes_per_rank"] == summary["memory_estimate"]["rank_state_bytes_per_rank"]


def test_the_router_balance_is_transformers_aux_loss_over_the_global_batch_whatever_its_split():
    """`train.router_balance`: over one batch without padding its aux is transformers' own load_balancing_loss_func;
    split into micro-batches (padded differently), the summed loss shares give the same value and the same gradient
    as the whole batch, so ranks and gradient accumulation do not change it."""
    from accelerate import Accelerator
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from fsdp_recipes.train import router_balance

    model = tiny_moe("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(1)
    ids = torch.randint(3, 103, (4, 6))

    def router_logits_of(model, batch):
        return model(input_ids=batch["input_ids"], use_cache=False).router_logits

    def rows(index, width):  # right-padded to `width`, as collate_rows pads
        padded = torch.zeros(len(index), width, dtype=torch.long)
        padded[:, :6] = ids[index]
        return {"input_ids": padded, "real_tokens": torch.full((len(index),), 6)}

    whole, split = [rows([0, 1, 2, 3], 6)], [rows([0, 1], 9), rows([2, 3], 7)]
    accelerator = Accelerator(cpu=True)
    one = router_balance.for_step(accelerator, model, whole, router_logits_of, parallel=ONE_LAYOUT)
    two = router_balance.for_step(accelerator, model, split, router_logits_of, parallel=ONE_LAYOUT)
    expected = load_balancing_loss_func(router_logits_of(model, whole[0]), 4, 2)
    assert one.aux_loss == pytest.approx(float(expected), rel=1e-5) and two.aux_loss == pytest.approx(one.aux_loss)

    def gradient(balance, batches):
        model.zero_grad()
        for batch in batches:
            real = router_balance.real_token_mask(batch)
            balance.loss_share(router_logits_of(model, batch), real).backward()
        return model.model.layers[0].mlp.gate.weight.grad.clone()

    with torch.no_grad():
        for balance, batches in ((one, whole), (two, split)):
            shares = [
                balance.loss_share(router_logits_of(model, b), router_balance.real_token_mask(b)) for b in batches
            ]
            assert float(sum(shares)) == pytest.approx(0.5 * one.aux_loss, rel=1e-5)  # coefficient x aux
    torch.testing.assert_close(gradient(two, split), gradient(one, whole), rtol=1e-5, atol=1e-8)
    assert gradient(one, whole).abs().sum() > 0
    not_asked = router_balance.for_step(
        accelerator, tiny_moe("qwen3_moe"), whole, router_logits_of, parallel=ONE_LAYOUT
    )
    assert not_asked is None  # its config does not ask for the loss
    from fsdp_recipes.models.experts import describe_experts

    assert "not added to this recipe's objective" in describe_experts(model.config)["router_aux_loss"]


def test_an_attached_router_balance_adds_the_loss_shares_gradient_and_changes_no_value_the_loop_sees():
    """`router_balance.attach`: the loop is a dense model's loop (forward, loss, backward); the pass over the step's
    micro-batches runs in `loop.micro_batches_in_sync` and each forward with gradients carries its share of
    coefficient x aux into the backward. Against adding the shares to the loss by hand: the same loss values, the same
    gradients. A forward with gradients the step did not announce, or one missing, is an error."""
    import copy

    from accelerate import Accelerator

    from fsdp_recipes.train import loop, router_balance

    model = tiny_moe("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    by_hand = copy.deepcopy(model)
    torch.manual_seed(2)

    def rows(width, count):  # right-padded, as collate_rows pads
        padded = torch.zeros(2, width, dtype=torch.long)
        padded[:, :count] = torch.randint(3, 103, (2, count))
        return {"input_ids": padded, "real_tokens": torch.tensor([count, count - 1])}

    micro_batches = [rows(9, 6), rows(7, 7)]

    def forward(model, batch):
        return model(input_ids=batch["input_ids"], use_cache=False)

    def task_loss(output):  # any loss of the model's output: the balance must not change it
        return output.logits.float().logsumexp(-1).mean()

    accelerator = Accelerator(cpu=True)
    balance = router_balance.attach(model, forward, real_of=router_balance.real_token_mask)
    assert router_balance.attached(model) is balance and router_balance.attached(by_hand) is None
    attached_losses = []
    for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=ONE_LAYOUT):
        loss = task_loss(forward(model, batch))
        loss.backward()
        attached_losses.append(loss.detach())
    assert balance.figures()["aux_loss"] > 0

    step = router_balance.for_step(
        accelerator, by_hand, micro_batches, lambda m, b: forward(m, b).router_logits, parallel=ONE_LAYOUT
    )
    hand_losses = []
    for batch in micro_batches:
        output = forward(by_hand, batch)
        loss = task_loss(output)
        (loss + step.loss_share(output.router_logits, router_balance.real_token_mask(batch))).backward()
        hand_losses.append(loss.detach())
    assert step.aux_loss == pytest.approx(balance.figures()["aux_loss"])
    assert [float(x) for x in attached_losses] == [float(x) for x in hand_losses]
    gate = "model.layers.0.mlp.gate.weight"
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, parameter in by_hand.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-5, atol=1e-8, msg=name)
    without = copy.deepcopy(by_hand)
    without.zero_grad()
    for batch in micro_batches:
        task_loss(forward(without, batch)).backward()
    assert not torch.allclose(dict(without.named_parameters())[gate].grad, grads[gate])  # the balance did reach it

    with pytest.raises(RuntimeError, match="outside the step's micro-batches"):
        task_loss(forward(model, micro_batches[0])).backward()
    synced = loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=ONE_LAYOUT)
    task_loss(forward(model, next(synced))).backward()  # one of the two forwards only
    with pytest.raises(RuntimeError, match="fewer than its micro-batches"):
        next(iter(loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=ONE_LAYOUT)))
    assert router_balance.attach(tiny_moe("qwen3_moe"), forward) is None  # its config does not ask for the loss

    def problem(**asked):  # the checkpointing the hook cannot ride on, refused before loading
        settings = dict(fsdp_checkpointing=False, wrap_policy="TRANSFORMER_BASED_WRAP", gradient_checkpointing=False)
        return router_balance.checkpointing_problem(model.config, **{**settings, "kwargs": None, **asked})

    assert (
        problem() is None and problem(fsdp_checkpointing=True) is None and problem(gradient_checkpointing=True) is None
    )
    assert "TRANSFORMER_BASED_WRAP" in problem(fsdp_checkpointing=True, wrap_policy="SIZE_BASED_WRAP")
    assert "use_reentrant: false" in problem(gradient_checkpointing=True, kwargs={"use_reentrant": True})
    assert router_balance.checkpointing_problem(
        tiny_moe("qwen3_moe").config, fsdp_checkpointing=True, wrap_policy="SIZE_BASED_WRAP",
        gradient_checkpointing=False, kwargs=None,
    ) is None  # fmt: skip


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_preference_tuning_an_moe_adds_the_router_balance_and_logs_it(tmp_path, preference_data, recipe):
    """The policy's forward feeds the router's load-balancing loss (the reference's does not; KTO: the examples' rows,
    not the KL estimate's), logged as aux_loss, with the run summary saying so. The loss is turned on by the recipe's
    `router_aux_loss_coef` (TRL's name) on a checkpoint whose config leaves it off, and the export keeps it on."""
    from transformers import AutoTokenizer

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")  # output_router_logits: false, as released models ship
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "base")
    values = base_recipe_values(
        tmp_path / "unused.json", preference_data, tmp_path / "out", model_config=None, max_steps=2,
        model_name_or_path=str(tmp_path / "base"), per_device_train_batch_size=4, eval_steps=1000, beta=0.1,
        router_aux_loss_coef=0.1,
    )  # fmt: skip
    run_recipe_in_process(recipe, tmp_path, recipe, values)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["router_aux_loss"].startswith("added: 0.1 x aux")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["output_router_logits"] is True and exported["router_aux_loss_coef"] == 0.1
    steps = [record for record in read_metrics(tmp_path / "out") if "aux_loss" in record]
    assert [record["step"] for record in steps] == [1, 2] and all(record["aux_loss"] > 0 for record in steps)


def test_distilling_into_an_moe_student_adds_its_router_balance_and_logs_it(
    tmp_path, pretrained_tiny_model, small_chat_data
):
    """The student's forward feeds the router's load-balancing loss (its no-gradient pass skips the teacher and the
    output layer); the dense teacher has none. Logged as aux_loss, the run summary saying so, and the loss it adds
    reaches the router: a run without it ends with other router weights."""
    from safetensors.torch import load_file

    from fixtures.reward_distill import distill_values

    config = {"model_type": "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"], "output_router_logits": True}
    for name, coefficient in (("balanced", 0.5), ("unbalanced", 0.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**config, "router_aux_loss_coef": coefficient}))
        values = distill_values(
            tmp_path / f"{name}.json", pretrained_tiny_model, small_chat_data, tmp_path / name, max_steps=2
        )
        run_recipe_in_process("distill", tmp_path, name, values)
    summary = json.loads((tmp_path / "balanced" / "run_summary.json").read_text())
    assert summary["router_aux_loss"].startswith("added: 0.5 x aux")
    steps = [record for record in read_metrics(tmp_path / "balanced") if "aux_loss" in record]
    assert [record["step"] for record in steps] == [1, 2] and all(record["aux_loss"] > 0 for record in steps)
    assert not any("aux_loss" in record for record in read_metrics(tmp_path / "unbalanced"))
    balanced, unbalanced = (load_file(tmp_path / name / "model.safetensors") for name in ("balanced", "unbalanced"))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(balanced[gate], unbalanced[gate])


@pytest.mark.parametrize(
    "value, model, expected",
    [
        (-0.1, "moe", "router_aux_loss_coef must be >= 0 or null, got -0.1"),
        (0.01, "dense", "router_aux_loss_coef 0.01 on Llama, a dense model (no router to balance): remove it"),
    ],
)
def test_a_negative_router_aux_loss_coef_or_one_on_a_dense_model_is_refused_before_loading(
    tmp_path, small_chat_data, tiny_model_config, capsys, value, model, expected
):
    config = tiny_model_config
    if model == "moe":
        config = tmp_path / "moe.json"
        config.write_text(json.dumps({"model_type": "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"]}))
    values = base_recipe_values(config, small_chat_data, tmp_path / "out", router_aux_loss_coef=value)
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert expected in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", ["grpo", "reward", "classify"])
def test_grpo_reward_and_classify_add_the_router_balance_through_a_hook_on_the_decoder(tmp_path, request, recipe):
    """These recipes' forwards do not hand the router logits back (a classification head returns scores; GRPO's rows
    are left-padded or packed): a hook on the decoder reads them and its attention mask. The loss is logged, named in
    the run summary, and reaches the router: a run with coefficient 0 ends with other router weights."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from fixtures.classify import classify_values
    from fixtures.every_recipe import SHORT
    from fixtures.grpo import grpo_values
    from fixtures.reward_distill import reward_values

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")  # released-style: router logits off in its config
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "base")
    (tmp_path / "moe.json").write_text(json.dumps({"model_type": "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"]}))
    make = {
        "grpo": lambda out: grpo_values(tmp_path / "base", request.getfixturevalue("prompt_data"), out, max_steps=2),
        "reward": lambda out: reward_values(tmp_path / "base", request.getfixturevalue("reward_pairs"), out, **SHORT),
        "classify": lambda out: classify_values(
            tmp_path / "moe.json", request.getfixturevalue("classify_data"), out, **SHORT
        ),
    }[recipe]
    for name, coefficient in (("balanced", 0.5), ("off", 0.0)):
        values = {**make(tmp_path / name), "router_aux_loss_coef": coefficient}
        run_recipe_in_process(recipe, tmp_path, name, values)
    summary = json.loads((tmp_path / "balanced" / "run_summary.json").read_text())
    assert summary["router_aux_loss"].startswith("added: 0.5 x aux")
    steps = [record for record in read_metrics(tmp_path / "balanced") if "aux_loss" in record]
    assert [record["step"] for record in steps] == [1, 2] and all(record["aux_loss"] > 0 for record in steps)
    assert not any("aux_loss" in record for record in read_metrics(tmp_path / "off"))
    balanced, off = (load_file(tmp_path / name / "model.safetensors") for name in ("balanced", "off"))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(balanced[gate], off[gate])


def test_an_mxfp4_gpt_oss_checkpoint_trains_dequantized_and_exports_plain_weights(tmp_path, small_chat_data):
    """gpt-oss ships its experts in MXFP4 (packed 4-bit blocks and shared exponents), which transformers keeps packed,
    for inference only, where Triton and `kernels` are installed: training loads it with
    `Mxfp4Config(dequantize=True)`. A tiny checkpoint written in that format (random blocks) trains through the SFT
    recipe and exports plain weights that load back with no quantization_config, equal to the trained ones."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.models.modeling import dequantized_for_training

    family = dict(COMMON, **FAMILIES["gpt_oss"], intermediate_size=32)  # MXFP4 packs rows of 32 values
    tiny_moe("gpt_oss", intermediate_size=32).save_pretrained(tmp_path / "mxfp4")
    weights = load_file(tmp_path / "mxfp4" / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    experts, hidden, width = family["num_local_experts"], family["hidden_size"], family["intermediate_size"]
    for layer in range(family["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, rows, columns in (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)):
            del weights[prefix + name]
            blocks = (experts, rows, columns // 32, 16)
            weights[prefix + f"{name}_blocks"] = torch.randint(0, 256, blocks, dtype=torch.uint8, generator=generator)
            weights[prefix + f"{name}_scales"] = torch.full(blocks[:3], 124, dtype=torch.uint8)  # 2^-3
    save_file(weights, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "mxfp4")
    assert dequantized_for_training(AutoConfig.from_pretrained(tmp_path / "mxfp4")).dequantize is True
    assert dequantized_for_training(AutoConfig.from_pretrained(TOKENIZER.parents[1] / "tiny_llama.json")) is None

    values = base_recipe_values(
        tmp_path / "unused.json", small_chat_data, tmp_path / "out", model_config=None, max_steps=2,
        model_name_or_path=str(tmp_path / "mxfp4"), exact_match_eval_samples=0, attn_implementation="eager",
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "mxfp4", values)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in exported
    trained = load_file(tmp_path / "out" / "model.safetensors")
    assert trained["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert torch.equal(
        loaded["model.layers.0.mlp.experts.gate_up_proj"], trained["model.layers.0.mlp.experts.gate_up_proj"]
    )
