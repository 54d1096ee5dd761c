"""Run inside a sequence-parallel launch (`tests/scripts/recipes_in_sequence.py`, entry `check:sequence_exchange`): on
every rank, per-token losses and gradients through `SequenceShards.per_token` against the same model run whole on
that rank, for packed rows 11 tokens wide (padded to a multiple of sp), GQA, a sliding window of 3, the chunked and
the whole-logits loss. Rank 0 writes {rank: {case: [loss error, gradient relative error]}} to OUTPUT as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def per_token_errors(shards) -> dict[str, list[float]]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from fsdp_recipes.train.losses import TokenLoss

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    models = {
        "llama": LlamaConfig(num_key_value_heads=2, **shape),
        "sliding window 3": Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
                                        max_window_layers=0, layer_types=["sliding_attention"] * 2, **shape),
    }  # fmt: skip
    torch.manual_seed(0)  # the same rows on every rank
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]])
    batch = {"input_ids": torch.randint(1, 64, (2, 11)), "position_ids": positions}
    batch["targets"] = torch.randint(0, 64, (2, 11)).masked_fill(positions == 0, -100)
    errors = {}
    for name, config in models.items():
        for implementation in ("chunked", "full_logits"):
            config._attn_implementation = "sdpa"
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(config)
            loss = TokenLoss(model, implementation, chunk_size=5)  # no group: whole rows, this rank alone
            expected = loss.token_losses(model, batch)
            expected.sum().backward()
            whole = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            loss.sequence_shards = shards  # now split by position over the group
            got = loss.token_losses(model, batch)
            got.sum().backward()
            worst = 0.0
            for n, parameter in model.named_parameters():
                dist.all_reduce(parameter.grad, group=shards.group)  # FSDP's average over the group's ranks
                relative = (parameter.grad / shards.size - whole[n]).abs().max() / whole[n].abs().max()
                worst = max(worst, float(relative))
            errors[f"{name}, {implementation}"] = [float((got - expected).detach().abs().max()), worst]
    return errors


def main(output: str) -> None:
    from accelerate.utils import gather_object

    from fsdp_recipes.distributed.accelerator import build_accelerator

    accelerator, parallel = build_accelerator()
    errors = per_token_errors(parallel.sequence_shards)
    gathered = gather_object([errors])
    if accelerator.is_main_process:
        Path(output).write_text(json.dumps({str(rank): value for rank, value in enumerate(gathered)}))
