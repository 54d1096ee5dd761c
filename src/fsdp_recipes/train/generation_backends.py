"""The engines behind `train.generation.generate_completions`, all from transformers, all sampling through
`train.sampling` (so they agree token for token):

- `generate`: `model.generate` with a dynamic KV cache, `batch_size` prompts at a time, left-padded; under FSDP or
  TP the ranks decode in lockstep (`synced_gpus`);
- `static_compiled`: the same with a static KV cache and the decoding step `torch.compile`d (transformers'
  `CompileConfig`): no per-step Python overhead or reallocation once compiled, at one compile per new shape;
- `paged`: transformers' continuous batching (a paged KV cache; finished rows leave the batch and waiting prompts
  join it at once, no padding), each rank its own engine, which is why it needs the whole weights on the rank (FSDP2's
  weights gathered for the pass) and no per-forward collective (no TP or EP)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fsdp_recipes.train import sampling

TRANSFORMERS_BACKENDS = ("generate", "paged", "static_compiled")  # this module's: the model itself generates
BACKENDS = (*TRANSFORMERS_BACKENDS, "vllm")  # vllm: a server (train.vllm_client) generates, from pushed weights
PAGE_SIZE = 64  # tokens per page of the paged KV cache: completions of a few hundred tokens waste < 64 slots each
_PAGED_ATTENTION = ("sdpa", "eager", "paged|eager", "paged|sdpa")


def causal_lm_class(model_config):
    """The transformers class `AutoModelForCausalLM` builds for `model_config` (None when it has none)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(model_config), None)


def backend_problem(backend: str, model_config, *, sharded_layers: bool) -> str | None:
    """Why `backend` cannot generate for this model and layout (None: it can), before any weight loads."""
    if backend not in BACKENDS:
        return f"generation_backend must be one of {', '.join(BACKENDS)}; got {backend!r}"
    if backend in ("generate", "vllm"):  # vllm runs the model elsewhere, whatever its sharding here
        return None
    if sharded_layers:
        return (
            f"generation_backend {backend} runs each rank's model on its own, but under tensor or expert parallelism "
            "every forward is a collective across ranks: use generation_backend generate (ranks decode in lockstep)"
        )
    model_class = causal_lm_class(model_config)
    name = model_class.__name__ if model_class else type(model_config).__name__
    if backend == "static_compiled" and not getattr(model_class, "_can_compile_fullgraph", False):
        return (
            f"generation_backend static_compiled: transformers does not mark {name} as compilable with a static "
            "cache (_can_compile_fullgraph is False): use generation_backend generate or paged"
        )
    if backend == "paged" and not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"generation_backend paged: {name} does not route attention through transformers' attention interface "
            "(_supports_attention_backend is False), which paged attention plugs into: use generation_backend generate"
        )
    return None


@contextlib.contextmanager
def _left_padding(tokenizer) -> Iterator[None]:
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side = side


# generate() merges the model's generation_config into every call: a repetition penalty there (Qwen2.5-Instruct ships
# one) would sample from something else than the policy, and differ from the paged engine, which applies none
_POLICY_AS_IS = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0)


