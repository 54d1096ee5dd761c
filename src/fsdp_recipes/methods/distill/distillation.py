"""Knowledge distillation: a student's per-token loss `(1 - kd_ratio) x CE + kd_ratio x KD`, where CE is the
cross-entropy on the data's targets (computed exactly as SFT computes it, `losses.chunked_token_losses`) and KD compares
the student's next-token distribution with a frozen teacher's, both softened by `temperature`, on the same tokens:

- forward_kl: KL(teacher || student), the usual distillation loss (the student covers all the teacher's mass);
- reverse_kl: KL(student || teacher) (mode-seeking: the student may drop the teacher's unlikely tokens);
- jsd: the Jensen-Shannon divergence, the mean of both KLs to the average distribution (symmetric, bounded by log 2).

Neither model's logits exist whole: KD runs `chunk_size` tokens at a time from the final hidden states of both models
(`ChunkedDistillation`); each chunk's fp32 logits are made, used and freed, and are made again in backward, so what
autograd keeps is the hidden states and the output layers' weights, never an N x vocabulary tensor. Only tokens that
carry loss go through the output layers.

The teacher's final hidden states come from its own forward with its output layer bypassed (`TeacherHidden`); its
output layer's weight is gathered whole once (`full_weight`: under FSDP2 a collective, at set-up) and kept on every
rank, since KD needs it while the student's step runs, after the teacher's sharded forward has released its weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.data.rows import IGNORE_INDEX
from fsdp_recipes.distributed import sequence_parallel, tensor_parallel
from fsdp_recipes.distributed.sequence_parallel import SequenceShards
from fsdp_recipes.train.losses import _logits_transform, chunked_token_losses, model_inputs

KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")

# chunk x vocabulary fp32 tensors the loss holds at its peak, for the memory estimate: per chunk both models' logits,
# both log-probabilities, the teacher's probabilities and their product in forward, the autograd graph of the
# recomputed chunk in backward, besides cross-entropy's buffer. Measured (benchmarks/distill_loss_memory.py, 128,256
# vocabulary, 2 x 1,024 tokens, kd_ratio 0.5): 3.43 GiB with 1,024-token chunks = 7.0 chunks, 0.95 GiB with 256 = 7.8
# chunks. With kd_ratio 1 there is no cross-entropy: one chunk fewer, so 7 is then an upper bound.
PEAK_CHUNK_BUFFERS = 7


def kd_token_losses(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kd_loss: str, temperature: float):
    """Per-row divergence between the softened distributions of two [rows, vocabulary] fp32 logit tensors."""
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    if kd_loss == "forward_kl":
        return (teacher.exp() * (teacher - student)).sum(-1)
    if kd_loss == "reverse_kl":
        return (student.exp() * (student - teacher)).sum(-1)
    if kd_loss == "jsd":
        mixture = torch.logaddexp(student, teacher) - math.log(2.0)
        return 0.5 * (teacher.exp() * (teacher - mixture)).sum(-1) + 0.5 * (student.exp() * (student - mixture)).sum(-1)
    raise ValueError(f"kd_loss {kd_loss!r} is not one of {KD_LOSSES}")


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits, computed in the weights' dtype as the model's own output layer would (then upcast)."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    return logits.float()


class ChunkedDistillation(torch.autograd.Function):
    """Per-token KD loss of `hidden @ weight.T (+ bias)` (the student) against `teacher_hidden @ teacher_weight.T (+
    teacher_bias)`, `chunk_size` tokens at a time. Backward recomputes each chunk's logits and differentiates that chunk
    alone (a checkpoint per chunk), so one chunk's logits exist at once. Gradients flow to the student's hidden states,
    weight and bias; the teacher's inputs are constants."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, settings):
        kd_loss, temperature, chunk_size = settings
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            losses[rows] = kd_token_losses(
                _logits(hidden[rows], weight, bias),
                _logits(teacher_hidden[rows], teacher_weight, teacher_bias),
                kd_loss,
                temperature,
            )
        ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
        ctx.settings = settings
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = ctx.saved_tensors
        kd_loss, temperature, chunk_size = ctx.settings
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias) if bias is not None else None
        weight_leaf = weight.detach().requires_grad_()
        bias_leaf = bias.detach().requires_grad_() if bias is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            with torch.no_grad():
                teacher_logits = _logits(teacher_hidden[rows], teacher_weight, teacher_bias)
            with torch.enable_grad():
                hidden_leaf = hidden[rows].detach().requires_grad_()
                chunk = kd_token_losses(
                    _logits(hidden_leaf, weight_leaf, bias_leaf), teacher_logits, kd_loss, temperature
                )
                leaves = [hidden_leaf, weight_leaf] + ([bias_leaf] if bias_leaf is not None else [])
                grads = torch.autograd.grad(chunk, leaves, grad_outputs=grad_losses[rows])
            grad_hidden[rows] = grads[0]
            grad_weight += grads[1]
            if grad_bias is not None:
                grad_bias += grads[2]
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_kd_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    kd_loss: str,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """Per-token KD loss shaped like `targets` ([..., T]), 0 where the target is IGNORE_INDEX (only the tokens that
    carry loss go through either output layer)."""
    if kd_loss not in KD_LOSSES:
        raise ValueError(f"kd_loss {kd_loss!r} is not one of {KD_LOSSES}")
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    keep = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    losses = torch.zeros(flat_targets.shape, dtype=torch.float32, device=hidden.device)
    settings = (kd_loss, temperature, chunk_size)
    if keep.numel():
        kept = ChunkedDistillation.apply(
            flat_hidden[keep], weight, bias, flat_teacher[keep], teacher_weight, teacher_bias, settings
        )
        return losses.index_put((keep,), kept).reshape(targets.shape)
    # no target here: still a result that depends on the student's weights (every rank runs backward under FSDP)
    first = ChunkedDistillation.apply(
        flat_hidden[:1], weight, bias, flat_teacher[:1], teacher_weight, teacher_bias, settings
    )
    return (losses + 0.0 * first.sum()).reshape(targets.shape)


