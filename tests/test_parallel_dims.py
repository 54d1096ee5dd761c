"""Tensor and context parallelism in an Accelerate config's parallelism_config: refused with the reason, by
`fsdp-recipes validate-config` and by a recipe at start-up (every rank, before any weights load), because they do not
run on the pinned versions (docs/parallelism.md). All in this process: no launch.

The last test checks that the reason still holds: when accelerate or transformers change so that it no longer does, it
fails and says to revisit fsdp_recipes.distributed.parallel_dims."""

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


def test_fsdp_times_tp_is_refused_with_the_reason_and_nothing_else(tmp_path, capsys):
    path = config_with(tmp_path, "fsdp2_tp2.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    errors = errors_of(lint_config_file(path))
    assert list(errors) == [TP_KEY]  # the sizes multiply to the 4 processes: only TP itself is refused
    assert "ReplicateParallel" in errors[TP_KEY] and "parallelism_config_tp_size: 1" in errors[TP_KEY]
    assert cli.main(["validate-config", str(path)]) == 1
    assert "tensor parallelism does not run" in capsys.readouterr().out


def test_the_estimator_and_the_catalog_refuse_tp_and_cp_layouts_with_the_same_reason(tmp_path):
    hsdp_tp = config_with(tmp_path, "hsdp_tp.yaml", 8, dp_replicate=2, dp_shard=2, tp=2, cp=1)
    with pytest.raises(ConfigError, match="tp_size 2: tensor parallelism does not run"):
        LaunchLayout.from_file(hsdp_tp)  # not "dp_replicate_size 2 x dp_shard_size 2 != num_processes 8"
    with pytest.raises(ConfigError, match=r"context parallelism \(cp_size 8\) is not supported"):
        LaunchLayout.from_file(config_with(tmp_path, "cp8.yaml", 8, dp_shard=1, cp=8))
    assert (
        LaunchLayout.from_file(config_with(tmp_path, "hsdp.yaml", 4, dp_replicate=2, dp_shard=2, tp=1)).shard_size == 2
    )


def test_sizes_that_do_not_multiply_to_the_processes_name_every_dimension(tmp_path):
    path = config_with(tmp_path, "tp_wrong.yaml", 8, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    message = errors_of(lint_config_file(path))["parallelism_config"]
    assert "dp_shard 2 x tp 2 = 4 processes, but the launch has 8" in message


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
        ({"TP": "2"}, "error: the Accelerate config: parallelism_config.parallelism_config_tp_size: tp_size 2"),
        (
            {"CP": "2"},
            "error: the Accelerate config: parallelism_config.parallelism_config_cp_size: context "
            "parallelism needs CUDA: cp_size 2",
        ),
    ],
)
def test_sft_refuses_tp_and_cp_before_loading(
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


def test_the_reason_for_refusing_tensor_parallelism_still_holds():
    """accelerate's FSDP2 + TP preparation imports a class transformers no longer has. If this fails, the pinned
    versions changed: rerun benchmarks/tensor_parallel_probe.py and revisit fsdp_recipes.distributed.parallel_dims."""
    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in inspect.getsource(
        Accelerator._prepare_tp
    )
    with pytest.raises(ImportError):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
