"""The chunked cross-entropy: the same losses and gradients as whole logits, without ever holding the micro-batch's
N x vocabulary logits; models that transform their logits fall back. In-process (the 2-process parity of chunked
against whole logits is in tests/test_sft_recipe.py: the shared runs use one each)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.train import losses as losses_module
from fsdp_recipes.train.losses import (
    ChunkedCrossEntropy,
    TokenLoss,
    chunked_token_losses,
    loss_implementation_problem,
    torch_kernel_token_losses,
)

# Ours and torch's own F.linear_cross_entropy (loss_implementation: linear_cross_entropy), held to the same tests.
KERNELS = {"chunked": chunked_token_losses, "linear_cross_entropy": torch_kernel_token_losses}

VOCAB = 300


def tiny_llama(vocab_size=VOCAB, **overrides):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return AutoModelForCausalLM.from_config(LlamaConfig(**settings), attn_implementation="eager")


def packed_batch(rows=3, width=20):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (rows, width), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, width), generator=generator)
    targets[:, :5] = IGNORE_INDEX  # a prompt
    targets[-1, 12:] = IGNORE_INDEX  # padding
    positions = torch.cat([torch.arange(8), torch.arange(width - 8)]).repeat(rows, 1)  # two examples per row
    return {"input_ids": input_ids, "targets": targets, "position_ids": positions}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_equals_cross_entropy_in_loss_and_gradients(chunk_size, with_bias, kernel):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(VOCAB, generator=generator, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, VOCAB, (50,), generator=generator)
    targets[::3] = IGNORE_INDEX
    upstream = torch.rand(50, generator=generator, dtype=torch.float64)  # a per-token weighting, as DPO's sums are

    chunked = KERNELS[kernel](hidden, weight, bias, targets, chunk_size)
    (chunked.double() * upstream).sum().backward()
    got = [hidden.grad.clone(), weight.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for tensor in (hidden, weight, bias):
        if tensor is not None:
            tensor.grad = None

    logits = hidden @ weight.T + (bias if with_bias else 0)
    expected = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    (expected.double() * upstream).sum().backward()
    want = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])

    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=1e-6)
    assert (chunked[::3] == 0).all()
    assert chunked._base is None  # no view: an FSDP2 module's output, whose pre-backward hook a view could lose
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_batch_without_targets_has_zero_loss_and_no_gradient(kernel):
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    losses = KERNELS[kernel](hidden, weight, None, torch.full((4,), IGNORE_INDEX), 2)
    assert losses.tolist() == [0.0] * 4 and losses._base is None
    losses.sum().backward()  # every rank runs backward, with or without targets
    assert not hidden.grad.any() and not weight.grad.any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tied", [False, True])
def test_through_a_model_loss_and_every_gradient_equal_whole_logits(tied, kernel):
    batch = packed_batch()
    whole_model, chunked_model = tiny_llama(tie_word_embeddings=tied), tiny_llama(tie_word_embeddings=tied)
    whole, chunked = TokenLoss(whole_model, "full_logits"), TokenLoss(chunked_model, kernel, chunk_size=7)
    assert whole.description == "whole logits" and "7 tokens per chunk" in chunked.description
    whole_loss, chunked_loss = whole.loss_sum(whole_model, batch), chunked.loss_sum(chunked_model, batch)
    torch.testing.assert_close(chunked_loss, whole_loss, rtol=1e-5, atol=1e-5)
    whole_loss.backward()
    chunked_loss.backward()
    for (name, a), (_, b) in zip(chunked_model.named_parameters(), whole_model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    per_token = chunked.token_losses(chunked_model, batch)
    assert per_token.shape == batch["targets"].shape and (per_token[batch["targets"] == IGNORE_INDEX] == 0).all()


def test_outside_the_loss_the_model_is_unchanged():
    model = tiny_llama()
    untouched = copy.deepcopy(model)
    TokenLoss(model, "chunked")
    ids = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(model(input_ids=ids).logits, untouched(input_ids=ids).logits, rtol=0, atol=0)
    assert model.state_dict().keys() == untouched.state_dict().keys()  # parameter names, hence checkpoints and exports
    generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, untouched.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))


def test_the_micro_batch_logits_are_never_kept_for_backward():
    """Every activation autograd saves during the forward is recorded (parameters aside): with a chunked loss none is as large as the micro-batch's N x vocabulary logits; with whole logits one is (the
    control)."""
    batch = packed_batch(rows=4, width=32)
    vocab = 4096  # as large next to the hidden size as real vocabularies are
    logits_elements = batch["input_ids"].numel() * vocab

    def largest_saved(implementation):
        model = tiny_llama(vocab_size=vocab)
        loss = TokenLoss(model, implementation, chunk_size=16)
        sizes = []

        parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def record(tensor):  # parameters, and views of them (torch's kernel saves the weight as a view), aside
            if tensor.untyped_storage().data_ptr() not in parameter_storages:
                sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
            loss.loss_sum(model, batch)
        return max(sizes)

    assert largest_saved("full_logits") >= logits_elements
    assert largest_saved("chunked") < logits_elements / 4
    assert largest_saved("linear_cross_entropy") < logits_elements / 4


def test_torch_kernel_is_refused_before_loading_where_torch_lacks_it(monkeypatch):
    """The GPU machine's torch 2.11 has no chunking options: one message naming the fix, not a failure mid-step."""
    assert loss_implementation_problem("linear_cross_entropy", "cpu") is None  # torch 2.13 here
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions")
    assert losses_module.torch_kernel_options(1024) is None
    assert "use chunked" in loss_implementation_problem("linear_cross_entropy", "cuda")


