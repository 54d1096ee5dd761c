"""Sampling completions from a model being trained, for the online recipes (GRPO's rollouts, on-policy distillation):
`generate_completions` (transformers `generate` with its KV cache, each completion's noise seeded by its own key so it
does not depend on its batch neighbours or the rank split) and `weights_gathered` (an FSDP2 model's layers gathered
once per generation pass instead of once per decoded token)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch

from fsdp_recipes.models.experts import generation_options
from fsdp_recipes.train.evaluation import ReproducibleSampling


@dataclasses.dataclass
class GenerationSettings:
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    batch_size: int = 8
    seed: int = 42


def sampling_problems(temperature: float, top_p: float, top_k: int | None) -> list[str]:
    """What is wrong with the sampling settings, for the config's `cross_field_problems`."""
    problems = []
    if not (math.isfinite(temperature) and temperature > 0):
        problems.append(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k must be >= 1 or null, got {top_k}")
    return problems


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def describe_gathering(model: torch.nn.Module, *, enabled: bool) -> str:
    """What `weights_gathered` does for `model`, for the run summary."""
    if not enabled:
        return "weights gathered per forward (once per decoded token), gather_weights_for_generation off"
    if not _fsdp_modules(model):
        return "whole weights on every process already (no FSDP2 sharding)"
    return "whole weights gathered once per generation pass (unshard; no reshard after forward until it ends)"


def reshard_after_forward(accelerator) -> bool:
    """The Accelerate config's `fsdp_reshard_after_forward` (True without FSDP), which `weights_gathered` restores."""
    return bool(getattr(getattr(accelerator.state, "fsdp_plugin", None), "reshard_after_forward", True))


@contextlib.contextmanager
def weights_gathered(model: torch.nn.Module, *, enabled: bool, reshard_after_forward: bool = True) -> Iterator[None]:
    """Within it, every FSDP2 unit of `model` holds its whole parameters and keeps them across forwards, so a
    generation pass gathers each layer once instead of once per decoded token; after it, they are sharded again and
    `reshard_after_forward` (the Accelerate config's) is restored."""
    modules = _fsdp_modules(model) if enabled else []
    if not modules:
        yield
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard_after_forward, recurse=False)


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: list[list[int]],
    keys: list[int],
    settings: GenerationSettings,
    *,
    synced_gpus: bool,
) -> tuple[list[list[int]], list[bool]]:
    """The generation step: one completion per prompt (token ids, up to and including the first end-of-sequence
    token) and whether it stopped at the length limit instead (truncated). Sampling at `temperature` within `top_k`
    and `top_p`, by Gumbel-max noise seeded per `keys` entry (`sampling_key`), so a completion does not depend on its
    batch neighbours; transformers `generate` with its KV cache, `batch_size` prompts at a time (left-padded). Under
    FSDP `synced_gpus` keeps ranks decoding in lockstep (each forward may be a collective).

    A vLLM (or other) backend replaces this function: same inputs, same outputs; its sampling must then be seeded
    per key too for completions to stay independent of the rank split."""
    from transformers import LogitsProcessorList, TopKLogitsWarper

    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    completions, truncated = [], []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(prompt_ids), settings.batch_size):
            chunk = prompt_ids[start : start + settings.batch_size]
            batch = tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(next(model.parameters()).device)
            width = batch["input_ids"].shape[1]
            processors = LogitsProcessorList()
            if settings.top_k:
                processors.append(TopKLogitsWarper(settings.top_k))
            processors.append(
                ReproducibleSampling(
                    seed=settings.seed,
                    indices=torch.tensor(keys[start : start + settings.batch_size]),
                    prompt_width=width,
                    temperature=settings.temperature,
                    top_p=settings.top_p,
                )
            )
            output = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=settings.max_completion_length,
                min_new_tokens=1,
                do_sample=False,
                logits_processor=processors,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
                synced_gpus=synced_gpus,
                use_cache=True,
                **generation_options(model),
            )
            for row in output[:, width:].tolist():
                ended = eos in row
                completions.append(row[: row.index(eos) + 1] if ended else row)
                truncated.append(not ended)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return completions, truncated
