"""The memory estimator (fsdp_recipes.tools.estimator, `fsdp-recipes estimate`): its state bytes against what real FSDP2 ranks
hold on CPU at 1, 2 and 4 processes, its sharding arithmetic, its activation formula, and its command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.sizes import parse_reserve, parse_size
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.tools.estimator.arguments import add_estimate_arguments
from fsdp_recipes.tools.estimator.command import main, run_estimate
from fsdp_recipes.tools.estimator.formulas import Unit, activation_bytes, estimate, plan_units, state_bytes_on_rank
from fsdp_recipes.tools.estimator.recipe import config_class, recipe_config
from fsdp_recipes.tools.estimator.shapes import Param, load_model_info
from fsdp_recipes.tools.estimator.workload import Workload, workload_for
from helpers.paths import FSDP_CPU_CONFIG, REPO

LLAMA_8B = REPO / "tests" / "data" / "llama-3-8b-like_config.json"
GiB = 2**30


def fsdp_yaml(
    path: Path,
    *,
    processes=8,
    machines=1,
    version=2,
    reshard=True,
    mixed="bf16",
    offload=False,
    checkpointing=False,
    wrap="TRANSFORMER_BASED_WRAP",
    extra_fsdp=None,
    **top,
) -> Path:
    fsdp = {
        "fsdp_version": version,
        "fsdp_auto_wrap_policy": wrap,
        "fsdp_offload_params": offload,
        "fsdp_activation_checkpointing": checkpointing,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    fsdp["fsdp_reshard_after_forward" if version == 2 else "fsdp_sharding_strategy"] = (
        reshard if version == 2 else ("FULL_SHARD" if reshard else "SHARD_GRAD_OP")
    )
    fsdp.update(extra_fsdp or {})
    raw = {
        "distributed_type": "FSDP",
        "num_processes": processes,
        "num_machines": machines,
        "mixed_precision": mixed,
        "fsdp_config": fsdp,
        **top,
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def llama8b():
    return load_model_info(str(LLAMA_8B))


@pytest.fixture(scope="module")
def tiny_info(tiny_model_config):
    return load_model_info(str(tiny_model_config))


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------------------------ validation (slow)
# Every recipe run records, after its first optimizer step, the bytes each rank really holds (DTensor local shards and
# their padded storage, gradients, AdamW state: `state_bytes_per_rank`) beside the estimator's prediction for each
# rank (`memory_estimate.rank_state_bytes_per_rank`). The shared SFT runs serve here (1 and 2 ranks); the resume on 4
# ranks checks the same in tests/test_checkpoint_resume.py, and the LoRA runs in tests/test_sft_lora.py.
@pytest.fixture(scope="module")
def measured(reference_run, one_process_run) -> dict[int, dict]:
    summaries = [json.loads((run / "run_summary.json").read_text()) for run in (one_process_run, reference_run)]
    return {summary["world_size"]: summary for summary in summaries}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_predicted_state_bytes_are_what_each_rank_holds_to_the_byte(measured, world_size):
    """Parameters, gradients and AdamW state per rank, through the real FSDP2 path: the padded storage of parameters
    and gradients and the unpadded AdamW state are predicted to the byte on every rank. A torch upgrade that changes
    FSDP2's padding fails here first."""
    summary = measured[world_size]  # 1: a plain process (no FSDP); 2: FSDP2 FULL_SHARD
    assert summary["world_size"] == world_size and summary["distributed_type"] == ("FSDP" if world_size > 1 else "NO")
    held, predicted = summary["state_bytes_per_rank"], summary["memory_estimate"]["rank_state_bytes_per_rank"]
    assert len(held) == world_size and all(sum(rank.values()) > 0 for rank in held)
    assert held == predicted
    # the headline (most loaded rank) is never below what a rank holds
    headline = summary["memory_estimate"]["predicted_per_gpu_bytes"]
    assert all(
        headline["parameters"] + headline["gradients"] + headline["optimizer_state"] >= sum(rank.values())
        for rank in held
    )


@pytest.mark.slow
def test_measured_state_shrinks_as_one_over_n(measured):
    """Real ranks: state at 2 ranks is ~1/2 of one rank's (padding makes it slightly more), as predicted."""
    one = sum(measured[1]["state_bytes_per_rank"][0].values())
    rank0 = sum(measured[2]["state_bytes_per_rank"][0].values())
    assert one / 2 <= rank0 <= one / 2 * 1.03, (rank0, one)


