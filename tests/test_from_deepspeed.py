"""`fsdp-recipes from-deepspeed`: DeepSpeed configs (ZeRO 0-3, offload, MiCS, bf16/fp16, Hugging Face's "auto"
values) become Accelerate configs that accelerate's own loader reads, that pass the linter and make the launcher
export the expected FSDP_* settings; every DeepSpeed key is accounted for; bad input is one error, nothing written.
And docs/from-deepspeed.md's table of per-rank bytes is what the estimator says. All in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.launch_checks import exported_environment
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.estimator import MODEL_SHAPES, formulas
from fsdp_recipes.tools.estimator.shapes import load_model_info
from fsdp_recipes.tools.estimator.workload import Workload
from fsdp_recipes.tools.linter import lint_config_file
from helpers.paths import REPO

# What Hugging Face's DeepSpeed docs ship for ZeRO-3 with offload: everything the Trainer fills is "auto".
HF_ZERO3_AUTO = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def zero(stage: int, *, precision: str = "bf16", offload: tuple[str, ...] = (), **extra) -> dict:
    config = {
        precision: {"enabled": True},
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, **{f"offload_{part}": {"device": "cpu"} for part in offload}},
    }
    config.update(extra)
    return config


# name, DeepSpeed config, command-line options, what the launcher must export (None: not exported)
CASES = [
    ("zero0_bf16", zero(0), [], {"ACCELERATE_USE_FSDP": None, "ACCELERATE_MIXED_PRECISION": "bf16", "WORLD_SIZE": "8"}),
    (
        "zero1_bf16",
        zero(1),
        [],
        {
            "FSDP_VERSION": "2",
            "FSDP_RESHARD_AFTER_FORWARD": "false",
            "FSDP_OFFLOAD_PARAMS": "false",
            "ACCELERATE_MIXED_PRECISION": "bf16",
        },
    ),
    (
        "zero2_fp16",
        zero(2, precision="fp16"),
        [],
        {"FSDP_RESHARD_AFTER_FORWARD": "false", "ACCELERATE_MIXED_PRECISION": "fp16"},
    ),
    (
        "zero2_offload_optimizer",
        zero(2, offload=("optimizer",)),
        ["--num-processes", "4"],
        {"FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true", "WORLD_SIZE": "4"},
    ),
    (
        "zero3_bf16",
        zero(3),
        [],
        {
            "FSDP_RESHARD_AFTER_FORWARD": "true",
            "FSDP_OFFLOAD_PARAMS": "false",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        },
    ),
    (
        "zero3_offload_fp16",
        zero(3, precision="fp16", offload=("param", "optimizer")),
        [],
        {"FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "true", "ACCELERATE_MIXED_PRECISION": "fp16"},
    ),
    ("zero3_fp32", {"zero_optimization": {"stage": 3}}, [], {"ACCELERATE_MIXED_PRECISION": "no"}),
    (
        "zero3_hf_auto",
        HF_ZERO3_AUTO,
        [],
        {
            "FSDP_RESHARD_AFTER_FORWARD": "true",
            "FSDP_OFFLOAD_PARAMS": "true",
            "ACCELERATE_MIXED_PRECISION": "bf16",
            "WORLD_SIZE": "8",
        },
    ),
    (
        "zero3_mics_two_nodes",
        zero(3, train_batch_size=128) | {"zero_optimization": {"stage": 3, "mics_shard_size": 8}},
        ["--num-machines", "2"],
        {
            "WORLD_SIZE": "16",
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8",
        },
    ),
]


def translate(tmp_path: Path, config: dict | str, options=(), capsys=None) -> tuple[int, Path, str, str]:
    source = tmp_path / "ds_config.json"
    source.write_text(config if isinstance(config, str) else json.dumps(config))
    output = tmp_path / "accelerate_config.yaml"
    code = cli.main(["from-deepspeed", str(source), "-o", str(output), *options])
    captured = capsys.readouterr() if capsys else None
    return code, output, captured.out if captured else "", captured.err if captured else ""


@pytest.mark.parametrize("name, config, options, expected", CASES, ids=[case[0] for case in CASES])
def test_translation_loads_lints_clean_and_exports_the_expected_settings(
    tmp_path, capsys, name, config, options, expected
):
    code, output, out, _ = translate(tmp_path, config, options, capsys)
    assert code == 0, out
    load_config_from_file(str(output))  # accelerate's loader: raises on keys it does not know
    assert lint_config_file(output) == []
    environment = exported_environment(output)
    for key, value in expected.items():
        assert environment.get(key) == value, (key, environment)
    header = output.read_text().split("\ncompute_environment:")[0]
    assert f"accelerate launch --config_file {output}" in header


def test_batch_and_optimizer_settings_become_recipe_fields(tmp_path, capsys):
    config = zero(
        3,
        gradient_clipping=0.5,
        steps_per_print=25,
        optimizer={"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        scheduler={
            "type": "WarmupDecayLR",
            "params": {
                "warmup_num_steps": 100,
                "total_num_steps": 2000,
                "warmup_max_lr": 3e-5,
                "warmup_type": "linear",
            },
        },
    )
    code, output, out, _ = translate(tmp_path, config, capsys=capsys)
    assert code == 0
    fields = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.5,
        "learning_rate": 3e-5,
        "adam_epsilon": 1e-6,
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "lr_scheduler_type": "linear",
        "warmup_steps": 100,
        "max_steps": 2000,
        "logging_steps": 25,
    }
    printed = yaml.safe_load(out.split("set in the recipe config:\n")[1])
    assert printed == fields
    lines = output.read_text().splitlines()
    start = lines.index("# Set in the recipe config (FSDP settings stay here; these are the recipe's):") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("#   "))
    assert yaml.safe_load("\n".join(line[4:] for line in lines[start:end])) == fields
    assert "not carried over" not in out and "approximated" not in out  # every key of this file has its counterpart


def leaf_keys(config: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys += leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"]
    return keys


def test_every_deepspeed_key_is_accounted_for_and_unsupported_ones_are_reported(tmp_path, capsys):
    config = json.loads(json.dumps(HF_ZERO3_AUTO))
    config["zero_optimization"].update(zero_quantized_weights=True, zero_hpz_partition_size=8)
    config.update(
        flops_profiler={"enabled": True, "profile_step": 1},
        my_own_setting=7,
        activation_checkpointing={"partition_activations": True},
    )
    code, output, out, _ = translate(tmp_path, config, capsys=capsys)
    assert code == 0
    for key in leaf_keys(config):
        assert key in out or key.split(".")[0] + ":" in out, f"{key} is not accounted for"
    not_carried = out.split("not carried over:\n")[1].split("\n\n")[0]
    for key in (
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.reduce_bucket_size",
        "flops_profiler:",
        "activation_checkpointing:",
        "my_own_setting: not a setting this translation knows",
    ):
        assert key in not_carried and key in output.read_text(), key
    assert "fp16.hysteresis" in not_carried and "fp16 is not enabled" in not_carried  # "auto" resolved to bf16
    auto = out.split("'auto' values:\n")[1].split("\n\n")[0]
    assert "written as mixed_precision bf16" in auto and "keep the recipe config's per_device_train_batch_size" in auto


def test_static_loss_scaling_and_optimizer_only_offload_are_reported_not_dropped(tmp_path, capsys):
    config = zero(2, precision="fp16", offload=("optimizer",))
    config["fp16"].update(loss_scale=1024, hysteresis=2)
    code, _, out, _ = translate(tmp_path, config, capsys=capsys)
    assert code == 0
    assert "fp16.loss_scale 1024: a static loss scale" in out and "fp16.hysteresis:" in out
    approximated = out.split("approximated:\n")[1].split("\n\n")[0]
    assert "zero_optimization.offload_optimizer.device cpu -> fsdp_offload_params: true" in approximated
    assert "zero_optimization.stage 2" not in approximated and "zero_optimization.stage 2" in out


def test_the_number_of_processes_comes_from_train_batch_size(tmp_path, capsys):
    code, output, out, _ = translate(tmp_path, zero(3, train_batch_size=32), capsys=capsys)
    assert code == 0 and yaml.safe_load(output.read_text())["num_processes"] == 4
    code, output, out, _ = translate(
        tmp_path,
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}},
        ["--num-processes", "8", "--force"],
        capsys,
    )
    assert code == 0 and "gradient_accumulation_steps: 2" in out


@pytest.mark.parametrize(
    "config, options, message",
    [
        (
            '{"zero_optimization": {"stage": 3,}',
            [],
            "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 35)",
        ),
        ("[1, 2]", [], "holds a JSON list, not the object of settings DeepSpeed reads"),
        ({"zero_optimization": {"stage": 4}}, [], "zero_optimization.stage is 4: DeepSpeed has stages 0, 1, 2 and 3"),
        ({"zero_optimization": {"stage": "three"}}, [], "zero_optimization.stage is 'three'"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local"}}},
            [],
            "zero_optimization.offload_param.device is nvme: FSDP2 offloads to CPU memory only",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            [],
            "zero_optimization.offload_optimizer.device is nvme",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], "fp16.enabled and bf16.enabled are both true"),
        (
            zero(3, train_batch_size=64),
            ["--num-processes", "4"],
            "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 4 processes",
        ),
        (zero(3), ["--num-processes", "12", "--num-machines", "8"], "--num-processes 12 is the global count"),
        (zero(1), ["--num-processes", "1"], "ZeRO stage 1 shards over processes, but the launch has 1"),
    ],
)
def test_bad_input_is_one_error_and_nothing_is_written(tmp_path, capsys, config, options, message):
    code, output, _, err = translate(tmp_path, config, options, capsys)
    assert code == 2
    assert err.count("error:") == 1 and message in err and "Traceback" not in err, err
    assert not output.exists()


def test_an_existing_output_is_not_overwritten_without_force(tmp_path, capsys):
    (tmp_path / "accelerate_config.yaml").write_text("mine\n")
    code, output, _, err = translate(tmp_path, zero(3), capsys=capsys)
    assert code == 2 and "exists: pass --force" in err and output.read_text() == "mine\n"
    assert translate(tmp_path, zero(3), ["--force"], capsys)[0] == 0 and output.read_text() != "mine\n"


def test_the_docs_table_of_per_rank_bytes_is_what_the_estimator_says():
    """docs/from-deepspeed.md, "What each rank holds": Llama-3.1-8B, bf16, 8 GPUs per node."""
    doc = (REPO / "docs" / "from-deepspeed.md").read_text()
    info = load_model_info(str(MODEL_SHAPES / "meta-llama/Llama-3.1-8B/config.json"))
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    workload = Workload(2048, 1, "sdpa")
    rows = {row.split("|")[1].strip(): row for row in doc.splitlines() if row.startswith("| stage")}
    for stage, accelerate_config, zero_bytes_per_param in [
        ("stage 0", "ddp_8gpu.yaml", 16),
        ("stage 1", "fsdp_8gpu_shard_grad_op.yaml", 4 + 12 / 8),
        ("stage 2", "fsdp_8gpu_shard_grad_op.yaml", 2 + 14 / 8),
        ("stage 3", "fsdp_8gpu.yaml", 16 / 8),
        ("stage 3, MiCS 8 on 2 x 8 GPUs", "hsdp_2x8gpu.yaml", 16 / 8),
    ]:
        topology = LaunchLayout.from_file(REPO / "accelerate_configs" / accelerate_config)
        estimate = formulas.estimate(info, topology, workload)
        cells = [cell.strip() for cell in rows[stage].split("|")[3:9]]
        assert cells[:4] == [
            gib(estimate.state["parameters"]),
            gib(estimate.state["gradients"]),
            gib(estimate.state["optimizer_state"]),
            gib(sum(estimate.state.values())),
        ], stage
        assert cells[4].startswith(gib(estimate.buffers["all_gather"])), stage
        assert cells[5] == gib(zero_bytes_per_param * info.num_params), stage
        assert f"`{accelerate_config}`" in rows[stage]
    offload = formulas.estimate(
        info, LaunchLayout.from_file(REPO / "accelerate_configs/fsdp_8gpu_offload.yaml"), workload
    )
    assert f"{gib(sum(offload.host_state.values()))} of host RAM per rank" in rows["stage 3, offload cpu"]
    assert offload.device_state == 0 and f"| 0 | {gib(offload.buffers['all_gather'])} |" in rows["stage 3, offload cpu"]
