"""An estimate as `fsdp-recipes estimate` shows it: one JSON object (`estimate_report`, for --json) and the text
rendered from it (`render_report`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_recipes.common.sizes import gib
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools.estimator import vision
from fsdp_recipes.tools.estimator.advice import longest_row, suggestions
from fsdp_recipes.tools.estimator.formulas import Estimate
from fsdp_recipes.tools.estimator.shapes import ModelInfo
from fsdp_recipes.train.config import TrainingConfig


def topology_record(layout: LaunchLayout) -> dict[str, Any]:
    """The launch as the report's `topology` holds it: the layout's settings, with its sizes under the names and in
    the places the report has always given them (world_size, shard_size, tp_size, ep_size, sp_size)."""
    parallel, record = layout.parallel, {}
    for field in dataclasses.fields(layout):
        if field.name == "parallel":
            record["world_size"] = parallel.world_size
        else:
            record[field.name] = getattr(layout, field.name)
        if field.name == "reshard_after_forward":
            record["shard_size"] = parallel.shard_size
    return {**record, "tp_size": parallel.tp, "ep_size": parallel.ep, "sp_size": parallel.sp}


def estimate_report(est: Estimate, info: ModelInfo, recipe: TrainingConfig) -> dict[str, Any]:
    """The JSON object `fsdp-recipes estimate --json` prints, for the estimate of `recipe` (a config)."""
    layout = est.layout
    largest = max(est.units, key=lambda u: u.numel) if est.units else None
    return {
        "model": est.model,
        "model_type": info.model_type,
        "parameters_total": est.num_params,
        # a mixture of experts: what a token runs through (top-k of the routed experts), what FLOPs per token count
        "parameters_active": info.active_params,
        "experts": dataclasses.asdict(info.routing) if info.routing else None,
        "trainable_parameters": est.trainable_params,  # LoRA: the adapters; null: every parameter
        "topology": {**topology_record(layout), "sharding": layout.sharding, "description": layout.describe()},
        "workload": {**dataclasses.asdict(est.workload), "tokens_per_micro_batch": est.workload.tokens},
        "units": {
            "count": len(est.units),
            "largest": largest.name if largest else None,
            "largest_parameters": largest.numel if largest else 0,
        },
        "per_gpu_bytes": est.per_gpu(),
        "host_bytes_per_gpu": est.host_state,
        "gpu_memory_bytes": est.gpu_memory,
        "reserve_bytes": est.reserve,
        "usable_bytes": est.usable,
        "fits": est.fits,
        "headroom_bytes": est.usable - est.total,
        "longest_row_tokens": longest_row(info, est),  # at this micro-batch's rows, layout and checkpointing
        "vision": vision.record(info.vision, est.vision),  # a vision-language model's pictures and tower
        "suggestions": suggestions(info, est, recipe),
    }


def render_report(report: dict[str, Any]) -> str:
    """The text `fsdp-recipes estimate` prints: the launch, the bytes of each kind per GPU, whether they fit, and what
    to change when they do not."""
    g, topo, work = report["per_gpu_bytes"], report["topology"], report["workload"]
    ac = topo["activation_checkpointing"]
    experts = report.get("experts")
    routed = (
        f"; mixture of {experts['num_experts']} experts, {experts['experts_per_token']} per token: "
        f"{report['parameters_active'] / 1e9:.3f}B active"
        if experts
        else ""
    )
    lines = [
        f"model: {report['model']} ({report['model_type']}, {report['parameters_total'] / 1e9:.3f}B parameters{routed})",
        f"launch: {topo['description']}",
        f"micro-batch: {work['micro_batch_rows']} x {work['row_length']} tokens, attention "
        f"{work['attn_implementation']}; {report['units']['count']} FSDP units, largest {report['units']['largest']} "
        f"({report['units']['largest_parameters'] / 1e6:.1f}M parameters)",
        "",
        "per GPU (the most loaded rank)",
    ]
    lines[3:3] = vision.render(report.get("vision"))
    offload = " (on the host: CPU offload)" if topo["cpu_offload"] else ""
    host = report["host_bytes_per_gpu"]
    lora = report.get("trainable_parameters") is not None
    if lora:
        lines.insert(1, f"LoRA: {report['trainable_parameters'] / 1e6:.1f}M trainable adapter parameters, base frozen")
    rows = [
        (
            "parameters (frozen base + fp32 adapters)" if lora else "parameters (fp32, sharded)",
            host.get("parameters") if offload else g["parameters"],
        ),
        (
            "gradients (fp32 adapters)" if lora else "gradients (fp32, sharded)",
            host.get("gradients") if offload else g["gradients"],
        ),
        ("optimizer state (AdamW, 2 x fp32)", host.get("optimizer_state") if offload else g["optimizer_state"]),
        *([("reference model (frozen copy, sharded)", g["reference_model"])] if g["reference_model"] else []),
        *(
            [("teacher model (frozen, sharded; output layer whole)", g["teacher_model"])]
            if g.get("teacher_model")
            else []
        ),
        (f"activations, checkpointing {'on' if ac else 'off'}", g["activations"]),
        (
            f"  (checkpointing {'off' if ac else 'on'}: {gib(g['activations_with_checkpointing' if not ac else 'activations_without_checkpointing'])};"
            f" of which logits {gib(g['logits'])})",
            None,
        ),
        *([(f"  (of which the vision tower keeps {gib(g['vision_tower'])})", None)] if g.get("vision_tower") else []),
        ("all-gather buffers (compute dtype)", g["all_gather_buffers"]),
        ("unsharded gradients / buckets", g["reduce_scatter_buffers"]),
        *(
            [("generation pass (KV cache, gathered weights; not with activations)", g["generation"])]
            if g.get("generation")
            else []
        ),
        *(
            [("optimizer step (AdamW temporary; not with activations)", g["optimizer_step"])]
            if g.get("optimizer_step")
            else []
        ),
    ]
    for label, value in rows:
        if value is None:
            lines.append(f"  {label}")
        else:
            suffix = offload if offload and label.split()[0] in ("parameters", "gradients", "optimizer") else ""
            lines.append(f"  {label:<40} {gib(value):>12}{suffix}")
    lines.append(f"  {'total':<40} {gib(g['total']):>12}")
    verdict = "fits" if report["fits"] else "does NOT fit"
    lines.append(
        f"\n{verdict} in {gib(report['usable_bytes'])} usable per GPU ({gib(report['gpu_memory_bytes'])} minus "
        f"{gib(report['reserve_bytes'])} kept for the CUDA context, NCCL and fragmentation); headroom "
        f"{gib(report['headroom_bytes'])}"
    )
    split = f", {topo['sp_size']} ranks splitting each" if topo.get("sp_size", 1) > 1 else ""
    lines.append(
        f"longest row that fits: {report['longest_row_tokens']:,} tokens ({work['micro_batch_rows']} per micro-batch"
        f"{split}; the rest as above)"
    )
    if report["suggestions"]:
        lines.append("\nto make it fit:")
        for s in report["suggestions"]:
            mark = "fits" if s["fits"] else "still too big"
            host_note = f", host {gib(s['host_bytes_per_gpu'])} per GPU" if s["host_bytes_per_gpu"] else ""
            lines.append(
                f"  - {s['change']}: {gib(s['predicted_total_bytes'])} per GPU ({mark}{host_note}); {s['how']}"
            )
    return "\n".join(lines)