# ------------------------------------------------------------------------------------------------ sharding arithmetic
def test_full_shard_predicts_one_over_n_of_no_shard(llama8b, tiny_info):
    for info, tolerance in ((llama8b, 1e-4), (tiny_info, 0.02)):
        no_shard = LaunchLayout(ParallelDims(dp_replicate=8), distributed_type="MULTI_GPU")
        whole = sum(state_bytes_on_rank(plan_units(info, no_shard), no_shard).values())
        # NO_SHARD holds fp32 params + grads + 2 AdamW states: 16 bytes per parameter (+ 4-byte steps)
        assert whole == pytest.approx(16 * info.num_params, rel=1e-3)
        for n in (2, 4, 8):
            full = LaunchLayout(ParallelDims(dp_shard=n))
            sharded = sum(state_bytes_on_rank(plan_units(info, full), full).values())
            assert whole / n <= sharded <= whole / n * (1 + tolerance), (n, sharded, whole)


def test_padding_follows_fsdp2_chunks():
    """A parameter of 10 rows over 4 ranks: chunks of 3, 3, 3, 1 rows; storage padded to 3 rows on every rank."""
    param = Param("w", (10, 7))
    assert [param.rows_on(r, 4) for r in range(4)] == [3, 3, 3, 1]
    assert [param.rows_on(r, 8) for r in range(8)] == [2, 2, 2, 2, 2, 0, 0, 0]
    unit = Unit("u", "layer", [param])
    topo = LaunchLayout(ParallelDims(dp_shard=4))
    assert state_bytes_on_rank([unit], topo, 3) == {
        "parameters": 4 * 3 * 7,
        "gradients": 4 * 3 * 7,
        "optimizer_state": 2 * 4 * 1 * 7 + 4,
    }


