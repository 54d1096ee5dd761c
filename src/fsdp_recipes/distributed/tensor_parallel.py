"""Tensor and expert parallelism, with FSDP2 (and HSDP) around them, through transformers' own N-D engine.

An Accelerate config whose `parallelism_config` asks for `tp_size > 1` or `ep_size > 1` (fsdp_recipes.distributed.
expert_parallel says how `ep` reaches the processes) loads the model with `from_pretrained(...,
distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size, ep_size))`: transformers applies the model
class's `tp_plan` and `ep_plan` (routed experts split over `ep` ranks, tokens dispatched to them by all-to-all), then
FSDP2 per its `fsdp_plan` (the experts over the `efsdp` ranks that hold the same ones), before the weights load, each
rank reading only its shards. Expert parallelism changes no batch: the data-parallel ranks are those of TP. Accelerate then wraps nothing (its FSDP2 preparation returns an `FSDPModule` as it is) and stays the loop's
glue: optimizer, scheduler, gradient accumulation through FSDP2's `set_requires_gradient_sync`, clipping, checkpoints.
Accelerate's own TP path is not used: on the pinned accelerate 1.15 it imports a class transformers 5 removed
(docs/parallelism.md).

What this module owns:
- every setting of the Accelerate config that this route cannot honour, refused with the reason before any weight
  loads (`layout_problems`; the sizes themselves are the run's `ParallelDims`, fsdp_recipes.distributed.parallel_dims);
- what the model must allow (`model_problems`): a `tp_plan`, and `tp` dividing heads, KV heads, MLP width, vocabulary;
- transformers' `DistributedConfig` for the layout (`distributed_config`), and the data-parallel mesh attached to the
  accelerator, so that accelerate's dataloader gives every rank of a TP group the same batch and each data-parallel
  rank its own (`attach_data_parallel_mesh`).
The embedding and output layers are sharded on the vocabulary as the model's plan says; the chunked loss gathers the
output layer's weight per forward (`full_weight`) rather than gathering logits or going vocabulary-parallel.

Written for transformers 5.24's `transformers.distributed` (its API moves every minor release: pinned in
pyproject.toml).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.distributed import expert_parallel
from fsdp_recipes.distributed.parallel_dims import ParallelDims

TRANSFORMERS_VERSION = "5.24"


def layout_text(parallel: ParallelDims) -> str:
    """The TP/EP route's layout in words ("replicate 2 x fsdp 2 x tp 2 x ep 2"), for messages and the run summary."""
    parts = [f"tp {parallel.tp}"] if parallel.tp > 1 else []
    if parallel.ep > 1:
        parts.append(f"ep {parallel.ep}")
    if parallel.dp_shard > 1:
        parts.insert(0, f"fsdp {parallel.dp_shard}")
    if parallel.dp_replicate > 1:
        parts.insert(0, f"replicate {parallel.dp_replicate}")
    return " x ".join(parts)


def distributed_config(parallel: ParallelDims, *, mixed_precision: str):
    """transformers' DistributedConfig for this layout."""
    from transformers.distributed import DistributedConfig

    _sum_partial_gradients_once_per_backward()

    return DistributedConfig(
        tp_size=parallel.tp,
        fsdp_size=parallel.dp_shard,
        dp_replicate_size=parallel.dp_replicate,
        ep_size=parallel.ep,
        fsdp_mixed_precision=mixed_precision == "bf16",
    )


