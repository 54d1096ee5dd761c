"""Padding-free policy passes (`padding_free`): the completions' log-probabilities computed on packed rows instead of
padded ones.

A round's padded rows are as wide as its longest prompt plus its longest completion, so a batch of uneven lengths
spends much of its compute on padding. Here each micro-batch's sequences (prompt + completion, no padding) are packed
first-fit-decreasing into rows of that same width, with position ids restarting at every sequence and no attention
mask, so transformers builds a block-diagonal causal mask (sdpa, eager, flex; flash-attention reads the restarts of
one row, so for it the rows are laid end to end) and no sequence attends to another: the same values as the padded
pass, from fewer rows. Rows keep the padded width so that attention, whose cost grows with the square of a row's
length under sdpa and eager, costs no more per row than padded. The output layer runs only on the positions that
predict completion tokens (a pre-hook on it selects them), as `logits_to_keep` does for the padded rows.
"""

from __future__ import annotations

import contextlib

import torch

from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.distributed.sequence_parallel import SequenceShards
from fsdp_recipes.methods.grpo.policy_gradient import token_log_probs


def packed_rows(part: dict[str, torch.Tensor], *, row_width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The packed layout of padded rollout rows (`rollouts.rollout_batch`: prompt left-padded, completion
    right-padded): `packed_input_ids` and `packed_position_ids` [packed rows, width], and for each completion token,
    the flat index of the packed position that predicts it (`packed_predicting`) and its own flat index in the padded
    completion layout [rows x completion width] (`packed_targets`)."""
    mask, input_ids = part["attention_mask"], part["input_ids"]
    completion_width = part["completion_ids"].shape[1]
    prompt_width = input_ids.shape[1] - completion_width
    spans = []
    for row in range(input_ids.shape[0]):
        real = mask[row].nonzero().flatten()
        start, end = int(real[0]), int(real[-1]) + 1
        spans.append((row, start, end))
    bins: list[list[tuple[int, int, int]]] = []
    fill: list[int] = []
    for span in sorted(spans, key=lambda s: (-(s[2] - s[1]), s[0])):  # first fit, longest first
        length = span[2] - span[1]
        place = next((b for b, used in enumerate(fill) if used + length <= row_width), None)
        if place is None:
            bins.append([])
            fill.append(0)
            place = len(bins) - 1
        bins[place].append(span)
        fill[place] += length
    width = max(fill)
    packed_ids = torch.full((len(bins), width), pad_token_id, dtype=torch.long)
    positions = torch.zeros_like(packed_ids)
    predicting, targets = [], []
    for b, spans_in_row in enumerate(bins):
        offset = 0
        for row, start, end in spans_in_row:
            length = end - start
            packed_ids[b, offset : offset + length] = input_ids[row, start:end]
            positions[b, offset : offset + length] = torch.arange(length)
            first_completion = offset + prompt_width - start  # the packed position of the completion's first token
            for j in range(end - prompt_width):
                predicting.append(b * width + first_completion + j - 1)
                targets.append(row * completion_width + j)
            offset += length
        positions[b, offset:] = torch.arange(width - offset)  # the padding is a sequence of its own
    return {
        "packed_input_ids": packed_ids,
        "packed_position_ids": positions,
        "packed_predicting": torch.tensor(predicting, dtype=torch.long),
        "packed_targets": torch.tensor(targets, dtype=torch.long),
    }


@contextlib.contextmanager
def output_layer_on(model: torch.nn.Module, flat_positions: torch.Tensor):
    """Within it, the model's output layer sees only the hidden states at `flat_positions` of its [rows, width]
    input (as one row of that many positions)."""

    def select(_module, args):
        hidden = args[0]
        return (hidden.flatten(0, 1)[flat_positions].unsqueeze(0), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def completion_log_probs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    *,
    sequence_shards: SequenceShards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollouts.completion_log_probs` from the packed layout: the same [rows, completion width] tensors (0 where
    there is no completion token); split by position over `sequence_shards` (the run's sequence-parallel group)."""
    if sequence_shards is not None:
        return _split_completion_log_probs(model, batch, temperature, sequence_shards)
    input_ids, position_ids = batch["packed_input_ids"], batch["packed_position_ids"]
    config = getattr(model, "module", model).config
    if str(getattr(config, "_attn_implementation", "")).startswith("flash"):  # varlen reads one row's restarts
        input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
    with output_layer_on(model, batch["packed_predicting"]):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    completion_ids = batch["completion_ids"]
    tokens = completion_ids.flatten()[batch["packed_targets"]]
    chosen, entropy = token_log_probs(logits, tokens.unsqueeze(0), temperature)
    log_probs = torch.zeros(completion_ids.numel(), dtype=chosen.dtype, device=chosen.device)
    entropies = torch.zeros_like(log_probs)
    log_probs = log_probs.index_put((batch["packed_targets"],), chosen[0])
    entropies = entropies.index_put((batch["packed_targets"],), entropy[0])
    return log_probs.view_as(completion_ids), entropies.view_as(completion_ids)


def _split_completion_log_probs(model, batch: dict[str, torch.Tensor], temperature: float, shards):
    """The same, under sequence parallelism: each rank runs its slice of every packed row, the log-probabilities and
    entropies of the positions it holds are gathered back whole (distributed/sequence_parallel.py)."""
    input_ids = batch["packed_input_ids"]
    completion_ids = batch["completion_ids"]
    predicted = torch.full((input_ids.numel(),), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    predicted[batch["packed_predicting"]] = completion_ids.flatten()[batch["packed_targets"]]

    def forward(local_inputs: dict[str, torch.Tensor], local_predicted: torch.Tensor) -> torch.Tensor:
        positions = (local_predicted.flatten() != IGNORE_INDEX).nonzero().flatten()
        with output_layer_on(model, positions):
            logits = model(**local_inputs).logits
        chosen, entropy = token_log_probs(logits, local_predicted.flatten()[positions].unsqueeze(0), temperature)
        values = torch.zeros(local_predicted.numel(), 2, dtype=chosen.dtype, device=chosen.device)
        values = values.index_put((positions,), torch.stack([chosen[0], entropy[0]], dim=-1))
        return values.view(*local_predicted.shape, 2)

    inputs = {"input_ids": input_ids, "position_ids": batch["packed_position_ids"], "use_cache": False}
    whole = shards.per_token(forward, inputs, predicted.view_as(input_ids), IGNORE_INDEX).flatten(0, 1)
    picked = whole[batch["packed_predicting"]]
    log_probs = torch.zeros(completion_ids.numel(), dtype=picked.dtype, device=picked.device)
    log_probs = log_probs.index_put((batch["packed_targets"],), picked[:, 0])
    entropies = torch.zeros_like(log_probs).index_put((batch["packed_targets"],), picked[:, 1])
    return log_probs.view_as(completion_ids), entropies.view_as(completion_ids)
