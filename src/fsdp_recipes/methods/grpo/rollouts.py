"""The data of online RL: which prompts each step samples (`PromptSchedule`), the completions the policy generates
for them (`generate_completions`, the one place a faster generation backend such as vLLM would go), and the rows the
loss reads (`rollout_batch`, `completion_log_probs`).

Every step's global batch is fixed by (seed, round) alone: the prompts of round r are the next ones of a permutation of
the data drawn per epoch from the seed, each repeated `num_generations` times (a group), and the completion slots are
dealt to ranks in contiguous equal parts. A slot's sampling noise is seeded by (seed, round, prompt index, generation
index), so a completion does not depend on the number of ranks, and a resumed run draws exactly what the stopped one
would have: no sampler state needs saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator

import torch

from fsdp_recipes.distributed.collectives import gather_tensors
from fsdp_recipes.methods.grpo import padding_free as packing
from fsdp_recipes.methods.grpo.groups import ScoredSlots
from fsdp_recipes.methods.grpo.policy_gradient import (
    advantages_of,
    entropy_threshold,
    token_log_probs,
    zero_std_fraction,
)
from fsdp_recipes.models.experts import generation_options
from fsdp_recipes.train.evaluation import ReproducibleSampling


class PromptSchedule:
    """The prompts of each round: `prompts_per_round` consecutive entries of an endless stream of permutations of
    `range(prompt_count)`, one per epoch, each drawn from (seed, epoch). Round r starts at position r x
    prompts_per_round plus the prompts drawn beyond their rounds' share so far (`more_prompts`, dynamic sampling's
    extra passes), which is all a checkpoint needs to record (`state_dict`): the stream itself is a function of the
    seed. `epoch` / `batches_into_epoch` (rounds started in it) are what progress.json shows of it."""

    def __init__(self, prompt_count: int, prompts_per_round: int, *, seed: int):
        self.prompt_count, self.prompts_per_round, self.seed = prompt_count, prompts_per_round, seed
        self.epoch, self.batches_into_epoch = 0, 0
        self.extra_prompts_drawn = 0
        self._next_position = 0
        self._permutations: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {epoch: torch.randperm(self.prompt_count, generator=generator).tolist()}
        return self._permutations[epoch]

    def _take(self, start: int, count: int) -> list[int]:
        chosen = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.prompt_count)
            chosen.append(self._permutation(epoch)[offset])
        self._next_position = start + count
        return chosen

    def prompts_for_round(self, round_index: int) -> list[int]:
        start = round_index * self.prompts_per_round + self.extra_prompts_drawn
        self.epoch = start // self.prompt_count
        first_round_of_epoch = -(-self.epoch * self.prompt_count // self.prompts_per_round)  # the first to start in it
        self.batches_into_epoch = round_index - first_round_of_epoch + 1
        return self._take(start, self.prompts_per_round)

    def more_prompts(self, count: int) -> list[int]:
        """The next `count` prompts of the stream, drawn within the current round (they shift later rounds)."""
        self.extra_prompts_drawn += count
        return self._take(self._next_position, count)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batches_into_epoch": self.batches_into_epoch,
            "extra_prompts_drawn": self.extra_prompts_drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream of a checkpoint (written between rounds)."""
        self.extra_prompts_drawn = int(state.get("extra_prompts_drawn", 0))


def rank_slots(prompt_indices: list[int], num_generations: int, *, rank: int, world_size: int) -> list[tuple[int, int]]:
    """This rank's (prompt index, generation index) slots of a round: the round's groups laid end to end, dealt to
    ranks in contiguous equal parts (a group may span two ranks)."""
    slots = [(prompt, generation) for prompt in prompt_indices for generation in range(num_generations)]
    per_rank = len(slots) // world_size
    return slots[rank * per_rank : (rank + 1) * per_rank]


def sampling_key(round_index: int, prompt_index: int, generation_index: int, attempt: int = 0) -> int:
    """The index a slot's sampling noise is seeded by (with the run's seed); `attempt` counts a round's generation
    passes (dynamic sampling draws again, with fresh noise, for more prompts)."""
    key = ((round_index * 1_000_003 + prompt_index) * 10_007 + generation_index) % 2**61
    return key if attempt == 0 else (key * 1_009 + attempt) % 2**61


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