def test_hsdp_shards_over_the_shard_size_only(llama8b, tmp_path):
    hsdp = LaunchLayout.from_file(
        fsdp_yaml(
            tmp_path / "h.yaml",
            processes=16,
            machines=2,
            parallelism_config={"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 8},
        )
    )
    assert (hsdp.parallel.world_size, hsdp.parallel.shard_size, hsdp.sharding) == (16, 8, "HSDP")
    full8 = LaunchLayout(ParallelDims(dp_shard=8))
    full16 = LaunchLayout(ParallelDims(dp_shard=16))
    state = lambda t: sum(state_bytes_on_rank(plan_units(llama8b, t), t).values())  # noqa: E731
    assert state(hsdp) == state(full8) and state(hsdp) > 1.9 * state(full16)
    with pytest.raises(ConfigError, match="dp_replicate_size 2 x dp_shard_size 4"):
        LaunchLayout.from_file(
            fsdp_yaml(
                tmp_path / "bad.yaml",
                processes=16,
                parallelism_config={"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 4},
            )
        )


def test_topologies_read_from_accelerate_yaml(tmp_path):
    repo = LaunchLayout.from_file(REPO / "accelerate_configs" / "fsdp_8gpu.yaml")
    assert (repo.parallel.world_size, repo.fsdp_version, repo.sharding, repo.mixed_precision, repo.compute_bytes) == (
        8,
        2,
        "FULL_SHARD",
        "bf16",
        2,
    )
    sgo = LaunchLayout.from_file(fsdp_yaml(tmp_path / "a.yaml", reshard=False))
    assert sgo.sharding == "SHARD_GRAD_OP"
    fsdp1 = LaunchLayout.from_file(fsdp_yaml(tmp_path / "b.yaml", version=1, reshard=False))
    assert (fsdp1.fsdp_version, fsdp1.sharding) == (1, "SHARD_GRAD_OP")
    # FSDP1 strategy written where `accelerate config` puts it is ignored by the launcher: FULL_SHARD
    fsdp1_misplaced = LaunchLayout.from_file(
        fsdp_yaml(tmp_path / "c.yaml", version=1, extra_fsdp={"fsdp_reshard_after_forward": "SHARD_GRAD_OP"})
    )
    assert fsdp1_misplaced.sharding == "FULL_SHARD"
    ddp = LaunchLayout.from_mapping({"distributed_type": "MULTI_GPU", "num_processes": 8, "mixed_precision": "bf16"})
    assert (ddp.distributed_type, ddp.parallel.shard_size, ddp.sharding) == ("MULTI_GPU", 1, "NO_SHARD")
    omitted = LaunchLayout.from_mapping(
        {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}
    )
    assert omitted.wrap_policy == "NO_WRAP"  # what the launcher does with an omitted policy


def test_units_mirror_accelerates_fsdp2_preparation(tiny_info):
    topo = LaunchLayout(ParallelDims(dp_shard=2))
    units = plan_units(tiny_info, topo)
    assert [u.kind for u in units] == ["embedding", "layer", "layer", "tail"]
    assert [u.reshard_after_forward for u in units] == [True, True, True, False]
    assert sum(u.numel for u in units) == tiny_info.num_params
    # NO_WRAP: the decoder layers stay in the root, which is never resharded after forward
    no_wrap = plan_units(tiny_info, dataclasses.replace(topo, wrap_policy="NO_WRAP"))
    assert [u.kind for u in no_wrap] == ["embedding", "tail", "root"] and not no_wrap[-1].reshard_after_forward
    with pytest.raises(ConfigError, match="GPT2Block"):
        plan_units(tiny_info, dataclasses.replace(topo, wrap_classes=("GPT2Block",)))


def test_buffers_by_sharding(llama8b):
    full = LaunchLayout(ParallelDims(dp_shard=8), mixed_precision="bf16")
    work = Workload(2048, 4)
    e_full = estimate(llama8b, full, work)
    e_sgo = estimate(llama8b, dataclasses.replace(full, reshard_after_forward=False), work)
    e_nowrap = estimate(llama8b, dataclasses.replace(full, wrap_policy="NO_WRAP"), work)
    # SHARD_GRAD_OP and NO_WRAP keep every unit gathered from forward to backward: the whole model in bf16
    assert e_sgo.buffers["all_gather"] == pytest.approx(2 * llama8b.num_params, rel=1e-6)
    assert e_nowrap.buffers["all_gather"] == pytest.approx(2 * llama8b.num_params, rel=0.1)
    assert e_full.buffers["all_gather"] < e_sgo.buffers["all_gather"] / 4
    offload = estimate(llama8b, dataclasses.replace(full, cpu_offload=True), work)
    assert offload.per_gpu()["parameters"] == 0 and offload.host_state == e_full.state
    assert offload.total == e_full.total - sum(e_full.state.values())


def test_the_optimizer_step_is_the_peak_once_checkpointing_shrinks_activations(llama8b):
    """AdamW's foreach step holds one fp32 copy of the rank's trainable shard; it follows backward, so it competes with
    the activations, not with them and on top. On one GPU with checkpointing it is the larger (the H200 run)."""
    one_gpu = LaunchLayout(ParallelDims(), mixed_precision="bf16", activation_checkpointing=True)
    work = Workload(2048, 4)
    checkpointed = estimate(llama8b, one_gpu, work)
    shard = sum(unit.numel for unit in checkpointed.units)
    assert checkpointed.optimizer_step == 4 * shard + 2 * len([p for unit in checkpointed.units for p in unit.params])
    assert checkpointed.total == checkpointed.device_state + checkpointed.optimizer_step
    assert checkpointed.per_gpu()["optimizer_step"] == checkpointed.optimizer_step
    full_activations = estimate(llama8b, dataclasses.replace(one_gpu, activation_checkpointing=False), work)
    assert full_activations.optimizer_step < full_activations.activations_used
    buffers = full_activations.buffers["all_gather"] + full_activations.buffers["reduce_scatter"]
    assert full_activations.total == full_activations.device_state + full_activations.activations_used + buffers
    offloaded = estimate(llama8b, dataclasses.replace(one_gpu, cpu_offload=True), work)
    assert offloaded.optimizer_step == 0  # the step runs on the host


def test_auto_attention_is_estimated_as_the_gpu_run_takes_it(llama8b):
    """auto: flex for packed rows (keys and values saved at the KV heads' size), sdpa under TP or unpacked rows (repeated
    to every query head), as models/attention.py chooses on a CUDA GPU."""
    one_node = LaunchLayout(ParallelDims(dp_shard=8), mixed_precision="bf16")
    packed = Workload(2048, 4, attn_implementation="auto", packs_examples=True)
    activations = lambda layout, work: estimate(llama8b, layout, work).activations_used  # noqa: E731
    flex = activations(one_node, dataclasses.replace(packed, attn_implementation="flex_attention"))
    sdpa = activations(one_node, dataclasses.replace(packed, attn_implementation="sdpa"))
    assert flex < sdpa and activations(one_node, packed) == flex
    assert activations(one_node, dataclasses.replace(packed, packs_examples=False)) == sdpa
    tensor_parallel = dataclasses.replace(one_node, parallel=ParallelDims(dp_shard=4, tp=2))
    assert activations(tensor_parallel, packed) == activations(
        tensor_parallel, dataclasses.replace(packed, attn_implementation="sdpa")
    )


# ------------------------------------------------------------------------------------------------ activations
def test_activation_formula(llama8b):
    work = Workload(row_length=2048, micro_batch_rows=4, loss_implementation="full_logits")
    acts = activation_bytes(llama8b, work, compute_bytes=2)
    h, i, kv, tokens = 4096, 14336, 8 * 128, 8192
    # sdpa gets keys and values repeated to all 32 heads (transformers does so whenever a mask is given: packed rows)
    per_token_layer = 2 * (2 * h + 3 * h + 2 * h + 4 * i) + 4 * 2 * h + 4 * 32
    assert acts["per_layer"] == per_token_layer * tokens
    flash = activation_bytes(llama8b, dataclasses.replace(work, attn_implementation="flash_attention_2"), 2)
    assert acts["per_layer"] - flash["per_layer"] == 2 * 2 * (h - kv) * tokens  # flash takes the 8 kv heads as they are
    assert acts["logits"] == 3 * 4 * 128256 * tokens
    assert acts["without_checkpointing"] > 32 * acts["per_layer"] + acts["logits"]
    assert acts["with_checkpointing"] == 32 * 2 * h * tokens + max(
        acts["per_layer"], acts["logits"] + (4 * h + 2 * h + 2 * 2 * 128 + 24) * tokens
    )
    # linear in tokens; eager attention adds the s^2 scores
    double = activation_bytes(llama8b, dataclasses.replace(work, micro_batch_rows=8), 2)
    assert double["without_checkpointing"] == 2 * acts["without_checkpointing"]
    eager = activation_bytes(llama8b, dataclasses.replace(work, attn_implementation="eager"), 2)
    assert eager["per_layer"] - acts["per_layer"] == (2 + 4) * 32 * 2048 * tokens
    # the chunked loss holds one chunk's fp32 logits and the hidden states of the loss tokens
    chunked = activation_bytes(llama8b, dataclasses.replace(work, loss_implementation="chunked"), 2)
    assert chunked["logits"] == 4 * 128256 * 1024 + 2 * h * tokens
    assert chunked["logits"] <= acts["logits"] / 8


# ------------------------------------------------------------------------------------------------ command line
def test_size_parsing():
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("141GiB") == 141 * 2**30
    assert parse_size("24e9") == 24 * 10**9
    assert parse_size(" 1.5 tb ") == 1.5e12
    assert parse_size("40960MiB") == 40 * 2**30
    for bad in ("eighty", "80XB", "-8GB", "", "80"):  # "80" would be 80 bytes: refused, with a hint
        with pytest.raises(ConfigError):
            parse_size(bad)
    assert parse_reserve("10%", 100 * 2**30) == 10 * 2**30
    assert parse_reserve("0", 100) == 0
    with pytest.raises(ConfigError):
        parse_reserve("150%", 100 * 2**30)


def test_cli_json_fields_and_fit(tiny_model_config, capsys):
    code, out, _ = run_cli(
        [
            "--model",
            tiny_model_config,
            "--accelerate-config",
            FSDP_CPU_CONFIG,
            "--json",
            "--gpu-memory",
            "24GB",
            "--max-length",
            "64",
            "--batch-size",
            "4",
        ],
        capsys,
    )
    assert code == 0
    report = json.loads(out)
    per_gpu = report["per_gpu_bytes"]
    assert set(per_gpu) >= {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "all_gather_buffers",
        "activations_with_checkpointing",
        "activations_without_checkpointing",
        "total",
    }
    assert per_gpu["total"] == sum(
        per_gpu[k]
        for k in (
            "parameters",
            "gradients",
            "optimizer_state",
            "activations",
            "all_gather_buffers",
            "reduce_scatter_buffers",
        )
    )
    assert report["fits"] is True and report["suggestions"] == []
    assert report["topology"]["sharding"] == "FULL_SHARD" and report["topology"]["world_size"] == 2
    assert report["workload"]["tokens_per_micro_batch"] == 256
    assert report["gpu_memory_bytes"] == 24 * 10**9 and report["reserve_bytes"] == 24 * 10**8
    assert report["usable_bytes"] - per_gpu["total"] == report["headroom_bytes"] > 0


def test_cli_does_not_fit_and_suggests(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_config": str(LLAMA_8B),
                "max_length": 2048,
                "per_device_train_batch_size": 4,
                "loss_implementation": "full_logits",
            }
        )
    )
    code, out, _ = run_cli(
        ["--recipe-config", recipe, "--accelerate-config", REPO / "accelerate_configs" / "fsdp_8gpu.yaml", "--json"],
        capsys,
    )
    report = json.loads(out)
    assert code == 1 and report["fits"] is False and report["headroom_bytes"] < 0
    assert report["parameters_total"] == 8_030_261_248
    by_change = {s["change"]: s for s in report["suggestions"]}
    assert by_change["activation checkpointing"]["fits"]
    ac_total = by_change["activation checkpointing"]["predicted_total_bytes"]
    current = report["per_gpu_bytes"]
    assert (
        ac_total
        == current["total"] - current["activations_without_checkpointing"] + current["activations_with_checkpointing"]
    )
    assert by_change["CPU offload"]["host_bytes_per_gpu"] == sum(
        current[k] for k in ("parameters", "gradients", "optimizer_state")
    )
    assert any(c.startswith("more GPUs") for c in by_change) and any(c.startswith("LoRA") for c in by_change)
    assert all(s["predicted_total_bytes"] < current["total"] for s in report["suggestions"])
    # the table says the same in words
    code, out, _ = run_cli(
        [
            "--recipe-config",
            recipe,
            "--accelerate-config",
            REPO / "accelerate_configs" / "fsdp_8gpu.yaml",
            "--gpu-memory",
            "141GiB",
        ],
        capsys,
    )
    assert code == 0 and "fits in" in out and "NOT" not in out and "total" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model/config.json"], "no such file"),
        (["--model", "{tiny}", "--gpu-memory", "lots"], "cannot read memory size"),
        (["--model", "{tiny}", "--accelerate-config", "/nonexistent.yaml"], "does not exist"),
        (["--model", "{tiny}", "--batch-size", "0"], "must be >= 1"),
        ([], "no model"),
    ],
)
def test_cli_bad_inputs_fail_clearly(argv, message, tiny_model_config, capsys):
    argv = [a.replace("{tiny}", str(tiny_model_config)) for a in argv]
    if "--accelerate-config" not in argv:
        argv += ["--accelerate-config", str(FSDP_CPU_CONFIG)]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_hands_wiring_matches_cli_module(tiny_model_config, capsys):
    """The two functions cli.py wires: a parser filled by add_estimate_arguments, run by run_estimate."""
    import argparse

    parser = argparse.ArgumentParser()
    add_estimate_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model_config),
            "--accelerate-config",
            str(FSDP_CPU_CONFIG),
            "--num-processes",
            "4",
            "--json",
        ]
    )
    assert run_estimate(args) == 0
    assert json.loads(capsys.readouterr().out)["topology"]["shard_size"] == 4


