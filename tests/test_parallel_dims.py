"""Tensor and context parallelism in an Accelerate config's parallelism_config, checked by `fsdp-recipes
validate-config` and by a recipe at start-up (every rank, before any weights load): TP layouts are read (sizes named,
what the transformers route cannot honour refused with the reason, the model's sizes checked), CP is refused
(docs/parallelism.md). All in this process: the TP runs themselves are in tests/test_tensor_parallel.py.

The last test checks why accelerate's own TP preparation is bypassed: when it stops importing the class transformers
removed, it fails and says to revisit fsdp_recipes.distributed.tensor_parallel."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.launch_checks import (
    ERROR,
    check_launch_environment,
    exported_environment,
    lint_launch_environment,
)
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.linter import lint_config_file
from fsdp_recipes.tools.topology import CONFIG_DIR
from helpers.recipes import base_recipe_values, recipe_error_in_process

TP_KEY = "parallelism_config.parallelism_config_tp_size"
CP_KEY = "parallelism_config.parallelism_config_cp_size"


def config_with(tmp_path: Path, name: str, num_processes: int, **sizes) -> Path:
    """The shipped 4-process CPU HSDP config with other parallelism_config sizes."""
    raw = yaml.safe_load((CONFIG_DIR / "hsdp_4proc_cpu.yaml").read_text())
    raw["num_processes"] = num_processes
    raw["parallelism_config"] = {f"parallelism_config_{key}_size": value for key, value in sizes.items()}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def errors_of(findings) -> dict[str, str]:
    return {f.key: f.message for f in findings if f.severity == ERROR}


def test_fsdp_times_tp_is_a_layout_that_runs_and_the_shipped_tp_configs_lint_clean(tmp_path, capsys):
    path = config_with(tmp_path, "fsdp2_tp2.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    assert errors_of(lint_config_file(path)) == {}
    for name in ("tp_2proc_cpu.yaml", "fsdp2_tp2_4proc_cpu.yaml", "tp8_fsdp_2x8gpu.yaml", "tp8_hsdp_4x8gpu.yaml"):
        assert cli.main(["validate-config", str(CONFIG_DIR / name)]) == 0, capsys.readouterr().out
        assert check_launch_environment(exported_environment(CONFIG_DIR / name)) == []


@pytest.mark.parametrize(
    "fsdp_change, named",
    [
        ({"fsdp_offload_params": True}, "fsdp_offload_params"),
        ({"fsdp_activation_checkpointing": True}, "gradient_checkpointing: true"),
        ({"fsdp_reshard_after_forward": False}, "SHARD_GRAD_OP"),
        ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, "fsdp_plan"),
        ({"fsdp_version": 1}, "fsdp_version: 2"),
    ],
)
def test_what_the_tp_route_cannot_honour_is_refused_with_its_fix(tmp_path, fsdp_change, named):
    raw = yaml.safe_load((CONFIG_DIR / "fsdp2_tp2_4proc_cpu.yaml").read_text())
    raw["fsdp_config"].update(fsdp_change)
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(raw))
    errors = errors_of(lint_config_file(path))
    assert named in errors.get(TP_KEY, "") + errors.get("fsdp_config.fsdp_version", "") + str(errors), errors


def test_fp16_under_tp_is_refused():
    environment = exported_environment(CONFIG_DIR / "fsdp2_tp2_4proc_cpu.yaml") | {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert "use bf16" in errors_of(lint_launch_environment(environment))[TP_KEY]


def test_the_estimator_and_the_catalog_read_tp_layouts_and_refuse_cp(tmp_path):
    hsdp_tp = LaunchLayout.from_file(config_with(tmp_path, "hsdp_tp.yaml", 8, dp_replicate=2, dp_shard=2, tp=2, cp=1))
    assert (hsdp_tp.tp_size, hsdp_tp.shard_size, hsdp_tp.data_parallel_size, hsdp_tp.hsdp_replicate) == (2, 2, 4, 2)
    assert "2 replicas x 2 shards) x TP 2" in hsdp_tp.describe()
    with pytest.raises(ConfigError, match=r"dp_replicate_size 2 x dp_shard_size 2 x tp_size 2 != num_processes 16"):
        LaunchLayout.from_file(config_with(tmp_path, "bad.yaml", 16, dp_replicate=2, dp_shard=2, tp=2, cp=1))
    with pytest.raises(ConfigError, match=r"context parallelism \(cp_size 8\) is not supported"):
        LaunchLayout.from_file(config_with(tmp_path, "cp8.yaml", 8, dp_shard=1, cp=8))
    assert LaunchLayout.from_file(CONFIG_DIR / "tp8_fsdp_2x8gpu.yaml").shard_size == 2


def test_sizes_that_do_not_multiply_to_the_processes_name_every_dimension(tmp_path):
    path = config_with(tmp_path, "tp_wrong.yaml", 8, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    message = errors_of(lint_config_file(path))["parallelism_config"]
    assert "dp_shard 2 x tp 2 = 4 processes, but the launch has 8" in message
    assert "parallelism_config_tp_size = 8" in message


def test_validate_config_with_a_model_names_what_tp_cannot_split(tmp_path, tokenizer):
    from helpers.data import write_tiny_model_config

    path = config_with(tmp_path, "fsdp2_tp2.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    fits = write_tiny_model_config(tmp_path / "fits.json", tokenizer, vocab_size=104)
    odd = write_tiny_model_config(tmp_path / "odd.json", tokenizer, vocab_size=104, intermediate_size=129)
    assert errors_of(lint_config_file(path, model=str(fits))) == {}
    assert "does not divide Llama's intermediate_size 129" in errors_of(lint_config_file(path, model=str(odd)))[TP_KEY]


def test_a_model_tp_cannot_split_is_named_with_its_numbers(tmp_path, tokenizer):
    from transformers import AutoConfig, GPT2Config, LlamaForCausalLM

    from fsdp_recipes.distributed.tensor_parallel import TensorParallelLayout, model_problems
    from fsdp_recipes.models.modeling import model_class_for
    from helpers.data import write_tiny_model_config

    config = AutoConfig.from_pretrained(write_tiny_model_config(tmp_path / "c.json", tokenizer, vocab_size=104))
    assert model_class_for(config, "causal-lm") is LlamaForCausalLM
    assert model_problems(TensorParallelLayout(1, 1, 2), config, LlamaForCausalLM) == []
    (problem,) = model_problems(TensorParallelLayout(1, 1, 3), config, LlamaForCausalLM)
    assert "tp_size 3 does not divide Llama's num_attention_heads 4, num_key_value_heads 2" in problem
    assert "intermediate_size 128, vocab_size 104:" in problem
    no_plan = model_problems(TensorParallelLayout(1, 1, 2), GPT2Config(), model_class_for(GPT2Config(), "causal-lm"))
    assert len(no_plan) == 1 and "has no tensor-parallel plan" in no_plan[0], no_plan


def test_context_parallelism_needs_cuda_on_this_machine_and_is_not_wired_anywhere(tmp_path):
    path = config_with(tmp_path, "cp8.yaml", 8, dp_replicate=1, dp_shard=1, tp=1, cp=8)
    offline = errors_of(lint_config_file(path))
    assert list(offline) == [CP_KEY]  # cp alone gives FSDP a dimension to shard over: no dp_shard error
    assert "do not shard batches along the sequence" in offline[CP_KEY]
    environment = exported_environment(path)
    on_cpu = errors_of(lint_launch_environment(environment, has_cuda=False))[CP_KEY]
    assert on_cpu.startswith("context parallelism needs CUDA: cp_size 8")
    assert "_scaled_dot_product_flash_attention_for_cpu" in on_cpu
    on_gpu = errors_of(lint_launch_environment(environment, has_cuda=True))[CP_KEY]
    assert "needs CUDA" not in on_gpu and "not supported" in on_gpu
    assert check_launch_environment(exported_environment(CONFIG_DIR / "hsdp_4proc_cpu.yaml")) == []


@pytest.mark.parametrize(
    "sizes, expected",
    [
        (
            {"TP": "2", "DP_SHARD": "1"},
            "error: the Accelerate config: parallelism_config.parallelism_config_tp_size: tensor parallelism runs with "
            "FSDP2 around it",
        ),
        (
            {"CP": "2"},
            "error: the Accelerate config: parallelism_config.parallelism_config_cp_size: context "
            "parallelism needs CUDA: cp_size 2",
        ),
    ],
)
def test_sft_refuses_tp_without_fsdp2_and_cp_before_loading(
    sizes, expected, tmp_path, tiny_model_config, chat_data, capsys, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name}_SIZE", size)
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert error.startswith(expected), error
    assert not (tmp_path / "out").exists()


def test_the_reason_for_bypassing_accelerates_tensor_parallelism_still_holds():
    """accelerate's FSDP2 + TP preparation imports a class transformers no longer has, so TP goes through
    transformers' DistributedConfig and accelerate wraps nothing. If this fails, the pinned versions changed: revisit
    fsdp_recipes.distributed.tensor_parallel (docs/parallelism.md)."""
    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in inspect.getsource(
        Accelerator._prepare_tp
    )
    with pytest.raises(ImportError):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