def rollout_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    *,
    pad_token_id: int,
    prompt_width: int,
    completion_width: int,
) -> dict[str, torch.Tensor]:
    """Rows of prompt (left-padded to `prompt_width`) then completion (right-padded to `completion_width`): the same
    widths on every rank (the round's longest), so a row's values do not depend on its batch neighbours.
    `completion_mask` is 1 on each completion's tokens."""
    rows = len(prompt_ids)
    input_ids = torch.full((rows, prompt_width + completion_width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        input_ids[row, prompt_width : prompt_width + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, prompt_width - len(prompt) : prompt_width + len(completion)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "completion_ids": input_ids[:, prompt_width:],
        "completion_mask": attention_mask[:, prompt_width:].clone(),
    }


def rows_run(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows the policy pass runs on (the packed ones with `padding_free`) and their real tokens: what the
    throughput and `padding_fraction` figures count."""
    return {"input_ids": batch.get("packed_input_ids", batch["input_ids"]), "real_tokens": batch["real_tokens"]}


def completion_log_probs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability under `model` (at the sampling temperature) and the entropy there,
    [rows, completion width] (fp32; values at padding are meaningless: weight them by the mask). From the packed
    layout when the batch has one (`padding_free`)."""
    if "packed_input_ids" in batch:
        return packing.completion_log_probs(model, batch, temperature)
    completion_width = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=completion_width + 1,  # the output layer runs on the positions predicting completions only
    ).logits
    predicting = logits[:, -completion_width - 1 : -1]
    return token_log_probs(predicting, batch["completion_ids"], temperature)


@torch.no_grad()
def values_before_step(
    accelerator,
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    first_of_round: bool,
    keep_old_log_probs: bool,
    reference_log_probs,
    temperature: float,
    top_entropy_quantile: float,
) -> None:
    """Collective. What a step's loss needs before its first gradient pass, added to its micro-batches: at a round's
    first step the policy's log-probabilities as it generated (`old_log_probs`, the ratio's denominator, when the
    round serves several steps) and the reference's (`reference_log_probs(batch)`, when there is a KL term); at every
    step, when `top_entropy_quantile` < 1, `entropy_mask`: the completion tokens whose entropy under the current
    policy is in that top share of the step's GLOBAL batch (every rank and micro-batch: one threshold, whatever the
    split; it costs this forward pass without gradients)."""
    entropies = []
    for part in micro_batches:
        if (first_of_round and keep_old_log_probs) or top_entropy_quantile < 1:
            values, entropy = completion_log_probs(model, part, temperature)
            if first_of_round and keep_old_log_probs:
                part["old_log_probs"] = values
            entropies.append(entropy)
        if first_of_round and reference_log_probs is not None:
            part["reference_log_probs"] = reference_log_probs(part)
    if top_entropy_quantile < 1:
        masks = torch.cat([part["completion_mask"] for part in micro_batches])
        threshold = entropy_threshold(
            gather_tensors(accelerator, torch.cat(entropies)), gather_tensors(accelerator, masks), top_entropy_quantile
        )
        for part, entropy in zip(micro_batches, entropies):
            part["entropy_mask"] = ((entropy >= threshold) & part["completion_mask"].bool()).float()


class Stopwatch:
    """Seconds spent per phase of a step (generation, scoring, training), for the step-time breakdown."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def shares(self) -> dict[str, float]:
        total = sum(self.seconds.values()) or 1.0
        return {f"time/{name}_share": value / total for name, value in self.seconds.items()}


def assemble_round(
    chosen: ScoredSlots,
    generated: ScoredSlots,
    prompt_ids: list[list[int]],
    *,
    rank: int,
    world_size: int,
    device,
    function_names: list[str],
    num_generations: int,
    scale_rewards: str,
    advantage_estimator: str,
    mask_truncated_completions: bool,
    rows_per_micro_batch: int,
    pad_token_id: int,
    padding_free: bool,
    kept_groups: int,
    generation_passes: int,
) -> tuple[list[dict[str, torch.Tensor]], float, dict[str, float], ScoredSlots, torch.Tensor]:
    """The round's training data, from the groups `chosen` (the same on every rank, slot order) out of everything
    `generated` this round: this rank's contiguous share made into micro-batches (rows padded to the widest prompt and
    completion of the whole batch, so a row does not depend on the split; `padding_free` adds their packed layout),
    the global count of loss tokens, the round's figures under TRL's names (over every generated completion), and
    this rank's slots with their advantages. No collective: the inputs are global."""
    advantages = advantages_of(chosen.rewards, num_generations, scale_rewards, advantage_estimator)
    masks = [0 if t and mask_truncated_completions else 1 for t in chosen.truncated]
    global_tokens = float(sum(len(c) * m for c, m in zip(chosen.completion_ids, masks)))
    prompt_width = max(len(prompt_ids[p]) for p in chosen.prompt_indices)
    completion_width = max(map(len, chosen.completion_ids))
    per_rank = len(chosen) // world_size
    share = range(rank * per_rank, (rank + 1) * per_rank)
    mine = chosen.select(list(share))
    batch = rollout_batch(
        [prompt_ids[p] for p in mine.prompt_indices],
        mine.completion_ids,
        pad_token_id=pad_token_id,
        prompt_width=prompt_width,
        completion_width=completion_width,
    )
    batch["advantages"] = advantages[share.start : share.stop]
    batch["completion_mask"] *= torch.tensor([masks[s] for s in share], dtype=torch.long).unsqueeze(1)
    batch["real_tokens"] = batch["attention_mask"].sum(dim=1)
    micro_batches = []
    for start in range(0, per_rank, rows_per_micro_batch):
        part = {key: value[start : start + rows_per_micro_batch] for key, value in batch.items()}
        if padding_free:
            part.update(packing.packed_rows(part, row_width=prompt_width + completion_width, pad_token_id=pad_token_id))
        micro_batches.append({key: value.to(device) for key, value in part.items()})
    lengths = torch.tensor([len(c) for c in generated.completion_ids], dtype=torch.float)
    scored = (~generated.per_function.isnan()).sum(dim=0).clamp(min=1)
    totals = generated.per_function.nan_to_num(0.0).sum(dim=0)
    figures = {
        "reward": float(generated.rewards.mean()),
        "reward_std": float(generated.rewards.std()),
        **{f"rewards/{name}/mean": float(totals[i] / scored[i]) for i, name in enumerate(function_names)},
        "frac_reward_zero_std": zero_std_fraction(generated.rewards, num_generations),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(torch.tensor(generated.truncated, dtype=torch.float).mean()),
        "tokens/generated": int(lengths.sum()),
        "dynamic_sampling/kept_groups": kept_groups,
        "dynamic_sampling/generation_rounds": generation_passes,
    }
    return micro_batches, global_tokens, figures, mine, advantages[share.start : share.stop]
