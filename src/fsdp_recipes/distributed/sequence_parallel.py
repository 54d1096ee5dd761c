"""Sequence parallelism (Ulysses: DeepSpeed-Ulysses' all-to-all scheme) with FSDP2, for rows too long for one device.

The size is accelerate's own key, `parallelism_config_sp_size`, in the Accelerate YAML (the launcher exports it as
PARALLELISM_CONFIG_SP_SIZE). Accelerate 1.15 runs it only with DeepSpeed, so its parallelism config is kept away from
the `Accelerator` and this module attaches the mesh itself (`attach`): (dp_replicate, dp_shard, cp) in rank order,
FSDP2 sharding over dp_shard x sp ("dp_shard_cp", as accelerate names it for context parallelism) and, because the
dimension is named "cp", accelerate's dataloader gives the ranks of a sequence-parallel group the same batch, as it
does a TP group's.

What a group of `sp` ranks does with its batch:
- every value outside the model's forward is the whole batch's, the same on each rank of the group (counts, losses,
  log-probabilities, metrics): the group shares its batch as a TP group does (`ParallelDims.batch_sharing_size`);
- inside a forward run through `SequenceShards.per_token` (the token losses, distillation's, GRPO's packed policy
  passes), each rank runs its slice of every row (the row padded to a multiple of `sp`, position ids kept, so rotary
  embeddings and packed examples stay right); around attention an all-to-all turns the sequence slices into head
  slices over the whole row and back (`_ulysses_sdpa`: sdpa over each example of the row in turn, causal with no mask
  tensor, so no width x width mask is built however long the row); the per-token results are gathered back to the
  whole row, whose backward hands each rank the gradient of its own slice (times `sp`: FSDP averages gradients over
  dp x sp ranks, while each group's loss is counted once);
- forwards outside it (generation, a sequence-classification head) see whole rows on every rank of the group, with
  plain sdpa.

Activation memory per rank so falls by `sp`: attention holds whole rows, but heads / sp of them. Composes with FSDP2
and HSDP; refused with tensor or expert parallelism, context parallelism, an attention implementation other than
sdpa, heads or KV heads that `sp` does not divide, and a mixture of experts' router loss (its counts are per slice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from fsdp_recipes.distributed.parallel_dims import ParallelDims

SHARDS_KEYWORD = "sequence_parallel_shards"  # the model call's keyword that reaches the attention
MESH_DIMENSION = "cp"  # accelerate's dataloader gives the ranks of a "cp" dimension the same batch
SUPPORTED_RECIPES = ("sft", "pretrain", "dpo", "kto", "distill", "grpo", "reward", "classify")  # split forwards
KEY = "parallelism_config.parallelism_config_sp_size"
DOCS = "docs/parallelism.md#sequence-parallelism"


def layout_problems(parallel: ParallelDims, environ: Mapping[str, str]) -> dict[str, str]:
    """{Accelerate config key: why} for a launch asking for sequence parallelism in a way this route cannot run."""
    sp = parallel.sp
    if sp <= 1:
        return {}
    fix = "set parallelism_config_sp_size: 1"
    if parallel.tp > 1 or parallel.ep > 1:
        return {KEY: f"sequence parallelism (sp {sp}) does not compose with tensor or expert parallelism yet: {fix}, "
                f"or parallelism_config_tp_size and parallelism_config_ep_size: 1 ({DOCS})"}  # fmt: skip
    if parallel.cp > 1:
        return {KEY: f"sequence parallelism and context parallelism are two ways to split a row: choose one ({fix})"}
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or environ.get("FSDP_VERSION", "1") != "2":
        return {KEY: f"sequence parallelism (sp {sp}) runs with FSDP2 (distributed_type: FSDP, fsdp_version: 2): "
                f"use an FSDP2 config, or {fix}"}  # fmt: skip
    return {}


def model_problems(sp: int, model_config, *, attn_implementation: str | None, recipe: str) -> list[str]:
    """Why this model or recipe cannot run under `sp`, each with its fix (empty for sp 1)."""
    if sp <= 1:
        return []
    fix = "or set parallelism_config_sp_size: 1"
    problems = []
    if recipe not in SUPPORTED_RECIPES:
        problems.append(
            f"sequence parallelism runs the recipes whose forwards give per-token values "
            f"({', '.join(SUPPORTED_RECIPES)}); {recipe} is not one of them yet: run it without ({fix[3:]})"
        )
    if getattr(model_config, "vision_config", None) is not None:
        problems.append(
            "sequence parallelism with a vision-language model is not built: each rank would hold a slice of a row "
            f"while the model places every picture's features by its tokens in the whole row; run it without ({fix[3:]})"
        )
    config = getattr(model_config, "text_config", None) or model_config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count and count % sp:
            problems.append(
                f"sp {sp} does not divide the model's {name} ({count}): the all-to-all gives each rank heads / sp "
                f"heads; choose an sp that divides {count}, {fix}"
            )
    if attn_implementation not in (None, "sdpa"):
        problems.append(
            f"sequence parallelism wraps sdpa attention, not {attn_implementation}: set attn_implementation: sdpa, {fix}"
        )
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        problems.append(
            f"a mixture of experts' router loss counts its experts' tokens per rank, and under sp {sp} each rank holds "
            f"a slice of the row: set router_aux_loss_coef: 0, {fix}"
        )
    return problems


# ------------------------------------------------------------------------------------------------------ the run's shards
class SequenceShards:
    """The sequence-parallel group of this rank: splits rows by position and gathers per-token values back."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def per_token(
        self,
        forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
        inputs: dict[str, torch.Tensor],
        targets: torch.Tensor,
        ignore_index: int,
    ) -> torch.Tensor:
        """`forward(local_inputs, local_targets)` -> per-token values [rows, local width] on this rank's slice of
        every row; returns them for the whole rows [rows, width], on every rank of the group."""
        width = inputs["input_ids"].shape[1]
        padded = -(-width // self.size) * self.size
        local = padded // self.size
        start = self.rank * local
        pad = padded - width
        input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
        if pad:  # a document of its own at the end (positions restart), with no targets
            rows = input_ids.shape[0]
            input_ids = torch.cat([input_ids, input_ids.new_zeros(rows, pad)], dim=1)
            tail = torch.arange(pad, device=position_ids.device).expand(rows, pad)
            position_ids = torch.cat([position_ids, tail.to(position_ids.dtype)], dim=1)
            targets = torch.cat([targets, targets.new_full((rows, pad), ignore_index)], dim=1)
        examples = _examples(position_ids)
        local_inputs = {
            **inputs,
            "input_ids": input_ids[:, start : start + local],
            "position_ids": position_ids[:, start : start + local],
            # down to the attention as a keyword of the layers' call, so that activation checkpointing's recompute,
            # in the backward, splits its attention again (the context below is gone by then)
            SHARDS_KEYWORD: (self, examples),
        }
        with _sharded(self, examples):  # for forwards that build their own inputs (the distillation teacher's)
            values = forward(local_inputs, targets[:, start : start + local])
        return _GatherSequence.apply(values, self)[:, :width]


_SHARDED: tuple[SequenceShards, list] | None = None  # inside `per_token` only: the group, and each row's examples


@contextlib.contextmanager
def _sharded(shards: SequenceShards, examples: list[list[tuple[int, int]]]):
    global _SHARDED
    saved, _SHARDED = _SHARDED, (shards, examples)
    try:
        yield
    finally:
        _SHARDED = saved


def attach(accelerator, parallel: ParallelDims):
    """Collective: the (dp_replicate, dp_shard, cp) mesh where accelerate's FSDP2 preparation and dataloader look for
    it, and the attention wrapper; returns (the mesh, this process's `SequenceShards`) for `ParallelDims.with_meshes`.
    sp 1: nothing, (None, None)."""
    if parallel.sp <= 1:
        return None, None
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        accelerator.device.type,
        (parallel.dp_replicate, parallel.dp_shard, parallel.sp),
        mesh_dim_names=("dp_replicate", "dp_shard", MESH_DIMENSION),
    )
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", MESH_DIMENSION)]._flatten("dp_shard_cp")
    # FSDP shards over dp_shard x sp; the config's sizes say so (accelerate reads only which FSDP dimensions exist)
    parallelism = ParallelismConfig(dp_replicate_size=parallel.dp_replicate, dp_shard_size=parallel.shard_size)
    accelerator.state.parallelism_config = parallelism
    accelerator.state.device_mesh = mesh
    if accelerator.torch_device_mesh is not mesh or accelerator.parallelism_config is not parallelism:
        raise RuntimeError("the sequence-parallel mesh could not be attached (written for accelerate 1.15)")
    sp_mesh = mesh[MESH_DIMENSION]
    _install_attention()
    return mesh, SequenceShards(sp_mesh.get_group(), parallel.sp, sp_mesh.get_local_rank())


