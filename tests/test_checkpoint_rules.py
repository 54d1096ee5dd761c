"""Which checkpoints a run may write next to, and pruning, on hand-made checkpoint folders (no training); the
optimizer state a checkpoint holds for parameters that had no gradient yet."""

from __future__ import annotations

import json

from fsdp_recipes.train.checkpoint import (
    CHECKPOINTS,
    LATEST,
    PROGRESS,
    checkpoint_conflict,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
)


def make_checkpoints(output_dir, *steps, latest=None):
    root = output_dir / CHECKPOINTS
    for step in steps:
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / PROGRESS).write_text(json.dumps({"step": step}))
    (root / ".staging-step-00000099").mkdir()  # a save killed midway: never counts
    (root / LATEST).write_text(f"step-{(latest or steps[-1]):08d}\n")
    return root


def test_a_new_run_may_not_mix_its_checkpoints_with_an_earlier_runs(tmp_path):
    assert checkpoint_conflict(tmp_path, None) is None
    make_checkpoints(tmp_path, 10, 20)
    problem = checkpoint_conflict(tmp_path, None)
    assert "earlier run" in problem and "step-00000020" in problem and "--resume_from_checkpoint latest" in problem


def test_resuming_from_the_newest_is_fine_from_an_older_one_is_not(tmp_path):
    root = make_checkpoints(tmp_path, 10, 20)
    assert checkpoint_conflict(tmp_path, root / "step-00000020") is None
    problem = checkpoint_conflict(tmp_path, root / "step-00000010")
    assert "newer checkpoints exist (step-00000020)" in problem


def test_resuming_from_another_folder_into_one_with_checkpoints_is_refused(tmp_path):
    other = make_checkpoints(tmp_path / "other", 5)
    make_checkpoints(tmp_path / "out", 10)
    assert "earlier run" in checkpoint_conflict(tmp_path / "out", other / "step-00000005")


