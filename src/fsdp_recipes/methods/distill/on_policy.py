"""On-policy distillation (TRL's GKD; Agarwal et al., 2024): on a share `lmbda` of the optimizer steps the student
trains on completions it samples itself from the data's prompts, scored token by token by the teacher, so it learns
where its own mistakes take it rather than only along the data's completions; with `seq_kd` the other steps train on
completions the teacher samples (sequence-level KD) instead of the data's.

Which steps are on-policy is drawn from (seed, step), and each completion's sampling noise is keyed by (seed, step,
its prompt's tokens): neither depends on the number of ranks or micro-batches, and a resumed run draws what the
stopped one would have. A row's prompt is its tokens before its first training target; rows hold one example each
(packing is refused with `lmbda` or `seq_kd`), so a multi-turn example is cut at its first assistant reply and the
sampled completion replaces everything after it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import torch

from fsdp_recipes.data.rows import IGNORE_INDEX, collate_rows, shifted_targets
from fsdp_recipes.train import generation, weight_sync


def is_on_policy_step(lmbda: float, seed: int, step: int) -> bool:
    """Whether optimizer step `step` trains on the student's own samples: true on a share `lmbda` of the steps."""
    if lmbda <= 0:
        return False
    if lmbda >= 1:
        return True
    return random.Random(f"on-policy:{seed}:{step}").random() < lmbda


def sampling_key(step: int, prompt: list[int]) -> int:
    """A completion's sampling key (with the run's seed): its step and its prompt's tokens, not its place in a batch."""
    digest = hashlib.blake2b(f"{step}:{','.join(map(str, prompt))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**61


def prompts_of(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each row's prompt: its tokens up to and including the one that predicts its first training target (the whole
    row where it has no target)."""
    prompts = []
    for ids, targets, real in zip(
        batch["input_ids"].tolist(), batch["targets"].tolist(), batch["real_tokens"].tolist()
    ):
        first = next((i for i, target in enumerate(targets[:real]) if target != IGNORE_INDEX), real - 1)
        prompts.append(ids[: first + 1])
    return prompts


def with_sampled_completions(
    micro_batches: list[dict[str, torch.Tensor]],
    generator: torch.nn.Module,
    tokenizer,
    settings: generation.GenerationSettings,
    *,
    step: int,
    max_length: int,
    pad_token_id: int,
    synced_gpus: bool,
) -> list[dict[str, torch.Tensor]]:
    """Collective under FSDP/TP (`synced_gpus`). The micro-batches with each row's completion replaced by one
    `generator` samples from the row's prompt (one generation pass over all of this rank's rows); the sampled
    tokens, up to and including the end-of-sequence token and cut at `max_length`, are the new training targets."""
    prompts = [prompt for batch in micro_batches for prompt in prompts_of(batch)]
    completions, _ = generation.generate_completions(
        generator, tokenizer, prompts, [sampling_key(step, p) for p in prompts], settings, synced_gpus=synced_gpus
    )
    rows, made = [], []
    for prompt, completion in zip(prompts, completions):
        ids = (prompt + completion)[:max_length]
        mask = ([0] * len(prompt) + [1] * len(completion))[:max_length]
        rows.append({"input_ids": ids, "targets": shifted_targets(ids, mask), "position_ids": list(range(len(ids)))})
    start = 0
    for batch in micro_batches:
        count = batch["input_ids"].shape[0]
        collated = collate_rows(rows[start : start + count], pad_token_id)
        made.append({key: value.to(batch["input_ids"].device) for key, value in collated.items()})
        start += count
    return made


@dataclasses.dataclass
class OnPolicy:
    """A run's GKD settings (`lmbda`, `seq_kd`) and how it samples (at the KD temperature, `max_new_tokens`); with a
    vLLM server, the student's weights it holds (`server_weights`), pushed before each on-policy pass that follows a
    step, and the run's every-rank guard the server's requests go through."""

    lmbda: float
    seq_kd: bool
    seed: int
    max_length: int
    settings: generation.GenerationSettings
    reshard_after_forward: bool
    server_weights: weight_sync.ServerWeights | None = None
    on_every_rank: object = None
    output_dir: str = ""

    @classmethod
    def from_config(cls, config, run) -> OnPolicy:
        server = run.generation_server
        settings = generation.GenerationSettings(
            config.max_new_tokens, temperature=config.temperature, batch_size=config.per_device_eval_batch_size,
            seed=config.seed, **generation.backend_options(config), server=server,
        )  # fmt: skip
        reshard = generation.reshard_after_forward(run.accelerator)
        weights = weight_sync.ServerWeights.for_run(run, config)
        return cls(
            config.lmbda, config.seq_kd, config.seed, config.max_length, settings, reshard, weights, run.on_every_rank,
            config.output_dir,
        )  # fmt: skip

    def close(self) -> dict:
        """The weight pushes' count and seconds (vLLM), for the summary."""
        return self.server_weights.close() if self.server_weights is not None else {}

    def batches(self, micro_batches, step: int, student, teacher, tokenizer, *, synced_gpus: bool):
        """Collective when it samples. (The step's micro-batches, whether they hold the student's own samples):
        the data's on a step that is neither on-policy nor `seq_kd`, else sampled by the student (a share `lmbda`
        of the steps) or the teacher, each model's weights gathered once for the pass."""
        students = is_on_policy_step(self.lmbda, self.seed, step)
        if not (students or self.seq_kd):
            return micro_batches, False
        sampler = student if students else teacher
        if self.server_weights is not None:  # the student on the vLLM server (seq_kd is refused with it)
            weights = self.server_weights
            with weight_sync.resumable_when_the_server_fails(self.output_dir, main_process=weights.main_process):
                weights.push(student, version=step - 1)
                sampled = self.on_every_rank(
                    lambda: with_sampled_completions(
                        micro_batches, student, tokenizer, self.settings, step=step, max_length=self.max_length,
                        pad_token_id=tokenizer.pad_token_id, synced_gpus=False,
                    )
                )  # fmt: skip
            return sampled, True
        with generation.weights_gathered(sampler, enabled=True, reshard_after_forward=self.reshard_after_forward):
            sampled = with_sampled_completions(
                micro_batches, sampler, tokenizer, self.settings, step=step, max_length=self.max_length,
                pad_token_id=tokenizer.pad_token_id, synced_gpus=synced_gpus,
            )  # fmt: skip
        return sampled, students
