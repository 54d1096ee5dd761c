"""FSDP-aware memory estimate per GPU, from a model config and an Accelerate YAML, before anything is launched.

`fsdp-recipes estimate --model NAME_OR_PATH_OR_CONFIG --accelerate-config FILE [--recipe-config FILE]` builds the model
on the meta device (no weights, no GPU, no network for a local config), splits its parameters into the FSDP units that
accelerate's preparation would create, and adds up, for the most loaded rank:

- parameters, gradients and AdamW state as sharded by the config (FSDP2: every parameter split along dim 0, a rank
  holding ceil(rows / shard_size) rows; FSDP1: one flat parameter per unit padded to a multiple of the shard size);
- activations of one micro-batch (per_device_train_batch_size x max_length tokens), with and without activation
  checkpointing, and the fp32 logits of the loss;
- FSDP's unsharded buffers (all-gathered parameters of the units in use and prefetched, in the compute dtype, and the
  unsharded gradients of a unit before its reduce-scatter).

The formulas are in docs/memory-estimator.md; tests/test_memory.py checks the state bytes against what real FSDP2
ranks hold on CPU at 1, 2 and 4 processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.sizes import gib, parse_reserve, parse_size
from fsdp_recipes.distributed.accelerate_config import LaunchLayout

FP32 = 4
DEFAULT_GPU_MEMORY = "80GB"
DEFAULT_RESERVE = "10%"  # CUDA context, NCCL buffers, allocator fragmentation: not modelled, kept free
LORA_RANK = 16


# --------------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    def rows_on(self, rank: int, shards: int) -> int:
        """Rows of dim 0 that `rank` holds when split over `shards` (torch.chunk: ceil-sized chunks, last ones short
        or empty)."""
        rows = self.shape[0] if self.shape else 1
        chunk = -(-rows // shards)
        return max(0, min(chunk, rows - rank * chunk))

    def padded_rows(self, shards: int) -> int:
        rows = self.shape[0] if self.shape else 1
        return -(-rows // shards)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1


@dataclass
class Unit:
    """One FSDP parameter group: gathered and freed together."""

    name: str
    kind: str  # layer, embedding, tail, root, module
    params: list[Param]
    reshard_after_forward: bool = True

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass
class ModelInfo:
    """Shapes of a causal LM, read from a weightless copy on the meta device."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    no_split_modules: list[str]
    params: list[Param]
    module_params: dict[str, list[Param]]  # module path -> its own (direct) parameters
    module_class: dict[str, str]  # module path -> class name
    embedding_path: str | None
    output_path: str | None
    final_norm_path: str | None
    linear_shapes_in_layers: list[tuple[int, int]]  # (in, out) of every nn.Linear inside the layers (for LoRA)
    linear_names_in_layers: list[str] = field(default_factory=list)  # their module names (q_proj, ...), same order

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)


def load_model_info(model: str, *, trust_remote_code: bool = False) -> ModelInfo:
    """`model` is a Hub id, a folder with config.json, or a config.json file."""
    config = _load_config(model, trust_remote_code=trust_remote_code)
    return model_info_from_config(config, trust_remote_code=trust_remote_code)


def _load_config(model: str, *, trust_remote_code: bool = False):
    from fsdp_recipes.models.modeling import load_model_config

    path = Path(model).expanduser()
    looks_local = model.startswith(("/", "./", "../", "~")) or model.endswith(".json") or model.count("/") > 1
    if looks_local and not path.exists():
        raise ConfigError(
            f"model {model!r}: no such file or folder. Give a config.json, a folder holding one, or a Hub model id."
        )
    try:
        if path.is_file():
            return load_model_config(None, str(path), trust_remote_code=trust_remote_code)
        return load_model_config(str(path) if path.is_dir() else model, None, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, EnvironmentError...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"could not read a model config from {model!r} ({first_line}). Give a config.json, a folder holding one, "
            "or a Hub model id (the Hub needs network access, or the model in the local cache)."
        ) from None


