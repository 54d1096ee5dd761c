"""Token losses, in one place for every recipe: the summed cross-entropy of a causal LM over its targets, and the
factor that turns a rank's sum into its share of the global mean.

Recipes sum per-token losses over a micro-batch and scale by `global_mean_scale`, so the gradient is that of the mean
over every target token of the global batch, whatever its split into ranks and micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator

IGNORE_INDEX = -100  # targets that carry no loss (prompt tokens, padding, the last token of each example)


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["targets"] != IGNORE_INDEX).sum())


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
    if str(getattr(model.config, "_attn_implementation", "")).startswith("flash"):
        input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
    return {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}


def global_mean_scale(accelerator: Accelerator, global_target_count: float) -> float:
    """Factor turning a rank's summed loss into its share of the global mean: FSDP/DDP average gradients over
    ranks, so each rank scales by world_size / (targets in the whole optimizer step, all ranks and micro-batches).
    The result is the same gradient whatever the split of the global batch into ranks and micro-batches."""
    return accelerator.num_processes / max(global_target_count, 1.0)