def test_pruning_keeps_the_newest_and_never_latest(tmp_path):
    make_checkpoints(tmp_path, 10, 20, 30, 40, latest=10)
    removed = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in removed] == ["step-00000020"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000010", "step-00000030", "step-00000040"]
    assert latest_checkpoint(tmp_path).name == "step-00000010"


# ------------------------------------------------------------------------------ what a resumed run must keep
TRAINING_CONFIGS = {
    "sft": "SFTConfig", "pretrain": "PretrainConfig", "dpo": "DPOConfig", "kto": "KTOConfig", "grpo": "GRPOConfig",
    "reward": "RewardConfig", "distill": "DistillConfig", "classify": "ClassifyConfig",
}  # fmt: skip


def test_every_field_of_every_training_recipe_says_what_a_resume_may_do_with_it():
    """Declared with the field, so a new field cannot be left out of the resume check in silence: "sensitive" (a resume
    keeps it unless allow_config_change names it), "fixed" (the checkpoint's tensors depend on it), "free"."""
    import dataclasses

    from helpers.recipes import load_recipe

    for recipe, name in TRAINING_CONFIGS.items():
        config_class = getattr(load_recipe(recipe), name)
        undeclared = [
            field.name
            for field in dataclasses.fields(config_class)
            if field.metadata.get("resume") not in ("sensitive", "fixed", "free")
        ]
        assert undeclared == [], f"{recipe}: {undeclared} do not say what a resume may do with them"
        fixed = config_class().resume_fixed_fields()
        assert set(fixed) == {
            "use_peft",
            "lora_r",
            "lora_target_modules",
            "lora_modules_to_save",
            "use_dora",
            "load_in_4bit",
        }


def test_each_recipe_declares_what_its_objective_and_data_depend_on():
    """The shared layer asks the config class; each recipe adds its own objective and data fields."""
    from helpers.recipes import load_recipe

    declared = {
        name: getattr(load_recipe(name), config)().resume_sensitive_fields()
        for name, config in (
            ("sft", "SFTConfig"),
            ("dpo", "DPOConfig"),
            ("pretrain", "PretrainConfig"),
            ("classify", "ClassifyConfig"),
        )
    }
    assert {"beta", "loss_type", "label_smoothing"} <= set(declared["dpo"])
    assert {"packing", "assistant_only_loss", "completion_only_loss"} <= set(declared["sft"])
    assert {"dataset_text_field", "packing_strategy", "streaming"} <= set(declared["pretrain"])
    assert {"text_column", "label_column", "class_weights"} <= set(declared["classify"])
    assert all({"dataset_name", "max_length", "seed"} <= set(fields) for fields in declared.values())


def test_a_changed_objective_is_refused_listing_every_change_unless_allowed(tmp_path):
    import pytest

    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.train.checkpoint import check_resume_config
    from helpers.recipes import load_recipe

    config_class = load_recipe("dpo").DPOConfig
    saved = {"beta": 0.5, "loss_type": "ipo", "max_length": 1024}  # fields it lacks had their defaults
    now = config_class(beta=0.1, loss_type="sigmoid", learning_rate=1e-3)  # learning_rate: not the objective
    with pytest.raises(ConfigError) as refused:
        check_resume_config(now, saved, tmp_path / "step-00000004")
    message = str(refused.value)
    assert "(beta: 0.5 -> 0.1; loss_type: 'ipo' -> 'sigmoid')" in message
    assert "--allow_config_change beta loss_type (recorded in metrics.jsonl)" in message
    allowed = config_class(beta=0.1, loss_type="ipo", allow_config_change=["beta"], resume_from_checkpoint="latest")
    assert check_resume_config(allowed, saved, tmp_path) == {"beta": [0.5, 0.1]}
    with pytest.raises(ConfigError, match=r"other LoRA settings \(lora_r 4 in the checkpoint, 16 now\)"):
        check_resume_config(allowed, {**saved, "use_peft": False, "lora_r": 4}, tmp_path)


def test_allow_config_change_names_only_fields_a_resume_checks():
    from helpers.recipes import load_recipe

    config = load_recipe("dpo").DPOConfig(
        model_name_or_path="m",
        dataset_name="d",
        resume_from_checkpoint="latest",
        allow_config_change=["betta", "lora_r"],
    )
    problems = config.validate()
    assert "allow_config_change: 'betta' is not a field that resuming checks; did you mean 'beta'?" in problems
    assert any(p.startswith("allow_config_change: lora_r cannot change on resume") for p in problems)
    config.resume_from_checkpoint = None
    config.allow_config_change = ["beta"]
    assert "allow_config_change applies to a resumed run only" in config.validate()[0]


def test_accelerates_notice_of_a_shared_tensor_is_dropped_for_declared_ties_only(caplog):
    """accelerate's save (`clean_state_dict_for_safetensors`, what save_state calls with safetensors) announces each
    tensor it leaves out for sharing memory with another. A tie the model declares (tied embeddings) is restored on
    load, so it goes unannounced; a shared tensor the model does not declare is still announced."""
    from accelerate import PartialState
    from accelerate.utils import clean_state_dict_for_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_recipes.distributed.logs import tied_copies_unannounced

    PartialState()
    config = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=True))
    with tied_copies_unannounced([model]), caplog.at_level("WARNING"):
        cleaned = clean_state_dict_for_safetensors(model.state_dict())
    assert "lm_head.weight" not in cleaned and "Removed shared tensor" not in caplog.text
    untied = model.state_dict()
    untied["model.norm.weight"] = untied["model.layers.0.input_layernorm.weight"]  # shared, and declared by nobody
    with tied_copies_unannounced([model]), caplog.at_level("WARNING"):
        clean_state_dict_for_safetensors(untied)
    assert "Removed shared tensor {" in caplog.text and "'model.norm.weight'" in caplog.text  # with the tie, once
    caplog.clear()
    with caplog.at_level("WARNING"):  # outside the context, accelerate's notice is as it was
        clean_state_dict_for_safetensors(model.state_dict())
    assert "Removed shared tensor {'lm_head.weight'}" in caplog.text


def test_a_parameter_without_a_gradient_yet_gets_adamws_fresh_state_so_a_checkpoint_holds_every_parameter():
    """torch's distributed loading fills a fresh optimizer's state for every parameter and wants each in the
    checkpoint (a Llava's tower layers past the one it reads never get a gradient): the state given is AdamW's own
    first state, so the updates that follow are those of a run that never saved."""
    import torch

    from fsdp_recipes.train.checkpoint import complete_optimizer_state

    def trained(complete: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        optimizer = torch.optim.AdamW([*used.parameters(), *unused.parameters()], lr=0.1, weight_decay=0.1)
        used(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = [p.clone() for p in unused.parameters()]
        if complete:
            pending = [torch.ones_like(p) for p in used.parameters()]  # a gradient being accumulated: kept as it is
            for parameter, grad in zip(used.parameters(), pending):
                parameter.grad = grad
            complete_optimizer_state(optimizer)
            assert all(p.grad is g for p, g in zip(used.parameters(), pending))
            optimizer.zero_grad(set_to_none=True)
            assert all(
                optimizer.state[p]["step"] == 0 and not optimizer.state[p]["exp_avg"].any()
                for p in before and unused.parameters()
            )
            assert all(torch.equal(a, b) for a, b in zip(before, unused.parameters()))  # nothing moved
        (used(torch.ones(1, 3)).sum() + unused(torch.ones(1, 3)).sum()).backward()  # now it is used
        optimizer.step()
        return [p.detach().clone() for p in (*used.parameters(), *unused.parameters())]

    for completed, plain in zip(trained(True), trained(False)):
        assert torch.equal(completed, plain)
