"""Sequence parallelism (Ulysses, `distributed/sequence_parallel.py`): rows split by position over the ranks of an
`sp` group, an all-to-all around attention, per-token values gathered back. Checked in-process where no processes
are needed (the rules, the layout read from the Accelerate YAML, the estimator), and in one 4-process launch
(FSDP 2 x SP 2): the exchange itself on every rank (per-token losses and gradients against the same model run whole,
packed rows, GQA, a sliding window, a width that sp does not divide: tests/helpers/sequence_exchange.py), then SFT on
1k-token packed rows with its resume on the same layout and on one process, DPO, KTO and distillation (teacher and
student split alike) under the same layout and pretraining under SP 4, each equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from helpers.paths import REPO
from helpers.recipes import read_metrics, run_recipe_launched_here

SP_2 = REPO / "accelerate_configs" / "fsdp2_sp2_4proc_cpu.yaml"
ONE_PROCESS_FSDP = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
LAUNCHED = {
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    "PARALLELISM_CONFIG_SP_SIZE": "2",
}


def test_what_sequence_parallelism_cannot_split_is_refused_with_its_fix():
    from transformers import LlamaConfig, Qwen3MoeConfig

    from fsdp_recipes.distributed import sequence_parallel
    from fsdp_recipes.distributed.parallel_dims import ParallelDims

    def layout_problems(environ):
        return sequence_parallel.layout_problems(ParallelDims.from_environment(environ), environ)

    assert layout_problems(LAUNCHED) == {}
    for change, words in (
        ({"PARALLELISM_CONFIG_TP_SIZE": "2"}, "does not compose with tensor or expert parallelism"),
        ({"PARALLELISM_CONFIG_EP_SIZE": "2"}, "does not compose with tensor or expert parallelism"),
        ({"PARALLELISM_CONFIG_CP_SIZE": "2"}, "choose one"),
        ({"FSDP_VERSION": "1"}, "runs with FSDP2"),
    ):
        (problem,) = layout_problems({**LAUNCHED, **change}).values()
        assert words in problem and "parallelism_config_sp_size: 1" in problem, problem
    llama = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    problems = sequence_parallel.model_problems(4, llama, attn_implementation="sdpa", recipe="sft")
    assert ["num_attention_heads (6)" in problems[0], "num_key_value_heads (2)" in problems[1]] == [True, True]
    (problem,) = sequence_parallel.model_problems(2, llama, attn_implementation="flash_attention_2", recipe="dpo")
    assert "set attn_implementation: sdpa" in problem
    (problem,) = sequence_parallel.model_problems(2, llama, attn_implementation="sdpa", recipe="eval")
    assert "eval is not one of them yet" in problem and "distill, grpo, reward, classify" in problem
    moe = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, output_router_logits=True)
    (problem,) = sequence_parallel.model_problems(2, moe, attn_implementation="sdpa", recipe="sft")
    assert "router_aux_loss_coef: 0" in problem
    assert sequence_parallel.model_problems(1, moe, attn_implementation="eager", recipe="grpo") == []
    from transformers import LlavaConfig

    (problem,) = sequence_parallel.model_problems(2, LlavaConfig(), attn_implementation="sdpa", recipe="sft")
    assert "with a vision-language model is not built" in problem
    from types import SimpleNamespace

    from fsdp_recipes.common.errors import ConfigError
    from fsdp_recipes.methods.grpo.settings import PolicyObjectiveFields
    from fsdp_recipes.train.compilation import compile_choice

    with pytest.raises(ConfigError, match="set torch_compile: false"):
        compile_choice(True, device_type="cuda", max_steps=0, sequence_parallel=2)
    assert compile_choice("auto", device_type="cuda", max_steps=0, sequence_parallel=2)[0] is False
    padded = PolicyObjectiveFields.sequence_split_problem(SimpleNamespace(padding_free=False))
    assert "set padding_free: true" in padded  # GRPO splits its policy passes from the packed layout only
    assert PolicyObjectiveFields.sequence_split_problem(SimpleNamespace(padding_free=True)) is None


def test_the_layout_and_the_estimate_of_a_sequence_parallel_launch():
    """The Accelerate YAML's `parallelism_config_sp_size`: FSDP shards over the sp ranks too, the ranks of a group
    share one batch; the estimator divides the per-token activations by sp and finds the longest row that fits."""
    from fsdp_recipes.distributed.accelerate_config import LaunchLayout
    from fsdp_recipes.tools.catalog import Catalog, model_info
    from fsdp_recipes.tools.estimator.advice import longest_row
    from fsdp_recipes.tools.estimator.formulas import activation_bytes, estimate_for_recipe
    from fsdp_recipes.tools.estimator.recipe import recipe_config as read_recipe_config
    from fsdp_recipes.tools.estimator.workload import Workload

    cpu = LaunchLayout.from_file(SP_2).parallel
    assert (cpu.sp, cpu.shard_size, cpu.data_parallel_size, cpu.hsdp_replicas) == (2, 4, 2, None)
    assert "over SP 2" in LaunchLayout.from_file(SP_2).describe()
    node = LaunchLayout.from_file(REPO / "accelerate_configs" / "sp8_fsdp_4x8gpu.yaml").parallel
    assert (node.sp, node.shard_size, node.data_parallel_size) == (8, 32, 4)

    catalog = Catalog(REPO)
    config = catalog.find("sft/llama-3.1-70b_long_128k_sp8")
    info = model_info(catalog.model_file(config))
    recipe = read_recipe_config(config.values, script=REPO / "recipes" / "sft.py", where=config.key)
    split = catalog.estimate(config)
    whole = estimate_for_recipe(info, LaunchLayout.from_file(REPO / "accelerate_configs" / "fsdp_4x8gpu.yaml"), recipe)
    assert split.layout.parallel.sp == 8 and split.fits and not whole.fits  # as the shipped config's comment says
    assert longest_row(info, split) >= 131072 > 4 * longest_row(info, whole)
    work = Workload(row_length=4096, micro_batch_rows=1)
    one, two = (activation_bytes(info, work, 2, sp=sp)["per_layer"] for sp in (1, 2))
    assert one / 2 < two < one  # half the tokens, plus the all-to-all's copies, keys and values unrepeated


def _steps(output_dir: Path, keys=("loss", "grad_norm")) -> dict:
    return {(r["step"], k): r[k] for r in read_metrics(output_dir) for k in keys if r.get(k) is not None}


def _assert_same_steps(launched: Path, one: Path, what: str) -> None:
    got, expected = _steps(launched), _steps(one)
    assert got and got.keys() == expected.keys(), (what, sorted(got), sorted(expected))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key, got[key], value)


def test_per_token_values_and_every_recipe_split_by_position_equal_one_process_and_sft_resumes(
    tmp_path, four_process_launch
):
    """In the suite's 4-process launch (tests/fixtures/four_processes.py), under FSDP 2 x SP 2 (pretraining SP 4)."""
    launched = four_process_launch
    exchange = json.loads((launched / "exchange.json").read_text())
    assert sorted(exchange) == ["0", "1", "2", "3"]
    for rank, cases in exchange.items():
        assert len(cases) == 4, cases
        for case, (loss_error, gradient_error) in cases.items():
            assert loss_error < 1e-5 and gradient_error < 1e-4, (rank, case, loss_error, gradient_error)
    for name in ("sft", "lora", "dpo", "kto", "distill", "grpo", "reward", "classify", "pretrain"):
        _assert_same_steps(launched / "sp" / name, launched / "one" / name, name)
    _assert_same_steps(launched / "sp" / "hsdp", launched / "one" / "sft", "hsdp 2 x sp 2, checkpointed")
    hsdp = json.loads((launched / "sp" / "hsdp" / "run_summary.json").read_text())
    assert hsdp["parameter_placements"] == ["(Replicate(), Shard(dim=0))"], hsdp["parameter_placements"]
    assert hsdp["parallel_dims"] == ParallelDims(dp_replicate=2, sp=2).describe()
    summary = json.loads((launched / "sp" / "sft" / "run_summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_batch_rows"] == 2
    assert summary["sequence_parallel"]["size"] == 2 and summary["sequence_parallel"]["data_parallel_size"] == 2
    assert summary["parallel_dims"] == LaunchLayout.from_file(SP_2).parallel.describe()  # live = offline
    assert {"sequence_parallel", "sequence_split"} <= set(summary["checks_before_loading"])
    assert summary["parameter_meshes"] == ["('dp_shard_cp',)"]  # FSDP shards over the sp ranks too
    # resumed on the same layout: step 3 as the uninterrupted run had it, and the same export, bitwise
    assert _steps(launched / "sp" / "resumed")[(3, "loss")] == _steps(launched / "sp" / "sft")[(3, "loss")]
    exported = load_file(launched / "sp" / "sft" / "model.safetensors")
    for name, tensor in load_file(launched / "sp" / "resumed" / "model.safetensors").items():
        assert torch.equal(tensor, exported[name]), name
    # resumed on one process: DCP reshards the checkpoint of the dp_shard x sp mesh
    resumed = yaml.safe_load((launched / "sp_resumed.yaml").read_text())
    on_one = {**resumed, "output_dir": str(tmp_path / "resumed_on_one"), "per_device_train_batch_size": 2}
    run_recipe_launched_here("sft", tmp_path, "resumed_on_one", on_one, ONE_PROCESS_FSDP)
    assert _steps(tmp_path / "resumed_on_one")[(3, "loss")] == pytest.approx(
        _steps(launched / "sp" / "sft")[(3, "loss")], rel=1e-5
    )
