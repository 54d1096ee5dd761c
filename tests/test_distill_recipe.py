"""recipes/distill.py: the chunked KD loss against the whole-logits computation (values and gradients, each kd_loss),
what autograd keeps, kd_ratio 0 as SFT's loss exactly, and every error raised before weights load, in this process;
the shared runs (tests/fixtures/reward_distill.py: a 2-process launch and its 1-process twin here) show 2 ranks equal
to 1 process with the teacher sharded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fixtures.reward_distill import DISTILL_STEPS, distill_values
from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.methods.distill import distillation
from fsdp_recipes.train import losses
from helpers.recipes import read_metrics, recipe_error_in_process


def whole_logits_kd(student_logits, teacher_logits, targets, kd_loss, temperature):
    """The textbook computation: both distributions over the whole vocabulary for every token, masked afterwards."""
    log_q = torch.log_softmax(student_logits.float() / temperature, -1)
    log_p = torch.log_softmax(teacher_logits.float() / temperature, -1)
    if kd_loss == "forward_kl":
        values = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    elif kd_loss == "reverse_kl":
        values = torch.nn.functional.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    else:
        log_m = torch.log((log_p.exp() + log_q.exp()) / 2)
        values = 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)
    return values * (targets != IGNORE_INDEX)


@pytest.mark.parametrize("kd_loss", distillation.KD_LOSSES)
def test_chunked_kd_equals_whole_logits_in_values_and_gradients(kd_loss):
    torch.manual_seed(0)
    tokens, width, teacher_width, vocabulary = 3 * 13, 8, 12, 50
    hidden = torch.randn(3, 13, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocabulary, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocabulary, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(3, 13, teacher_width, dtype=torch.float64)
    teacher_weight = torch.randn(vocabulary, teacher_width, dtype=torch.float64)
    targets = torch.randint(0, vocabulary, (3, 13))
    targets[0, :5] = IGNORE_INDEX  # a prompt
    targets[2, 9:] = IGNORE_INDEX  # padding
    upstream = torch.rand(3, 13, dtype=torch.float64)  # weights every token differently, as a real backward does
    chunked = distillation.chunked_kd_losses(
        hidden, weight, bias, teacher_hidden, teacher_weight, None, targets,
        kd_loss=kd_loss, temperature=2.0, chunk_size=7,
    )  # fmt: skip
    assert chunked.shape == targets.shape and tokens > 7
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight, bias))
    whole = whole_logits_kd(hidden @ weight.T + bias, teacher_hidden @ teacher_weight.T, targets, kd_loss, 2.0)
    whole_grads = torch.autograd.grad((whole * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(chunked, whole.float(), rtol=1e-5, atol=1e-6)
    assert (chunked[targets == IGNORE_INDEX] == 0).all()
    for got, expected in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (chunked_grads[0][targets == IGNORE_INDEX] == 0).all()  # ignored tokens get no gradient


def test_no_saved_tensor_is_as_large_as_the_logits():
    """During the forward of CE + KD from hidden states, autograd keeps nothing of N x vocabulary size (the whole-
    logits computation, checked the same way, does)."""
    torch.manual_seed(0)
    tokens, width, vocabulary = 64, 16, 1000
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocabulary, width, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(tokens, 24), torch.randn(vocabulary, 24)
    targets = torch.randint(0, vocabulary, (tokens,))

    def largest_saved(compute) -> int:
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            compute().sum().backward()
        return max(sizes)

    logits_size = tokens * vocabulary
    chunked = largest_saved(
        lambda: 0.5 * losses.chunked_token_losses(hidden, weight, None, targets, 8)
        + 0.5 * distillation.chunked_kd_losses(
            hidden, weight, None, teacher_hidden, teacher_weight, None, targets,
            kd_loss="forward_kl", temperature=1.0, chunk_size=8,
        )
    )  # fmt: skip
    whole = largest_saved(
        lambda: whole_logits_kd(hidden @ weight.T, teacher_hidden @ teacher_weight.T, targets, "forward_kl", 1.0)
    )
    assert whole >= logits_size
    assert chunked == vocabulary * 24 < logits_size  # the largest: the teacher's output weight (vocabulary x width)


def _tiny(config_path: Path, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path)).train()


def _batch(tokenizer):
    from fsdp_recipes.data.rows import collate_rows, shifted_targets

    rows = []
    for prompt, answer in (("reverse: abc", "cba"), ("reverse: hello", "olleh")):
        ids = tokenizer(prompt + answer)["input_ids"]
        mask = [0] * (len(ids) - len(answer)) + [1] * len(answer)
        rows.append({"input_ids": ids, "targets": shifted_targets(ids, mask), "position_ids": list(range(len(ids)))})
    return collate_rows(rows, tokenizer.pad_token_id)


def test_through_the_models_it_is_the_whole_logits_mix_of_cross_entropy_and_kd(tokenizer, tiny_model_config):
    student, teacher_model = _tiny(tiny_model_config, 1), _tiny(tiny_model_config, 2).eval()
    batch = _batch(tokenizer)
    with torch.no_grad():
        teacher_logits = teacher_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    student_logits = student(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    ce = torch.nn.functional.cross_entropy(
        student_logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).reshape(batch["targets"].shape)
    expected = (0.7 * ce + 0.3 * whole_logits_kd(student_logits, teacher_logits, batch["targets"], "jsd", 1.5)).sum()
    expected_grads = torch.autograd.grad(expected, list(student.parameters()))
    teacher = distillation.TeacherHidden(teacher_model)
    teacher.gather_head()
    loss = distillation.DistillationLoss(student, teacher, kd_ratio=0.3, temperature=1.5, kd_loss="jsd", chunk_size=4)
    got = loss.loss_sum(student, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got_grad, expected_grad in zip(torch.autograd.grad(got, list(student.parameters())), expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert set(loss.last_parts) == {"ce", "kd"}
    # outside the loss the output layer is itself again: generation and plain forwards see logits
    assert student(input_ids=batch["input_ids"]).logits.shape[-1] == student.config.vocab_size


def test_kd_ratio_zero_is_sfts_loss_exactly(tokenizer, tiny_model_config):
    """Same weights, same batch: the loss and every gradient equal SFT's chunked cross-entropy bitwise."""
    batch = _batch(tokenizer)
    sft_model, distilled = _tiny(tiny_model_config, 1), _tiny(tiny_model_config, 1)
    sft_loss = losses.TokenLoss(sft_model, "chunked", chunk_size=4).loss_sum(sft_model, batch)
    teacher = distillation.TeacherHidden(_tiny(tiny_model_config, 2).eval())
    teacher.gather_head()
    kd = distillation.DistillationLoss(
        distilled, teacher, kd_ratio=0.0, temperature=2.0, kd_loss="forward_kl", chunk_size=4
    )
    kd_loss = kd.loss_sum(distilled, batch)
    assert torch.equal(kd_loss, sft_loss)
    sft_loss.backward()
    kd_loss.backward()
    for a, b in zip(sft_model.parameters(), distilled.parameters()):
        assert torch.equal(a.grad, b.grad)