def full_weight(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as one whole local tensor: FSDP2's sharded DTensor gathered (a collective: every rank calls it), a
    plain tensor as it is; detached."""
    if tensor is None:
        return None
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach()


class TeacherHidden:
    """`teacher_hidden(batch)`: the frozen teacher's final hidden states for a batch of rows, from its own (sharded)
    forward with its output layer bypassed; and its output layer's `weight`/`bias`, gathered whole once. Build it on
    the unsharded teacher, call `gather_head` once sharded."""

    def __init__(self, teacher: torch.nn.Module):
        self.teacher = teacher
        self.head = teacher.get_output_embeddings()
        self.weight = self.bias = None
        self._bypass = False
        original = self.head.forward
        self.head.forward = lambda hidden: hidden if self._bypass else original(hidden)

    def gather_head(self) -> None:
        self.weight = full_weight(self.head.weight)
        self.bias = full_weight(getattr(self.head, "bias", None))

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self._bypass = True
        try:
            return self.teacher(**model_inputs(self.teacher, batch)).logits
        finally:
            self._bypass = False


class DistillationLoss:
    """The student's per-token loss `(1 - kd_ratio) x CE + kd_ratio x KD` from its final hidden states, computed in its
    own forward by its output layer (as `losses.TokenLoss` does for SFT: FSDP2 has that layer's weight gathered there;
    outside the loss the layer behaves as before). Build it on the unprepared student, before `accelerator.prepare`."""

    def __init__(
        self,
        student: torch.nn.Module,
        teacher: TeacherHidden,
        *,
        kd_ratio: float,
        temperature: float,
        kd_loss: str,
        chunk_size: int = 1024,
        sequence_shards: SequenceShards | None = None,
    ):
        if kd_loss not in KD_LOSSES:
            raise ValueError(f"kd_loss {kd_loss!r} is not one of {KD_LOSSES}")
        self.teacher, self.kd_ratio, self.temperature, self.kd_loss = teacher, kd_ratio, temperature, kd_loss
        self.chunk_size = chunk_size
        self.sequence_shards = sequence_shards  # the run's sequence-parallel group (None: whole rows)
        self.head = student.get_output_embeddings()
        self._active: dict | None = None
        self._returned = None
        self.last_parts: dict[str, torch.Tensor] = {}
        self._parts: dict[
            str, torch.Tensor
        ] = {}  # the last forward's per-token parts (sequence parallelism gathers them)
        self.router_logits = None  # a mixture of experts with output_router_logits: the student's last forward's
        original = self.head.forward
        self.head.forward = lambda hidden: original(hidden) if self._active is None else self._head_forward(hidden)
        self.description = (
            f"(1 - {kd_ratio}) x cross-entropy + {kd_ratio} x {kd_loss} at temperature {temperature}, "
            f"{chunk_size} tokens per chunk"
        )

    def token_losses(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], *, kd_ratio: float | None = None
    ) -> torch.Tensor:
        """Per-token loss shaped like the batch's targets (0 where there is no target), fp32. A collective under FSDP
        (the teacher's forward, then the student's). `kd_ratio`: this batch's, instead of the configured one (the
        student's own samples train on KD alone: cross-entropy on them would teach it what it already says). Under
        sequence parallelism (`sequence_shards`) each rank runs both models on its slice of every row, and the loss and
        its parts come back whole on every rank of the group (distributed/sequence_parallel.py)."""
        inputs = model_inputs(model, batch)
        targets = batch["targets"].reshape(inputs["input_ids"].shape)
        ratio = self.kd_ratio if kd_ratio is None else kd_ratio
        shards = self.sequence_shards
        if shards is None:
            return self._losses_of(model, inputs, targets, ratio).reshape(batch["targets"].shape)

        def with_parts(local_inputs, local_targets):  # the parts ride along: a rank's own sums would be its slice's
            total = self._losses_of(model, local_inputs, local_targets, ratio)
            return torch.stack([total, *(part.reshape(total.shape) for part in self._parts.values())], dim=-1)

        stacked = shards.per_token(with_parts, inputs, targets, IGNORE_INDEX)
        self.last_parts = {name: stacked[..., 1 + k].detach().sum() for k, name in enumerate(self._parts)}
        return stacked[..., 0].reshape(batch["targets"].shape)

    def _losses_of(self, model, inputs: dict[str, torch.Tensor], targets: torch.Tensor, ratio: float) -> torch.Tensor:
        teacher_hidden = self.teacher(inputs)
        self._active = {"targets": targets, "teacher": teacher_hidden, "kd_ratio": ratio}
        try:
            output = model(**inputs)
        finally:
            self._active = None
        losses, self.router_logits = output.logits, getattr(output, "router_logits", None)
        if losses is not self._returned:  # check_no_logits_transform refuses known cases before loading
            raise RuntimeError("the student transformed its output layer's result: distillation cannot run on it")
        self._returned = None
        return losses.reshape(targets.shape)

    def loss_sum(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], *, kd_ratio: float | None = None
    ) -> torch.Tensor:
        return self.token_losses(model, batch, kd_ratio=kd_ratio).sum()

    def router_logits_of(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The student's router logits on `batch` (`train.router_balance`'s pass before the step): its forward with
        the output layer bypassed, no teacher."""
        self._active = {"router_only": True}
        try:
            return model(**model_inputs(model, batch)).router_logits
        finally:
            self._active = None

    def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self._active.get("router_only") else self._losses(hidden)

    def _losses(self, hidden: torch.Tensor) -> torch.Tensor:
        targets, teacher_hidden, kd_ratio = self._active["targets"], self._active["teacher"], self._active["kd_ratio"]
        # a vocabulary-sharded output layer (tensor parallelism) is gathered whole for the loss
        weight, bias = tensor_parallel.full_weight(self.head.weight), getattr(self.head, "bias", None)
        parts = {}
        total = None
        if kd_ratio < 1:
            parts["ce"] = chunked_token_losses(hidden, weight, bias, targets, self.chunk_size)
            total = (1 - kd_ratio) * parts["ce"]
        if kd_ratio > 0:
            parts["kd"] = chunked_kd_losses(
                hidden,
                weight,
                bias,
                teacher_hidden.to(hidden.device),
                self.teacher.weight,
                self.teacher.bias,
                targets,
                kd_loss=self.kd_loss,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
            )
            total = parts["kd"] * kd_ratio if total is None else total + kd_ratio * parts["kd"]
        self.last_parts = {name: value.detach().sum() for name, value in parts.items()}  # read at logging steps
        self._parts = {name: value.detach() for name, value in parts.items()}
        self._returned = total
        return total


def check_shared_vocabulary(student_config, teacher_config, student_tokenizer, teacher_tokenizer, *, teacher: str):
    """Before loading: KD compares two distributions token by token, so both models must have the same vocabulary
    size and tokenizers that map text to the same ids. ConfigError naming the mismatch."""
    student_size = student_config.get_text_config().vocab_size
    teacher_size = teacher_config.get_text_config().vocab_size
    if student_size != teacher_size:
        raise ConfigError(
            f"the teacher {teacher!r} has vocab_size {teacher_size} and the student {student_size} (their config.json): "
            "distillation compares their next-token distributions id by id, so they need one vocabulary. Pick a "
            "teacher and student of one family (e.g. Llama-3.1-8B and Llama-3.2-1B)"
        )
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        only_teacher = sorted(set(teacher_vocab.items()) - set(student_vocab.items()), key=lambda item: item[1])
        only_student = sorted(set(student_vocab.items()) - set(teacher_vocab.items()), key=lambda item: item[1])
        shown = "; ".join(
            f"the {side}'s has " + ", ".join(f"{token!r}->{index}" for token, index in entries[:3])
            for side, entries in (("teacher", only_teacher), ("student", only_student))
            if entries
        )
        raise ConfigError(
            f"the teacher {teacher!r} (teacher_model_name_or_path) and the student (tokenizer_name_or_path, else "
            f"model_name_or_path) have different tokenizers ({len(only_teacher)} token/id entries only in the "
            f"teacher's, {len(only_student)} only in the student's: {shown}): the same text would be different ids "
            "for each. Use the teacher's tokenizer for the student (tokenizer_name_or_path), or a teacher of the "
            "student's family"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student_tokenizer, name) != getattr(teacher_tokenizer, name):
            raise ConfigError(
                f"the teacher {teacher!r} and the student's tokenizers have different {name}s (the teacher's "
                f"{getattr(teacher_tokenizer, name)}, the student's {getattr(student_tokenizer, name)}): use one "
                "tokenizer"
            )


def check_no_logits_transform(model_config, *, which: str) -> None:
    """Before loading: KD works from hidden states through the output layer, so a model that transforms its logits
    after it (soft-capping, scaling) would be distilled from the wrong distribution. ConfigError."""
    reason = _logits_transform(model_config)
    if reason:
        raise ConfigError(
            f"the {which} ({model_config.model_type}) {reason} after its output layer, which chunked distillation "
            "does not reproduce: pick a model family without it"
        )


def check_teacher_splits(teacher_config, sp: int) -> None:
    """Before loading, under sequence parallelism (`sp`: the run's `parallel.sp`): the teacher's heads split as the
    student's (its forward runs on the same slices of every row). ConfigError."""
    problems = sequence_parallel.model_problems(sp, teacher_config, attn_implementation=None, recipe="distill")
    if problems:
        raise ConfigError([f"the teacher: {problem}" for problem in problems])
