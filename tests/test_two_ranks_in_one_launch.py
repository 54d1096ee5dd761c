"""Runs that need two FSDP2 ranks, each checked against one process with the same global batch, sharing one
2-process launch (tests/scripts/recipes_in_sequence.py): a mixture of experts trained whole with its router's
load-balancing loss, and one of every other family transformers ships (DeepSeek-V3's router bias is a checkpoint
buffer that accelerate's FSDP2 load could not carry, and which each step updates from the loads of both ranks); LoRA
on its experts (peft's wrapper of the fused expert weights, sharded by FSDP2 with the rest); and GRPO with a tool
where some completions call it and some do not, so the two ranks have different numbers of completions to resume
after tool answers: they stay in step by padding their generation passes (else a rank would wait in a collective
forever); and a vision-language model (a tiny Llava on the demo's pictures): SFT, resumed exactly from its step-1
checkpoint, DPO against its sharded frozen copy, and GRPO with LoRA and a frozen tower, its rewards reading the
pictures."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from fixtures.grpo import tool_run_values
from helpers.launch import alongside, launch, require_success
from helpers.paths import REPO
from helpers.recipes import base_recipe_values, read_metrics, recipe_config, run_recipe_in_process
from helpers.scripted_tools import CONVERSATION_REWARD, TOOLS_FILE, scripted_generation
from helpers.tiny_moe import COMMON, FAMILIES, tiny_moe
from helpers.vision import (
    llava_folder,
    shapes_pairs,
    shapes_prompts,
    shapes_subset,
    vision_dpo_values,
    vision_grpo_values,
    vision_values,
)

SEQUENCE = REPO / "tests" / "scripts" / "recipes_in_sequence.py"
DEEPSEEK_BIAS = [0.02, -0.01, 0.0, -0.03]


@pytest.mark.slow
def test_an_moe_whole_and_with_lora_on_its_experts_and_grpo_with_uneven_tool_use_equal_one_process(
    tmp_path, small_chat_data, pretrained_tiny_model, prompt_data
):
    # a vision-language model, whole and resumed, on rows with and without pictures: the 3 text rows share a global
    # batch with one picture (lengths grouped), so one rank has no picture and runs the tower on a blank one
    pictures = shapes_subset(tmp_path / "pictures", count=8, text_only=3)
    picture_pairs = shapes_pairs(tmp_path / "picture_pairs", count=16)  # and DPO on them, against a sharded copy
    picture_prompts = shapes_prompts(tmp_path / "picture_prompts", count=16)  # and GRPO, rewards seeing them
    config = {"model_type": "qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"], "output_router_logits": True}
    (tmp_path / "moe.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.1}))
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    (tmp_path / "my_tools.py").write_text(TOOLS_FILE)
    (tmp_path / "my_rewards.py").write_text(CONVERSATION_REWARD)
    common = dict(max_steps=3, logging_steps=1, exact_match_eval_samples=0, eval_steps=1000)
    families = sorted(set(FAMILIES) - {"qwen3_moe"})
    for family in families:
        model = tiny_moe(family, output_router_logits=True)
        if family == "deepseek_v3":  # a bias of zeros would hide a rank that never received it; a small one routes
            with torch.no_grad():
                model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor(DEEPSEEK_BIAS))
        model.save_pretrained(tmp_path / f"base_{family}")
    runs = {  # name: (the launched recipe, its 2-rank values, the batch size that gives one process the same batch)
        "moe": ("sft", base_recipe_values(
            tmp_path / "moe.json", small_chat_data, tmp_path / "moe_two", per_device_train_batch_size=2, **common
        ), 4),
        **{family: ("sft", base_recipe_values(
            tmp_path / "unused.json", small_chat_data, tmp_path / f"{family}_two", model_config=None,
            model_name_or_path=str(tmp_path / f"base_{family}"), per_device_train_batch_size=2,
            **{**common, "max_steps": 2},
        ), 4) for family in families},
        "lora": ("sft", base_recipe_values(
            tmp_path / "unused.json", small_chat_data, tmp_path / "lora_two", model_config=None,
            model_name_or_path=str(tmp_path / "base"), use_peft=True, lora_r=2, lora_dropout=0.0,
            per_device_train_batch_size=2, learning_rate=1e-2, **common,
        ), 4),
        "tools": ("grpo+scripted_tools_mixed", tool_run_values(
            tmp_path, pretrained_tiny_model, prompt_data, tmp_path / "tools_two", per_device_train_batch_size=4,
        ), 8),
        "vision": ("sft", vision_values(pictures, tmp_path / "vision_two", per_device_train_batch_size=2, save_steps=1), 4),
        "vision_resumed": ("sft", vision_values(
            pictures, tmp_path / "vision_resumed_two", per_device_train_batch_size=2,
            resume_from_checkpoint=str(tmp_path / "vision_two" / "checkpoints" / "step-00000001"),
        ), None),  # step 2 again, from the first run's step-1 checkpoint
        "vision_dpo": ("dpo", vision_dpo_values(picture_pairs, tmp_path / "vision_dpo_two", per_device_train_batch_size=2), 4),
        "vision_grpo": ("grpo", vision_grpo_values(  # LoRA: the reference is the policy with its adapters off
            picture_prompts, tmp_path / "vision_grpo_two", gradient_accumulation_steps=1, model_config=None,
            tokenizer_name_or_path=None, model_name_or_path=str(llava_folder(tmp_path / "llava")), use_peft=True,
            lora_r=2, lora_dropout=0.0, learning_rate=1e-2, freeze_vision_tower=True,
        ), 8),
    }  # fmt: skip
    arguments = []
    for name, (recipe, values, _) in runs.items():
        arguments += [recipe, str(recipe_config(tmp_path / f"{name}_two.yaml", **values))]
    twins = {name: run for name, run in runs.items() if run[2] is not None}  # the rest: compared with a 2-rank run

    def one_process_twins() -> None:
        for name, (recipe, values, one_batch) in twins.items():
            one = {**values, "output_dir": str(tmp_path / f"{name}_one"), "per_device_train_batch_size": one_batch}
            script, _, option = recipe.partition("+")
            with scripted_generation(direct_on_short=True) if option else contextlib.nullcontext():
                run_recipe_in_process(script, tmp_path, f"{name}_one", one)

    _, (launched,) = alongside(one_process_twins, lambda: launch(SEQUENCE, arguments))  # the cores the launch leaves
    require_success(launched)
    for name in twins:
        twos, ones = ([r for r in read_metrics(tmp_path / f"{name}_{side}") if "loss" in r] for side in ("two", "one"))
        assert [r["step"] for r in twos] == [r["step"] for r in ones] and twos, name
        keys = {
            "lora": ("loss",), "tools": ("loss", "tools/call_frequency"), "vision": ("loss", "grad_norm"),
            "vision_dpo": ("loss", "grad_norm", "rewards/margins"),
            "vision_grpo": ("loss", "reward", "rewards/brightness/mean"),
        }.get(name, ("loss", "aux_loss", "moe/load_imbalance"))  # fmt: skip
        for two, single in zip(twos, ones):
            for key in keys:
                if key in single:
                    assert two[key] == pytest.approx(single[key], rel=1e-5), (name, key)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    two, one = (load_file(tmp_path / f"deepseek_v3_{side}" / "model.safetensors")[bias] for side in ("two", "one"))
    assert not torch.equal(one, torch.tensor(DEEPSEEK_BIAS))  # moved by 0.001 x sign(mean load - load)
    torch.testing.assert_close(two, one, rtol=0, atol=0)  # each step's loads summed over both ranks: one update
    rounds = [r for r in read_metrics(tmp_path / "tools_two") if "tools/call_frequency" in r]
    # seed 7's first round draws "hud" (answered directly) for rank 0 and "jcnhb" (a call) for rank 1
    assert rounds and all(r["tools/call_frequency"] == 0.5 for r in rounds)
    adapters = [load_file(tmp_path / f"lora_{side}" / "adapter_model.safetensors") for side in ("two", "one")]
    assert [key for key in adapters[1] if ".experts." in key] and adapters[0].keys() == adapters[1].keys()
    for key in adapters[1]:
        torch.testing.assert_close(adapters[0][key], adapters[1][key], rtol=1e-4, atol=1e-5, msg=key)
    # the vision-language model: its vision blocks wrapped beside its decoder layers (Llava's _no_split_modules names
    # CLIP's text embeddings, which it lacks); GRPO's LoRA adapts its language model only, the tower frozen
    resumed, whole = (read_metrics(tmp_path / f"{name}_two") for name in ("vision_resumed", "vision"))
    later = [r for r in resumed if "loss" in r]
    assert [r["step"] for r in later] == [2]  # resumed exactly: the uninterrupted run's step 2
    again = next(r for r in whole if r.get("step") == 2 and "loss" in r)
    assert later[0]["loss"] == pytest.approx(again["loss"], rel=1e-6) and later[0]["grad_norm"] == pytest.approx(
        again["grad_norm"], rel=1e-6
    )
    summary = json.loads((tmp_path / "vision_two" / "run_summary.json").read_text())
    assert set(summary["fsdp"]["wrap_classes"]) == {"LlamaDecoderLayer", "CLIPEncoderLayer", "CLIPVisionEmbeddings"}
    adapters = [load_file(tmp_path / f"vision_grpo_{side}" / "adapter_model.safetensors") for side in ("two", "one")]
    assert adapters[0].keys() == adapters[1].keys() and all("language_model" in key for key in adapters[0])
    for key in adapters[1]:
        torch.testing.assert_close(adapters[0][key], adapters[1][key], rtol=1e-4, atol=1e-5, msg=key)