# ------------------------------------------------------------------------------ errors before weights load, in-process
@pytest.fixture
def values(tmp_path, student_config, pretrained_tiny_model, small_chat_data):
    return lambda **overrides: distill_values(
        student_config, pretrained_tiny_model, small_chat_data, tmp_path / "out", **overrides
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kd_ratio": 1.5}, "kd_ratio must be in [0, 1], got 1.5"),
        ({"temperature": 0.0}, "temperature must be a number > 0, got 0.0"),
        ({"kd_loss": "kl"}, "kd_loss 'kl' is not one of forward_kl, reverse_kl, jsd"),
        ({"teacher_model_name_or_path": None}, "teacher_model_name_or_path is required"),
        ({"lmbda": 1.5}, "lmbda must be in [0, 1], got 1.5"),
        ({"lmbda": 0.5, "packing": True}, "lmbda > 0 or seq_kd samples a completion for each row's prompt"),
        ({"seq_kd": True, "packing": True}, "set packing: false"),
    ],
)
def test_refuses_bad_settings(tmp_path, capsys, values, overrides, message):
    assert message in recipe_error_in_process("distill", tmp_path, values(**overrides), capsys)


def test_refuses_a_teacher_with_another_vocabulary_size(tmp_path, capsys, values, pretrained_tiny_model):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    for path in pretrained_tiny_model.iterdir():
        if path.suffix != ".safetensors":  # no weights: the refusal comes before loading them
            (teacher / path.name).write_bytes(path.read_bytes())
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    line = recipe_error_in_process("distill", tmp_path, values(teacher_model_name_or_path=str(teacher)), capsys)
    assert f"has vocab_size {config['vocab_size'] + 8} and the student {config['vocab_size']}" in line
    assert not (tmp_path / "out").exists()


