"""What to change when an estimate does not fit: the launch (activation checkpointing, FULL_SHARD, more GPUs, CPU
offload) or the recipe config (the memory-saving alternatives its class declares, LoRA, a smaller micro-batch), each
with the total per GPU predicted after the change. A change to the recipe config is made on the config itself and
estimated again, so that the recipe decides what it changes (rows, adapters, model copies)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools.estimator import vision
from fsdp_recipes.tools.estimator.formulas import Estimate, activation_bytes, estimate_for_recipe
from fsdp_recipes.tools.estimator.shapes import ModelInfo
from fsdp_recipes.train.config import TrainingConfig


def suggestions(info: ModelInfo, current: Estimate, recipe: TrainingConfig) -> list[dict[str, Any]]:
    """What to change when `current` (the estimate for `recipe`) does not fit, each with its predicted total per GPU;
    only changes that lower the total."""
    if current.fits:
        return []
    layout = current.layout
    out: list[dict[str, Any]] = []

    def changed(new_layout: LaunchLayout = layout, new_recipe: TrainingConfig = recipe) -> Estimate:
        return estimate_for_recipe(
            info, new_layout, new_recipe, gpu_memory=current.gpu_memory, reserve=current.reserve,
            images_per_row=current.vision.pictures_per_row if current.vision else None,
        )  # fmt: skip

    def add(change: str, how: str, new_layout: LaunchLayout = layout, new_recipe: TrainingConfig = recipe) -> None:
        new = changed(new_layout, new_recipe)
        if new.total < current.total:
            out.append(
                {
                    "change": change,
                    "how": how,
                    "predicted_total_bytes": new.total,
                    "fits": new.fits,
                    "host_bytes_per_gpu": sum(new.host_state.values()) if new.host_state else 0,
                }
            )

    parallel = layout.parallel
    tp, world = parallel.tp, parallel.world_size
    sharded_by_transformers = tp > 1 or parallel.ep > 1  # the DistributedConfig route: no offload, no LoRA
    if layout.is_fsdp and not layout.activation_checkpointing:
        add(
            "activation checkpointing",
            "gradient_checkpointing: true in the recipe config (under tensor or expert parallelism the model's own "
            "checkpointing is the one that applies)"
            if sharded_by_transformers
            else "fsdp_activation_checkpointing: true in the Accelerate config "
            "(accelerate_configs/fsdp_8gpu_activation_checkpointing.yaml)",
            dataclasses.replace(layout, activation_checkpointing=True),
        )
    if (
        tp == 1
        and world > 1
        and (not layout.is_fsdp or parallel.shard_size < world or not layout.reshard_after_forward)
    ):
        full = dataclasses.replace(
            layout,
            distributed_type="FSDP",
            fsdp_version=layout.fsdp_version if layout.is_fsdp else 2,
            # one copy sharded over every rank (a sequence-parallel group's included)
            parallel=dataclasses.replace(parallel, dp_replicate=1, dp_shard=world // parallel.sp),
            reshard_after_forward=True,
            wrap_policy=layout.wrap_policy if layout.is_fsdp else "TRANSFORMER_BASED_WRAP",
        )
        add(
            "FSDP FULL_SHARD over all GPUs",
            f"shard over all {world} GPUs (accelerate_configs/fsdp_8gpu.yaml is the one-node example)",
            full,
        )
    # (not under sequence parallelism, which refuses tensor parallelism: fsdp_recipes.distributed.sequence_parallel)
    if layout.is_fsdp and tp == 1 and parallel.sp == 1 and layout.gpus_per_node > 1 and not recipe.use_peft:
        within = layout.gpus_per_node
        add(
            f"tensor parallelism (TP {within} within each node)",
            f"parallelism_config_tp_size: {within} in the Accelerate config (accelerate_configs/tp8_fsdp_2x8gpu.yaml "
            "is a 2-node example): each layer split over a node's GPUs, FSDP over the nodes; activations of the heads "
            "and the MLP shrink as 1/TP",
            dataclasses.replace(
                layout,
                # each layer split over a node's ranks, one copy sharded over the rest
                parallel=dataclasses.replace(parallel, dp_replicate=1, dp_shard=world // within, tp=within),
                activation_checkpointing=False,
            ),
        )
    if layout.is_fsdp:
        per_node = layout.gpus_per_node
        for machines in (2, 4, 8, 16, 32, 64, 128):
            more_world = per_node * layout.num_machines * machines
            more = dataclasses.replace(
                layout,
                # one copy sharded over every rank outside the tensor-parallel groups, tp and the rest as they are
                parallel=dataclasses.replace(parallel, dp_replicate=1, dp_shard=more_world // tp // parallel.sp),
                num_machines=layout.num_machines * machines,
            )
            if changed(more).fits or machines == 128:
                add(
                    f"more GPUs ({more_world})",
                    f"FSDP over {more_world} GPUs ({layout.num_machines * machines} nodes of "
                    f"{per_node}): state shrinks as 1/GPUs, activations and buffers do not",
                    more,
                )
                break
    if layout.is_fsdp and not layout.cpu_offload and not sharded_by_transformers:  # that route has no offload
        add(
            "CPU offload",
            "fsdp_offload_params: true (accelerate_configs/fsdp_8gpu_offload.yaml); parameters, gradients "
            "and optimizer state move to host RAM, several times slower steps",
            dataclasses.replace(layout, cpu_offload=True),
        )
        if not layout.activation_checkpointing:
            add(
                "CPU offload + activation checkpointing",
                "both of the above",
                dataclasses.replace(layout, cpu_offload=True, activation_checkpointing=True),
            )
    for description, values in recipe.memory_saving_alternatives():
        change, _, cost = description.partition(": ")
        settings = ", ".join(f"{key}: {json.dumps(value)}" for key, value in values.items())
        add(
            change,
            f"{settings} in the recipe config" + (f" ({cost})" if cost else ""),
            new_recipe=dataclasses.replace(recipe, **values),
        )
    if current.vision and current.vision.trained_tower:
        add(
            "freeze the vision tower",
            "freeze_vision_tower: true in the recipe config: the image encoder keeps no gradients, AdamW state or "
            "activations for backward (its reading of pictures does not adapt)",
            new_recipe=dataclasses.replace(recipe, freeze_vision_tower=True),
        )
    if info.linear_shapes_in_layers and current.trainable_params is None and not sharded_by_transformers:
        lora = dataclasses.replace(recipe, use_peft=True)
        add(
            f"LoRA (rank {lora.lora_r})",
            f"use_peft: true in the recipe config: rank-{lora.lora_r} adapters on every "
            "linear of the decoder layers, base weights frozen in the compute dtype",
            new_recipe=lora,
        )
    batch = recipe.per_device_train_batch_size
    if batch > 1:
        smaller = dataclasses.replace(
            recipe,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=recipe.gradient_accumulation_steps * batch,
        )
        add(
            "micro-batch 1",
            f"per_device_train_batch_size: 1 and gradient_accumulation_steps: "
            f"{smaller.gradient_accumulation_steps} (same global batch, more steps per update)",
            new_recipe=smaller,
        )
    return out


def longest_row(info: ModelInfo, current: Estimate, *, most: int = 1 << 22) -> int:
    """The longest row (tokens) that fits beside everything else `current` holds, at its rows per micro-batch, layout
    and activation checkpointing (only the activations grow with the row, and a picture as large as the row holds,
    for a vision-language model whose pictures' size varies); a multiple of the sequence-parallel size;
    0 when not even that fits."""
    layout, step = current.layout, current.layout.parallel.sp

    def fits(length: int) -> bool:
        workload = dataclasses.replace(current.workload, row_length=length)
        activations = activation_bytes(info, workload, layout.compute_bytes, tp=layout.parallel.tp, sp=step)
        load = current.vision and vision.tower_load(
            info.vision, length, workload.micro_batch_rows, layout.compute_bytes, per_row=current.vision.pictures_per_row,
            train_tower=current.vision.trained_tower, train_projector=current.vision.trained_projector, strict=False,
        )  # fmt: skip
        activations = vision.with_tower(activations, load)
        return dataclasses.replace(current, workload=workload, activations=activations, vision=load).fits

    low, high = 0, step  # fits(low) (or low is 0); find the first length that does not fit
    while high <= most and fits(high):
        low, high = high, high * 2
    if high > most:
        return low
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