def describe(parallel: ParallelDims) -> dict | None:
    """The run summary's `sequence_parallel` (None without)."""
    sp = parallel.sp
    if sp == 1:
        return None
    return {
        "size": sp,
        "data_parallel_size": parallel.data_parallel_size,
        "how": f"each row split over {sp} ranks by position (padded to a multiple of {sp}); an all-to-all around "
        f"attention gives each rank whole rows for heads / {sp}; sdpa runs each example causal; per-token losses "
        "gathered back (Ulysses)",
    }


# ------------------------------------------------------------------------------------------------ the communication
def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """[sp, ...] chunk i to rank i; returns [sp, ...] chunk i from rank i."""
    chunks = chunks.contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """The exchange of `_all_to_all`, whose gradient is the same exchange back (equal chunks both ways)."""

    @staticmethod
    def forward(ctx, chunks, group):
        ctx.group = group
        return _all_to_all(chunks, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _sequence_to_heads(states: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[rows, heads, local width, dim] (this rank's tokens, every head) -> [rows, heads / sp, width, dim]."""
    rows, heads, local, dim = states.shape
    sp = shards.size
    chunks = states.reshape(rows, sp, heads // sp, local, dim).transpose(0, 1)  # chunk j: head group j
    received = _AllToAll.apply(chunks, shards.group)  # chunk i: rank i's tokens of my head group
    return received.permute(1, 2, 0, 3, 4).reshape(rows, heads // sp, sp * local, dim)


def _heads_to_sequence(states: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """[rows, heads / sp, width, dim] -> [rows, heads, local width, dim]: the inverse of `_sequence_to_heads`."""
    rows, group_heads, width, dim = states.shape
    sp = shards.size
    chunks = states.reshape(rows, group_heads, sp, width // sp, dim).permute(2, 0, 1, 3, 4)  # chunk i: rank i's tokens
    received = _AllToAll.apply(chunks, shards.group)  # chunk j: head group j of my tokens
    return received.transpose(0, 1).reshape(rows, sp * group_heads, width // sp, dim)


class _GatherSequence(torch.autograd.Function):
    """[rows, local width] per rank -> [rows, width] on every rank of the group. Every rank then computes the same
    loss from the whole rows, so each rank's gradient for its own slice is that loss's, taken once per rank: `sp`
    times it, because FSDP averages gradients over dp x sp ranks while the group's loss counts once."""

    @staticmethod
    def forward(ctx, values, shards):
        ctx.shards = shards
        gathered = [torch.empty_like(values) for _ in range(shards.size)]
        dist.all_gather(gathered, values.contiguous(), group=shards.group)
        return torch.cat(gathered, dim=1)

    @staticmethod
    def backward(ctx, grad):
        shards = ctx.shards
        local = grad.shape[1] // shards.size
        return grad[:, shards.rank * local : (shards.rank + 1) * local] * shards.size, None


# ----------------------------------------------------------------------------------------------------- the attention
_PLAIN_SDPA = None


def _install_attention() -> None:
    """sdpa, wrapped: inside `SequenceShards.per_token` the all-to-all attention over whole rows, elsewhere plain."""
    global _PLAIN_SDPA
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _PLAIN_SDPA is None:
        _PLAIN_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
        # outside compiled regions (torch_compile: a graph break at attention): the exchange and the loop over a row's
        # examples would be traced into a new graph per batch
        AttentionInterface.register("sdpa", torch.compiler.disable(_ulysses_sdpa))


def _ulysses_sdpa(module, query, key, value, attention_mask, **kwargs):
    sharded = kwargs.pop(SHARDS_KEYWORD, None) or _SHARDED
    if sharded is None:
        return _PLAIN_SDPA(module, query, key, value, attention_mask, **kwargs)
    shards, rows = sharded
    query, key, value = (_sequence_to_heads(states, shards) for states in (query, key, value))
    # each example in turn, joined by concatenation (slice assignments would each copy the whole gradient back)
    output = torch.cat(
        [
            torch.cat(
                [
                    _causal_attention(module, *(x[row : row + 1, :, start:end] for x in (query, key, value)), **kwargs)
                    for start, end in examples
                ],
                dim=2,
            )
            for row, examples in enumerate(rows)
        ]
    )
    return _heads_to_sequence(output, shards).transpose(1, 2).contiguous(), None


def _examples(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each example: a new one starts where the positions do not continue, as
    transformers finds packed examples (padding restarts its positions too, so it is an example of its own)."""
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    width = position_ids.shape[1]
    rows = []
    for row in restarts.cpu().tolist():
        starts = [0] + [index + 1 for index, restart in enumerate(row) if restart]
        rows.append(list(zip(starts, starts[1:] + [width])))
    return rows


def _causal_attention(module, query, key, value, *, scaling=None, dropout=0.0, sliding_window=None, **_):
    """One example's causal attention, with no mask tensor (a row's examples are attended one by one, so no
    width x width mask is ever built); a sliding window longer than the example changes nothing, a shorter one is a
    band mask of the example's length."""
    length = query.shape[2]
    mask = None
    if sliding_window and length > sliding_window:
        index = torch.arange(length, device=query.device)
        mask = (index[None, :] <= index[:, None]) & (index[:, None] - index[None, :] < sliding_window)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip
