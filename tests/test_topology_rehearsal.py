"""The shipped Accelerate configs rehearsed on this CPU machine with the SFT recipe, under real `accelerate launch`.

HSDP (hsdp_4proc_cpu.yaml) really builds a 2 x 2 (replicate x shard) mesh, and HSDP, SHARD_GRAD_OP and NO_SHARD
(plain DDP, MULTI_GPU: MULTI_CPU here) all give the losses of the 2-process FULL_SHARD run with the same global
batch. A wrap class the model lacks stops the recipe before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    FSDP_CPU_CONFIG,
    REPO,
    SFT,
    base_recipe_values,
    launch,
    rank_reports,
    read_metrics,
    recipe_config,
    require_success,
)

pytestmark = pytest.mark.slow
CONFIGS = REPO / "accelerate_configs"
SHARD_REPORT = REPO / "tests" / "scripts" / "shard_report.py"
GPU_CONFIG_ON_CPU = ["--mixed_precision", "no"]  # a GPU config rehearsed in fp32, for exact comparisons


def run_recipe(tmp: Path, name: str, config: Path, *, num_processes: int, rows_per_process: int,
               tiny_model_config, chat_data, launcher_args=()) -> Path:
    output_dir = tmp / name
    values = base_recipe_values(tiny_model_config, chat_data, output_dir, per_device_train_batch_size=rows_per_process)
    result = launch(SFT, ["--config", str(recipe_config(tmp / f"{name}.yaml", **values))], num_processes=num_processes,
                    accelerate_config=config, launcher_args=list(launcher_args))
    require_success(result)
    return output_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_config, chat_data):
    """10 steps, global batch 8 rows each, fp32."""
    tmp = tmp_path_factory.mktemp("topology_runs")
    common = dict(tiny_model_config=tiny_model_config, chat_data=chat_data)
    return {
        "full_shard": run_recipe(tmp, "full_shard", FSDP_CPU_CONFIG, num_processes=2, rows_per_process=4, **common),
        "hsdp": run_recipe(tmp, "hsdp", CONFIGS / "hsdp_4proc_cpu.yaml", num_processes=4, rows_per_process=2, **common),
        "shard_grad_op": run_recipe(tmp, "shard_grad_op", CONFIGS / "fsdp_8gpu_shard_grad_op.yaml", num_processes=2,
                                    rows_per_process=4, launcher_args=GPU_CONFIG_ON_CPU, **common),
        "no_shard": run_recipe(tmp, "no_shard", CONFIGS / "ddp_8gpu.yaml", num_processes=2, rows_per_process=4,
                               launcher_args=GPU_CONFIG_ON_CPU, **common),
    }


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "run_summary.json").read_text())


@pytest.mark.parametrize("name", ["hsdp", "shard_grad_op", "no_shard"])
def test_losses_equal_the_two_process_full_shard_run(runs, name):
    reference, other = losses(runs["full_shard"]), losses(runs[name])
    assert len(reference) == len(other) == 10
    assert reference[-1] < reference[0]  # it trains
    torch.testing.assert_close(torch.tensor(other), torch.tensor(reference), rtol=1e-5, atol=1e-6)


def test_each_run_used_the_topology_its_config_names(runs):
    hsdp, sgo, ddp = summary(runs["hsdp"]), summary(runs["shard_grad_op"]), summary(runs["no_shard"])
    assert (hsdp["world_size"], hsdp["distributed_type"], hsdp["fsdp"]["reshard_after_forward"]) == (4, "FSDP", "True")
    # HSDP: each parameter is split in 2 shards, so each of the 4 ranks holds about half of the model.
    assert sum(hsdp["parameters_per_rank"]) == 2 * hsdp["parameters_total"]
    assert (sgo["world_size"], sgo["distributed_type"], sgo["fsdp"]["reshard_after_forward"]) == (2, "FSDP", "False")
    assert (ddp["world_size"], ddp["distributed_type"], ddp["fsdp"]) == (2, "MULTI_CPU", None)
    assert ddp["parameters_per_rank"] == [ddp["parameters_total"]] * 2  # DDP: every rank holds the whole model


def test_hsdp_config_on_four_cpu_processes_builds_a_replicate_by_shard_mesh(tiny_model_config):
    result = launch(SHARD_REPORT, [str(tiny_model_config)], num_processes=4, accelerate_config=CONFIGS / "hsdp_4proc_cpu.yaml")
    require_success(result)
    reports = rank_reports(result.stdout)
    assert [report["rank"] for report in reports] == [0, 1, 2, 3]
    for report in reports:
        assert report["distributed_type"] == "FSDP"
        assert report["placements"] == ["(Replicate(), Shard(dim=0))"]
    # Ranks 0-1 and 2-3 are the two replicas: each pair holds the whole model between them.
    assert reports[0]["local"] + reports[1]["local"] == reports[0]["total"]
    assert [r["local"] for r in reports[:2]] == [r["local"] for r in reports[2:]]


def test_a_wrap_class_the_model_lacks_stops_the_recipe_before_weights_load(tmp_path, tiny_model_config, chat_data):
    raw = yaml.safe_load(FSDP_CPU_CONFIG.read_text())
    raw["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "GPT2Block"
    crafted = tmp_path / "gpt2_block.yaml"
    crafted.write_text(yaml.safe_dump(raw))
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")
    result = launch(SFT, ["--config", str(recipe_config(tmp_path / "recipe.yaml", **values))],
                    accelerate_config=crafted, timeout=120)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "error: fsdp_transformer_layer_cls_to_wrap names GPT2Block" in result.stderr
    assert "Set it to LlamaDecoderLayer" in result.stderr
    assert result.stderr.count("error: fsdp_transformer_layer_cls_to_wrap") == 1  # once, from the main rank
    assert not (tmp_path / "out").exists()
