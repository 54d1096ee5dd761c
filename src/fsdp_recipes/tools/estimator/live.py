"""The estimate for the launch in progress: what a running recipe writes to its run summary beside the bytes it
measures (fsdp_recipes.run imports `estimate_for_run`; the one import of the tools by the layers below them)."""

from __future__ import annotations

from typing import Any

from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models.experts import is_routed_expert_parameter
from fsdp_recipes.tools.estimator import vision
from fsdp_recipes.tools.estimator.formulas import (
    Unit,
    adapter_state_bytes_on_rank,
    estimate_for_recipe,
    plan_units,
    state_bytes_on_rank,
)
from fsdp_recipes.tools.estimator.shapes import model_info_from_config
from fsdp_recipes.tools.estimator.workload import layout_for_recipe
from fsdp_recipes.train.config import TrainingConfig


def estimate_for_run(
    accelerator, model_config, recipe_config: TrainingConfig, *, parallel: ParallelDims, gpu_memory: int | None = None
) -> dict[str, Any]:
    """The estimate for the launch in progress (`parallel`: its sizes, `Run.parallel`), for the run summary beside the
    measured peak memory. Cheap (a meta model, no weights) and no collectives: call it on any rank. Bytes are for the
    most loaded rank; `rank_state_bytes` is the state this very rank should hold (parameters, gradients, AdamW
    state)."""
    info = model_info_from_config(model_config, trust_remote_code=bool(recipe_config.trust_remote_code))
    layout = layout_for_recipe(LaunchLayout.from_accelerator(accelerator, parallel), recipe_config)
    est = estimate_for_recipe(info, layout, recipe_config, gpu_memory=gpu_memory or 80 * 10**9)
    units = plan_units(info, layout)

    expert_units = [
        Unit(unit.name, unit.kind, [p for p in unit.params if is_routed_expert_parameter(p.name)]) for unit in units
    ]

    freeze = (bool(recipe_config.freeze_vision_tower), bool(recipe_config.freeze_multi_modal_projector))
    frozen = vision.frozen_parameters(info.vision, lora=est.adapters is not None, freeze=freeze)

    def on_rank(rank: int) -> dict[str, int]:
        if est.adapters is None:
            held = state_bytes_on_rank(units, layout, rank, frozen=frozen)
        else:
            held = adapter_state_bytes_on_rank(info, units, layout, est.adapters, rank)
        if info.routing is not None and est.adapters is None:  # set beside metrics.held_state_bytes' own split
            held["routed_expert_parameters"] = state_bytes_on_rank(expert_units, layout, rank, trainable=False)[
                "parameters"
            ]
        return held

    return {
        "predicted_per_gpu_bytes": est.per_gpu(),
        "predicted_host_bytes_per_gpu": est.host_state,
        "rank_state_bytes": on_rank(accelerator.process_index),
        "rank_state_bytes_per_rank": [on_rank(rank) for rank in range(accelerator.num_processes)],
        "trainable_parameters": est.trainable_params if est.adapters is not None else info.num_params,
        "sharding": layout.sharding,
        "tokens_per_micro_batch": est.workload.tokens,
    }


_SHOWN_APART = ("total", "activations_without_checkpointing", "activations_with_checkpointing")


def readable_estimate(estimate: dict[str, Any]) -> list[tuple[str, str]]:
    """The estimate as a few (name, text) rows of the printed run summary, in GiB: the total one GPU holds, then its
    non-zero parts, four to a row. Every figure, in bytes, stays in run_summary.json."""

    def gib(count: int) -> str:
        return f"{count / 2**30:.3g}"

    per_gpu = estimate["predicted_per_gpu_bytes"]
    parts = [
        f"{name.replace('_', ' ')} {gib(count)}"
        for name, count in per_gpu.items()
        if count and name not in _SHOWN_APART
    ]
    rows = [
        (
            "memory_estimate",
            f"{gib(per_gpu['total'])} GiB per GPU, predicted ({estimate['sharding']}, {estimate['tokens_per_micro_batch']} "
            "tokens per micro-batch); in bytes in run_summary.json",
        )
    ]
    rows += [("  of which (GiB)" if i == 0 else "", ", ".join(parts[i : i + 4])) for i in range(0, len(parts), 4)]
    if host := {name: count for name, count in estimate["predicted_host_bytes_per_gpu"].items() if count}:
        rows.append(
            ("  host (GiB)", ", ".join(f"{name.replace('_', ' ')} {gib(count)}" for name, count in host.items()))
        )
    return rows
