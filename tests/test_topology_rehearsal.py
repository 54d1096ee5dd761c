"""The shipped Accelerate configs rehearsed on this CPU machine with the SFT recipe, under real `accelerate launch`.

HSDP (hsdp_4proc_cpu.yaml) really builds a 2 x 2 (replicate x shard) mesh, and HSDP, SHARD_GRAD_OP and NO_SHARD
(plain DDP, MULTI_GPU: MULTI_CPU here) all give the losses of the 2-process FULL_SHARD run with the same global
batch (the shared reference run of conftest.py). A wrap class the model lacks stops the recipe before any weights
load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, STEPS, read_metrics, resume_values, run_sft

pytestmark = pytest.mark.slow
CONFIGS = REPO / "accelerate_configs"
GPU_CONFIG_ON_CPU = ["--mixed_precision", "no"]  # a GPU config rehearsed in fp32, for exact comparisons


def run_recipe(tmp: Path, name: str, config: Path, *, num_processes: int, rows_per_process: int,
               tiny_model_config, data, launcher_args=()) -> Path:
    values = resume_values(tiny_model_config, data, tmp / name, per_device_train_batch_size=rows_per_process,
                           save_steps=None, exact_match_eval_samples=0)
    run_sft(tmp, name, values, num_processes=num_processes, accelerate_config=config, launcher_args=list(launcher_args))
    return tmp / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_config, small_chat_data, reference_run):
    """The reference run's 12 steps (global batch 16 rows, fp32) on the other topologies."""
    tmp = tmp_path_factory.mktemp("topology_runs")
    common = dict(tiny_model_config=tiny_model_config, data=small_chat_data)
    return {
        "full_shard": reference_run,
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
    assert len(reference) == len(other) == STEPS
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


def test_hsdp_config_on_four_cpu_processes_builds_a_replicate_by_shard_mesh(runs):
    hsdp = summary(runs["hsdp"])
    assert hsdp["parameter_placements"] == ["(Replicate(), Shard(dim=0))"]
    # Ranks 0-1 and 2-3 are the two replicas: each pair holds the whole model between them.
    per_rank = hsdp["parameters_per_rank"]
    assert per_rank[0] + per_rank[1] == hsdp["parameters_total"] and per_rank[:2] == per_rank[2:]


def test_a_wrap_class_the_model_lacks_stops_the_recipe_before_weights_load(tiny_model_config):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from transformers import AutoConfig

    from fsdp_recipes.errors import ConfigError
    from fsdp_recipes.modeling import resolve_wrap_classes

    plugin = SimpleNamespace(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(ConfigError, match="fsdp_transformer_layer_cls_to_wrap names GPT2Block") as error:
        resolve_wrap_classes(accelerator, AutoConfig.from_pretrained(tiny_model_config))
    assert "Set it to LlamaDecoderLayer" in str(error.value)
    plugin.transformer_cls_names_to_wrap = None  # then the model's own _no_split_modules
    assert resolve_wrap_classes(accelerator, AutoConfig.from_pretrained(tiny_model_config)) == ["LlamaDecoderLayer"]
