"""The CPU FSDP2 route and the degraded-launch guard, under real `accelerate launch` / torchrun processes.

If an accelerate upgrade breaks the private switch in fsdp_recipes/distributed.py, these tests fail."""

from __future__ import annotations

import sys

import pytest

from conftest import FSDP_CPU_CONFIG, REPO, base_recipe_values, free_port, launch, rank_reports, recipe_config, run_process_group

pytestmark = pytest.mark.slow
SHARD_REPORT = REPO / "tests" / "scripts" / "shard_report.py"
SFT_CLAIMING_A_DEVICE = REPO / "tests" / "scripts" / "sft_on_a_machine_claiming_a_device.py"


def reports(stdout: str) -> list[dict]:
    return rank_reports(stdout)


def test_fsdp2_yaml_on_cpu_really_shards_over_gloo(tiny_model_config):
    result = launch(SHARD_REPORT, [str(tiny_model_config)])
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = reports(result.stdout)
    assert [r["rank"] for r in ranks] == [0, 1]
    for report in ranks:
        assert report["distributed_type"] == "FSDP"
        assert report["placements"] == ["(Shard(dim=0),)"]  # every parameter is a DTensor shard
        assert report["local"] < report["total"]
    assert sum(r["local"] for r in ranks) == ranks[0]["total"]


def test_fsdp1_yaml_on_cpu_is_refused_with_a_clear_error(tmp_path, tiny_model_config):
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text(
        FSDP_CPU_CONFIG.read_text()
        .replace("fsdp_version: 2", "fsdp_version: 1")
        .replace("fsdp_reshard_after_forward: true", "fsdp_sharding_strategy: FULL_SHARD")
    )
    result = launch(SHARD_REPORT, [str(tiny_model_config)], accelerate_config=fsdp1, timeout=120)
    assert result.returncode != 0
    assert "error: FSDP1 cannot run on CPU" in result.stderr
    assert "fsdp_version: 2" in result.stderr


def test_guard_refuses_a_launch_that_degraded_into_independent_processes(tmp_path):
    # Plain Accelerator() under torchrun on a machine without GPUs: each process is its own rank 0.
    script = tmp_path / "plain.py"
    script.write_text(
        "from accelerate import Accelerator\n"
        "from fsdp_recipes.distributed import refuse_degraded_launch\n"
        "from fsdp_recipes.errors import exit_on_user_error\n"
        "exit_on_user_error(lambda: refuse_degraded_launch(Accelerator()))\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    result = run_process_group(command, timeout=120)
    assert result.returncode != 0
    assert "error: the launcher started 2 processes but accelerate joined 1" in result.stderr


def test_recipe_refuses_a_multi_gpu_launch_that_degraded_into_independent_processes(tmp_path, tiny_model_config, chat_data):
    # Without a device a MULTI_GPU launch now runs as MULTI_CPU (tests/test_topology_rehearsal.py); the wrapper makes
    # the recipe believe a device exists, so it builds a plain Accelerator(), which accelerate leaves degraded here.
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")
    config = recipe_config(tmp_path / "recipe.yaml", **values)
    result = launch(SFT_CLAIMING_A_DEVICE, ["--config", str(config)], accelerate_config=None,
                    launcher_args=["--multi_gpu"], timeout=120)
    assert result.returncode != 0
    assert "every process would train alone" in result.stderr
    assert not (tmp_path / "out").exists()
