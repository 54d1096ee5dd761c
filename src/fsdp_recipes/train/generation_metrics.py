"""Generation metrics' side of evaluation (recipes/eval.py): held-out prompts batched in dataset order, and the
`Predict` that generates their completions with the run's backend, the same tokens on any number of ranks."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fsdp_recipes.common.errors import UserError
from fsdp_recipes.train import generation
from fsdp_recipes.train.evaluation import Predict


class GenerationCollator:
    """Left-padded prompts (generation appends on the right), their references and example indices, and their
    pictures' bytes (`images`) when they show some."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        padding_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        try:
            batch = self.tokenizer.pad({"input_ids": [e["prompt_ids"] for e in examples]}, return_tensors="pt")
        finally:
            self.tokenizer.padding_side = padding_side
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "reference": [e["reference"] for e in examples],
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
            **({"images": [e["images"] for e in examples]} if "images" in examples[0] else {}),
        }


def generation_dataloader(examples: list[dict[str, Any]], tokenizer, *, batch_size: int) -> torch.utils.data.DataLoader:
    """Prompts in dataset order (`{"prompt_ids", "reference", "index"}` each); `accelerator.prepare` splits it."""
    return torch.utils.data.DataLoader(
        examples, batch_size=batch_size, shuffle=False, collate_fn=GenerationCollator(tokenizer)
    )


def generation_predict(tokenizer, *, settings, do_sample: bool, synced_gpus: bool) -> Predict:
    """A `Predict` that generates a completion per prompt (`train.generation`, `settings`' backend), greedy or
    sampled with each example's index as its key: the same tokens for an example on any number of ranks, in any batch
    and with any backend. An end-of-sequence token may come first (an empty prediction is an answer too). Prompts
    with pictures are generated with them (`settings.pictures`, the model's processor)."""
    settings = dataclasses.replace(settings, greedy=not do_sample, block_eos_first=False)
    failures: list[UserError] = []

    def predict(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        keys = [int(index) for index in batch["index"]]
        references = list(batch["reference"])
        if failures:  # the server failed on this rank: the other ranks' batches are still gathered with these
            return {"predictions": [""] * len(prompts), "references": references}
        try:
            completions, _ = generation.generate_completions(
                model, tokenizer, prompts, keys, settings, synced_gpus=synced_gpus, images=batch.get("images")
            )
        except UserError as error:  # a vLLM server gone: raised on every rank once the batches are gathered
            if settings.backend != "vllm":
                raise
            failures.append(error)
            return {"predictions": [""] * len(prompts), "references": references}
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return {"predictions": [text.strip() for text in texts], "references": references}

    predict.failures = failures
    return predict
