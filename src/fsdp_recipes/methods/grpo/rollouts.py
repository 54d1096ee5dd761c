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

from fsdp_recipes.methods.grpo.policy_gradient import token_log_probs
from fsdp_recipes.train.evaluation import ReproducibleSampling


class PromptSchedule:
    """The prompts of each round: `prompts_per_round` consecutive entries of an endless sequence of permutations of
    `range(prompt_count)`, one per epoch, each drawn from (seed, epoch). `epoch` / `batches_into_epoch` (rounds
    started in it) and `state_dict` are what a checkpoint records of it. A resume restores nothing: a round's prompts
    are a function of its index and the seed, and the step gives the index."""

    def __init__(self, prompt_count: int, prompts_per_round: int, *, seed: int):
        self.prompt_count, self.prompts_per_round, self.seed = prompt_count, prompts_per_round, seed
        self.epoch, self.batches_into_epoch = 0, 0
        self._permutations: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {epoch: torch.randperm(self.prompt_count, generator=generator).tolist()}
        return self._permutations[epoch]

    def prompts_for_round(self, round_index: int) -> list[int]:
        start = round_index * self.prompts_per_round
        chosen = []
        for position in range(start, start + self.prompts_per_round):
            epoch, offset = divmod(position, self.prompt_count)
            chosen.append(self._permutation(epoch)[offset])
        self.epoch = start // self.prompt_count
        first_round_of_epoch = -(-self.epoch * self.prompt_count // self.prompts_per_round)  # the first to start in it
        self.batches_into_epoch = round_index - first_round_of_epoch + 1
        return chosen

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_into_epoch": self.batches_into_epoch}


def rank_slots(prompt_indices: list[int], num_generations: int, *, rank: int, world_size: int) -> list[tuple[int, int]]:
    """This rank's (prompt index, generation index) slots of a round: the round's groups laid end to end, dealt to
    ranks in contiguous equal parts (a group may span two ranks)."""
    slots = [(prompt, generation) for prompt in prompt_indices for generation in range(num_generations)]
    per_rank = len(slots) // world_size
    return slots[rank * per_rank : (rank + 1) * per_rank]


def sampling_key(round_index: int, prompt_index: int, generation_index: int) -> int:
    """The index a slot's sampling noise is seeded by (with the run's seed)."""
    return ((round_index * 1_000_003 + prompt_index) * 10_007 + generation_index) % 2**61


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


def completion_log_probs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability under `model` (at the sampling temperature) and the entropy there,
    [rows, completion width] (fp32; values at padding are meaningless: weight them by the mask)."""
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
    accelerator,
    *,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    truncated: list[bool],
    rewards: torch.Tensor,
    per_function: torch.Tensor,
    function_names: list[str],
    num_generations: int,
    scale_rewards: str,
    mask_truncated_completions: bool,
    rows_per_micro_batch: int,
    pad_token_id: int,
) -> tuple[list[dict[str, torch.Tensor]], float, dict[str, float]]:
    """Collective. This rank's scored completions made into training micro-batches: rewards gathered over ranks (the
    global batch, slot order) give the group-normalised advantages; rows padded to the round's widest prompt and
    completion on any rank. Returns the micro-batches (on the device), the global count of loss tokens, and the
    round's figures under TRL's names (the same on every rank)."""
    from fsdp_recipes.methods.grpo.policy_gradient import group_advantages, zero_std_fraction

    device, rank = accelerator.device, accelerator.process_index
    all_rewards = accelerator.gather(rewards.to(device)).cpu()
    all_per_function = accelerator.gather(per_function.T.contiguous().to(device)).cpu()
    lengths = accelerator.gather(torch.tensor([len(c) for c in completion_ids], device=device)).cpu()
    all_truncated = accelerator.gather(torch.tensor(truncated, device=device)).cpu()
    widths = accelerator.gather(torch.tensor([[max(map(len, prompt_ids)), int(lengths.max())]], device=device))
    prompt_width, completion_width = widths.amax(dim=0).tolist()
    share = len(completion_ids)
    batch = rollout_batch(
        prompt_ids,
        completion_ids,
        pad_token_id=pad_token_id,
        prompt_width=prompt_width,
        completion_width=completion_width,
    )
    batch["advantages"] = group_advantages(all_rewards, num_generations, scale_rewards)[
        rank * share : (rank + 1) * share
    ]
    if mask_truncated_completions:
        batch["completion_mask"] *= (~torch.tensor(truncated)).long().unsqueeze(1)
    batch["real_tokens"] = batch["attention_mask"].sum(dim=1)
    global_tokens = float(accelerator.reduce(batch["completion_mask"].sum().to(device), reduction="sum"))
    micro_batches = [
        {key: value[start : start + rows_per_micro_batch].to(device) for key, value in batch.items()}
        for start in range(0, share, rows_per_micro_batch)
    ]
    scored = (~all_per_function.isnan()).sum(dim=0).clamp(min=1)
    totals = all_per_function.nan_to_num(0.0).sum(dim=0)
    figures = {
        "reward": float(all_rewards.mean()),
        "reward_std": float(all_rewards.std()),
        **{f"rewards/{name}/mean": float(totals[i] / scored[i]) for i, name in enumerate(function_names)},
        "frac_reward_zero_std": zero_std_fraction(all_rewards, num_generations),
        "completions/mean_length": float(lengths.float().mean()),
        "completions/clipped_ratio": float(all_truncated.float().mean()),
        "tokens/generated": int(lengths.sum()),
    }
    return micro_batches, global_tokens, figures
