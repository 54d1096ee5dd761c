"""Which completions a round trains on: every rank's scored completions gathered into one global list
(`gather_scored`), the same on every rank, and the groups chosen from it (`GroupPool`).

With `dynamic_sampling` (DAPO's; verl's `filter_groups`) a group whose rewards are all equal carries no gradient (its
advantages are 0), so it is set aside and more prompts are sampled until the round has `prompts_per_round` groups with
a reward spread, or `max_generation_rounds` generation passes were made; then the set-aside groups fill what is
missing, in the order they were generated (they add no gradient, only tokens to the loss's average), so a step's
batch keeps its size. Selection works on the gathered list, so it does not depend on how slots were dealt to ranks.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fsdp_recipes.distributed.collectives import gather_lists, gather_tensors
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.methods.grpo.policy_gradient import ZERO_STD


@dataclasses.dataclass
class ScoredSlots:
    """Completions laid out slot after slot (groups of `num_generations` completions of one prompt, consecutive):
    the prompt of each (its index in the data), the token ids, whether it hit the length limit, its weighted reward
    and each reward function's value (NaN: no reward)."""

    prompt_indices: list[int]
    completion_ids: list[list[int]]
    truncated: list[bool]
    rewards: torch.Tensor  # [slots]
    per_function: torch.Tensor  # [slots, functions]
    policy_masks: list[list[int]] | None = None  # with tools: 1 on the policy's tokens, 0 on the tool messages
    tool_calls: list[tuple[int, int]] | None = None  # with tools: (calls, failed calls) of each completion
    sampling_log_probs: list[list[float]] | None = None  # vLLM: each token's log-probability as it was sampled

    def __len__(self) -> int:
        return len(self.prompt_indices)

    def select(self, slots: list[int]) -> ScoredSlots:
        index = torch.tensor(slots, dtype=torch.long)
        return ScoredSlots(
            [self.prompt_indices[s] for s in slots],
            [self.completion_ids[s] for s in slots],
            [self.truncated[s] for s in slots],
            self.rewards[index],
            self.per_function[index],
            None if self.policy_masks is None else [self.policy_masks[s] for s in slots],
            None if self.tool_calls is None else [self.tool_calls[s] for s in slots],
            None if self.sampling_log_probs is None else [self.sampling_log_probs[s] for s in slots],
        )

    @staticmethod
    def concatenate(parts: list[ScoredSlots]) -> ScoredSlots:
        return ScoredSlots(
            [p for part in parts for p in part.prompt_indices],
            [c for part in parts for c in part.completion_ids],
            [t for part in parts for t in part.truncated],
            torch.cat([part.rewards for part in parts]),
            torch.cat([part.per_function for part in parts]),
            None if parts[0].policy_masks is None else [m for part in parts for m in part.policy_masks],
            None if parts[0].tool_calls is None else [c for part in parts for c in part.tool_calls],
            None if parts[0].sampling_log_probs is None else [v for part in parts for v in part.sampling_log_probs],
        )


def gather_scored(
    accelerator,
    prompt_indices: list[int],
    completion_ids: list[list[int]],
    truncated: list[bool],
    rewards: torch.Tensor,
    per_function: torch.Tensor,
    policy_masks: list[list[int]] | None = None,
    tool_calls: list[tuple[int, int]] | None = None,
    sampling_log_probs: list[list[float]] | None = None,
    *,
    parallel: ParallelDims,
) -> ScoredSlots:
    """Collective: this rank's scored slots (`per_function` [functions, slots], as `rewards.score` gives it) joined
    with every other data-parallel rank's (of `parallel`, the run's layout), in rank order (the slot order of the
    round), on every rank. Token ids travel as Python lists (a few kilobytes), rewards as tensors."""
    per_slot = per_function.T.contiguous()
    if accelerator.num_processes == 1:
        return ScoredSlots(
            list(prompt_indices), list(completion_ids), list(truncated), rewards.cpu(), per_slot.cpu(),
            policy_masks, tool_calls, sampling_log_probs,
        )  # fmt: skip
    device = accelerator.device
    lists = functools.partial(gather_lists, accelerator, parallel=parallel)
    tensors = functools.partial(gather_tensors, accelerator, parallel=parallel)
    return ScoredSlots(
        lists(list(prompt_indices)),
        lists(list(completion_ids)),
        lists(list(truncated)),
        tensors(rewards.to(device)).cpu(),
        tensors(per_slot.to(device)).cpu(),
        None if policy_masks is None else lists(list(policy_masks)),
        None if tool_calls is None else [tuple(c) for c in lists(list(tool_calls))],
        None if sampling_log_probs is None else lists(list(sampling_log_probs)),
    )


def groups_with_spread(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] True where a group's rewards are not all equal (its advantages are not all 0)."""
    return rewards.view(-1, num_generations).std(dim=1) >= ZERO_STD


class GroupPool:
    """The groups generated for one round, pass after pass, and the `prompts_per_round` the step trains on. Without
    `dynamic_sampling` the first pass is the batch; with it, groups with a reward spread come first (in generation
    order), then those without, while there are not enough."""

    def __init__(self, prompts_per_round: int, num_generations: int, *, dynamic_sampling: bool):
        self.prompts_per_round, self.num_generations = prompts_per_round, num_generations
        self.dynamic_sampling = dynamic_sampling
        self.passes: list[ScoredSlots] = []

    def add(self, scored: ScoredSlots) -> None:
        self.passes.append(scored)

    @property
    def generated(self) -> ScoredSlots:
        """Every completion generated this round, all passes."""
        return ScoredSlots.concatenate(self.passes)

    def _groups(self) -> tuple[list[int], list[int]]:
        """Group indices (into `generated`) with and without a reward spread, each in generation order."""
        spread = groups_with_spread(self.generated.rewards, self.num_generations).tolist()
        return [g for g, s in enumerate(spread) if s], [g for g, s in enumerate(spread) if not s]

    def full(self) -> bool:
        """Whether the round needs no further generation pass."""
        return not self.dynamic_sampling or len(self._groups()[0]) >= self.prompts_per_round

    def batch(self) -> tuple[ScoredSlots, int]:
        """The groups to train on (those with a reward spread first, each kind in generation order), laid out slot
        after slot, and how many of them have a reward spread."""
        if not self.dynamic_sampling:
            chosen = list(range(self.prompts_per_round))
            kept = sum(groups_with_spread(self.passes[0].rewards, self.num_generations).tolist())
        else:
            spread, flat = self._groups()
            chosen = (spread + flat)[: self.prompts_per_round]
            kept = min(len(spread), self.prompts_per_round)
        slots = [g * self.num_generations + i for g in chosen for i in range(self.num_generations)]
        return self.generated.select(slots), kept
