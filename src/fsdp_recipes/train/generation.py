"""Sampling completions, the one seam every recipe that generates goes through (GRPO's rollouts, on-policy
distillation, eval.py): `generate_completions` (the configured `generation_backend`, `train.generation_backends`, each
completion's noise keyed by its own key, `train.sampling`, so it depends neither on its batch neighbours, the rank
split nor the backend) and `weights_gathered` (an FSDP2 model's layers gathered once per generation pass instead of
once per decoded token). The `vllm` backend sends the same keyed requests to a vLLM server (`train.vllm_client`):
its completions are vLLM's sampling, not transformers' (the same greedy ones), and come with vLLM's log-probabilities
of the sampled tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.models.experts import generation_options
from fsdp_recipes.train import generation_backends


@dataclasses.dataclass
class GenerationSettings:
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    batch_size: int = 8  # prompts per `generate` call (generate, static_compiled); paged takes them all at once
    seed: int = 42
    backend: str = "generate"
    compile_backend: str = "inductor"  # static_compiled's torch.compile backend and mode (null: reduce-overhead)
    compile_mode: str | None = None
    greedy: bool = False  # argmax instead of sampling (evaluation's default)
    block_eos_first: bool = True  # no empty completion (training: it carries no signal); evaluation allows it
    server: Any = None  # the vLLM server (train.vllm_client.VLLMServer) of backend vllm
    pictures: Any = None  # a vision-language model's processor (data.images.ImageInputs): pictures to pixel values


class Generated(tuple):
    """A generation pass's result: unpacks as (token_ids, truncated), one entry per prompt, like the pairs the
    backends have always returned; `sampling_log_probs`: each completion token's log-probability as the engine
    sampled it (vLLM's, after temperature, top-k and top-p), None where the engine reports none (transformers')."""

    def __new__(cls, token_ids, truncated, sampling_log_probs=None):
        made = super().__new__(cls, (token_ids, truncated))
        made.sampling_log_probs = sampling_log_probs
        return made


def backend_setting():
    """The `generation_backend` field, one definition for every recipe that generates."""
    return setting(
        "generate",
        "the engine that writes completions, all of them transformers' and sampling alike (same tokens): generate "
        "(dynamic KV cache, padded batches; works everywhere), paged (continuous batching over a paged KV cache: "
        "finished rows leave, waiting prompts join, no padding; FSDP2 or one process, whole weights per rank), "
        "static_compiled (static KV cache, decoding step torch.compile'd with torch_compile_backend/_mode: fastest "
        "per token once compiled, a compile per new shape); vllm (a vLLM server, use_vllm's: its own sampling, "
        "weights pushed to it after each step that changes them; made for GPUs, not faster on CPU: docs/vllm.md)",
        resume="free",
        check=checks.one_of(generation_backends.BACKENDS),
    )


def backend_options(config) -> dict:
    """A recipe config's generation backend, for `GenerationSettings` (static_compiled compiles with the run's
    torch_compile_backend and torch_compile_mode, where the recipe has them)."""
    return dict(
        backend=config.generation_backend,
        compile_backend=getattr(config, "torch_compile_backend", "inductor"),
        compile_mode=getattr(config, "torch_compile_mode", None),
    )


def describe_backend(backend: str) -> str:
    """The run summary's words for a backend."""
    return {
        "generate": "transformers generate (dynamic KV cache, padded batches)",
        "paged": "transformers continuous batching (paged KV cache)",
        "static_compiled": "transformers generate with a static KV cache, decoding step compiled",
        "vllm": "vLLM server (weights pushed after each step that changes them)",
    }[backend]


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


def set_up_for_pictures(model: torch.nn.Module, pad_token_id: int) -> None:
    """FSDP2 sets itself up at the first forward through the whole model; transformers encodes pictures outside that
    forward when it generates, so a one-token forward comes first (a no-op cost after the first call)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.tensor([[pad_token_id]], device=device), use_cache=False)


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


def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: list[list[int]],
    keys: list[int],
    settings: GenerationSettings,
    *,
    synced_gpus: bool,
    images: list[list[bytes]] | None = None,
) -> Generated:
    """The generation step: one completion per prompt (token ids, up to and including the first end-of-sequence
    token, never that token first) and whether it stopped at the length limit instead (truncated). Sampling at
    `temperature` within `top_k` and `top_p` is keyed (`train.sampling`): noise is a function of (seed, the prompt's
    `keys` entry, the token's index), so a completion does not depend on its batch neighbours, the rank split or the
    backend (`settings.backend`, `train.generation_backends`). Under FSDP without gathered weights, or TP, each forward
    is a collective: `synced_gpus` keeps ranks decoding in lockstep (`generate`/`static_compiled`; `paged` is refused
    there before loading).

    Backend `vllm` asks `settings.server` for them instead (the model is not run; its weights must have been pushed):
    the same inputs, the same outputs, plus vLLM's log-probabilities of the sampled tokens.

    `images`: each prompt's pictures (their bytes), made into pixel values by `settings.pictures` (`generate` and
    `static_compiled` only; a vision-language model's transformers engines, its weights gathered under FSDP2)."""
    if settings.backend == "vllm":
        return _vllm_completions(model, tokenizer, prompt_ids, keys, settings)
    was_training = model.training
    model.eval()
    try:
        token_ids, truncated = generation_backends.run_backend(
            model, tokenizer, prompt_ids, keys, settings, synced_gpus=synced_gpus, options=generation_options(model),
            images=images,
        )  # fmt: skip
    finally:
        model.train(was_training)
    return Generated(token_ids, truncated)


def _vllm_completions(model, tokenizer, prompt_ids, keys, settings: GenerationSettings) -> Generated:
    if settings.server is None:
        raise RuntimeError("generation_backend vllm needs GenerationSettings.server (the recipe connects it)")
    if not prompt_ids:
        return Generated([], [], [])
    sampled = settings.server.generate(
        prompt_ids, keys, seed=settings.seed, max_tokens=settings.max_completion_length,
        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
        stop_token_ids=generation_backends.stop_tokens(model, tokenizer), min_tokens=int(settings.block_eos_first),
        greedy=settings.greedy,
    )  # fmt: skip
    return Generated(sampled.token_ids, sampled.truncated, sampled.log_probs)
