from __future__ import annotations

import re

import pytest

from fsdp_recipes.common.arguments import parse_config
from fsdp_recipes.common.errors import ConfigError
from helpers.recipes import load_recipe

SFTConfig = load_recipe("sft").SFTConfig


def write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


BASE = "model_name_or_path: some/model\ndataset_name: some/data\n"


def test_yaml_values_and_command_line_overrides(tmp_path):
    path = write(tmp_path, BASE + "learning_rate: 1e-5\nmax_steps: 3\npacking: false\n")
    config = parse_config(SFTConfig, ["--config", path, "--max_steps", "7", "--save_steps", "null"])
    assert config.save_steps is None  # null on the command line, as in YAML
    assert config.learning_rate == 1e-5  # YAML reads 1e-5 as a string; it must come out a float
    assert config.max_steps == 7  # the command line wins
    assert config.packing is False
    assert config.trust_remote_code is False


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--save_steps", "null", "--save_steps", "2"], 2),
        (["--save_steps", "2", "--save_steps", "null"], None),
        (["--save_steps=none", "--save_steps=3"], 3),
        (["--save_steps", "4", "--save_steps=NULL"], None),
        (["--save_steps", "null", "--eval_steps", "5"], None),
    ],
)
def test_the_last_flag_for_a_field_wins_null_or_not(tmp_path, flags, expected):
    config = parse_config(SFTConfig, ["--config", write(tmp_path, BASE + "save_steps: 9\n"), *flags])
    assert config.save_steps == expected


def test_unknown_keys_are_reported_with_the_closest_valid_key(tmp_path):
    path = write(tmp_path, BASE + "learning_rat: 1e-3\nfsdp_config: {}\n")
    with pytest.raises(ConfigError) as error:
        parse_config(SFTConfig, ["--config", path, "--max_step", "3"])
    text = str(error.value)
    assert "3 problems" in text
    assert "'learning_rat'" in text and "did you mean 'learning_rate'" in text
    assert "'fsdp_config'" in text and "Accelerate config" in text  # FSDP settings live there only
    assert "'max_step'" in text and "the command line" in text


def test_all_value_problems_are_reported_together(tmp_path):
    path = write(tmp_path, "dataset_name: d\nlearning_rate: -1\nlr_scheduler_type: cosinus\npush_to_hub: true\n")
    with pytest.raises(ConfigError) as error:
        parse_config(SFTConfig, ["--config", path])
    problems = error.value.problems
    assert any("model_name_or_path" in p for p in problems)
    assert any("learning_rate" in p for p in problems)
    assert any("cosinus" in p for p in problems)
    assert any("hub_model_id" in p for p in problems)


def test_type_errors_in_yaml(tmp_path):
    path = write(tmp_path, BASE + "packing: maybe\nmax_steps: [1]\n")
    with pytest.raises(ConfigError) as error:
        parse_config(SFTConfig, ["--config", path])
    assert "packing" in str(error.value) and "max_steps" in str(error.value)


def test_malformed_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config(SFTConfig, ["--config", write(tmp_path, "a: [1, 2\n")])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(SFTConfig, ["--config", str(tmp_path / "nope.yaml")])


def recipe_config_class(recipe: str):
    """The config class a recipe defines: the one dataclass in recipes/<recipe>.py ending in `Config`."""
    import dataclasses

    module = load_recipe(recipe)
    classes = [
        value
        for name, value in vars(module).items()
        if name.endswith("Config") and dataclasses.is_dataclass(value) and value.__module__ == module.__name__
    ]
    assert len(classes) == 1, f"recipes/{recipe}.py should define one config class, found {classes}"
    return classes[0]


