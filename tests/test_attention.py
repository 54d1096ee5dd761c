"""resolve_attn_implementation: auto picks what each architecture can run (the model then builds and trains on
packed rows, examples kept apart), and an implementation that cannot run is a ConfigError before weights load.
Tiny models of several architectures, in-process on CPU: seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.models.attention import resolve_attn_implementation

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    # Sliding-window layers (window 4) and attention-logit softcapping, which sdpa cannot do.
    "gemma2": lambda: Gemma2Config(**SHAPE, head_dim=8, sliding_window=4),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "bloom": lambda: BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
}
AUTO = {
    "llama": ("sdpa", "sdpa (auto: LlamaForCausalLM supports it)"),
    "qwen2": ("sdpa", "sdpa (auto: Qwen2ForCausalLM supports it)"),
    "gemma2": ("eager", "eager (auto: Gemma2ForCausalLM does not support sdpa)"),
    "gpt2": ("sdpa", "sdpa (auto: GPT2LMHeadModel supports it)"),
    "bloom": ("eager", "eager (auto: BloomForCausalLM does not support sdpa)"),
}


def packed_batch():
    """Two packed rows, as fsdp_recipes.data.rows builds them: position_ids restart per example, no attention mask."""
    torch.manual_seed(0)
    rows = [[torch.randint(3, VOCAB, (n,)) for n in lengths] for lengths in ((7, 5, 9), (11, 10))]
    input_ids = torch.stack([torch.cat(row) for row in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(e)) for e in row]) for row in rows])
    return rows, input_ids, position_ids


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_auto_chooses_what_the_architecture_runs_and_the_model_trains_with_it(architecture):
    config = CONFIGS[architecture]()
    implementation, note = resolve_attn_implementation(config, None)
    assert (implementation, note) == AUTO[architecture]
    assert config._attn_implementation is None  # the caller's config is left as it was
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    assert model.config._attn_implementation == implementation
    _, input_ids, position_ids = packed_batch()
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    assert logits.shape == (*input_ids.shape, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2", "gpt2"])
@pytest.mark.parametrize("explicit", [None, "eager"])
def test_packed_examples_do_not_see_each_other(architecture, explicit):
    """With position_ids and no mask, transformers' masking_utils finds the example boundaries and builds a
    block-diagonal mask (sdpa, eager; flex too), for every row of the batch."""
    config = CONFIGS[architecture]()
    implementation, _ = resolve_attn_implementation(config, explicit)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    rows, input_ids, position_ids = packed_batch()
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        for row, (examples, logits) in enumerate(zip(rows, packed, strict=True)):
            alone = torch.cat([model(input_ids=e[None], use_cache=False).logits[0] for e in examples])
            torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4, msg=f"row {row}")


def test_an_explicit_implementation_is_kept():
    assert resolve_attn_implementation(CONFIGS["llama"](), "eager") == ("eager", "eager (requested)")
    assert resolve_attn_implementation(CONFIGS["gemma2"](), "flex_attention", device_type="cuda") == (
        "flex_attention",
        "flex_attention (requested)",
    )
    assert resolve_attn_implementation(CONFIGS["llama"](), "auto") == AUTO["llama"]  # auto is the default's name


def test_flex_attention_is_refused_on_a_cpu_for_training_and_for_evaluation():
    with pytest.raises(ConfigError, match=r"flex_attention cannot train on cpu: torch .*FlexAttention has no backward"):
        resolve_attn_implementation(CONFIGS["llama"](), "flex_attention")
    with pytest.raises(ConfigError, match=r"flex_attention cannot run on cpu: .*inductor's C\+\+ template.*Use sdpa"):
        resolve_attn_implementation(CONFIGS["llama"](), "flex_attention", training=False)
    assert resolve_attn_implementation(CONFIGS["llama"](), "flex_attention", training=False, device_type="cuda")[0] == (
        "flex_attention"
    )


FLEX_NOTE = "flex_attention (auto: packed rows on CUDA, and LlamaForCausalLM supports it: a block mask keeps the "


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (dict(device_type="cuda", packs_examples=True), FLEX_NOTE),
        (dict(device_type="cpu", packs_examples=True), "sdpa (auto: LlamaForCausalLM supports it)"),
        (dict(device_type="cuda", packs_examples=False), "sdpa (auto: LlamaForCausalLM supports it)"),
        (dict(device_type="cuda", packs_examples=True, tensor_parallel=True), "sdpa (auto: "),
        (dict(device_type="cuda", packs_examples=True, generates=True), "sdpa (auto: "),
    ],
)
def test_auto_takes_flex_attention_for_packed_rows_on_a_cuda_gpu(where, expected):
    implementation, note = resolve_attn_implementation(CONFIGS["llama"](), None, **where)
    assert note.startswith(expected) and implementation == note.split(" ")[0]


def test_auto_keeps_sdpa_for_packed_rows_where_the_model_has_no_flex_attention():
    implementation, note = resolve_attn_implementation(CONFIGS["gpt2"](), None, device_type="cuda", packs_examples=True)
    assert implementation == "sdpa" and "GPT2LMHeadModel does not support flex_attention" in note


def test_an_implementation_the_model_class_does_not_support():
    with pytest.raises(ConfigError, match=r"'sdpa': Gemma2ForCausalLM does not support it \(it supports eager, "):
        resolve_attn_implementation(CONFIGS["gemma2"](), "sdpa")
    with pytest.raises(ConfigError, match=r"'flex_attention': GPT2LMHeadModel does not support it"):
        resolve_attn_implementation(CONFIGS["gpt2"](), "flex_attention", device_type="cuda")


def test_an_unknown_implementation():
    with pytest.raises(ConfigError, match=r"'flash' is not one .* flash_attention_2, flash_attention_3, or auto"):
        resolve_attn_implementation(CONFIGS["llama"](), "flash")


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_without_a_gpu(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=f"{name} needs a CUDA GPU"):
        resolve_attn_implementation(CONFIGS["llama"](), name)


@pytest.mark.parametrize(
    ("name", "package"), [("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")]
)
def test_flash_attention_without_its_package(name, package, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(module, *args):
        return None if module == package else real_find_spec(module, *args)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine where the package is missing
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=f"needs the {package} package, which is not installed"):
        resolve_attn_implementation(CONFIGS["llama"](), name)


def test_rows_are_laid_end_to_end_for_flash_attention_and_the_loss_is_unchanged():
    """Flash-attention's varlen path isolates packed examples only in a batch of one row: the loss function lays the
    rows end to end for it. The same flattening, run through sdpa, gives the same loss as the rows side by side."""
    from types import SimpleNamespace

    from fsdp_recipes.train.losses import causal_lm_loss_sum, model_inputs

    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]]),
        "targets": torch.tensor([[6, -100, 8, -100], [10, -100, -100, -100]]),
    }
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert model_inputs(flash, batch)["input_ids"].shape == (1, 8)
    assert model_inputs(flash, batch)["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1, 0, 1]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa")
    side_by_side = causal_lm_loss_sum(model, batch)
    end_to_end = causal_lm_loss_sum(model, {key: value.reshape(1, -1) for key, value in batch.items()})
    torch.testing.assert_close(end_to_end, side_by_side, rtol=1e-6, atol=1e-6)


def test_packing_is_refused_for_models_that_ignore_position_ids():
    from transformers import OPTConfig

    from fsdp_recipes.models.modeling import check_packing_is_isolated

    for config in (OPTConfig(), BloomConfig()):
        with pytest.raises(ConfigError, match="packing: false"):
            check_packing_is_isolated(config)
    check_packing_is_isolated(LlamaConfig())


# ---------------------------------------------------------------------------------------- packed rows, every route
PACKED_MODELS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=8),
    "gemma3 (sliding window 4)": lambda: Gemma3TextConfig(
        **SHAPE, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                        num_experts_per_tok=2),
}  # fmt: skip


def token_losses(model, examples, *, packed: bool, restart_positions: bool = True):
    """Per-token cross-entropy of each example predicting its next tokens: the examples packed in one row (position
    ids restarting per example, or running on with restart_positions=False: a leak), or each run alone."""
    if not packed:
        return torch.cat([_next_token_losses(model, e[None], torch.arange(len(e))[None]) for e in examples])
    ids = torch.cat(examples)[None]
    positions = (
        torch.cat([torch.arange(len(e)) for e in examples]) if restart_positions else torch.arange(ids.shape[1])
    )[None]
    losses, start = _next_token_losses(model, ids, positions, whole=True), 0
    kept = []
    for example in examples:  # each example's last position would predict the next example's first token
        kept.append(losses[start : start + len(example) - 1])
        start += len(example)
    return torch.cat(kept)


def _next_token_losses(model, ids, positions, whole=False):
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()
    losses = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
    return torch.cat([losses, losses.new_zeros(1)]) if whole else losses


def gradients(model, losses):
    model.zero_grad()
    losses.sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("architecture", sorted(PACKED_MODELS))
def test_packed_rows_give_every_token_the_loss_and_gradients_it_has_alone(architecture):
    """sdpa (what auto takes on CPU) trains on packed rows exactly as on the examples alone; a leak between the
    examples (positions that do not restart) is caught by the same comparison."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PACKED_MODELS[architecture](), attn_implementation="sdpa")
    examples = [torch.randint(3, VOCAB, (n,)) for n in (7, 12, 9)]
    alone = token_losses(model, examples, packed=False)
    alone_grads = gradients(model, alone)
    packed = token_losses(model, examples, packed=True)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for name, grad in gradients(model, packed).items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        leaked = token_losses(model, examples, packed=True, restart_positions=False)
    assert (leaked - alone).abs().max() > 1e-3