def _sum_partial_gradients_once_per_backward() -> None:
    """transformers 5.24's `replicated_with_grad_allreduce` style (Qwen3's per-head q_norm/k_norm under TP: replicated
    weights whose gradient covers only this rank's heads) sums `param.grad` over the TP group after every backward.
    Under gradient accumulation `param.grad` already holds the earlier micro-steps' sum, which is then summed again:
    micro-step k counts tp^(n-k) times. The same style, summing each backward's own gradient once (a tensor hook,
    before it is accumulated), replaces it for this process."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    class ReplicatedGradientSummedPerBackward(ReplicatedWithGradAllReduce):
        def install_forward(self, module, mesh):
            original_forward, hooked, group = module.forward, {}, mesh.get_group()

            def summed(grad):
                grad = grad.clone()
                torch.distributed.all_reduce(grad, group=group)
                return grad

            def forward(*args, **kwargs):
                if torch.is_grad_enabled():  # hooked at the first forward: the weights are replaced when they load
                    for name, param in module.named_parameters(recurse=False):
                        if param.requires_grad and hooked.get(name) is not param:
                            param.register_hook(summed)
                            hooked[name] = param
                return original_forward(*args, **kwargs)

            module.forward = forward
            return module

    ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"] = ReplicatedGradientSummedPerBackward()


def layout_problems(parallel: ParallelDims, environ: Mapping[str, str]) -> list[str]:
    """What the Accelerate config asks for that the TP/EP route cannot do, each with its fix (empty: it runs)."""
    problems = expert_parallel.layout_problems(ep=parallel.ep, tp=parallel.tp, dp_shard=parallel.dp_shard)
    # sizes that do not multiply to the world size: launch_checks, with every dimension named
    fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not fsdp or environ.get("FSDP_VERSION", "1") != "2":
        problems.append(
            "tensor parallelism runs with FSDP2 around it: set distributed_type: FSDP and fsdp_version: 2 "
            "(accelerate_configs/fsdp2_tp2_4proc_cpu.yaml is one)"
        )
        return problems
    unsupported = {
        "FSDP_OFFLOAD_PARAMS": (
            "true",
            "fsdp_offload_params: CPU offload is not wired into the TP route; set it to false (offload with FSDP "
            "alone: accelerate_configs/fsdp_8gpu_offload.yaml)",
        ),
        "FSDP_ACTIVATION_CHECKPOINTING": (
            "true",
            "fsdp_activation_checkpointing: accelerate would wrap layers that transformers has already sharded; set "
            "it to false and gradient_checkpointing: true in the recipe config (the model's own checkpointing)",
        ),
        "FSDP_RESHARD_AFTER_FORWARD": (
            "false",
            "fsdp_reshard_after_forward: false (SHARD_GRAD_OP) is not expressible through DistributedConfig, which "
            "reshards every decoder layer; set it to true",
        ),
    }
    for key, (bad, message) in unsupported.items():
        if environ.get(key, "").lower() == bad:
            problems.append(message)
    if environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or environ.get(
        "FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"
    ) not in ("TRANSFORMER_BASED_WRAP", ""):
        problems.append(
            "fsdp_auto_wrap_policy / fsdp_transformer_layer_cls_to_wrap: under TP the model class's own fsdp_plan "
            "decides the FSDP units (one per decoder layer); use TRANSFORMER_BASED_WRAP without a class list"
        )
    if environ.get("ACCELERATE_MIXED_PRECISION", "no") == "fp16":
        problems.append("mixed_precision: fp16 needs loss scaling that the TP route does not add; use bf16 (or no)")
    return problems


def problems(parallel: ParallelDims, environ: Mapping[str, str]) -> dict[str, str]:
    """{Accelerate config key: what the TP/EP route cannot do} for the launch environment (empty without either)."""
    found = layout_problems(parallel, environ) if parallel.sharded_layers else []
    if not found:
        return {}
    key = "parallelism_config_tp_size" if parallel.tp > 1 else expert_parallel.CONFIG_KEY
    return {f"parallelism_config.{key}": "; ".join(found)}


def model_problems(layout: ParallelDims, model_config, model_class, num_experts: int | None = None) -> list[str]:
    """What keeps this model from `layout`: for TP no tp_plan, or sizes tp does not divide (the model's numbers); for
    EP what fsdp_recipes.distributed.expert_parallel.model_problems says (`num_experts`: the routed experts, None for
    a dense model)."""
    found = expert_parallel.model_problems(layout.ep, model_config, model_class, num_experts)
    if layout.tp <= 1:
        return found
    return found + _tensor_parallel_model_problems(layout, model_config, model_class)


def _tensor_parallel_model_problems(layout: ParallelDims, model_config, model_class) -> list[str]:
    name = type(model_config).__name__.removesuffix("Config")
    plan = dict(getattr(model_class, "_tp_plan", None) or {}) | dict(
        getattr(model_config, "base_model_tp_plan", None) or {}
    )
    if model_class is None or not plan:
        shown = getattr(model_class, "__name__", "a class transformers does not ship")
        return [
            f"{name} ({shown}) has no tensor-parallel plan (tp_plan) in transformers "
            f"{TRANSFORMERS_VERSION}: set parallelism_config_tp_size: 1 and shard with FSDP alone "
            "(accelerate_configs/fsdp_8gpu.yaml)"
        ]
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    sizes = {
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None),
        "intermediate_size": getattr(text, "intermediate_size", None),
        "moe_intermediate_size": getattr(text, "moe_intermediate_size", None),
        "vocab_size": getattr(text, "vocab_size", None),
    }
    bad = {key: value for key, value in sizes.items() if isinstance(value, int) and value % layout.tp}
    if not bad:
        return []
    listed = ", ".join(f"{key} {value}" for key, value in bad.items())
    return [
        f"tp_size {layout.tp} does not divide {name}'s {listed}: choose a tp_size that divides every one of them "
        f"(each rank holds 1/tp of the heads, the MLP width and the vocabulary)"
    ]


# --- the running launch ------------------------------------------------------------------------------------------------
def attach_data_parallel_mesh(accelerator, parallel: ParallelDims):
    """A (dp_replicate, dp_shard, tp) mesh in transformers' rank order, attached where accelerate's dataloader looks:
    every rank of a TP group then gets the same batch and each data-parallel rank its own slice. No
    ParallelismConfig is attached, so that accelerate's own (broken) TP preparation never runs."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        accelerator.device.type,
        (parallel.dp_replicate, parallel.dp_shard, parallel.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
    )
    accelerator.state.device_mesh = mesh
    if accelerator.torch_device_mesh is not mesh:
        raise RuntimeError("accelerate's device mesh could not be attached (written for accelerate 1.15)")
    return mesh


@contextlib.contextmanager
def weights_to_load(accelerator, model_name_or_path: str | None, output_dir: str, complete=None):
    """The folder every rank loads its shards from: `model_name_or_path`, or, with `complete` (a function loading
    the whole model as one process would: initialised from a config, or with a new classification head), the
    weights rank 0 builds with it and saves under `output_dir` for the time of the load. Completing needs the whole
    model in rank 0's host memory once."""
    if complete is None:
        yield model_name_or_path
        return
    folder = Path(output_dir) / ".initial_weights"
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
        complete().save_pretrained(folder)
    accelerator.wait_for_everyone()
    try:
        yield str(folder)
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def sharded_root(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model as an FSDP2 module even where transformers applied no FSDP (TP alone: one data-parallel rank), so
    that accelerate's preparation leaves it as it is and gradient sync, clipping and checkpoints take one path.
    Accelerate would still resolve its wrap policy's class names on the model before seeing it is wrapped, and FSDP2
    has renamed them (`FSDPLlamaDecoderLayer`): the plugin's resolution is switched off for this launch, its settings
    kept for the run summary and the estimator."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not isinstance(model, FSDPModule):
        options = {}
        if model.config.distributed_config.fsdp_mixed_precision:  # what transformers gives its own FSDP units
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mesh=model._mesh_manager.get_mesh("fsdp"), **options)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None:
        plugin.set_auto_wrap_policy = lambda model: None  # transformers wrapped by the model's fsdp_plan
    return model


@contextlib.contextmanager
def saved_as_one_model(model: torch.nn.Module):
    """For `save_pretrained` on the main process alone with a state dict already gathered: transformers would
    otherwise gather again and wait at a barrier the other ranks never reach (it keys both on the model config's
    `distributed_config`, detached for the time of the save)."""
    config = getattr(model, "config", None)
    saved = getattr(config, "distributed_config", None)
    if saved is not None:
        config.distributed_config = None
    try:
        yield model
    finally:
        if saved is not None:
            config.distributed_config = saved


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """A TP-sharded weight gathered whole (differentiable: the gradient flows back to this rank's shard); a plain
    tensor as it is. Used by the chunked loss on a vocabulary-sharded output layer: every TP rank then computes the
    whole vocabulary's logits per chunk, as without TP, at the cost of holding the gathered weight during the loss."""
    from torch.distributed.tensor import DTensor

    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def describe(parallel: ParallelDims) -> dict[str, Any] | None:
    """The run summary's record of the TP/EP route (None without either)."""
    if not parallel.sharded_layers:
        return None
    return {
        "layout": layout_text(parallel),
        "engine": f"transformers.distributed.DistributedConfig (written for transformers {TRANSFORMERS_VERSION})",
        "data_parallel_size": parallel.data_parallel_size,
        "tensor_parallel_size": parallel.tp,
        "expert_parallel_size": parallel.ep,
    }