def test_refuses_a_teacher_with_another_tokenizer(tmp_path, capsys, values, pretrained_tiny_model, tokenizer):
    """Same vocabulary size, but one token maps to another id."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_bytes((pretrained_tiny_model / "config.json").read_bytes())
    data = json.loads((pretrained_tiny_model / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(token for token in vocab if len(token) == 1 and token.isalpha())[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(data))
    for path in pretrained_tiny_model.iterdir():
        if path.name.startswith(("tokenizer_config", "special_tokens", "chat_template")):
            (teacher / path.name).write_bytes(path.read_bytes())
    line = recipe_error_in_process("distill", tmp_path, values(teacher_model_name_or_path=str(teacher)), capsys)
    assert "2 token/id entries only in the teacher's, 2 only in the student's: the teacher's has" in line


def test_vocabulary_check_names_the_mismatch(tokenizer, tiny_model_config):
    student = AutoConfig.from_pretrained(tiny_model_config)
    teacher = AutoConfig.from_pretrained(tiny_model_config, vocab_size=student.vocab_size * 2)
    with pytest.raises(ConfigError, match=f"vocab_size {student.vocab_size * 2} and the student {student.vocab_size}"):
        distillation.check_shared_vocabulary(student, teacher, tokenizer, tokenizer, teacher="big")
    distillation.check_shared_vocabulary(student, student, tokenizer, tokenizer, teacher="same")


# -------------------------------------------------------------------------------------------------- the shared runs
@pytest.mark.slow
def test_a_lora_adapter_given_as_the_teacher_is_named_with_its_missing_base(tmp_path, capsys, values):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/gone/base-model"}))
    line = recipe_error_in_process("distill", tmp_path, values(teacher_model_name_or_path=str(adapter)), capsys)
    assert "is a LoRA adapter folder (for the base model '/gone/base-model', which does not exist here)" in line
    assert "a teacher is loaded as a whole model" in line and "export_merged_model" in line


def test_two_ranks_equal_one_process_with_the_teacher_sharded(reward_distill_launches):
    """2 ranks x 4 rows and 1 process x 8 rows give the same losses, parts and gradient norms (rtol 1e-5), with the
    teacher sharded on the 2 ranks (half its weights each, plus its whole output layer)."""
    two, one = reward_distill_launches["distill_two"], reward_distill_launches["distill_one"]
    records_two = {r["step"]: r for r in read_metrics(two) if "loss" in r}
    records_one = {r["step"]: r for r in read_metrics(one) if "loss" in r}
    assert sorted(records_two) == sorted(records_one) == list(range(1, DISTILL_STEPS + 1))
    for name in ("loss", "loss/ce", "loss/kd", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([records_two[s][name] for s in sorted(records_two)], dtype=torch.float64),
            torch.tensor([records_one[s][name] for s in sorted(records_two)], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-6,
        )
    assert records_two[DISTILL_STEPS]["loss"] < records_two[1]["loss"]
    for step in records_two.values():  # the logged loss is the mix of its parts
        assert step["loss"] == pytest.approx(0.5 * step["loss/ce"] + 0.5 * step["loss/kd"], rel=1e-6)
    summary = json.loads((two / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"]["version"] == 2
    assert summary["teacher"]["parameters"] > 2 * summary["total_parameters"]  # the wider teacher, frozen
    teacher_bytes = summary["memory_estimate"]["predicted_per_gpu_bytes"]["teacher_model"]  # half its fp32 weights,
    assert 2 * summary["teacher"]["parameters"] < teacher_bytes < 4 * summary["teacher"]["parameters"]  # + its head
    student = AutoModelForCausalLM.from_pretrained(two)
    assert student.config.hidden_size == 32


# ----------------------------------------------------------------------------------------------- the memory estimate
def test_the_estimate_counts_the_teacher_sharded_and_its_output_layer_whole():
    """Llama-3.1-8B teaching Llama-3.2-1B on 8 GPUs in bf16: the teacher's eighth of its weights in bf16 plus its whole
    128,256 x 4,096 output layer, beside the student's own state."""
    from fsdp_recipes.tools.catalog import Catalog, model_info
    from fsdp_recipes.tools.estimator import MODEL_SHAPES

    catalog = Catalog()
    config = catalog.find("distill/llama-3.1-8b_to_llama-3.2-1b")
    per_gpu = catalog.estimate(config).per_gpu()
    teacher = model_info(MODEL_SHAPES / "meta-llama/Llama-3.1-8B-Instruct" / "config.json")
    head = teacher.vocab_size * teacher.hidden_size * 2
    assert per_gpu["teacher_model"] == pytest.approx(teacher.num_params * 2 / 8 + head, rel=0.01)
    assert per_gpu["reference_model"] == 0
    without = catalog.estimate(
        dataclasses.replace(config, values={**config.values, "teacher_model_name_or_path": None})
    ).per_gpu()
    assert "teacher_model" not in without and without["total"] == per_gpu["total"] - per_gpu["teacher_model"]