def model_info_from_config(config, *, trust_remote_code: bool = False) -> ModelInfo:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise ConfigError(f"{config.model_type} is not a causal language model transformers can build: {error}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size"))
    heads = int(getattr(text, "num_attention_heads"))
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    seen: set[int] = set()
    params: list[Param] = []
    module_params: dict[str, list[Param]] = {}
    module_class: dict[str, str] = {}
    for path, module in model.named_modules():
        module_class[path] = type(module).__name__
        own = []
        for name, tensor in module.named_parameters(recurse=False):
            if id(tensor) in seen:  # tied: counted once, where first seen
                continue
            seen.add(id(tensor))
            param = Param(f"{path}.{name}" if path else name, tuple(tensor.shape))
            own.append(param)
            params.append(param)
        module_params[path] = own
    paths = {id(m): p for p, m in model.named_modules()}
    embed, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and out is not None and embed.weight is out.weight
    base_prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_prefix, None) if base_prefix else model
    final_norm = None
    if isinstance(base, torch.nn.Module):
        for _, child in base.named_children():
            if "Norm" in type(child).__name__:
                final_norm = child
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    inside_layers = {id(inner) for path, layer in model.named_modules() if path and type(layer).__name__ in no_split
                     for inner in layer.modules() if inner is not layer}
    layer_linears = [(path.rsplit(".", 1)[-1], module) for path, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear) and module is not out and id(module) in inside_layers]
    linears = [(module.in_features, module.out_features) for _, module in layer_linears]
    return ModelInfo(
        model_type=str(config.model_type), hidden_size=hidden,
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        num_layers=int(getattr(text, "num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        vocab_size=int(getattr(text, "vocab_size")), tied_embeddings=tied, no_split_modules=no_split, params=params,
        module_params=module_params, module_class=module_class,
        embedding_path=paths.get(id(embed)) if embed is not None else None,
        output_path=paths.get(id(out)) if out is not None else None,
        final_norm_path=paths.get(id(final_norm)) if final_norm is not None else None,
        linear_shapes_in_layers=linears, linear_names_in_layers=[name for name, _ in layer_linears],
    )


def plan_units(info: ModelInfo, topology: LaunchLayout) -> list[Unit]:
    """The FSDP units accelerate's preparation creates (accelerate 1.15): one per wrapped module (bottom-up); for FSDP2
    also the input embedding (own unit unless tied) and a tail unit [final norm, output embedding] that is not resharded
    after forward; and the root with whatever is left (not resharded after forward either). In execution order."""
    reshard = topology.reshard_after_forward
    assigned: set[str] = set()
    units: list[Unit] = []

    def subtree(path: str) -> list[Param]:
        prefix = path + "." if path else ""
        found = []
        for module_path, own in info.module_params.items():
            if module_path == path or module_path.startswith(prefix):
                found += [p for p in own if p.name not in assigned]
        return found

    def take(name: str, kind: str, paths: list[str], reshard_after_forward: bool) -> None:
        params = [p for path in paths for p in subtree(path)]
        if params:
            assigned.update(p.name for p in params)
            units.append(Unit(name, kind, params, reshard_after_forward))

    if topology.is_fsdp and topology.wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = set(topology.wrap_classes or info.no_split_modules)
        missing = classes - set(info.module_class.values())
        if missing:
            raise ConfigError(
                f"fsdp_transformer_layer_cls_to_wrap names {', '.join(sorted(missing))}, which this "
                f"{info.model_type} model does not contain (it has {', '.join(info.no_split_modules) or 'no _no_split_modules'})"
            )
        for path, cls in info.module_class.items():
            if cls in classes and path:
                take(path, "layer", [path], reshard)
    elif topology.is_fsdp and topology.wrap_policy == "SIZE_BASED_WRAP":
        for path in sorted(info.module_class, key=lambda p: -p.count(".")):  # bottom-up
            if path and sum(p.numel for p in subtree(path)) > topology.min_num_params:
                take(path, "module", [path], reshard)
    if topology.is_fsdp and topology.fsdp_version == 2:
        layer_units = units
        units = []
        if not info.tied_embeddings and info.embedding_path is not None:
            take(info.embedding_path, "embedding", [info.embedding_path], reshard)
        units += layer_units
        tail = [p for p in (info.final_norm_path, info.embedding_path if info.tied_embeddings else None,
                            info.output_path) if p is not None]
        take("tail (" + ", ".join(tail) + ")", "tail", tail, False)
    rest = [p for p in info.params if p.name not in assigned]
    if rest:
        # The root is not resharded after forward (FSDP1 and FSDP2 keep it for the backward that follows at once).
        units.append(Unit("root", "root", rest, False))
    return units


# --------------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    max_length: int = 1024
    per_device_train_batch_size: int = 8
    attn_implementation: str = "sdpa"
    gradient_accumulation_steps: int = 1
    loss_implementation: str = "chunked"
    loss_chunk_size: int = 1024

    @property
    def tokens(self) -> int:
        return self.max_length * self.per_device_train_batch_size


def workload_from_recipe(recipe: Any | None) -> Workload:
    """From a recipe config object or a mapping with the recipe config's field names; missing fields take the
    Workload defaults. With packing, a row is `packing_row_length` tokens wide when that is set (examples longer than
    it still get a row of their own, as wide as max_length)."""
    def get(name, default=None):
        if recipe is None:
            return default
        if isinstance(recipe, dict):
            value = recipe.get(name, default)
        else:
            value = getattr(recipe, name, default)
        return default if value is None else value

    defaults = Workload()
    row_length = get("max_length", defaults.max_length)
    if get("packing", False) and get("packing_row_length"):
        row_length = int(get("packing_row_length"))
    return Workload(
        int(row_length), int(get("per_device_train_batch_size", defaults.per_device_train_batch_size)),
        str(get("attn_implementation", defaults.attn_implementation)),
        int(get("gradient_accumulation_steps", defaults.gradient_accumulation_steps)),
        str(get("loss_implementation", defaults.loss_implementation)),
        int(get("loss_chunk_size", defaults.loss_chunk_size)),
    )


# --------------------------------------------------------------------------------------------------- estimate
def state_bytes_on_rank(units: list[Unit], topology: LaunchLayout, rank: int = 0, *, trainable: bool = True) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state that `rank` holds (before offload moves them to the host).

    FSDP2 (per parameter, along dim 0): parameter and gradient storage is padded to ceil(rows / S) rows on every rank
    (that is how FSDP2 allocates them); AdamW's exp_avg / exp_avg_sq are made from the unpadded local shard. FSDP1: a
    flat parameter per unit, padded to a multiple of S. Unsharded: everything whole. Parameters, gradients and AdamW
    state are fp32 (the recipe loads fp32 weights; under mixed precision they are the master weights), plus AdamW's
    4-byte `step` per parameter tensor."""
    shards = topology.shard_size if topology.is_fsdp else 1
    shard_rank = rank % shards
    params = grads = optim = 0
    count = 0
    for unit in units:
        count += len(unit.params)
        if shards == 1:
            padded = local = unit.numel
        elif topology.fsdp_version == 2:
            padded = sum(p.padded_rows(shards) * p.row_numel for p in unit.params)
            local = sum(p.rows_on(shard_rank, shards) * p.row_numel for p in unit.params)
        else:
            padded = -(-unit.numel // shards)
            local = max(0, min(padded, unit.numel - shard_rank * padded))
        params += FP32 * padded
        if trainable:
            grads += FP32 * padded
            optim += 2 * FP32 * local
    if trainable:
        optim += FP32 * count
    return {"parameters": params, "gradients": grads, "optimizer_state": optim}


@dataclass(frozen=True)
class Adapters:
    """LoRA as the recipes apply it (fsdp_recipes.models.adapters): rank-`rank` A (rank x in) and B (out x rank) matrices,
    fp32 and trainable, on the linear layers of the decoder blocks named in `target_modules` (None: all of them), plus
    DoRA's magnitude vector (out) per adapted layer; the base frozen at `frozen_bytes` per element (its compute dtype:
    no fp32 master copy, no gradient, no optimizer state). Modules trained in full beside the adapters
    (`lora_modules_to_save`) are not counted."""

    rank: int = LORA_RANK
    target_modules: tuple[str, ...] | None = None
    frozen_bytes: int = 2
    dora: bool = False

    def adapter_params(self, info: ModelInfo) -> list[Param]:
        shapes = info.linear_shapes_in_layers
        names = info.linear_names_in_layers or [""] * len(shapes)
        params = []
        for index, ((fan_in, fan_out), name) in enumerate(zip(shapes, names)):
            if self.target_modules is not None and name not in self.target_modules:
                continue
            params += [Param(f"{index}.lora_A", (self.rank, fan_in)), Param(f"{index}.lora_B", (fan_out, self.rank))]
            if self.dora:
                params.append(Param(f"{index}.magnitude", (fan_out,)))
        return params


def adapters_from_recipe(recipe: Any, compute_bytes: int) -> Adapters | None:
    """The Adapters of a recipe config (object or mapping with its field names), or None without use_peft."""
    get = (lambda name, default=None: recipe.get(name, default)) if isinstance(recipe, dict) else (
        lambda name, default=None: getattr(recipe, name, default))
    if not get("use_peft", False):
        return None
    targets = get("lora_target_modules")
    frozen = 1 if get("load_in_4bit", False) else compute_bytes  # 4 bits + quantisation constants: ~0.5 byte, say 1
    return Adapters(rank=int(get("lora_r", LORA_RANK) or LORA_RANK), target_modules=tuple(targets) if targets else None,
                    frozen_bytes=frozen, dora=bool(get("use_dora", False)))


def adapter_state_bytes_on_rank(info: ModelInfo, units: list[Unit], topology: LaunchLayout, adapters: Adapters,
                                rank: int = 0) -> dict[str, int]:
    """`state_bytes_on_rank` for LoRA: every base parameter at `frozen_bytes`, padded as FSDP2 pads it, with no
    gradient or optimizer state; every adapter matrix is a parameter of its own, sharded along dim 0 like any other
    (padded fp32 storage for it and its gradient, unpadded AdamW state, a 4-byte step)."""
    frozen = state_bytes_on_rank(units, topology, rank, trainable=False)["parameters"] * adapters.frozen_bytes // FP32
    adapter_unit = Unit("adapters", "layer", adapters.adapter_params(info))
    trained = state_bytes_on_rank([adapter_unit], topology, rank)
    return {"parameters": frozen + trained["parameters"], "gradients": trained["gradients"],
            "optimizer_state": trained["optimizer_state"]}


def frozen_copies_from_recipe(recipe: dict[str, Any], config_fields: frozenset[str]) -> int:
    """For a recipe config read as a mapping (`fsdp-recipes estimate`, `ls`), with the field names of the recipe's
    config class: the whole frozen model copies the run will keep beside the model it trains. A recipe whose config
    has TRL's `precompute_ref_log_probs` has a reference model; fsdp_recipes.train.reference decides when it is a copy."""
    if "precompute_ref_log_probs" not in config_fields:
        return 0
    from fsdp_recipes.train import reference

    return reference.frozen_copies(reference.mode_for(precompute=bool(recipe.get("precompute_ref_log_probs", False)),
                                                      use_peft=bool(recipe.get("use_peft", False))))


def for_recipe(topology: LaunchLayout, recipe: Any) -> LaunchLayout:
    """The topology as the recipe config changes it: the model's own activation checkpointing
    (`gradient_checkpointing: true`) saves the same activations as FSDP's."""
    get = recipe.get if isinstance(recipe, dict) else (lambda name, default=None: getattr(recipe, name, default))
    if get("gradient_checkpointing", False) and not topology.activation_checkpointing:
        return dataclasses.replace(topology, activation_checkpointing=True)
    return topology


def activation_bytes(info: ModelInfo, workload: Workload, compute_bytes: int) -> dict[str, int]:
    """Activations of one micro-batch kept for backward (bytes), decoder-only transformer (Llama-style: RMSNorm, GQA,
    gated MLP, no dropout). Per layer and token: c*(2h + 3q + 2kv + 4i) + 4*2h + 4*heads (+ c*heads*s + 4*heads*s for eager)."""
    c, h, i = compute_bytes, info.hidden_size, info.intermediate_size
    kv = info.num_kv_heads * info.head_dim
    q = info.num_heads * info.head_dim
    s, tokens = workload.max_length, workload.tokens
    per_token_layer = c * (2 * h + 3 * q + 2 * kv + 4 * i) + FP32 * 2 * h + FP32 * info.num_heads
    if workload.attn_implementation == "eager":
        per_token_layer += (c + FP32) * info.num_heads * s  # softmax in fp32 and its cast, a*s per token
    layer = per_token_layer * tokens
    # final norm (fp32 input + output), rotary cos/sin shared by all layers, ids/positions/targets (int64)
    other = (FP32 * h + c * h + 2 * c * info.head_dim + 3 * 8) * tokens
    if workload.loss_implementation == "full_logits":
        # fp32 logits, cross-entropy's fp32 log-probabilities and, in backward, their gradient (measured: 5.81 GiB
        # against 5.87 predicted, benchmarks/chunked_loss_memory.py)
        logits = 3 * FP32 * info.vocab_size * tokens
    else:  # one chunk's fp32 logits (one reused buffer), plus the hidden states of the tokens that carry loss
        logits = FP32 * info.vocab_size * min(workload.loss_chunk_size, tokens) + c * h * tokens
    checkpoint = c * h * tokens  # each layer's input, kept when its activations are recomputed
    without = info.num_layers * layer + other + logits
    with_ac = info.num_layers * checkpoint + max(layer, other + logits)
    return {"per_layer": layer, "logits": logits, "without_checkpointing": without, "with_checkpointing": with_ac}


def buffer_bytes(info: ModelInfo, units: list[Unit], topology: LaunchLayout, *, trainable_fraction: float = 1.0) -> dict[str, int]:
    """Unsharded copies: all-gathered parameters in the compute dtype and unsharded gradients before reduce-scatter
    (FSDP); gradient buckets and autocast weight copies (DDP / single process)."""
    c = topology.compute_bytes
    if not topology.is_fsdp or (topology.shard_size == 1 and topology.world_size > 1):  # DDP, one process, NO_SHARD
        total = sum(u.numel for u in units) if units else info.num_params
        matrices = sum(p.numel for p in info.params if len(p.shape) >= 2 and not p.name.endswith("embed_tokens.weight"))
        # autocast keeps a compute-dtype copy of each trainable fp32 matrix; a frozen LoRA base is loaded in that dtype
        autocast = c * matrices if topology.mixed_precision != "no" and trainable_fraction > 0 else 0
        buckets = FP32 * total * trainable_fraction if topology.distributed_type == "MULTI_GPU" else 0
        return {"all_gather": int(autocast), "reduce_scatter": int(buckets), "held": 0, "in_flight": int(autocast)}
    held = sum(u.numel for u in units if not u.reshard_after_forward)
    moving = [u.numel for u in units if u.reshard_after_forward]
    if topology.prefetch and len(moving) > 1:
        in_flight = max(a + b for a, b in zip(moving, moving[1:]))
    else:
        in_flight = max(moving, default=0)
    largest = max((u.numel for u in units), default=0)
    return {
        "all_gather": c * (held + in_flight),
        "reduce_scatter": int(c * largest * trainable_fraction),
        "held": c * held,
        "in_flight": c * in_flight,
    }


@dataclass
class Estimate:
    model: str
    topology: LaunchLayout
    workload: Workload
    num_params: int
    units: list[Unit]
    state: dict[str, int]
    activations: dict[str, int]
    buffers: dict[str, int]
    gpu_memory: int
    reserve: int = 0
    trainable_params: int | None = None  # LoRA: only the adapters
    host_state: dict[str, int] = field(default_factory=dict)
    adapters: Adapters | None = None
    frozen_copies: int = 0

    @property
    def activations_used(self) -> int:
        key = "with_checkpointing" if self.topology.activation_checkpointing else "without_checkpointing"
        return self.activations[key]

    @property
    def device_state(self) -> int:
        return 0 if self.topology.cpu_offload else sum(self.state.values())

    @property
    def total(self) -> int:
        return self.device_state + self.activations_used + self.buffers["all_gather"] + self.buffers["reduce_scatter"]

    @property
    def usable(self) -> int:
        return self.gpu_memory - self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def per_gpu(self) -> dict[str, int]:
        on_device = not self.topology.cpu_offload
        return {
            "parameters": self.state["parameters"] if on_device else 0,
            "gradients": self.state["gradients"] if on_device else 0,
            "optimizer_state": self.state["optimizer_state"] if on_device else 0,
            "reference_model": self.state.get("reference_model", 0) if on_device else 0,
            "activations": self.activations_used,
            "activations_without_checkpointing": self.activations["without_checkpointing"],
            "activations_with_checkpointing": self.activations["with_checkpointing"],
            "logits": self.activations["logits"],
            "all_gather_buffers": self.buffers["all_gather"],
            "reduce_scatter_buffers": self.buffers["reduce_scatter"],
            "total": self.total,
        }


def estimate(info: ModelInfo, topology: LaunchLayout, workload: Workload, *, gpu_memory: int = 80 * 10**9,
             reserve: int | None = None, model_name: str = "", adapters: Adapters | None = None,
             frozen_copies: int = 0) -> Estimate:
    """`frozen_copies`: whole frozen copies of the model sharded like it, at the compute dtype (preference tuning's
    reference model)."""
    units = plan_units(info, topology)
    compute = topology.compute_bytes
    if adapters is None:
        state = state_bytes_on_rank(units, topology, 0)
        buffers = buffer_bytes(info, units, topology)
        trainable = None
    else:
        state = adapter_state_bytes_on_rank(info, units, topology, adapters, 0)
        trainable = sum(p.numel for p in adapters.adapter_params(info))
        buffers = buffer_bytes(info, units, topology, trainable_fraction=0.0)
        buffers["reduce_scatter"] = FP32 * trainable
    if frozen_copies:
        copy = state_bytes_on_rank(units, topology, 0, trainable=False)["parameters"] * compute // FP32
        state["reference_model"] = frozen_copies * copy  # its gathered units are in flight when the policy's are not
    activations = activation_bytes(info, workload, compute)
    host = dict(state) if topology.cpu_offload else {}
    reserve = gpu_memory // 10 if reserve is None else reserve
    return Estimate(model_name, topology, workload, info.num_params, units, state, activations, buffers, gpu_memory,
                    reserve, trainable, host, adapters, frozen_copies)


def suggestions(info: ModelInfo, current: Estimate) -> list[dict[str, Any]]:
    """What to change when `current` does not fit, each with its predicted total per GPU (None: not computable)."""
    if current.fits:
        return []
    topo, work = current.topology, current.workload
    out: list[dict[str, Any]] = []

    def add(change: str, how: str, topology: LaunchLayout = topo, workload: Workload = work, lora: Adapters | None = None,
            frozen_copies: int = current.frozen_copies):
        new = estimate(info, topology, workload, gpu_memory=current.gpu_memory, reserve=current.reserve,
                       adapters=lora or current.adapters, frozen_copies=frozen_copies)
        if new.total < current.total:
            out.append({"change": change, "how": how, "predicted_total_bytes": new.total, "fits": new.fits,
                        "host_bytes_per_gpu": sum(new.host_state.values()) if new.host_state else 0})

    if topo.is_fsdp and not topo.activation_checkpointing:
        add("activation checkpointing", "fsdp_activation_checkpointing: true in the Accelerate config "
            "(accelerate_configs/fsdp_8gpu_activation_checkpointing.yaml)",
            dataclasses.replace(topo, activation_checkpointing=True))
    if topo.world_size > 1 and (not topo.is_fsdp or topo.shard_size < topo.world_size or not topo.reshard_after_forward):
        full = dataclasses.replace(topo, distributed_type="FSDP", fsdp_version=topo.fsdp_version if topo.is_fsdp else 2,
                                   shard_size=topo.world_size, reshard_after_forward=True,
                                   wrap_policy=topo.wrap_policy if topo.is_fsdp else "TRANSFORMER_BASED_WRAP")
        add("FSDP FULL_SHARD over all GPUs", f"shard over all {topo.world_size} GPUs (accelerate_configs/fsdp_8gpu.yaml "
            "is the one-node example)", full)
    if topo.is_fsdp:
        per_node = topo.gpus_per_node
        base = topo if topo.shard_size == topo.world_size else dataclasses.replace(topo, shard_size=topo.world_size)
        for machines in (2, 4, 8, 16, 32, 64, 128):
            world = per_node * topo.num_machines * machines
            more = dataclasses.replace(base, world_size=world, num_machines=topo.num_machines * machines, shard_size=world)
            if estimate(info, more, work, gpu_memory=current.gpu_memory, reserve=current.reserve,
                        adapters=current.adapters, frozen_copies=current.frozen_copies).fits or machines == 128:
                add(f"more GPUs ({world})", f"FSDP over {world} GPUs ({topo.num_machines * machines} nodes of {per_node}): "
                    "state shrinks as 1/GPUs, activations and buffers do not", more)
                break
    if topo.is_fsdp and not topo.cpu_offload:
        add("CPU offload", "fsdp_offload_params: true (accelerate_configs/fsdp_8gpu_offload.yaml); parameters, gradients "
            "and optimizer state move to host RAM, several times slower steps", dataclasses.replace(topo, cpu_offload=True))
        if not topo.activation_checkpointing:
            add("CPU offload + activation checkpointing", "both of the above",
                dataclasses.replace(topo, cpu_offload=True, activation_checkpointing=True))
    if current.frozen_copies:
        add("no reference model copy", "precompute_ref_log_probs: true in the recipe config (one pass of the starting "
            "model over the data before training; no copy kept), or use_peft: true (the policy without its adapters is "
            "the reference)", frozen_copies=0)
    if info.linear_shapes_in_layers and current.trainable_params is None:
        add(f"LoRA (rank {LORA_RANK})", f"use_peft: true in the recipe config: rank-{LORA_RANK} adapters on every "
            "linear of the decoder layers, base weights frozen in the compute dtype",
            lora=Adapters(rank=LORA_RANK, frozen_bytes=topo.compute_bytes))
    if work.per_device_train_batch_size > 1:
        smaller = dataclasses.replace(work, per_device_train_batch_size=1,
                                      gradient_accumulation_steps=work.gradient_accumulation_steps * work.per_device_train_batch_size)
        add("micro-batch 1", f"per_device_train_batch_size: 1 and gradient_accumulation_steps: "
            f"{smaller.gradient_accumulation_steps} (same global batch, more steps per update)", workload=smaller)
    return out


def estimate_report(est: Estimate, info: ModelInfo) -> dict[str, Any]:
    """The JSON object `fsdp-recipes estimate --json` prints."""
    topo = est.topology
    largest = max(est.units, key=lambda u: u.numel) if est.units else None
    return {
        "model": est.model,
        "model_type": info.model_type,
        "parameters_total": est.num_params,
        "trainable_parameters": est.trainable_params,  # LoRA: the adapters; null: every parameter
        "topology": {**dataclasses.asdict(topo), "sharding": topo.sharding, "description": topo.describe()},
        "workload": {**dataclasses.asdict(est.workload), "tokens_per_micro_batch": est.workload.tokens},
        "units": {"count": len(est.units), "largest": largest.name if largest else None,
                  "largest_parameters": largest.numel if largest else 0},
        "per_gpu_bytes": est.per_gpu(),
        "host_bytes_per_gpu": est.host_state,
        "gpu_memory_bytes": est.gpu_memory,
        "reserve_bytes": est.reserve,
        "usable_bytes": est.usable,
        "fits": est.fits,
        "headroom_bytes": est.usable - est.total,
        "suggestions": suggestions(info, est),
    }


# --------------------------------------------------------------------------------------------------- recipe hook
def estimate_for_run(accelerator, model_config, recipe_config, *, gpu_memory: int | None = None) -> dict[str, Any]:
    """The estimate for the launch in progress, for the run summary beside the measured peak memory. Cheap (a meta
    model, no weights) and no collectives: call it on any rank. Bytes are for the most loaded rank; `rank_state_bytes`
    is the state this very rank should hold (parameters, gradients, AdamW state)."""
    info = model_info_from_config(model_config, trust_remote_code=bool(getattr(recipe_config, "trust_remote_code", False)))
    topology = for_recipe(LaunchLayout.from_accelerator(accelerator), recipe_config)
    workload = workload_from_recipe(recipe_config)
    adapters = adapters_from_recipe(recipe_config, topology.compute_bytes)
    est = estimate(info, topology, workload, gpu_memory=gpu_memory or 80 * 10**9, adapters=adapters,
                   frozen_copies=recipe_config.frozen_model_copies())
    units = plan_units(info, topology)

    def on_rank(rank: int) -> dict[str, int]:
        if adapters is None:
            return state_bytes_on_rank(units, topology, rank)
        return adapter_state_bytes_on_rank(info, units, topology, adapters, rank)

    return {
        "predicted_per_gpu_bytes": est.per_gpu(),
        "predicted_host_bytes_per_gpu": est.host_state,
        "rank_state_bytes": on_rank(accelerator.process_index),
        "rank_state_bytes_per_rank": [on_rank(rank) for rank in range(accelerator.num_processes)],
        "trainable_parameters": est.trainable_params if adapters is not None else info.num_params,
        "sharding": topology.sharding,
        "tokens_per_micro_batch": workload.tokens,
    }


# --------------------------------------------------------------------------------------------------- CLI
def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="NAME_OR_PATH_OR_CONFIG",
                        help="Hub id, model folder, or config.json (default: the recipe config's model)")
    parser.add_argument("--accelerate-config", required=True, metavar="FILE", help="an Accelerate config YAML")
    parser.add_argument("--recipe-config", metavar="FILE",
                        help="recipe YAML: max_length, per_device_train_batch_size, attn_implementation, model")
    parser.add_argument("--max-length", type=int, help="tokens per row (overrides the recipe config)")
    parser.add_argument("--batch-size", type=int, help="per_device_train_batch_size (overrides the recipe config)")
    parser.add_argument("--num-processes", type=int, help="override num_processes (the GLOBAL GPU count)")
    parser.add_argument("--gpu-memory", default=DEFAULT_GPU_MEMORY, help="memory per GPU: 80GB, 141GiB, 24e9 (default 80GB)")
    parser.add_argument("--reserve", default=DEFAULT_RESERVE,
                        help="memory per GPU kept free for what is not modelled (CUDA context, NCCL, fragmentation): "
                        "a percentage of --gpu-memory or a size (default 10%%)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run_estimate(args: argparse.Namespace) -> int:
    """`fsdp-recipes estimate`. Raises ConfigError (exit 2 through the CLI) on bad input."""
    from fsdp_recipes.common.yaml_json import load_yaml_mapping

    gpu_memory = parse_size(args.gpu_memory)
    reserve = parse_reserve(args.reserve, gpu_memory)
    recipe = load_yaml_mapping(args.recipe_config) if args.recipe_config else {}
    if args.max_length is not None:
        recipe["max_length"] = args.max_length
    if args.batch_size is not None:
        recipe["per_device_train_batch_size"] = args.batch_size
    workload = workload_from_recipe(recipe)
    if workload.max_length < 1 or workload.per_device_train_batch_size < 1:
        raise ConfigError("max_length and per_device_train_batch_size must be >= 1")
    model = args.model or recipe.get("model_config") or recipe.get("model_name_or_path")
    if not model:
        raise ConfigError("no model: pass --model (Hub id, folder or config.json) or a --recipe-config that names one")
    topology = LaunchLayout.from_file(args.accelerate_config)
    if args.num_processes is not None:
        if args.num_processes < 1:
            raise ConfigError("--num-processes must be >= 1")
        hsdp = 1 < topology.shard_size < topology.world_size
        if hsdp and args.num_processes % topology.shard_size:
            raise ConfigError(f"--num-processes {args.num_processes} is not a multiple of the HSDP shard size "
                              f"{topology.shard_size}")
        shard = topology.shard_size if hsdp or topology.shard_size == 1 else args.num_processes
        topology = dataclasses.replace(topology, world_size=args.num_processes, shard_size=shard)
    info = load_model_info(str(model), trust_remote_code=args.trust_remote_code)
    topology = for_recipe(topology, recipe)
    frozen_copies = 0
    if args.recipe_config:
        from fsdp_recipes.tools.catalog import recipe_config_fields

        frozen_copies = frozen_copies_from_recipe(recipe, recipe_config_fields(Path(args.recipe_config)))
    est = estimate(info, topology, workload, gpu_memory=gpu_memory, reserve=reserve, model_name=str(model),
                   adapters=adapters_from_recipe(recipe, topology.compute_bytes), frozen_copies=frozen_copies)
    report = estimate_report(est, info)
    if args.json:
        print(json.dumps(report, indent=None))
    else:
        print(format_table(report))
    return 0 if est.fits else 1


def format_table(report: dict[str, Any]) -> str:
    g, topo, work = report["per_gpu_bytes"], report["topology"], report["workload"]
    ac = topo["activation_checkpointing"]
    lines = [
        f"model: {report['model']} ({report['model_type']}, {report['parameters_total'] / 1e9:.3f}B parameters)",
        f"launch: {topo['description']}",
        f"micro-batch: {work['per_device_train_batch_size']} x {work['max_length']} tokens, attention "
        f"{work['attn_implementation']}; {report['units']['count']} FSDP units, largest {report['units']['largest']} "
        f"({report['units']['largest_parameters'] / 1e6:.1f}M parameters)",
        "",
        "per GPU (the most loaded rank)",
    ]
    offload = " (on the host: CPU offload)" if topo["cpu_offload"] else ""
    host = report["host_bytes_per_gpu"]
    lora = report.get("trainable_parameters") is not None
    if lora:
        lines.insert(1, f"LoRA: {report['trainable_parameters'] / 1e6:.1f}M trainable adapter parameters, base frozen")
    rows = [
        ("parameters (frozen base + fp32 adapters)" if lora else "parameters (fp32, sharded)",
         host.get("parameters") if offload else g["parameters"]),
        ("gradients (fp32 adapters)" if lora else "gradients (fp32, sharded)", host.get("gradients") if offload else g["gradients"]),
        ("optimizer state (AdamW, 2 x fp32)", host.get("optimizer_state") if offload else g["optimizer_state"]),
        *([("reference model (frozen copy, sharded)", g["reference_model"])] if g["reference_model"] else []),
        (f"activations, checkpointing {'on' if ac else 'off'}", g["activations"]),
        (f"  (checkpointing {'off' if ac else 'on'}: {gib(g['activations_with_checkpointing' if not ac else 'activations_without_checkpointing'])};"
         f" of which logits {gib(g['logits'])})", None),
        ("all-gather buffers (compute dtype)", g["all_gather_buffers"]),
        ("unsharded gradients / buckets", g["reduce_scatter_buffers"]),
    ]
    for label, value in rows:
        if value is None:
            lines.append(f"  {label}")
        else:
            suffix = offload if offload and label.split()[0] in ("parameters", "gradients", "optimizer") else ""
            lines.append(f"  {label:<40} {gib(value):>12}{suffix}")
    lines.append(f"  {'total':<40} {gib(g['total']):>12}")
    verdict = "fits" if report["fits"] else "does NOT fit"
    lines.append(f"\n{verdict} in {gib(report['usable_bytes'])} usable per GPU ({gib(report['gpu_memory_bytes'])} minus "
                 f"{gib(report['reserve_bytes'])} kept for the CUDA context, NCCL and fragmentation); headroom "
                 f"{gib(report['headroom_bytes'])}")
    if report["suggestions"]:
        lines.append("\nto make it fit:")
        for s in report["suggestions"]:
            mark = "fits" if s["fits"] else "still too big"
            host_note = f", host {gib(s['host_bytes_per_gpu'])} per GPU" if s["host_bytes_per_gpu"] else ""
            lines.append(f"  - {s['change']}: {gib(s['predicted_total_bytes'])} per GPU ({mark}{host_note}); {s['how']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point until `fsdp-recipes estimate` is wired: python -m fsdp_recipes.tools.memory ..."""
    from fsdp_recipes.common.errors import UserError

    parser = argparse.ArgumentParser(prog="fsdp-recipes estimate", description=__doc__.splitlines()[0])
    add_estimate_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_estimate(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
