"""Token losses, in one place for every recipe: the summed cross-entropy of a causal LM over its targets, and the
factor that turns a rank's sum into its share of the global mean.

Recipes sum per-token losses over a micro-batch and scale by `global_mean_scale`, so the gradient is that of the mean
over every target token of the global batch, whatever its split into ranks and micro-batches. Under sequence
parallelism the forwards here run on this rank's slice of every row: they are given the run's group
(`run.parallel.sequence_shards`; None without sequence parallelism).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.images import VISION_INPUTS
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.distributed import tensor_parallel
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.distributed.sequence_parallel import SequenceShards
from fsdp_recipes.models.vision import vision_positions


def count_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's target tokens, on its device (reading the count would make the step wait for the device)."""
    return (batch["targets"] != IGNORE_INDEX).sum()


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of per-token cross-entropy over the batch's targets (targets are flattened in row order, as the logits)."""
    logits = model(**model_inputs(model, batch)).logits
    return F.cross_entropy(
        logits.flatten(0, 1).float(), batch["targets"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def model_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward's inputs for a batch of rows. No attention mask and no cache: transformers then finds the packed
    examples from position_ids (where they restart). Flash-attention's varlen path does so only for a batch of one
    row, so for flash the rows are laid end to end in one row (padding restarts its positions too, so it stays a
    sequence of its own); sdpa, eager and flex isolate examples in every row."""
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    vision = {key: batch[key] for key in VISION_INPUTS if key in batch}  # rows with pictures (data.images)
    if vision:  # Qwen-VL's positions are 3-D, over the pictures' patches
        position_ids = vision_positions(getattr(model, "module", model), batch)
    config = getattr(model, "module", model).config  # DDP (NO_SHARD) wraps the model; FSDP2 does not
    if str(getattr(config, "_attn_implementation", "")).startswith("flash"):
        input_ids, position_ids = input_ids.reshape(1, -1), position_ids.flatten(-2).unsqueeze(-2)
        vision = {
            key: value.reshape(1, -1) if key.endswith("token_type_ids") else value for key, value in vision.items()
        }
    return {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False, **vision}


def sequence_classification_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sequence_shards: SequenceShards | None = None,
) -> torch.Tensor:
    """A sequence classifier's logits [rows, labels], fp32, for right-padded rows. Under sequence parallelism
    (`sequence_shards`, the run's group) each rank runs its slice of every row: the head's per-token scores come back
    whole and each row's is taken where transformers' own pooling takes it (the rightmost token that is not the pad
    token); with positions 0..width-1 and no mask every real token sees what it sees in the padded pass (causal: never
    the padding after it)."""
    if sequence_shards is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    head = next(module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in ("score", "classifier"))

    def forward(local_inputs: dict[str, torch.Tensor], _targets: torch.Tensor) -> torch.Tensor:
        captured = []
        handle = head.register_forward_hook(lambda _module, _args, output: captured.append(output))
        try:
            model(**local_inputs)  # its own pooling, on a slice, is not used
        finally:
            handle.remove()
        return captured[-1].float()  # [rows, local width, labels]

    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    inputs = {"input_ids": input_ids, "position_ids": positions, "use_cache": False}
    per_token = sequence_shards.per_token(forward, inputs, torch.zeros_like(input_ids), IGNORE_INDEX)
    pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (
        torch.full_like(attention_mask[:, 0], input_ids.shape[1] - 1)
        if pad_token_id is None
        else (index * (input_ids != pad_token_id)).argmax(dim=-1)
    )
    return per_token[torch.arange(input_ids.shape[0], device=last.device), last]


def global_mean_scale(parallel: ParallelDims, global_total: torch.Tensor) -> torch.Tensor:
    """Factor turning a rank's summed loss into its share of the global mean: FSDP/DDP average gradients over
    ranks, so each rank scales by the data-parallel size (`parallel.data_parallel_size`, the run's) / (what the mean
    divides by in the whole optimizer step, all ranks and micro-batches: targets, pairs, examples, or a sum of class
    weights, which may be under 1). The result is the same gradient whatever the split of the global batch into ranks
    and micro-batches. A step with nothing to average (all prompt, every class weighted 0) has a zero loss sum: its
    scale is 0. `global_total` is a tensor on the device (`Run.sum_over_ranks`) and so is the scale, in float32: no
    step waits for the count to reach the host."""
    ranks = parallel.data_parallel_size  # the ranks of a TP or SP group share one batch
    total = torch.as_tensor(global_total, dtype=torch.float64)
    counted = total > 0
    return torch.where(counted, ranks / torch.where(counted, total, 1.0), 0.0).float()


# ---------------------------------------------------------------------------------------------- chunked cross-entropy
LOSS_IMPLEMENTATIONS = ("chunked", "full_logits", "liger", "linear_cross_entropy")

# Heads whose logits the model transforms after the output projection: their loss needs the whole logits. Any other
# transformation is caught at the first step (`TokenLoss._check_untouched`).
_LOGITS_TRANSFORMS = {
    "final_logit_softcapping": "soft-caps its logits",
    "logit_scale": "scales its logits",
    "logits_scaling": "scales its logits",
}


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token negative log-likelihood of `targets` under `hidden @ weight.T (+ bias)`, computed `chunk_size` tokens
    at a time in one reused fp32 buffer: one chunk's logits exist at once, in forward and in backward (which
    recomputes them), so the N x vocabulary logits of the whole micro-batch never do. Logits are upcast to fp32 per
    chunk, as the whole-logits path does; gradients come back in the inputs' dtypes. `targets` must be valid token
    ids (no IGNORE_INDEX: select the rows that carry loss first)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_normalisers = torch.empty_like(losses)
        buffer = hidden.new_empty((min(chunk_size, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(buffer, hidden[rows], weight, bias)
            target_logits = logits.gather(1, targets[rows, None]).squeeze(1)
            largest = logits.amax(dim=1, keepdim=True)
            log_normalisers[rows] = logits.sub_(largest).exp_().sum(dim=1).log_() + largest.squeeze(1)
            losses[rows] = log_normalisers[rows] - target_logits
        ctx.save_for_backward(hidden, weight, bias, targets, log_normalisers)
        ctx.chunk_size = chunk_size
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, targets, log_normalisers = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias) if bias is not None else None
        buffer = hidden.new_empty((min(ctx.chunk_size, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # d loss_i / d logits_ij = softmax_ij - [j == target_i], times the incoming gradient of loss_i
            grad_logits = _chunk_logits(buffer, hidden[rows], weight, bias).sub_(log_normalisers[rows, None]).exp_()
            grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), targets[rows]] -= 1.0
            grad_logits = grad_logits.mul_(grad_losses[rows, None]).to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.T, hidden[rows].to(weight.dtype))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None


def _chunk_logits(buffer: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The chunk's logits in fp32, written into the front of `buffer` (reused: no allocation per chunk)."""
    logits = buffer[: hidden.shape[0]]
    if weight.dtype == torch.float32 and hidden.dtype == torch.float32:
        torch.mm(hidden, weight.T, out=logits)
    else:  # bf16/fp16 compute, as the model's own output layer would do, then upcast
        logits.copy_(hidden @ weight.T)
    if bias is not None:
        logits.add_(bias)
    return logits


def chunked_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Per-token NLL shaped like `targets` ([..., T]), 0 where the target is IGNORE_INDEX. Only the tokens that carry
    loss go through the output projection: prompt, padding and each example's last token cost nothing."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    if keep.numel():
        kept = ChunkedCrossEntropy.apply(flat_hidden[keep], weight, bias, flat_targets[keep], chunk_size)
        return _scattered(kept, keep, targets)
    # No target here (all prompt or padding): the result must still depend on hidden states and weights, since every
    # rank runs backward (FSDP reduce-scatters gradients from all of them); one token, weighted by zero.
    first = ChunkedCrossEntropy.apply(flat_hidden[:1], weight, bias, torch.zeros_like(flat_targets[:1]), chunk_size)
    return torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device) + 0.0 * first.sum()


def _scattered(kept: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`kept` at the flat positions `keep` of a zero tensor shaped like `targets`. The result is no view of another
    tensor: it is what the output layer returns, and FSDP2 hangs its pre-backward hook on it, which an in-place op on
    a view would detach (torch warns of that for every view an FSDP2 module returns)."""
    losses = torch.zeros(targets.shape, dtype=torch.float32, device=kept.device)
    losses.view(-1).index_put_((keep,), kept)
    return losses


def torch_kernel_options(chunk_size: int):
    """Options for torch's chunked F.linear_cross_entropy (torch 2.13: LinearCrossEntropyOptions.batch_chunk_size),
    or None where this torch lacks the function or the chunking option (torch 2.11 and older)."""
    options_class = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options_class is None or not hasattr(F, "linear_cross_entropy"):
        return None
    try:
        return options_class(batch_chunk_size=chunk_size)
    except TypeError:  # an early version without this option
        return None


def torch_kernel_token_losses(hidden, weight, bias, targets, chunk_size: int) -> torch.Tensor:
    """As chunked_token_losses, with torch's own kernel: only the tokens that carry loss, `chunk_size` at a time.
    Its losses come out in the inputs' dtype (bf16 under bf16 compute), upcast here."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    if not keep.numel():  # every rank runs backward: one token, weighted by zero (as chunked_token_losses)
        keep, weight_of_kept = torch.zeros(1, dtype=torch.long, device=hidden.device), 0.0
    else:
        weight_of_kept = 1.0
    kept = F.linear_cross_entropy(
        flat_hidden[keep],
        weight,
        flat_targets[keep].clamp(min=0),
        linear_bias=bias,
        reduction="none",
        options=torch_kernel_options(chunk_size),
    ).float()
    return _scattered(kept * weight_of_kept, keep, targets)


class TokenLoss:
    """The token loss of a causal LM, chosen once per run (`loss_implementation`):

    - "chunked" (default): cross-entropy from the final hidden states in chunks (`ChunkedCrossEntropy`), computed
      inside the model's own forward by its output layer, so FSDP2 has that layer's weight gathered as usual and
      parameter names do not change; outside the loss (generation, plain forwards) the layer behaves as before;
    - "full_logits": the model's logits for the whole micro-batch, then fp32 cross-entropy (what most trainers do);
    - "liger": liger-kernel's fused linear cross-entropy (GPUs, `pip install liger-kernel`) in the same place;
    - "linear_cross_entropy": torch's own F.linear_cross_entropy with its chunking options (torch >= 2.13), in the
      same place; its losses come in the compute dtype (docs/chunked-loss.md: why "chunked" stays the default).

    Build it on the unprepared model, before `accelerator.prepare`. Models that transform their logits after the
    output layer (soft-capping, scaling) fall back to whole logits; `description` says what runs, for the run summary.
    `sequence_shards`: the run's sequence-parallel group (`run.parallel.sequence_shards`), whose ranks each run their
    slice of every row; None (the default) runs whole rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        implementation: str = "chunked",
        *,
        chunk_size: int = 1024,
        sequence_shards: SequenceShards | None = None,
    ):
        if implementation not in LOSS_IMPLEMENTATIONS:
            raise ValueError(f"loss_implementation {implementation!r} is not one of {LOSS_IMPLEMENTATIONS}")
        self.head = model.get_output_embeddings()
        self.model_type = type(model).__name__
        self.chunk_size = chunk_size
        self.sequence_shards = sequence_shards
        self._targets = self._returned = None
        self.router_logits = None  # a mixture of experts with output_router_logits: the last forward's, per layer
        reason = _logits_transform(model.config) if implementation != "full_logits" else None
        self.implementation = "full_logits" if reason else implementation
        if reason:
            self.description = f"whole logits ({type(model).__name__} {reason}, so its loss needs them)"
        elif implementation == "chunked":
            self.description = f"chunked cross-entropy, {chunk_size} tokens per chunk"
        elif implementation == "liger":
            self.description = "liger-kernel fused linear cross-entropy"
        elif implementation == "linear_cross_entropy":
            self.description = f"torch's F.linear_cross_entropy, {chunk_size} tokens per chunk"
        else:
            self.description = "whole logits"
        if self.implementation != "full_logits":
            original = self.head.forward
            self.head.forward = lambda hidden: self._head_forward(original, hidden)

    def token_losses(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token NLL, shaped like the batch's targets (0 where there is no target), in fp32. Under sequence
        parallelism (`sequence_shards`) each rank runs its slice of every row and the losses come back whole on every
        rank of the group (distributed/sequence_parallel.py)."""
        inputs = model_inputs(model, batch)
        targets = batch["targets"].reshape(inputs["input_ids"].shape)
        shards = self.sequence_shards
        if shards is None:
            return self._losses_of(model, inputs, targets).reshape(batch["targets"].shape)
        forward = functools.partial(self._losses_of, model)
        return shards.per_token(forward, inputs, targets, IGNORE_INDEX).reshape(batch["targets"].shape)

    def _losses_of(self, model, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        if self.implementation == "full_logits":
            output = model(**inputs)
            logits, self.router_logits = output.logits, getattr(output, "router_logits", None)
            return F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            ).reshape(targets.shape)
        self._targets = targets
        try:
            output = model(**inputs)
            losses, self.router_logits = self._check_untouched(output.logits), getattr(output, "router_logits", None)
        finally:
            self._targets = None
        return losses.reshape(targets.shape)

    def router_logits_of(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward of `token_losses`, for its router logits (`train.router_balance`'s pass before the step)."""
        self.token_losses(model, batch)
        return self.router_logits

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of per-token cross-entropy over the batch's targets."""
        return self.token_losses(model, batch).sum()

    def _head_forward(self, original, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return original(hidden)
        if torch.compiler.is_compiling():
            # Kept out of torch.compile (torch_compile compiles the output layer as a region of its own): the loss
            # keeps only the tokens with a target, a count that changes every batch, so a traced loss would be a new
            # graph per batch. (A decorator would import dynamo, ~6 s, in every process, compiled or not.)
            return torch.compiler.disable(self._losses)(hidden)
        return self._losses(hidden)

    def _losses(self, hidden: torch.Tensor) -> torch.Tensor:
        # a vocabulary-sharded output layer (tensor parallelism) is gathered whole for the loss
        weight, bias = tensor_parallel.full_weight(self.head.weight), getattr(self.head, "bias", None)
        if self.implementation == "liger":
            return _liger_token_losses(hidden, weight, bias, self._targets)
        chunked = torch_kernel_token_losses if self.implementation == "linear_cross_entropy" else chunked_token_losses
        losses = chunked(hidden, weight, bias, self._targets, self.chunk_size)
        self._returned = losses
        return losses

    def _check_untouched(self, output: torch.Tensor) -> torch.Tensor:
        """The model must return what its output layer returned: anything done to it after the layer (soft-capping,
        scaling) would be done to per-token losses instead of logits. Met at the first forward, before any weight
        changes, on every rank alike: a user error with its fix, not a crash."""
        if self.implementation in ("chunked", "linear_cross_entropy") and output is not self._returned:
            raise ConfigError(
                f"{self.model_type} transforms the output of its output layer after the layer runs, so the "
                f"{self.implementation} loss, computed inside that layer, would be wrong for it: set "
                "loss_implementation: full_logits (and report the model type, so that it is recognised before loading)"
            )
        return output


def _logits_transform(config) -> str | None:
    for candidate in (config, getattr(config, "text_config", None)):
        for attribute, what in _LOGITS_TRANSFORMS.items():
            value = getattr(candidate, attribute, None)
            if value not in (None, 1, 1.0):
                return what
    return None


def _liger_token_losses(hidden, weight, bias, targets):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="none")
    flat = loss(weight, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), bias)
    return flat.float().reshape(targets.shape)


def loss_implementation_problem(implementation: str, device_type: str) -> str | None:
    """Why `implementation` cannot run on this device, or None."""
    if implementation not in LOSS_IMPLEMENTATIONS:
        return f"loss_implementation {implementation!r} is not one of {', '.join(LOSS_IMPLEMENTATIONS)}"
    if implementation == "liger":
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            return (
                "loss_implementation liger needs the liger-kernel package (pip install liger-kernel); or use "
                "chunked, which needs nothing"
            )
        if device_type != "cuda":
            return "loss_implementation liger runs on CUDA GPUs only; use chunked on this device"
    if implementation == "linear_cross_entropy" and torch_kernel_options(1) is None:
        return (
            f"loss_implementation linear_cross_entropy needs torch's F.linear_cross_entropy with chunking options "
            f"(torch 2.13 or newer); this torch {torch.__version__} lacks them: use chunked, which needs nothing"
        )
    return None


# ------------------------------------------------------------------------- preference (methods/preference/objectives.py)
def sequence_log_probs(token_losses: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its target tokens, from per-token NLL shaped [rows, width] (0 where a
    position has no target, as `TokenLoss.token_losses` returns it)."""
    return -token_losses.sum(dim=1)
