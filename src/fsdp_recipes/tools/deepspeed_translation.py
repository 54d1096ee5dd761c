"""The translation of a DeepSpeed config into an FSDP2 launch (`LaunchLayout`) and recipe fields, for
`fsdp-recipes from-deepspeed` (fsdp_recipes.tools.from_deepspeed, which reads the file and writes the YAML).

Every key ends up in exactly one list of the `Translation`: mapped, approximated (the difference said) or not carried
over (the reason said: fsdp_recipes.tools.deepspeed_keys). `"auto"` values are resolved where the FSDP side needs a
value and otherwise left to the recipe config, and listed either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.tools.deepspeed_keys import AUTO, NOT_CARRIED, NOT_CARRIED_SECTIONS, Reader, as_int


@dataclasses.dataclass
class Translation:
    layout: LaunchLayout  # the launch the Accelerate config asks for
    recipe_fields: dict[str, Any]  # recipe config field -> value
    mapped: list[str]  # "DeepSpeed key value -> FSDP / recipe setting"
    approximated: list[str]  # mapped to the nearest behaviour, the difference said
    not_carried: list[str]  # "key: why"
    auto: list[str]  # how each "auto" value was resolved


def translate(config: dict, *, num_processes: int | None = None, num_machines: int = 1) -> Translation:
    """The translation of a DeepSpeed config (a parsed JSON object). Raises ConfigError (one message, every problem)
    for what cannot be translated at all."""
    ds = Reader(config)
    fields: dict[str, Any] = {}
    mapped, approximated, not_carried, auto = [], [], [], []
    problems = []

    # --- batch: micro-batch x accumulation x processes = train_batch_size --------------------------------------------
    micro = as_int(ds.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu")
    accumulation = as_int(ds.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    total = as_int(ds.get("train_batch_size"), "train_batch_size")
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
    mics = as_int(ds.get("zero_optimization.mics_shard_size"), "zero_optimization.mics_shard_size")
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
            # HSDP (MiCS): `replicate` copies, each sharded over the mics_shard_size processes that divide the world
            parallel=ParallelDims(dp_replicate=replicate, dp_shard=num_processes // replicate)
            if replicate
            else ParallelDims(dp_shard=num_processes),
            num_machines=num_machines,
            distributed_type="FSDP",
            fsdp_version=2,
            reshard_after_forward=sharding != "SHARD_GRAD_OP",
            cpu_offload=offload,
            mixed_precision=precision,
            wrap_policy="TRANSFORMER_BASED_WRAP",
        )
    return Translation(layout, fields, mapped, approximated, not_carried, auto)


def _translate_scheduler(
    ds: Reader, fields: dict, mapped: list, approximated: list, not_carried: list, auto: list
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