def test_every_shipped_recipe_config_parses_and_says_how_to_launch_it(monkeypatch):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # configs name repo files relative to the root, where the commands are run
    configs = sorted((repo / "recipes" / "configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        recipe = path.relative_to(repo / "recipes" / "configs").parts[0]  # recipes/configs/<recipe>/...
        command = path.read_text().split("\n\n")[0]
        assert "accelerate launch" in command and f"recipes/{recipe}.py" in command, (
            f"{path} does not open with its command"
        )
        parse_config(recipe_config_class(recipe), ["--config", str(path)])


@pytest.mark.parametrize(
    "line, message",
    [
        ("learning_rate: .nan", "learning_rate must be a finite number"),
        ("learning_rate: .inf", "learning_rate must be a finite number"),
        ("max_grad_norm: -1", "max_grad_norm must be a finite number >= 0, got -1.0 (0 turns clipping off"),
        ("adam_beta2: 1.0", "adam_beta2 must be in [0, 1)"),
    ],
)
def test_values_that_would_break_training_silently_or_late_are_refused(tmp_path, line, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(SFTConfig, ["--config", write(tmp_path, BASE + line + "\n")])


RECIPES = ("sft", "pretrain", "dpo", "kto", "grpo", "reward", "distill", "classify", "eval")


def test_settings_are_checked_by_declaration_not_by_a_chain_of_overrides():
    """`validate` is RunConfig's alone: fields declare their checks (`setting(check=...)`), and each settings group
    states its cross-field rules in its own `cross_field_problems`, which runs whatever the other groups say."""
    for recipe in RECIPES:
        overriding = [klass.__name__ for klass in recipe_config_class(recipe).__mro__ if "validate" in vars(klass)]
        assert overriding == ["RunConfig"], (recipe, overriding)


def test_a_recipe_that_changes_a_default_keeps_the_fields_check(tmp_path):
    """GRPO declares its own per_device_train_batch_size (another default and help); the base check still runs."""
    grpo = recipe_config_class("grpo")
    assert "per_device_train_batch_size" in vars(grpo)["__annotations__"]
    lines = BASE + "reward_funcs: [exact_match]\nper_device_train_batch_size: 0\nloss_implementation: chunked\n"
    with pytest.raises(ConfigError) as refused:
        parse_config(grpo, ["--config", write(tmp_path, lines)])
    problems = refused.value.problems
    assert "per_device_train_batch_size must be >= 1, got 0" in problems
    # both the base's check (a known implementation) and GRPO's own (full_logits only) speak of loss_implementation
    assert [p for p in problems if p.startswith("loss_implementation 'chunked'")] and any(
        "for GRPO" in p for p in problems
    )


def test_every_groups_rules_run_and_every_problem_is_reported_at_once(tmp_path):
    lines = (
        BASE + "reward_funcs: []\nreward_weights: [1.0]\nnum_generations: 1\nmax_steps: 0\nnum_train_epochs: 0\n"
        "max_completion_length: 5000\nhub_strategy: checkpoint\n"
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(recipe_config_class("grpo"), ["--config", write(tmp_path, lines)])
    text = "\n".join(refused.value.problems)
    for expected in (
        "reward_funcs is required",  # the online-RL group's rule (an environment may score instead)
        "num_generations must be >= 2",  # a field's check (online RL)
        "reward_weights has 1 values for 0 reward_funcs",  # the online-RL group's rule
        "max_completion_length must be >= 1 and < max_length",  # the online-RL group's rule
        "set max_steps > 0 or num_train_epochs > 0",  # TrainingConfig's rule
        "hub_strategy 'checkpoint' uploads resumable checkpoints",  # publishing's field check
    ):
        assert expected in text, expected


@pytest.mark.parametrize(
    "value, device, max_steps, expected",
    [
        ("true", "cpu", 10, "on (torch_compile: true)"),
        ("True", "cpu", 10, "on (torch_compile: true)"),
        ("false", "cuda", 5000, "off (torch_compile: false)"),
        ("auto", "cpu", 5000, "off (auto: the device is cpu"),
        ("auto", "cuda", 50, "off (auto: max_steps 50 is under"),
        ("auto", "cuda", -1, "on (auto: a CUDA device"),
        ("auto", "cuda", 300, "on (auto: a CUDA device"),
    ],
)
def test_torch_compile_auto_compiles_where_the_pause_is_repaid(tmp_path, value, device, max_steps, expected):
    from fsdp_recipes.train.compilation import compile_choice

    config = parse_config(
        SFTConfig, ["--config", write(tmp_path, BASE), "--torch_compile", value, f"--max_steps={max_steps}"]
    )
    on, reason = compile_choice(config.torch_compile, device_type=device, max_steps=config.max_steps)
    assert reason.startswith(expected) and on == reason.startswith("on")


def test_torch_compile_alone_on_the_command_line_means_true_as_trainings_boolean_did(tmp_path):
    config = parse_config(SFTConfig, ["--config", write(tmp_path, BASE), "--torch_compile", "--max_steps", "3"])
    assert (config.torch_compile, config.max_steps) == ("true", 3)


def test_an_unknown_torch_compile_value_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"torch_compile 'sometimes' is not one of true, false, auto"):
        parse_config(SFTConfig, ["--config", write(tmp_path, BASE + "torch_compile: sometimes\n")])


def test_peft_s_all_linear_as_trl_configs_write_it_means_every_linear_layer(tmp_path):
    for written in ("all-linear", "[all-linear]"):
        text = BASE + f"use_peft: true\nlora_target_modules: {written}\n"
        assert parse_config(SFTConfig, ["--config", write(tmp_path, text)]).lora_target_modules is None  # as null
    dpo = load_recipe("dpo").DPOConfig
    text = BASE + "lora_target_modules: [all-linear]\n"
    assert parse_config(dpo, ["--config", write(tmp_path, text)]).lora_target_modules is None
    with pytest.raises(ConfigError, match=r"lora_target_modules in config file .*expected a list"):
        parse_config(SFTConfig, ["--config", write(tmp_path, BASE + "use_peft: true\nlora_target_modules: q_proj\n")])
