"""`fsdp-recipes from-deepspeed ds_config.json -o accelerate_config.yaml`: the FSDP2 Accelerate config equivalent to a
DeepSpeed config, the recipe fields to set, and every DeepSpeed setting that has no FSDP equivalent.

Every key of the DeepSpeed file ends up in exactly one of three lists: mapped (to the Accelerate config or to a
recipe field), approximated (mapped to the nearest FSDP behaviour, with the difference said), or not carried over
(with the reason). Nothing is dropped without a word. `"auto"` values (what Hugging Face's DeepSpeed integration
writes, to be filled from the training arguments) are resolved where the FSDP side needs a value and otherwise left
to the recipe config, and listed either way. The YAML itself is written by the generator of the shipped configs
(fsdp_recipes.tools.topology), so it passes the linter. The mapping and its reasons: docs/from-deepspeed.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from fsdp_recipes.common.errors import ConfigError, UserError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools.topology import describe_hardware, launch_lines, render_body

AUTO = "auto"

# DeepSpeed key (or a whole section) -> why nothing in FSDP2 / this repository corresponds to it.
NOT_CARRIED = {
    "zero_optimization.overlap_comm": "FSDP2 always overlaps communication with compute (it prefetches the next unit)",
    "zero_optimization.contiguous_gradients": "FSDP2 reduce-scatters each unit's gradients straight into its shards",
    "zero_optimization.reduce_bucket_size": "FSDP2 reduce-scatters per FSDP unit (a decoder layer), not per byte bucket",
    "zero_optimization.allgather_bucket_size": "FSDP2 all-gathers per FSDP unit (a decoder layer), not per byte bucket",
    "zero_optimization.allgather_partitions": "FSDP2 always all-gathers a unit's parameters in one collective",
    "zero_optimization.reduce_scatter": "FSDP2 always reduce-scatters gradients",
    "zero_optimization.round_robin_gradients": "a ZeRO-2 offload optimisation with no FSDP2 counterpart",
    "zero_optimization.sub_group_size": "the optimizer steps each rank's whole shard at once; there are no sub-groups",
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches one unit (a decoder layer) ahead, not a byte "
    "budget",
    "zero_optimization.stage3_param_persistence_threshold": "FSDP2 reshards every wrapped unit; parameters outside the "
    "decoder layers stay in the root unit, which is not resharded after forward",
    "zero_optimization.stage3_max_live_parameters": "FSDP2 keeps the current and the prefetched unit gathered: the unit "
    "size (a decoder layer, fsdp_transformer_layer_cls_to_wrap) is the knob",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 re-gathers a resharded unit whenever it is used again",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "nothing to set: the recipe always exports full "
    "weights at the end, and `fsdp-recipes export` turns any checkpoint into a model folder",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "nothing to set: the recipe always exports full "
    "weights at the end, and `fsdp-recipes export` turns any checkpoint into a model folder",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ (int8 weight all-gather): FSDP2 all-gathers in the compute "
    "dtype",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ (int8 frozen weights): FSDP2 keeps them in the "
    "parameter dtype",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ (int4 gradient reduce-scatter): FSDP2 reduces in the "
    "compute dtype",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hpZ (a second weight copy sharded within each node) has no FSDP2 "
    "counterpart; HSDP (accelerate_configs/hsdp_2x8gpu.yaml) keeps one whole replica per node instead",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS's two-level all-gather: FSDP2's HSDP gathers within the "
    "shard group only",
    "zero_optimization.elastic_checkpoint": "nothing to set: sharded (DCP) checkpoints load onto any number of processes",
    "zero_optimization.load_from_fp32_weights": "nothing to set: checkpoints hold the fp32 parameters FSDP trains",
    "zero_optimization.ignore_unused_parameters": "nothing to set: FSDP2 does not require every parameter to get a "
    "gradient",
    "zero_optimization.round_robin": "a ZeRO-2 offload optimisation with no FSDP2 counterpart",
    "zero_optimization.legacy_stage1": "a DeepSpeed implementation switch",
    "zero_optimization.memory_efficient_linear": "a DeepSpeed implementation switch",
    "zero_optimization.use_multi_rank_bucket_allreduce": "a DeepSpeed implementation switch",
    "zero_optimization.log_trace_cache_warnings": "a DeepSpeed logging switch",
    "zero_optimization.offload_param.pin_memory": "FSDP2's CPU offload pins host memory itself (accelerate does not "
    "expose the choice)",
    "zero_optimization.offload_optimizer.pin_memory": "FSDP2's CPU offload pins host memory itself (accelerate does not "
    "expose the choice)",
    "zero_optimization.offload_param.buffer_count": "DeepSpeed's offload buffers; FSDP2 moves one unit at a time",
    "zero_optimization.offload_param.buffer_size": "DeepSpeed's offload buffers; FSDP2 moves one unit at a time",
    "zero_optimization.offload_param.max_in_cpu": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.buffer_count": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.fast_init": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.pipeline_read": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.pipeline_write": "an NVMe offload setting",
    "fp16.hysteresis": "accelerate's gradient scaler lowers the scale at the first overflow (no hysteresis)",
    "fp16.consecutive_hysteresis": "accelerate's gradient scaler lowers the scale at the first overflow (no hysteresis)",
    "fp16.min_loss_scale": "accelerate's gradient scaler has no floor for the scale",
    "fp16.auto_cast": "FSDP's mixed precision casts parameters for compute; inputs are not cast separately",
    "fp16.fp16_master_weights_and_grads": "FSDP keeps fp32 master weights and reduces gradients in the compute dtype",
    "bf16.immediate_grad_update": "a DeepSpeed bf16-optimizer switch",
    "bf16.check_grad_overflow": "a DeepSpeed bf16-optimizer switch",
    "prescale_gradients": "FSDP2 divides gradients by the world size inside the reduce-scatter",
    "gradient_predivide_factor": "FSDP2 divides gradients by the world size inside the reduce-scatter",
    "sparse_gradients": "dense gradients only",
    "wall_clock_breakdown": "the recipe logs step time, tokens/s and data wait in metrics.jsonl",
    "memory_breakdown": "the run summary has the memory estimate and the metrics the peak memory",
    "zero_allow_untested_optimizer": "nothing to set: FSDP2 works with any torch optimizer",
    "zero_force_ds_cpu_optimizer": "nothing to set: the optimizer steps where the shards live",
    "dump_state": "a DeepSpeed debugging switch",
    "zero_optimization.offload_param.nvme_path": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.nvme_path": "an NVMe offload setting",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload: FSDP2 offloads all of it or none",
    "optimizer.params.torch_adam": "nothing to set: the recipes use torch's AdamW",
    "optimizer.params.fused": "optim: adamw_torch_fused in the recipe config picks the fused kernel",
    "scheduler.params.last_batch_iteration": "nothing to set: a resumed run restores the schedule from its checkpoint",
}
NOT_CARRIED_SECTIONS = {
    "activation_checkpointing": "DeepSpeed's own checkpointing API (Megatron-style models); for Hugging Face models set "
    "fsdp_activation_checkpointing: true in the Accelerate config (accelerate_configs/"
    "fsdp_8gpu_activation_checkpointing.yaml) or gradient_checkpointing: true in the recipe",
    "flops_profiler": "the recipe logs FLOPs per token and MFU in metrics.jsonl",
    "comms_logger": "no communication logger; torch.profiler shows the collectives",
    "csv_monitor": "report_to supports tensorboard, wandb and trackio",
    "comet": "report_to supports tensorboard, wandb and trackio",
    "aio": "NVMe offload settings: FSDP2 offloads to CPU memory only",
    "amp": "NVIDIA Apex AMP: use bf16 or fp16 (mixed_precision)",
    "sparse_attention": "a DeepSpeed kernel; attn_implementation chooses the attention kernel",
    "data_efficiency": "DeepSpeed's data sampling and routing library",
    "curriculum_learning": "DeepSpeed's data sampling and routing library",
    "compression_training": "DeepSpeed's compression library",
    "autotuning": "DeepSpeed's autotuner; `fsdp-recipes estimate` predicts memory per GPU instead",
    "elasticity": "DeepSpeed's elastic batch sizes; resume on another number of processes keeps the global batch instead",
    "pipeline": "pipeline parallelism: FSDP2 recipes here shard data-parallel only",
    "checkpoint": "DeepSpeed checkpoint options (tag validation, universal checkpoints): sharded DCP checkpoints reshard "
    "on load without conversion",
    "nebula": "DeepSpeed's Azure checkpoint service",
    "eigenvalue": "a DeepSpeed training-dynamics tool",
    "progressive_layer_drop": "a DeepSpeed training technique with no counterpart here",
    "quantize_training": "DeepSpeed's quantisation-aware training",
    "tensor_parallel": "tensor parallelism: FSDP2 recipes here shard data-parallel only",
    "sequence_parallel_size": "sequence parallelism: not in these recipes",
    "data_types": "DeepSpeed gradient accumulation dtype: FSDP accumulates in fp32 sharded gradients",
}


@dataclasses.dataclass
class Translation:
    layout: LaunchLayout  # the launch the Accelerate config asks for
    recipe_fields: dict[str, Any]  # recipe config field -> value
    mapped: list[str]  # "DeepSpeed key value -> FSDP / recipe setting"
    approximated: list[str]  # mapped to the nearest behaviour, the difference said
    not_carried: list[str]  # "key: why"
    auto: list[str]  # how each "auto" value was resolved


def load_deepspeed_config(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"cannot read the DeepSpeed config {str(path)!r}: {error.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}): "
            "fix the file (a DeepSpeed config is one JSON object)"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not the object of settings DeepSpeed reads")
    return config


def _leaves(config: dict, prefix: str = "") -> dict[str, Any]:
    found = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found.update(_leaves(value, path + "."))
        else:
            found[path] = value
    return found


class _Reader:
    """The DeepSpeed settings by dotted path; remembers which were looked at, so that the rest can be reported."""

    def __init__(self, config: dict):
        self.leaves = _leaves(config)
        self.used: set[str] = set()

    def get(self, path: str, default: Any = None) -> Any:
        self.used.add(path)
        return self.leaves.get(path, default)

    def has(self, path: str) -> bool:
        return path in self.leaves

    def unused(self) -> list[str]:
        return [path for path in self.leaves if path not in self.used]


def _as_int(value: Any, key: str) -> int | None:
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 0:
        raise ConfigError(f'{key} is {value!r}: expected a whole number or "auto"')
    return int(value)


def translate(config: dict, *, num_processes: int | None = None, num_machines: int = 1) -> Translation:
    """The translation of a DeepSpeed config (a parsed JSON object). Raises ConfigError (one message, every problem)
    for what cannot be translated at all."""
    ds = _Reader(config)
    fields: dict[str, Any] = {}
    mapped, approximated, not_carried, auto = [], [], [], []
    problems = []

    # --- batch: micro-batch x accumulation x processes = train_batch_size --------------------------------------------
    micro = _as_int(ds.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu")
    accumulation = _as_int(ds.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    total = _as_int(ds.get("train_batch_size"), "train_batch_size")
    if None not in (micro, accumulation, total):
        if num_processes is None:
            num_processes, remainder = divmod(total, micro * accumulation)
            if remainder or num_processes < 1:
                problems.append(
                    f"train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu {micro} "
                    f"x gradient_accumulation_steps {accumulation}"
                )
            else:
                mapped.append(
                    f"train_batch_size {total} = {micro} x {accumulation} x {num_processes} processes -> "
                    f"num_processes: {num_processes}"
                )
        elif micro * accumulation * num_processes != total:
            problems.append(
                f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accumulation} x {num_processes} processes: fix the file, "
                "or pass the --num-processes it was written for"
            )
    if num_processes is None:
        num_processes = 8 * num_machines
        auto.append(
            f"the number of processes is not in the file: assumed 8 per node ({num_processes}); pass "
            "--num-processes (the global count) to choose"
        )
    if total is not None and (micro is None) != (accumulation is None):
        known = micro if micro is not None else accumulation
        rest, remainder = divmod(total, known * num_processes)
        if remainder or rest < 1:
            problems.append(f"train_batch_size {total} is not a multiple of {known} x {num_processes} processes")
        elif micro is None:
            micro = rest
            mapped.append(
                f"train_batch_size {total} / ({accumulation} x {num_processes} processes) -> "
                f"per_device_train_batch_size: {micro}"
            )
        else:
            accumulation = rest
            mapped.append(
                f"train_batch_size {total} / ({micro} x {num_processes} processes) -> "
                f"gradient_accumulation_steps: {accumulation}"
            )
    for key, field, value in (
        ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", micro),
        ("gradient_accumulation_steps", "gradient_accumulation_steps", accumulation),
    ):
        if value is not None:
            fields[field] = value
            if ds.has(key) and ds.get(key) != AUTO:
                mapped.append(f"{key} {value} -> {field}: {value}")
        elif ds.get(key) == AUTO:
            auto.append(f"{key} is auto: keep the recipe config's {field}")
    if ds.get("train_batch_size") == AUTO:
        auto.append(
            "train_batch_size is auto: the recipe's global batch is per_device_train_batch_size x processes x "
            "gradient_accumulation_steps"
        )

    # --- sharding: the ZeRO stage -------------------------------------------------------------------------------
    stage = ds.get("zero_optimization.stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage is {stage!r}: DeepSpeed has stages 0, 1, 2 and 3")
    sharding = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}[stage]
    if stage == 0:
        mapped.append(
            "zero_optimization.stage 0 (plain data parallelism) -> NO_SHARD: DDP (distributed_type MULTI_GPU)"
        )
    elif stage == 1:
        approximated.append(
            "zero_optimization.stage 1 -> SHARD_GRAD_OP (fsdp_reshard_after_forward: false): FSDP has "
            "no optimizer-only sharding; SHARD_GRAD_OP also shards gradients and, between steps, "
            "parameters, so each rank holds less than under ZeRO-1, for one parameter all-gather per step"
        )
    elif stage == 2:
        mapped.append(
            "zero_optimization.stage 2 -> SHARD_GRAD_OP (fsdp_reshard_after_forward: false): parameters "
            "stay gathered from forward to backward; gradients and optimizer state sharded"
        )
    else:
        mapped.append("zero_optimization.stage 3 -> FULL_SHARD (fsdp_reshard_after_forward: true)")
    replicate = None
    mics = _as_int(ds.get("zero_optimization.mics_shard_size"), "zero_optimization.mics_shard_size")
    if mics is not None and mics > 0:
        if stage != 3:
            not_carried.append("zero_optimization.mics_shard_size: MiCS needs ZeRO stage 3 (DeepSpeed ignores it here)")
        elif mics >= num_processes:
            mapped.append(f"zero_optimization.mics_shard_size {mics} (all {num_processes} processes) -> FULL_SHARD")
        elif num_processes % mics or mics < 2:
            problems.append(
                f"zero_optimization.mics_shard_size {mics} must be >= 2 and divide the {num_processes} "
                "processes (HSDP shards each replica over that many)"
            )
        else:
            sharding, replicate = "HYBRID_SHARD", num_processes // mics
            mapped.append(
                f"zero_optimization.mics_shard_size {mics} -> HSDP: {replicate} replicas x {mics} shards "
                "(parallelism_config)"
            )
    if sharding != "NO_SHARD" and num_processes < 2:
        problems.append(
            f"ZeRO stage {stage} shards over processes, but the launch has {num_processes}: pass --num-processes >= 2"
        )

    # --- offload ---------------------------------------------------------------------------------------------
    offload = False
    for part in ("offload_param", "offload_optimizer"):
        device = ds.get(f"zero_optimization.{part}.device")
        if device in (None, "none"):
            continue
        key = f"zero_optimization.{part}.device"
        if device == "nvme":
            raise ConfigError(
                f"{key} is nvme: FSDP2 offloads to CPU memory only (fsdp_offload_params). Use device "
                '"cpu" if the host has the memory (16 bytes per parameter over the node), or shard over '
                "more GPUs instead"
            )
        if device != "cpu":
            raise ConfigError(f'{key} is {device!r}: DeepSpeed offloads to "cpu", "nvme" or "none"')
        if part == "offload_param" and stage != 3:
            not_carried.append(f"{key}: parameter offload needs ZeRO stage 3 (DeepSpeed ignores it here)")
            continue
        if stage == 0:
            not_carried.append(f"{key}: optimizer offload needs ZeRO stage >= 1 (DeepSpeed refuses it at stage 0)")
            continue
        offload = True
        ratio = ds.get("zero_optimization.offload_optimizer.ratio", 1) if part == "offload_optimizer" else 1
        if ratio != 1:
            not_carried.append(
                f"zero_optimization.offload_optimizer.ratio {ratio}: FSDP2 offloads all of the optimizer "
                "state or none of it"
            )
    if offload:
        keys = " and ".join(
            f"zero_optimization.{part}.device"
            for part in ("offload_param", "offload_optimizer")
            if ds.get(f"zero_optimization.{part}.device") == "cpu"
        )
        if ds.get("zero_optimization.offload_param.device") == "cpu":
            mapped.append(f"{keys} cpu -> fsdp_offload_params: true")
        else:
            approximated.append(
                f"{keys} cpu -> fsdp_offload_params: true: FSDP2 offloads parameters and gradients "
                "with the optimizer state (less GPU memory than ZeRO-Offload, more host traffic)"
            )

    # --- precision and loss scaling ------------------------------------------------------------------------------
    bf16_key = "bfloat16" if ds.has("bfloat16.enabled") else "bf16"  # DeepSpeed's older name for the section
    fp16, bf16 = ds.get("fp16.enabled", False), ds.get(f"{bf16_key}.enabled", False)
    if fp16 is True and bf16 is True:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: DeepSpeed refuses that too; enable one")
    if AUTO in (fp16, bf16) and True not in (fp16, bf16):
        precision = "bf16"
        auto.append(
            "fp16.enabled / bf16.enabled are auto: written as mixed_precision bf16 (the Trainer would take it "
            "from --bf16 / --fp16); on GPUs without bf16 (V100, T4) use fp16 (accelerate_configs/"
            "fsdp_8gpu_fp16.yaml)"
        )
    else:
        precision = "fp16" if fp16 is True else "bf16" if bf16 is True else "no"
        mapped.append(
            f"{'fp16' if fp16 is True else bf16_key}.enabled true -> mixed_precision: {precision}"
            if precision != "no"
            else "fp16.enabled / bf16.enabled not true -> mixed_precision: no (fp32)"
        )
    if precision == "fp16":
        scale = ds.get("fp16.loss_scale", 0)
        if scale not in (0, AUTO):
            not_carried.append(
                f"fp16.loss_scale {scale}: a static loss scale; accelerate's gradient scaler is "
                "dynamic (it starts at 2**16 and adapts)"
            )
        else:
            mapped.append("fp16.loss_scale 0 (dynamic) -> accelerate's dynamic gradient scaler, added for fp16")
        power = ds.get("fp16.initial_scale_power", 16)
        if power not in (16, AUTO):
            not_carried.append(
                f"fp16.initial_scale_power {power}: accelerate's scaler starts at 2**16; another start "
                f"needs GradScalerKwargs(init_scale=2**{power}) in the recipe's Accelerator"
            )
        window = ds.get("fp16.loss_scale_window")
        if window not in (None, AUTO):
            not_carried.append(
                f"fp16.loss_scale_window {window}: accelerate's scaler doubles the scale after 2000 "
                "steps without overflow; another window needs GradScalerKwargs(growth_interval=...) in "
                "the recipe's Accelerator"
            )
    else:
        ignored = [path for path in ds.leaves if path.startswith("fp16.") and path not in ds.used]
        if ignored:
            not_carried.append(f"{', '.join(ignored)}: fp16 is not enabled, so DeepSpeed ignores them too")
            ds.used.update(ignored)
    dtype = ds.get("communication_data_type")
    if dtype is not None:
        compute = {"bf16": ("bf16", "bfp16"), "fp16": ("fp16",), "no": ("fp32",)}[precision]
        if str(dtype) in compute:
            mapped.append(f"communication_data_type {dtype}: FSDP reduces gradients in the compute dtype already")
        else:
            not_carried.append(
                f"communication_data_type {dtype}: FSDP2 under accelerate reduces gradients in the "
                "compute dtype; another needs a MixedPrecisionPolicy(reduce_dtype=...) in code"
            )

    # --- optimizer and schedule --------------------------------------------------------------------------------
    clip = ds.get("gradient_clipping")
    if clip == AUTO:
        auto.append("gradient_clipping is auto: keep the recipe config's max_grad_norm")
    elif clip is not None:
        fields["max_grad_norm"] = float(clip)
        mapped.append(f"gradient_clipping {clip} -> max_grad_norm: {float(clip)}")
    optimizer = ds.get("optimizer.type")
    if optimizer is not None:
        if str(optimizer).lower() not in ("adam", "adamw"):
            not_carried.append(
                f"optimizer.type {optimizer}: the recipes train with torch AdamW; another optimizer "
                "means editing training.build_optimizer in a copy"
            )
        elif ds.get("optimizer.params.adam_w_mode", True) is False and str(optimizer).lower() == "adam":
            not_carried.append(
                "optimizer.params.adam_w_mode false: Adam with L2 regularisation; the recipes use "
                "AdamW's decoupled weight decay"
            )
        else:
            mapped.append(
                f"optimizer.type {optimizer} -> AdamW (torch; optim: adamw_torch, or adamw_torch_fused on GPU)"
            )
        params = {"lr": "learning_rate", "eps": "adam_epsilon", "weight_decay": "weight_decay"}
        for key, field in params.items():
            value = ds.get(f"optimizer.params.{key}")
            if value == AUTO:
                auto.append(f"optimizer.params.{key} is auto: keep the recipe config's {field}")
            elif value is not None:
                fields[field] = float(value)
                mapped.append(f"optimizer.params.{key} {value} -> {field}: {float(value)}")
        betas = ds.get("optimizer.params.betas")
        if betas == AUTO:
            auto.append("optimizer.params.betas is auto: keep the recipe config's adam_beta1 / adam_beta2")
        elif isinstance(betas, list) and len(betas) == 2:
            fields["adam_beta1"], fields["adam_beta2"] = float(betas[0]), float(betas[1])
            mapped.append(f"optimizer.params.betas {betas} -> adam_beta1: {betas[0]}, adam_beta2: {betas[1]}")
    _translate_scheduler(ds, fields, mapped, approximated, not_carried, auto)

    # --- logging ---------------------------------------------------------------------------------------------
    steps = ds.get("steps_per_print")
    if steps not in (None, AUTO):
        fields["logging_steps"] = int(steps)
        mapped.append(f"steps_per_print {steps} -> logging_steps: {int(steps)}")
    trackers = [name for name in ("tensorboard", "wandb") if ds.get(f"{name}.enabled") is True]
    if trackers:
        fields["report_to"] = trackers[0]
        mapped.append(f"{trackers[0]}.enabled true -> report_to: {trackers[0]}")
        if len(trackers) > 1:
            not_carried.append("wandb.enabled with tensorboard.enabled: report_to takes one tracker")
    for name in ("tensorboard", "wandb"):
        for key in [path for path in ds.leaves if path.startswith(f"{name}.") and path != f"{name}.enabled"]:
            not_carried.append(f"{key}: the tracker writes under output_dir (its run name is the recipe's)")
            ds.used.add(key)

    # --- everything else, each with its reason -------------------------------------------------------------------
    for path in ds.unused():
        section = path.split(".")[0]
        if path in NOT_CARRIED:
            not_carried.append(f"{path}: {NOT_CARRIED[path]}")
        elif section in NOT_CARRIED_SECTIONS:
            reason = f"{section}: {NOT_CARRIED_SECTIONS[section]}"
            if reason not in not_carried:
                not_carried.append(reason)
        else:
            not_carried.append(f"{path}: not a setting this translation knows; nothing was carried over for it")
    if problems:
        raise ConfigError(problems)
    if sharding == "NO_SHARD":
        layout = LaunchLayout.data_parallel(num_processes, num_machines, precision)
    else:
        layout = LaunchLayout(
            world_size=num_processes,
            num_machines=num_machines,
            distributed_type="FSDP",
            fsdp_version=2,
            reshard_after_forward=sharding != "SHARD_GRAD_OP",
            shard_size=num_processes // replicate if replicate else num_processes,
            cpu_offload=offload,
            mixed_precision=precision,
            wrap_policy="TRANSFORMER_BASED_WRAP",
        )
    return Translation(layout, fields, mapped, approximated, not_carried, auto)


def _translate_scheduler(
    ds: _Reader, fields: dict, mapped: list, approximated: list, not_carried: list, auto: list
) -> None:
    kind = ds.get("scheduler.type")
    if kind is None:
        return
    schedules = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if kind not in schedules:
        not_carried.append(
            f"scheduler.type {kind}: the recipes take transformers schedules (lr_scheduler_type) with a "
            "linear warm-up; WarmupLR, WarmupDecayLR and WarmupCosineLR have counterparts"
        )
        params = [path for path in ds.leaves if path.startswith("scheduler.params.")]
        if params:
            not_carried.append(f"{', '.join(params)}: settings of {kind}")
            ds.used.update(params)
        return
    fields["lr_scheduler_type"] = schedules[kind]
    mapped.append(f"scheduler.type {kind} -> lr_scheduler_type: {schedules[kind]}")
    for key, field in (("warmup_num_steps", "warmup_steps"), ("total_num_steps", "max_steps")):
        value = ds.get(f"scheduler.params.{key}")
        if value == AUTO:
            auto.append(f"scheduler.params.{key} is auto: keep the recipe config's {field}")
        elif value is not None:
            fields[field] = int(value)
            mapped.append(f"scheduler.params.{key} {value} -> {field}: {int(value)}")
    peak = ds.get("scheduler.params.warmup_max_lr")
    if peak == AUTO:
        auto.append("scheduler.params.warmup_max_lr is auto: keep the recipe config's learning_rate")
    elif peak is not None:
        if fields.get("learning_rate", float(peak)) != float(peak):
            not_carried.append(
                f"scheduler.params.warmup_max_lr {peak}: differs from optimizer.params.lr; the recipe "
                "warms up to learning_rate"
            )
        else:
            fields["learning_rate"] = float(peak)
            mapped.append(f"scheduler.params.warmup_max_lr {peak} -> learning_rate: {float(peak)}")
    for key in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio"):
        value = ds.get(f"scheduler.params.{key}")
        if value == AUTO:
            auto.append(f"scheduler.params.{key} is auto: the recipe's schedules start the warm-up at 0")
        elif value not in (None, 0, 0.0):
            approximated.append(
                f"scheduler.params.{key} {value}: the recipe's schedules start the warm-up at 0 and decay to 0"
            )
    warmup_type = ds.get("scheduler.params.warmup_type", "log")
    if warmup_type != "linear":
        approximated.append(
            f"scheduler.params.warmup_type {warmup_type}"
            f"{' (DeepSpeed default)' if not ds.has('scheduler.params.warmup_type') else ''}: the "
            "recipe warms up linearly"
        )


def render(translation: Translation, *, output: Path, source: Path) -> str:
    """The Accelerate YAML: a header saying where it comes from, how to launch it, the recipe fields and everything
    not carried over; then the body the shipped configs' generator writes for the topology."""
    layout = translation.layout
    launch = launch_lines(layout, str(output))
    nodes = f" (on every node, NODE_RANK 0..{layout.num_machines - 1})" if layout.num_machines > 1 else ""
    header = [
        f"# FSDP2 equivalent of the DeepSpeed config {source.name}, written by `fsdp-recipes from-deepspeed` "
        "(docs/from-deepspeed.md).",
        f"# {describe_hardware(layout)}.",
        f"# Launch{nodes}:",
        f"#   {launch[0]} \\",
        *[f"#       {line} \\" for line in launch[1:-1]],
        f"#       {launch[-1]}",
    ]
    if translation.recipe_fields:
        header.append("# Set in the recipe config (FSDP settings stay here; these are the recipe's):")
        header += [f"#   {line}" for line in recipe_fields_yaml(translation.recipe_fields).splitlines()]
    for title, items in (
        ("Approximated", translation.approximated),
        ("'auto' values", translation.auto),
        ("Not carried over (no FSDP equivalent)", translation.not_carried),
    ):
        if items:
            header.append(f"# {title}:")
            header += [f"#   - {item}" for item in items]
    header.append(f"# Check it against your model: fsdp-recipes validate-config {output} --model MODEL")
    return "\n".join(header + render_body(layout)) + "\n"