def test_tied_embeddings_are_one_tail_unit_counted_once():
    """demo/tiny_llama.json ties embeddings: accelerate puts embedding, final norm and lm_head in one tail unit, and
    the shared weight is counted once (as model.parameters() does)."""
    info = load_model_info(str(REPO / "demo" / "tiny_llama.json"))
    assert info.tied_embeddings
    units = plan_units(info, LaunchLayout(ParallelDims(dp_shard=2)))
    assert [u.kind for u in units] == ["layer", "layer", "layer", "tail"]
    assert "model.embed_tokens" in units[-1].name and sum(u.numel for u in units) == info.num_params == 505_600


def test_packed_rows_are_as_wide_as_packing_row_length():
    sft = REPO / "recipes" / "sft.py"  # the workload is what the recipe's config class says its rows are
    assert workload_for(recipe_config({"max_length": 4096}, script=sft)).row_length == 4096
    packed = {"max_length": 4096, "packing": True, "packing_row_length": 1024, "per_device_train_batch_size": 2}
    assert workload_for(recipe_config(packed, script=sft)).tokens == 2048
    unpacked = dict(packed, packing=False)  # packing_row_length only shapes packed rows
    assert workload_for(recipe_config(unpacked, script=sft)).tokens == 8192


def test_a_reference_model_copy_is_counted_for_the_mode_the_recipe_config_chooses(capsys, tmp_path, monkeypatch):
    """A recipe whose config class has TRL's precompute_ref_log_probs keeps a reference model: a frozen copy at the
    compute dtype, sharded like the policy, unless its values are precomputed or it is the policy without adapters."""
    dpo, sft = config_class(REPO / "recipes" / "dpo.py"), config_class(REPO / "recipes" / "sft.py")
    assert dpo().frozen_model_copies() == 1
    assert dpo(precompute_ref_log_probs=True).frozen_model_copies() == 0
    assert dpo(use_peft=True).frozen_model_copies() == 0
    assert sft().frozen_model_copies() == 0

    shipped = REPO / "recipes" / "configs" / "dpo" / "llama-3.1-8b_ultrafeedback.yaml"  # its comment launches dpo.py
    accelerate_config = REPO / "accelerate_configs" / "fsdp_8gpu.yaml"
    code, out, _ = run_cli(
        ["--recipe-config", shipped, "--accelerate-config", accelerate_config, "--model", LLAMA_8B, "--json"], capsys
    )
    per_gpu = json.loads(out)["per_gpu_bytes"]
    assert code == 0 and per_gpu["reference_model"] == per_gpu["parameters"] // 2  # bf16 copy of the fp32 shards
    code, table, _ = run_cli(
        ["--recipe-config", shipped, "--accelerate-config", accelerate_config, "--model", LLAMA_8B], capsys
    )
    assert "reference model (frozen copy, sharded)" in table
    monkeypatch.chdir(REPO)  # the copy's comment launches recipes/dpo.py, found from the working directory
    precomputed = tmp_path / "precomputed.yaml"
    precomputed.write_text(
        shipped.read_text().replace("learning_rate", "precompute_ref_log_probs: true\nlearning_rate")
    )
    code, out, _ = run_cli(
        ["--recipe-config", precomputed, "--accelerate-config", accelerate_config, "--model", LLAMA_8B, "--json"],
        capsys,
    )
    assert json.loads(out)["per_gpu_bytes"]["reference_model"] == 0

    code, out, _ = run_cli(
        [
            "--recipe-config",
            shipped,
            "--accelerate-config",
            accelerate_config,
            "--model",
            LLAMA_8B,
            "--gpu-memory",
            "20GB",
            "--json",
        ],
        capsys,
    )
    report = json.loads(out)
    by_change = {s["change"]: s for s in report["suggestions"]}
    assert code == 1 and by_change["no reference model copy"]["predicted_total_bytes"] == (
        report["per_gpu_bytes"]["total"] - report["per_gpu_bytes"]["reference_model"]
    )


