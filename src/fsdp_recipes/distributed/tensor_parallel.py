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
- the layout (`NdLayout`) read from the launch environment, and every setting of the Accelerate config
  that this route cannot honour, refused with the reason before any weight loads (`layout_problems`);
- what the model must allow (`model_problems`): a `tp_plan`, and `tp` dividing heads, KV heads, MLP width, vocabulary;
- the data-parallel mesh attached to the accelerator, so that accelerate's dataloader gives every rank of a TP group
  the same batch and each data-parallel rank its own (`attach_data_parallel_mesh`), and the sizes the loss and the
  metrics divide by (`data_parallel_size`, `tensor_parallel_size`).
The embedding and output layers are sharded on the vocabulary as the model's plan says; the chunked loss gathers the
output layer's weight per forward (`full_weight`) rather than gathering logits or going vocabulary-parallel.

Written for transformers 5.24's `transformers.distributed` (its API moves every minor release: pinned in
pyproject.toml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.distributed import expert_parallel, parallel_dims, sequence_parallel

TRANSFORMERS_VERSION = "5.24"


@dataclasses.dataclass(frozen=True)
class NdLayout:
    """The N-D mesh of a TP/EP launch, in transformers' order (dp_replicate, fsdp, tp): rank = (r * fsdp + f) * tp + t.
    The experts' mesh (dp_replicate, efsdp, ep) spans the same ranks."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tp

    def describe(self) -> str:
        parts = [f"tp {self.tp}"] if self.tp > 1 else []
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.dp_shard > 1:
            parts.insert(0, f"fsdp {self.dp_shard}")
        if self.dp_replicate > 1:
            parts.insert(0, f"replicate {self.dp_replicate}")
        return " x ".join(parts)

    def distributed_config(self, *, mixed_precision: str):
        """transformers' DistributedConfig for this layout."""
        from transformers.distributed import DistributedConfig

        _sum_partial_gradients_once_per_backward()

        return DistributedConfig(
            tp_size=self.tp,
            fsdp_size=self.dp_shard,
            dp_replicate_size=self.dp_replicate,
            ep_size=self.ep,
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


def layout_from_environment(environ: Mapping[str, str], world_size: int) -> NdLayout | None:
    """The TP/EP layout the launcher exported (PARALLELISM_CONFIG_*), or None when it asks for neither.
    A dp_shard size of -1 or 0 (accelerate's "the rest") is resolved from the world size."""
    sizes = parallel_dims.sizes_from_environment(environ)
    uses_parallelism_config = environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    ep = expert_parallel.size_from_environment(environ) if uses_parallelism_config else 1
    if sizes["tp"] <= 1 and ep <= 1:
        return None
    replicate, tp = max(1, sizes["dp_replicate"]), max(1, sizes["tp"])
    shard = sizes["dp_shard"] if sizes["dp_shard"] > 0 else max(1, world_size // (replicate * tp))
    return NdLayout(dp_replicate=replicate, dp_shard=shard, tp=tp, ep=ep)


def layout_problems(layout: NdLayout, environ: Mapping[str, str], world_size: int) -> list[str]:
    """What the Accelerate config asks for that the TP/EP route cannot do, each with its fix (empty: it runs)."""
    problems = expert_parallel.layout_problems(ep=layout.ep, tp=layout.tp, dp_shard=layout.dp_shard)
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


def problems(environ: Mapping[str, str]) -> dict[str, str]:
    """{Accelerate config key: what the TP/EP route cannot do} for the launch environment (empty without either)."""
    world_size = int(environ.get("WORLD_SIZE", "1"))
    layout = layout_from_environment(environ, world_size)
    found = [] if layout is None else layout_problems(layout, environ, world_size)
    if not found:
        return {}
    key = "parallelism_config_tp_size" if layout.tp > 1 else expert_parallel.CONFIG_KEY
    return {f"parallelism_config.{key}": "; ".join(found)}


def model_problems(layout: NdLayout, model_config, model_class, num_experts: int | None = None) -> list[str]:
    """What keeps this model from `layout`: for TP no tp_plan, or sizes tp does not divide (the model's numbers); for
    EP what fsdp_recipes.distributed.expert_parallel.model_problems says (`num_experts`: the routed experts, None for
    a dense model)."""
    found = expert_parallel.model_problems(layout.ep, model_config, model_class, num_experts)
    if layout.tp <= 1:
        return found
    return found + _tensor_parallel_model_problems(layout, model_config, model_class)


def _tensor_parallel_model_problems(layout: NdLayout, model_config, model_class) -> list[str]:
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
def attach_data_parallel_mesh(accelerator, layout: NdLayout) -> None:
    """A (dp_replicate, dp_shard, tp) mesh in transformers' rank order, attached where accelerate's dataloader looks:
    every rank of a TP group then gets the same batch and each data-parallel rank its own slice. No
    ParallelismConfig is attached, so that accelerate's own (broken) TP preparation never runs."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        accelerator.device.type,
        (layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
    )
    accelerator.state.device_mesh = mesh
    if accelerator.torch_device_mesh is not mesh:
        raise RuntimeError("accelerate's device mesh could not be attached (written for accelerate 1.15)")


def layout_of(accelerator) -> NdLayout | None:
    """The TP/EP layout of a running launch (the mesh `attach_data_parallel_mesh` attached, and the exported `ep`),
    None without either."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return NdLayout(
        dp_replicate=mesh["dp_replicate"].size(),
        dp_shard=mesh["dp_shard"].size(),
        tp=mesh["tp"].size(),
        ep=expert_parallel.size_from_environment(os.environ),
    )


def tensor_parallel_size(accelerator) -> int:
    """Ranks that share one batch (1 without TP)."""
    layout = layout_of(accelerator)
    return 1 if layout is None else layout.tp


def batch_sharing_size(accelerator) -> int:
    """Ranks that hold one batch together and so the same values outside the model: a TP group, or a
    sequence-parallel group (its rows split by position inside the forward only); 1 without either."""
    return tensor_parallel_size(accelerator) * sequence_parallel.size_of(accelerator)


def data_parallel_size(accelerator) -> int:
    """Ranks that each see a distinct batch: the world size over the TP (or SP) size."""
    return accelerator.num_processes // batch_sharing_size(accelerator)


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


def data_parallel_rank(accelerator) -> int:
    """This rank's index among the data-parallel ranks (transformers' mesh puts TP innermost, the sequence-parallel
    mesh SP: rank // tp, rank // sp)."""
    return accelerator.process_index // batch_sharing_size(accelerator)


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


def describe(layout: NdLayout | None) -> dict[str, Any] | None:
    """The run summary's record of the TP/EP route (None without either)."""
    if layout is None:
        return None
    return {
        "layout": layout.describe(),
        "engine": f"transformers.distributed.DistributedConfig (written for transformers {TRANSFORMERS_VERSION})",
        "data_parallel_size": layout.data_parallel_size,
        "tensor_parallel_size": layout.tp,
        "expert_parallel_size": layout.ep,
    }


def requested() -> NdLayout | None:
    """This launch's TP/EP layout, from its environment (None without either)."""
    return layout_from_environment(os.environ, int(os.environ.get("WORLD_SIZE", "1")))