def recipe_fields_yaml(fields: dict[str, Any]) -> str:
    return yaml.safe_dump(fields, sort_keys=False, default_flow_style=False).strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_config", type=Path, metavar="DS_CONFIG", help="a DeepSpeed config JSON")
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the Accelerate config YAML to write"
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        metavar="N",
        help="processes over all nodes (default: from train_batch_size, else 8 per node)",
    )
    parser.add_argument("--num-machines", type=int, default=1, metavar="M", help="nodes (default 1)")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")


def run(args: argparse.Namespace) -> int:
    if args.num_machines < 1 or (args.num_processes is not None and args.num_processes < 1):
        raise ConfigError("--num-processes and --num-machines must be >= 1")
    if args.num_processes is not None and args.num_processes % args.num_machines:
        raise ConfigError(
            f"--num-processes {args.num_processes} is the global count: it must be a multiple of "
            f"--num-machines {args.num_machines}"
        )
    if args.output.exists() and not args.force:
        raise UserError(f"{args.output} exists: pass --force to overwrite it, or choose another -o")
    translation = translate(
        load_deepspeed_config(args.ds_config), num_processes=args.num_processes, num_machines=args.num_machines
    )
    layout = translation.layout
    if layout.world_size % layout.num_machines:
        raise ConfigError(f"{layout.world_size} processes do not split evenly over {layout.num_machines} machines")
    text = render(translation, output=args.output, source=args.ds_config)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}: {describe_hardware(layout)}")
    for title, items in (
        ("mapped", translation.mapped),
        ("approximated", translation.approximated),
        ("'auto' values", translation.auto),
        ("not carried over", translation.not_carried),
    ):
        if items:
            print(f"\n{title}:")
            print("\n".join(f"  - {item}" for item in items))
    if translation.recipe_fields:
        print("\nset in the recipe config:")
        print("\n".join(f"  {line}" for line in recipe_fields_yaml(translation.recipe_fields).splitlines()))
    return 0
