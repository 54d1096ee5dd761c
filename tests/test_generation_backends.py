"""The generation backends (`train.generation_backends`: generate, paged, static_compiled) and the keyed sampling they
share (`train.sampling`), in this process: the same completions token for token on a dense model, a mixture of experts
and a model with sliding-window layers, greedy and sampled; sampling that draws from the right distribution; the
refusals before loading. Under FSDP2 on 2 processes: tests/test_grpo_generation.py and the GRPO launches (the 2-process
runs use paged and static_compiled, their 1-process twins generate)."""

from __future__ import annotations

import pytest
import torch

from fsdp_recipes.train import generation, generation_backends, sampling

PROMPTS = ["reverse: abc", "reverse: qwertyu", "x", "add 2 3", "a longer prompt, to make the others padded"]
KEYS = [11, 22, 33, 44, 55]


def _tiny(family: str, tokenizer):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3MoeConfig

    shape = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config = {
        "llama": lambda: LlamaConfig(**shape),
        "gemma3 (sliding window 4)": lambda: Gemma3TextConfig(
            **shape, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
        ),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **shape,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
        ),  # fmt: skip
    }[family]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["llama", "gemma3 (sliding window 4)", "qwen3_moe"])
def test_every_backend_writes_the_same_completions(family, tokenizer):
    """Greedy and sampled (top-k, top-p, temperature: the noise rides on the logits, so sampled equality needs equal
    logits and equal noise) on every family."""
    model = _tiny(family, tokenizer)
    model.generation_config.repetition_penalty = 1.3  # a model's own penalty: not the policy, and never applied
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    results = {}
    for greedy in (False, True):
        for backend in generation_backends.TRANSFORMERS_BACKENDS:
            settings = generation.GenerationSettings(
                8, temperature=0.8, top_k=40, top_p=0.9, batch_size=2, seed=3, backend=backend,
                compile_backend="eager", greedy=greedy,
            )  # fmt: skip
            results[greedy, backend] = generation.generate_completions(
                model, tokenizer, prompts, KEYS, settings, synced_gpus=False
            )
        for backend in generation_backends.TRANSFORMERS_BACKENDS:
            assert results[greedy, backend] == results[greedy, "generate"], (greedy, backend)
    completions, truncated = results[False, "paged"]
    assert all(tokens and tokens[0] != tokenizer.eos_token_id for tokens in completions)  # never empty
    assert all(cut == (tokens[-1] != tokenizer.eos_token_id) for tokens, cut in zip(completions, truncated))
    assert model.config._attn_implementation == "sdpa"  # the engine's switches are undone
    assert getattr(model.config, "output_router_logits", False) == (family == "qwen3_moe")
    assert results[False, "paged"] != results[True, "paged"]  # it does sample
    if family == "llama":
        alone = generation.GenerationSettings(8, temperature=0.8, top_k=40, top_p=0.9, seed=3, backend="paged")
        assert generation.generate_completions(model, tokenizer, prompts[1:2], KEYS[1:2], alone, synced_gpus=False) == (
            completions[1:2],
            truncated[1:2],
        )  # a completion does not depend on the requests beside it
        # a token the model's generation config lists ends a completion too, on every backend
        listed = results[True, "generate"][0][0][1]
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, listed]
        for backend in generation_backends.TRANSFORMERS_BACKENDS:
            greedy = generation.GenerationSettings(
                8, batch_size=2, backend=backend, compile_backend="eager", greedy=True
            )
            ended, cut = generation.generate_completions(
                model, tokenizer, prompts[:1], KEYS[:1], greedy, synced_gpus=False
            )
            assert ended[0][-1] == listed and len(ended[0]) <= 2 and cut == [False], backend


def test_keyed_sampling_draws_from_the_softmax_within_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -3.0])
    draws = 20_000
    keys = torch.arange(draws, dtype=torch.int64)
    seeds = sampling.row_seed(3, keys, 0)
    assert [sampling.row_seed(3, key, 0) for key in (0, 1, 2**40 + 7)] == [
        int(seed) for seed in sampling.row_seed(3, torch.tensor([0, 1, 2**40 + 7]), 0)
    ]  # the engine's arguments (Python ints) and generate's (tensors) agree
    scores = sampling.keyed_scores(logits.expand(draws, -1), seeds, temperature=0.5, top_k=4, top_p=0.95)
    counts = torch.bincount(scores.argmax(-1), minlength=5).float() / draws
    tempered = torch.softmax(logits / 0.5, -1)  # 0.80, 0.11, 0.04, 0.015, ...: the nucleus 0.95 keeps three
    expected = torch.zeros(5)
    expected[:3] = tempered[:3] / tempered[:3].sum()
    torch.testing.assert_close(counts, expected, atol=0.01, rtol=0)
    again = sampling.keyed_scores(logits.expand(draws, -1), seeds, temperature=0.5, top_k=4, top_p=0.95)
    assert torch.equal(again.argmax(-1), scores.argmax(-1))  # a function of the key: no generator state
    other_step = sampling.keyed_scores(
        logits.expand(draws, -1), sampling.row_seed(3, keys, 1), temperature=0.5, top_k=4, top_p=0.95
    )
    assert (other_step.argmax(-1) != scores.argmax(-1)).float().mean() > 0.2  # each token its own noise
    # a 152k vocabulary over 160 rows (24M draws): 24-bit uniforms rounded their largest value up to 1.0 (infinite
    # noise) about once per 16.7M draws; 23 bits never do
    assert torch.isfinite(sampling.gumbel_noise(torch.arange(160), 151_936)).all()


def test_a_backend_that_cannot_run_is_refused_with_the_reason():
    from transformers import BloomConfig, DbrxConfig, LlamaConfig

    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32)
    assert generation_backends.backend_problem("paged", llama, sharded_layers=False) is None
    assert generation_backends.backend_problem("static_compiled", llama, sharded_layers=False) is None
    assert "one of generate, paged, static_compiled, vllm" in generation_backends.backend_problem(
        "sglang", llama, sharded_layers=False
    )
    assert generation_backends.backend_problem("vllm", llama, sharded_layers=True) is None  # the server's layout
    assert "tensor or expert parallelism" in generation_backends.backend_problem("paged", llama, sharded_layers=True)
    assert generation_backends.backend_problem("generate", llama, sharded_layers=True) is None
    dbrx, bloom = DbrxConfig(d_model=32, n_heads=4, n_layers=1), BloomConfig(hidden_size=32, n_layer=1, n_head=4)
    assert "does not mark DbrxForCausalLM as compilable" in generation_backends.backend_problem(
        "static_compiled", dbrx, sharded_layers=False
    )
    assert "BloomForCausalLM does not route attention" in generation_backends.backend_problem(
        "paged", bloom, sharded_layers=False
    )