def test_models_that_transform_their_logits_fall_back_to_whole_logits():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    loss = TokenLoss(model, "chunked")
    assert loss.implementation == "full_logits" and "soft-caps its logits" in loss.description
    batch = packed_batch()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    expected = F.cross_entropy(
        logits.flatten(0, 1).float(), batch["targets"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    torch.testing.assert_close(loss.loss_sum(model, batch), expected)


def test_a_transformation_not_recognised_up_front_is_caught_at_the_first_step():
    model = tiny_llama()
    loss = TokenLoss(model, "chunked")
    original = type(model).forward

    def scaled_forward(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        output.logits = output.logits * 2
        return output

    model.forward = scaled_forward.__get__(model)
    with pytest.raises(ConfigError, match="LlamaForCausalLM transforms the output.*loss_implementation: full_logits"):
        loss.loss_sum(model, packed_batch())


def test_chunked_autograd_function_is_checked_by_gradcheck():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=generator)
    # Logits are upcast to fp32 per chunk, so gradcheck runs at fp32 precision.
    assert torch.autograd.gradcheck(
        lambda h, w, b: ChunkedCrossEntropy.apply(h, w, b, targets, 4),
        (hidden, weight, bias),
        eps=1e-3,
        atol=1e-2,
        rtol=1e-2,
    )


def test_under_regional_compilation_the_loss_is_not_recompiled_per_batch():
    """torch_compile: accelerate's compile_regions compiles the output layer too, and the chunked loss inside it keeps
    only the tokens with a target, a count that changes every batch. Traced, that was a new graph per count until
    dynamo's recompile limit (seen on the GPU run, docs/gpu.md); the loss must stay out of the compiled region."""
    from accelerate.utils import compile_regions

    model = tiny_llama()
    loss = TokenLoss(model, "chunked", chunk_size=7)
    compiled = compile_regions(model, backend="eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt_length in (3, 5, 9):  # a different number of targets each batch
            batch = packed_batch()
            batch["targets"][:, :prompt_length] = IGNORE_INDEX
            expected = TokenLoss(tiny_llama(), "full_logits").loss_sum(tiny_llama(), batch)
            torch.testing.assert_close(loss.loss_sum(compiled, batch), expected, rtol=1e-5, atol=1e-5)


def test_compiled_layers_recompile_once_for_a_new_row_width_then_never(monkeypatch):
    """`accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False, and accelerate's plugin took it: every new row
    width (unpacked rows, group_by_length) was a new graph of each layer until dynamo's recompile limit (8) left them
    uncompiled. The run's plugin (`compile_plugin`) under that environment recompiles once, to a graph for any width."""
    from types import SimpleNamespace

    from accelerate.utils import compile_regions_fsdp2
    from torch._dynamo.utils import counters

    from fsdp_recipes.run.starting import compile_plugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")  # what the launcher exports
    plugin = compile_plugin(SimpleNamespace(torch_compile_backend="eager", torch_compile_mode=None))
    model = compile_regions_fsdp2(tiny_llama(), **plugin.to_kwargs())
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for width in (6, 8, 10, 12, 14):
        model(input_ids=torch.randint(0, 50, (2, width)))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] > graphs[0]  # compiled, then once more for the second width
    assert graphs[-1] == graphs[1], graphs  # and never again
    torch._dynamo.reset()