def test_the_printed_summary_shows_the_estimate_in_a_few_gib_lines_and_the_json_keeps_the_bytes():
    from fsdp_recipes.run.components import printed_summary

    estimate = {
        "predicted_per_gpu_bytes": {"parameters": 3 * 2**30, "gradients": 3 * 2**30, "optimizer_state": 6 * 2**30,
                                    "reference_model": 0, "activations": 2**29, "activations_without_checkpointing": 2**29,
                                    "activations_with_checkpointing": 2**27, "logits": 2**28, "all_gather_buffers": 2**26,
                                    "total": 13 * 2**30},
        "predicted_host_bytes_per_gpu": {"optimizer_state": 0},
        "rank_state_bytes_per_rank": [{"parameters": 3 * 2**30}] * 8,
        "sharding": "FULL_SHARD",
        "tokens_per_micro_batch": 4096,
    }  # fmt: skip
    summary = {"world_size": 8, "memory_estimate": estimate, "optim": "adamw_torch"}
    rows = printed_summary(summary)
    assert rows[0] == ("world_size", 8) and rows[-1] == ("optim", "adamw_torch")
    assert rows[1] == (
        "memory_estimate",
        "13 GiB per GPU, predicted (FULL_SHARD, 4096 tokens per micro-batch); in bytes in run_summary.json",
    )
    assert rows[2:-1] == [
        ("  of which (GiB)", "parameters 3, gradients 3, optimizer state 6, activations 0.5"),
        ("", "logits 0.25, all gather buffers 0.0625"),
    ]  # the zero parts and the two activation variants left out; no host line when nothing is offloaded
    assert summary["memory_estimate"] is estimate  # run_summary.json is written from the summary, unchanged
    assert printed_summary({"memory_estimate": None}) == [("memory_estimate", None)]  # eval: none made