def stop_tokens(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's end of sequence and every one the model's generation config
    lists (Llama 3's <|eom_id|>, Qwen's <|endoftext|>), as `generate` stops at them."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))


def _compile_config(settings):
    from transformers import CompileConfig

    compile_config = CompileConfig(backend=settings.compile_backend, mode=settings.compile_mode or "reduce-overhead")
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only by default; a CPU run rehearses it
    return compile_config


def padded_generate(
    model, tokenizer, prompt_ids, keys, settings, *, synced_gpus: bool, static: bool, options: dict, images=None
):
    """`generate` and `static_compiled`: (completions, truncated), `settings.batch_size` left-padded prompts a time;
    `images`: each prompt's pictures, made into pixel values by `settings.pictures`."""
    stops = stop_tokens(model, tokenizer)
    completions, truncated = [], []
    extra = dict(_POLICY_AS_IS)
    if static:
        extra.update(cache_implementation="static", compile_config=_compile_config(settings), disable_compile=False)
    if images is not None:  # a sampled image token would be a picture's token without a picture
        extra["suppress_tokens"] = settings.pictures.never_generated
    with _left_padding(tokenizer):
        for start in range(0, len(prompt_ids), settings.batch_size):
            chunk = prompt_ids[start : start + settings.batch_size]
            device = next(model.parameters()).device
            padded = tokenizer.pad({"input_ids": chunk}, return_tensors="pt")
            batch = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
            if images is not None:  # before the move: the processor works on the CPU
                pixels = settings.pictures.pixel_inputs(batch["input_ids"], images[start : start + settings.batch_size])
                batch.update(pixels)
            batch = {key: value.to(device) for key, value in batch.items()}
            width = batch["input_ids"].shape[1]
            processor = sampling.KeyedSampling(
                seed=settings.seed, keys=keys[start : start + settings.batch_size], prompt_width=width,
                temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                not_first=stops if settings.block_eos_first else None, greedy=settings.greedy,
            )  # fmt: skip
            output = model.generate(
                **batch,
                max_new_tokens=settings.max_completion_length,
                do_sample=False,
                logits_processor=[processor],
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stops,
                synced_gpus=synced_gpus,
                use_cache=True,
                **extra,
                **options,
            )
            for row in output[:, width:].tolist():
                end = next((i for i, token in enumerate(row) if token in stops), None)
                completions.append(row if end is None else row[: end + 1])
                truncated.append(end is None)
    return completions, truncated


@contextlib.contextmanager
def _paged_ready(model) -> Iterator[None]:
    """The model as the engine needs it: an attention implementation paged attention wraps (a training route such as
    flex_attention is swapped for sdpa for the pass) and no router logits (see models.experts.generation_options)."""
    config = model.config
    attention = config._attn_implementation
    router_logits = getattr(config, "output_router_logits", None)
    swapped = attention not in _PAGED_ATTENTION and not str(attention).startswith("flash")
    if swapped:
        model.set_attn_implementation("sdpa")
    if router_logits:
        config.output_router_logits = False
    try:
        yield
    finally:
        if swapped:
            model.set_attn_implementation(attention)
        if router_logits:
            config.output_router_logits = router_logits


def paged_generate(model, tokenizer, prompt_ids, keys, settings) -> tuple[list[list[int]], list[bool]]:
    """`paged`: every prompt handed to one continuous-batching engine (transformers'), each request carrying its
    sampling key; (completions, truncated) in prompt order. Raises RuntimeError when a request fails."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if not prompt_ids:
        return [], []
    stops = stop_tokens(model, tokenizer)
    generation_config = GenerationConfig(
        max_new_tokens=settings.max_completion_length, do_sample=False, eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    hints = WorkloadHints(
        max_prompt_length=max(len(ids) for ids in prompt_ids),
        max_generated_length=settings.max_completion_length,
        num_requests=len(prompt_ids),
    )
    engine_config = ContinuousBatchingConfig(
        auto_switch_to_flash=False,  # the attention stays what the run chose
        page_size=PAGE_SIZE,
        num_blocks=sum(-(-(len(ids) + settings.max_completion_length) // PAGE_SIZE) for ids in prompt_ids) + 1,
    )  # a cache for every request at once, not most of the device's free memory (training's memory)
    with _paged_ready(model):
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=engine_config, workload_hints=hints
        )
        manager.logit_processor = sampling.paged_processor(
            seed=settings.seed, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
            not_first=stops if settings.block_eos_first else None, greedy=settings.greedy,
        )  # fmt: skip
        results = {}
        manager.start()
        try:
            for index, (ids, key) in enumerate(zip(prompt_ids, keys)):
                manager.add_request(
                    list(ids), request_id=str(index), max_new_tokens=settings.max_completion_length,
                    eos_token_id=stops, sampling_key=key,
                )  # fmt: skip
            while len(results) < len(prompt_ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
        finally:
            manager.stop(block=True)
            manager.destroy()
    failed = [rid for rid in map(str, range(len(prompt_ids))) if rid not in results or results[rid].error]
    if failed:
        reason = next((results[rid].error for rid in failed if rid in results), "the engine stopped")
        raise RuntimeError(f"paged generation failed for {len(failed)} of {len(prompt_ids)} prompts: {reason}")
    completions, truncated = [], []
    for index in range(len(prompt_ids)):
        tokens = list(results[str(index)].generated_tokens)
        completions.append(tokens)
        truncated.append(not tokens or tokens[-1] not in stops)
    return completions, truncated


@torch.no_grad()
def run_backend(model, tokenizer, prompt_ids, keys, settings, *, synced_gpus: bool, options: dict, images=None):
    if images is not None and settings.backend == "paged":  # refused before loading (methods.grpo.task)
        raise ValueError("the paged engine takes no pictures: generation_backend generate does")
    if settings.backend == "paged":
        return paged_generate(model, tokenizer, prompt_ids, keys, settings)
    static = settings.backend == "static_compiled"
    return padded_generate(
        model, tokenizer, prompt_ids, keys, settings, synced_gpus=synced_gpus, static=static, options=options,
        images=images,
    )  # fmt: skip
