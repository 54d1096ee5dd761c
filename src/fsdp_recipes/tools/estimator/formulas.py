"""The bytes of a training step on the most loaded rank: the FSDP units accelerate's preparation creates from a model,
the parameters, gradients and AdamW state each rank holds of them, the activations of one micro-batch, FSDP's
unsharded buffers, and their sum against the GPU's memory (`Estimate`). Formulas: docs/memory-estimator.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.models.experts import is_routed_expert_parameter
from fsdp_recipes.tools.estimator import vision
from fsdp_recipes.tools.estimator.shapes import ModelInfo, Param, load_model_info, tensor_parallel_local
from fsdp_recipes.tools.estimator.workload import Adapters, Workload, adapters_for, layout_for_recipe, workload_for
from fsdp_recipes.train.config import TrainingConfig

FP32 = 4
FP8 = 1


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


def plan_units(info: ModelInfo, layout: LaunchLayout) -> list[Unit]:
    """The FSDP units accelerate's preparation creates (accelerate 1.15): one per wrapped module (bottom-up); for FSDP2
    also the input embedding (own unit unless tied) and a tail unit [final norm, output embedding] that is not resharded
    after forward; and the root with whatever is left (not resharded after forward either). In execution order."""
    info = tensor_parallel_local(info, layout.parallel.tp, layout.parallel.ep)
    reshard = layout.reshard_after_forward
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

    if layout.is_fsdp and layout.wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = set(layout.wrap_classes or info.wrap_classes)
        missing = classes - set(info.module_class.values())
        if missing:
            raise ConfigError(
                f"fsdp_transformer_layer_cls_to_wrap names {', '.join(sorted(missing))}, which this "
                f"{info.model_type} model does not contain (it has {', '.join(info.no_split_modules) or 'no _no_split_modules'})"
            )
        for path, cls in info.module_class.items():
            if cls in classes and path:
                take(path, "layer", [path], reshard)
    elif layout.is_fsdp and layout.wrap_policy == "SIZE_BASED_WRAP":
        for path in sorted(info.module_class, key=lambda p: -p.count(".")):  # bottom-up
            if path and sum(p.numel for p in subtree(path)) > layout.min_num_params:
                take(path, "module", [path], reshard)
    if layout.is_fsdp and layout.fsdp_version == 2:
        layer_units = units
        units = []
        if not info.tied_embeddings and info.embedding_path is not None:
            take(info.embedding_path, "embedding", [info.embedding_path], reshard)
        units += layer_units
        tail = [
            p
            for p in (info.final_norm_path, info.embedding_path if info.tied_embeddings else None, info.output_path)
            if p is not None
        ]
        take("tail (" + ", ".join(tail) + ")", "tail", tail, False)
    rest = [p for p in info.params if p.name not in assigned]
    if rest:
        # The root is not resharded after forward (FSDP1 and FSDP2 keep it for the backward that follows at once).
        units.append(Unit("root", "root", rest, False))
    return units


def state_bytes_on_rank(
    units: list[Unit], layout: LaunchLayout, rank: int = 0, *, trainable: bool = True, frozen: Callable | None = None
) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state that `rank` holds (before offload moves them to the host).

    FSDP2 (per parameter, along dim 0): parameter and gradient storage is padded to ceil(rows / S) rows on every rank
    (that is how FSDP2 allocates them); AdamW's exp_avg / exp_avg_sq are made from the unpadded local shard. FSDP1: a
    flat parameter per unit, padded to a multiple of S. Unsharded: everything whole. Parameters, gradients and AdamW
    state are fp32 (the recipe loads fp32 weights; under mixed precision they are the master weights), plus AdamW's
    4-byte `step` per parameter tensor; `frozen` parameters (a frozen vision tower) get neither gradient nor AdamW
    state. Under expert parallelism the routed experts are sharded over their own mesh (dp_replicate, efsdp, ep):
    over efsdp = shard x tp / ep ranks, at index (rank // ep) % efsdp."""
    parallel = layout.parallel
    shards = parallel.shard_size if layout.is_fsdp else 1
    shard_rank = (rank // parallel.tp) % shards  # ranks in mesh order (replicate, shard, tp)
    expert_shards = max(1, shards * parallel.tp // parallel.ep) if parallel.ep > 1 else shards
    expert_rank = (rank // parallel.ep) % expert_shards if parallel.ep > 1 else shard_rank

    def sharding(param: Param) -> tuple[int, int]:
        return (expert_shards, expert_rank) if is_routed_expert_parameter(param.name) else (shards, shard_rank)

    def sizes(params: list[Param]) -> tuple[int, int]:  # (padded, unpadded) elements this rank holds of `params`
        numel = sum(p.numel for p in params)
        if shards == 1:
            return numel, numel
        if layout.fsdp_version == 2:
            padded = sum(p.padded_rows(sharding(p)[0]) * p.row_numel for p in params)
            return padded, sum(p.rows_on(sharding(p)[1], sharding(p)[0]) * p.row_numel for p in params)
        padded = -(-numel // shards)
        return padded, max(0, min(padded, numel - shard_rank * padded))

    params = grads = optim = count = 0
    for unit in units:
        params += FP32 * sizes(unit.params)[0]
        trained = [p for p in unit.params if not frozen(p)] if frozen and trainable else unit.params
        padded, local = sizes(trained)
        count += len(trained)
        if trainable:
            grads += FP32 * padded
            optim += 2 * FP32 * local
    if trainable:
        optim += FP32 * count
    return {"parameters": params, "gradients": grads, "optimizer_state": optim}


def adapter_state_bytes_on_rank(
    info: ModelInfo, units: list[Unit], layout: LaunchLayout, adapters: Adapters, rank: int = 0
) -> dict[str, int]:
    """`state_bytes_on_rank` for LoRA: every base parameter at `frozen_bytes`, padded as FSDP2 pads it, with no
    gradient or optimizer state; every adapter matrix is a parameter of its own, sharded along dim 0 like any other
    (padded fp32 storage for it and its gradient, unpadded AdamW state, a 4-byte step)."""
    frozen = state_bytes_on_rank(units, layout, rank, trainable=False)["parameters"] * adapters.frozen_bytes // FP32
    adapter_unit = Unit("adapters", "layer", adapters.adapter_params(info))
    trained = state_bytes_on_rank([adapter_unit], layout, rank)
    return {
        "parameters": frozen + trained["parameters"],
        "gradients": trained["gradients"],
        "optimizer_state": trained["optimizer_state"],
    }


def activation_bytes(
    info: ModelInfo, workload: Workload, compute_bytes: int, tp: int = 1, sp: int = 1
) -> dict[str, int]:
    """Activations of one micro-batch kept for backward (bytes), decoder-only transformer (Llama-style: RMSNorm, GQA,
    gated MLP, no dropout). Per layer and token: c*(2h + 3q + 2kv + 4i) + 4*2h + 4*heads (+ c*heads*s + 4*heads*s for eager;
    kv = q for sdpa and eager, which get keys and values repeated to every head). Under tensor parallelism `tp` the
    heads and the MLP width are split (q, kv, i, heads / tp), the hidden states (2h) are not (no sequence
    parallelism), and the chunked loss gathers the output layer's weight whole (c * vocab * h). A mixture of experts:
    i is the width a token runs through (`ModelInfo.mlp_width_per_token`: top-k experts plus shared ones), and each
    token also keeps its k routed copies in and out of the experts (c * 2kh) and the router's logits (4 bytes x
    experts, kept for the load-balancing loss). With expert parallelism a rank's experts process, on average, as many
    tokens as it sends: balanced routing is assumed, and a skewed router can exceed the estimate. Under sequence
    parallelism `sp` a rank holds 1/sp of every row's tokens (the row padded to a multiple of sp), and its attention
    the whole row for heads / sp: the same bytes, plus the all-to-all's copies of queries, keys, values and output;
    its sdpa runs each example causal with no mask, so keys and values keep their KV heads."""
    c, h, i = compute_bytes, info.hidden_size, info.mlp_width_per_token
    kv = info.num_kv_heads * info.head_dim
    q = info.num_heads * info.head_dim
    s, tokens = workload.row_length, workload.micro_batch_rows * -(-workload.row_length // sp)
    if workload.attn_implementation in ("sdpa", "eager") and sp == 1:
        # Packed and padded rows carry a mask, and with a mask transformers repeats keys and values to every query
        # head before sdpa on CUDA (its use_gqa_in_sdpa), as eager always does: they are saved at that size
        kv = q
    per_token_layer = c * (2 * h + (3 * q + 2 * kv + 4 * i) // tp) + FP32 * 2 * h + FP32 * info.num_heads // tp
    if sp > 1:  # the all-to-all's outputs kept for backward: queries, keys, values by heads, output by position
        per_token_layer += c * (2 * q + 2 * kv)
    if info.routing is not None:
        per_token_layer += c * 2 * info.routing.experts_per_token * h + FP32 * info.routing.num_experts
    if workload.attn_implementation == "eager":
        per_token_layer += (c + FP32) * info.num_heads * s // tp  # softmax in fp32 and its cast, a*s per token
    layer = per_token_layer * tokens
    # final norm (fp32 input + output), rotary cos/sin shared by all layers, ids/positions/targets (int64)
    other = (FP32 * h + c * h + 2 * c * info.head_dim + 3 * 8) * tokens
    if workload.loss_implementation == "full_logits":
        # fp32 logits, cross-entropy's fp32 log-probabilities and, in backward, their gradient (measured: 5.81 GiB
        # against 5.87 predicted, benchmarks/chunked_loss_memory.py)
        logits = 3 * FP32 * info.vocab_size * tokens
    else:  # one chunk's fp32 logits (one reused buffer; a distillation loss holds several), plus the hidden states of
        # the tokens that carry loss
        chunk = FP32 * info.vocab_size * min(workload.loss_chunk_size, tokens)
        logits = workload.loss_chunk_buffers * chunk + c * h * tokens
        if tp > 1:  # the vocabulary-sharded output layer's weight, gathered for the loss
            logits += c * info.vocab_size * h
    checkpoint = c * h * tokens  # each layer's input, kept when its activations are recomputed
    without = info.num_layers * layer + other + logits
    with_ac = info.num_layers * checkpoint + max(layer, other + logits)
    return {"per_layer": layer, "logits": logits, "without_checkpointing": without, "with_checkpointing": with_ac}


def generation_bytes(info: ModelInfo, workload: Workload, compute_bytes: int, tp: int = 1) -> int:
    """A generation pass's peak (online RL; 0 otherwise): the KV cache of its sequences (keys and values of every
    layer at the compute dtype), one decoding step's fp32 logits, and, when it keeps the weights gathered, the whole
    model at the compute dtype. It comes between training micro-steps, so it competes with activations, not with them."""
    if not workload.generation_sequences:
        return 0
    kv = info.num_kv_heads * info.head_dim
    cache = 2 * info.num_layers * kv * compute_bytes * workload.generation_sequences * workload.generation_tokens // tp
    logits = FP32 * info.vocab_size * workload.generation_sequences
    weights = compute_bytes * info.num_params // tp if workload.generation_gathers_weights else 0
    return cache + logits + weights


def buffer_bytes(
    info: ModelInfo, units: list[Unit], layout: LaunchLayout, *, trainable_fraction: float = 1.0
) -> dict[str, int]:
    """Unsharded copies: all-gathered parameters in the compute dtype and unsharded gradients before reduce-scatter
    (FSDP); gradient buckets and autocast weight copies (DDP / single process)."""
    c, parallel = layout.compute_bytes, layout.parallel
    if not layout.is_fsdp or (parallel.shard_size == 1 and parallel.world_size > 1):  # DDP, one process, NO_SHARD
        total = sum(u.numel for u in units) if units else info.num_params
        matrices = sum(p.numel for p in info.params if len(p.shape) >= 2 and not p.name.endswith("embed_tokens.weight"))
        # autocast keeps a compute-dtype copy of each trainable fp32 matrix; a frozen LoRA base is loaded in that dtype
        autocast = c * matrices if layout.mixed_precision != "no" and trainable_fraction > 0 else 0
        buckets = FP32 * total * trainable_fraction if layout.distributed_type == "MULTI_GPU" else 0
        return {"all_gather": int(autocast), "reduce_scatter": int(buckets), "held": 0, "in_flight": int(autocast)}
    held = sum(gathered_bytes(u, layout) for u in units if not u.reshard_after_forward)
    moving = [gathered_bytes(u, layout) for u in units if u.reshard_after_forward]
    if layout.prefetch and len(moving) > 1:
        in_flight = max(a + b for a, b in zip(moving, moving[1:]))
    else:
        in_flight = max(moving, default=0)
    largest = max((u.numel for u in units), default=0)
    return {
        "all_gather": held + in_flight,
        "reduce_scatter": int(c * largest * trainable_fraction),  # gradients stay in the compute dtype
        "held": held,
        "in_flight": in_flight,
    }


def gathered_bytes(unit: Unit, layout: LaunchLayout) -> int:
    """A unit's all-gathered parameters: in the compute dtype, except under float8 training (mixed_precision fp8,
    torchao) where FSDP2 gathers a decoder layer's linear weights in float8, 1 byte each. Not converted: norms,
    routed experts' stacked weights, the embeddings, the output layer, and matrices with a size that is not a
    multiple of 16 (a router over 60 experts). (The model's very first linear layer is not converted either: one
    matrix, left out of this count.)"""
    c = layout.compute_bytes
    if layout.mixed_precision != "fp8" or unit.kind != "layer":
        return c * unit.numel

    def converted(p) -> bool:
        return len(p.shape) == 2 and all(size % 16 == 0 for size in p.shape)

    return sum((FP8 if converted(p) else c) * p.numel for p in unit.params)


@dataclass
class Estimate:
    model: str
    layout: LaunchLayout
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
    generation: int = 0  # online RL's generation pass (generation_bytes): instead of activations, not with them
    vision: vision.TowerLoad | None = None  # a vision-language model's pictures and tower (in the activations)

    @property
    def activations_used(self) -> int:
        key = "with_checkpointing" if self.layout.activation_checkpointing else "without_checkpointing"
        return self.activations[key]

    @property
    def device_state(self) -> int:
        return 0 if self.layout.cpu_offload else sum(self.state.values())

    @property
    def optimizer_step(self) -> int:
        """While AdamW steps (torch's foreach implementation, its default on GPUs) it holds one more fp32 copy of
        the rank's trainable shard (the square root of exp_avg_sq), after backward has freed the activations. With
        activation checkpointing this is the peak: measured on an H200, 21.2 GiB for a 1.1B model against 18.2 GiB
        predicted without it (docs/gpu.md). Offloaded, the step runs on the host."""
        return 0 if self.layout.cpu_offload else self.state["optimizer_state"] // 2

    @property
    def total(self) -> int:
        training = self.activations_used + self.buffers["all_gather"] + self.buffers["reduce_scatter"]
        return self.device_state + max(training, self.generation, self.optimizer_step)

    @property
    def usable(self) -> int:
        return self.gpu_memory - self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def per_gpu(self) -> dict[str, int]:
        on_device = not self.layout.cpu_offload
        return {
            "parameters": self.state["parameters"] if on_device else 0,
            "gradients": self.state["gradients"] if on_device else 0,
            "optimizer_state": self.state["optimizer_state"] if on_device else 0,
            "reference_model": self.state.get("reference_model", 0) if on_device else 0,
            **(
                {"teacher_model": self.state["teacher_model"] if on_device else 0}
                if "teacher_model" in self.state
                else {}
            ),
            "activations": self.activations_used,
            "activations_without_checkpointing": self.activations["without_checkpointing"],
            "activations_with_checkpointing": self.activations["with_checkpointing"],
            "logits": self.activations["logits"],
            **({"vision_tower": self.vision.kept(self.layout.activation_checkpointing)} if self.vision else {}),
            "all_gather_buffers": self.buffers["all_gather"],
            "reduce_scatter_buffers": self.buffers["reduce_scatter"],
            **({"generation": self.generation} if self.generation else {}),
            "optimizer_step": self.optimizer_step,
            "total": self.total,
        }


def resolved_attention(workload: Workload, layout: LaunchLayout) -> Workload:
    """The attention a GPU run takes for `auto` (models/attention.py): flex for packed rows unless the launch splits
    the model by tensor parallelism or the recipe generates as it trains, else sdpa."""
    if workload.attn_implementation != "auto":
        return workload
    flex = workload.packs_examples and layout.parallel.tp == 1 and workload.generation_sequences == 0
    return replace(workload, attn_implementation="flex_attention" if flex else "sdpa")


def estimate(
    info: ModelInfo,
    layout: LaunchLayout,
    workload: Workload,
    *,
    gpu_memory: int = 80 * 10**9,
    reserve: int | None = None,
    model_name: str = "",
    adapters: Adapters | None = None,
    frozen_copies: int = 0,
    frozen_models: list[ModelInfo] = (),
    images_per_row: int = 1,
    freeze: tuple[bool, bool] = (False, False),
) -> Estimate:
    """`frozen_copies`: whole frozen copies of the model sharded like it, at the compute dtype (preference tuning's
    reference model). `frozen_models`: other models kept frozen beside it (a distillation teacher), each sharded like
    it at the compute dtype, with its output layer also whole on every rank (distillation needs it during the
    student's step). A vision-language model: `images_per_row` pictures in each row, and `freeze` (its vision tower,
    its projector) kept as they are (estimator.vision)."""
    workload = resolved_attention(workload, layout)
    units = plan_units(info, layout)
    compute = layout.compute_bytes
    load, frozen = vision.image_side(
        info.vision, workload, compute, lora=adapters is not None, freeze=freeze, per_row=images_per_row
    )
    if adapters is None:
        state = state_bytes_on_rank(units, layout, 0, frozen=frozen)
        buffers = buffer_bytes(info, units, layout)
        trainable = None
    else:
        state = adapter_state_bytes_on_rank(info, units, layout, adapters, 0)
        trainable = sum(p.numel for p in adapters.adapter_params(info))
        buffers = buffer_bytes(info, units, layout, trainable_fraction=0.0)
        buffers["reduce_scatter"] = FP32 * trainable
    if frozen_copies:
        copy = state_bytes_on_rank(units, layout, 0, trainable=False)["parameters"] * compute // FP32
        state["reference_model"] = frozen_copies * copy  # its gathered units are in flight when the policy's are not
    if frozen_models:
        state["teacher_model"] = sum(frozen_model_bytes(other, layout) for other in frozen_models)
    activations = activation_bytes(info, workload, compute, tp=layout.parallel.tp, sp=layout.parallel.sp)
    activations = vision.with_tower(activations, load)
    host = dict(state) if layout.cpu_offload else {}
    reserve = gpu_memory // 10 if reserve is None else reserve
    return Estimate(
        model_name,
        layout,
        workload,
        info.num_params,
        units,
        state,
        activations,
        buffers,
        gpu_memory,
        reserve,
        trainable,
        host,
        adapters,
        frozen_copies,
        generation_bytes(info, workload, compute, tp=layout.parallel.tp),
        load,
    )


def frozen_model_bytes(info: ModelInfo, layout: LaunchLayout) -> int:
    """A frozen model sharded like the trained one at the compute dtype, plus its output layer whole (vocabulary x
    hidden size: `methods.distill.distillation` gathers it once and keeps it)."""
    sharded = state_bytes_on_rank(plan_units(info, layout), layout, 0, trainable=False)["parameters"]
    return sharded * layout.compute_bytes // FP32 + info.vocab_size * info.hidden_size * layout.compute_bytes


def estimate_for_recipe(
    info: ModelInfo,
    layout: LaunchLayout,
    recipe: TrainingConfig,
    *,
    gpu_memory: int = 80 * 10**9,
    reserve: int | None = None,
    model_name: str = "",
    frozen_model_info: Callable[[str], ModelInfo] | None = None,
    images_per_row: int | None = None,
) -> Estimate:
    """The estimate for a recipe config on a launch: its micro-batch, its adapters, its frozen model copies and other
    frozen models (`recipe.frozen_models()`, their shapes read by `frozen_model_info`, default `load_model_info`), the
    vision tower or projector it freezes, and the activation checkpointing it adds to the launch, all asked of the
    config; `images_per_row`: pictures per row, for a vision-language model (default: 1, none in packed rows, taken
    as text: the data is not read here)."""
    frozen_model_info = frozen_model_info or load_model_info
    layout = layout_for_recipe(layout, recipe)
    return estimate(
        info,
        layout,
        workload_for(recipe),
        gpu_memory=gpu_memory,
        reserve=reserve,
        model_name=model_name,
        adapters=adapters_for(recipe, layout.compute_bytes),
        frozen_copies=recipe.frozen_model_copies(),
        frozen_models=[frozen_model_info(name) for name in recipe.frozen_models()],
        images_per_row=(0 if recipe.packs_examples() else 1) if images_per_row is None else images_per_row,
        freeze=(bool(recipe.freeze_vision_tower), bool(recipe.freeze_multi_modal_projector)),
    )