def test_flex_attention_gives_packed_rows_the_losses_they_have_alone(monkeypatch):
    """FlexAttention (what auto takes for packed rows on CUDA) has no backward on CPU: its forward is checked here,
    on every architecture above, against each example run alone with sdpa. The kernel and the block mask's
    construction run uncompiled (compiling changes their speed, not their result; on this CPU a compile per shape
    costs seconds); the block mask is the one transformers builds from the restarting positions."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers import masking_utils
    from transformers.integrations import flex_attention as integration

    monkeypatch.setattr(integration, "compile_friendly_flex_attention", lambda q, k, v, training=False, **kw: (
        flex_attention(q, k, v, **kw)))  # fmt: skip
    monkeypatch.setattr(masking_utils, "create_block_mask", lambda *a, _compile=True, **kw: create_block_mask(*a, **kw))
    for architecture, make_config in PACKED_MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="sdpa").eval()
        examples = [torch.randint(3, VOCAB, (n,)) for n in (7, 12, 9)]
        with torch.no_grad():
            alone = token_losses(model, examples, packed=False)
            model.set_attn_implementation("flex_attention")
            packed = token_losses(model, examples, packed=True)
            leaked = token_losses(model, examples, packed=True, restart_positions=False)
        torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4, msg=architecture)
        assert (leaked - alone).abs().max() > 1e-3, architecture