def test_the_estimate_counts_the_kd_losss_chunk_buffers():
    """The KD loss holds PEAK_CHUNK_BUFFERS chunk x vocabulary fp32 tensors at its peak where cross-entropy reuses one:
    the 8B -> 1B config's loss term against the same config at kd_ratio 0 (SFT's loss), and the prediction for
    benchmarks/distill_loss_memory.py's shapes against its measured 3.43 GiB (128,256 vocabulary, 2 x 1,024 tokens,
    1,024-token chunks, fp32; docs/reward-and-distillation.md)."""
    from fsdp_recipes.tools.catalog import Catalog, model_info
    from fsdp_recipes.tools.estimator import MODEL_SHAPES
    from fsdp_recipes.tools.estimator.formulas import activation_bytes
    from fsdp_recipes.tools.estimator.recipe import recipe_config
    from fsdp_recipes.tools.estimator.workload import workload_for

    catalog = Catalog()
    config = catalog.find("distill/llama-3.1-8b_to_llama-3.2-1b")
    script = next(recipe.path for recipe in catalog.recipes() if recipe.name == "distill")
    student = model_info(MODEL_SHAPES / "meta-llama/Llama-3.2-1B" / "config.json")

    def loss_bytes(info=student, compute_bytes=2, **changes):
        workload = workload_for(recipe_config({**config.values, **changes}, script=script, where=config.key))
        return activation_bytes(info, workload, compute_bytes)["logits"]

    chunk = 4 * student.vocab_size * config.values["loss_chunk_size"]
    assert distillation.PEAK_CHUNK_BUFFERS > 1
    assert loss_bytes() - loss_bytes(kd_ratio=0.0) == (distillation.PEAK_CHUNK_BUFFERS - 1) * chunk
    benchmark = dict(max_length=1024, per_device_train_batch_size=2, loss_chunk_size=1024)  # its student: hidden 64
    measured = 3.43 * 2**30
    assert loss_bytes(dataclasses.replace(student, hidden_size=64), 4, **benchmark) == pytest.approx(measured, rel=0.05)
