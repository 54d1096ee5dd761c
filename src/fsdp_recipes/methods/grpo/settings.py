"""The settings of online RL (TRL's GRPOConfig names and semantics): how completions are sampled, the clipped policy
objective, the reward functions: one group, `OnlineRLFields`, that a recipe's config class puts before
`TrainingConfig`. Each field declares its check and what a resume may do with it; the group states the rules between
its fields (`cross_field_problems`) and tells the shared layer what it costs (a reference copy, a generation pass)."""

from __future__ import annotations

import dataclasses

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.methods.grpo import policy_gradient, rewards, rollouts


@dataclasses.dataclass
class OnlineRLFields:
    """Every online-RL setting, one group; put it before `TrainingConfig` in a recipe config's bases."""

    # --- sampling: how completions are generated ---------------------------------------------------------------------
    num_generations: int = setting(
        8,
        "completions per prompt (a group, >= 2): more = better advantage estimates, fewer prompts "
        "per step; must divide the global batch of completions",
        resume="sensitive",
        check=checks.at_least(2, note=" (a group to compare)"),
    )
    max_completion_length: int = setting(
        256, "tokens generated per completion at most (memory: the KV cache grows with it)", resume="sensitive"
    )
    temperature: float = setting(1.0, "sampling temperature (> 0)", resume="sensitive")
    top_p: float = setting(1.0, "nucleus sampling: 1.0 keeps every token", resume="sensitive")
    top_k: int | None = setting(None, "sample among the k likeliest (null: all)", resume="sensitive")
    gather_weights_for_generation: bool = setting(
        True,
        "hold the whole policy on every rank for a generation pass (one all-gather per pass, more "
        "memory) instead of gathering each layer for every decoded token",
        resume="free",
    )

    # --- the policy objective ------------------------------------------------------------------------------------------
    beta: float = setting(
        0.0,
        "KL coefficient: > 0 keeps the policy near the reference at the cost of a reference "
        "forward per step (and, without LoRA, a frozen model copy); 0: no reference",
        resume="sensitive",
    )
    epsilon: float = setting(0.2, "the ratio is clipped to [1 - epsilon, ...]", resume="sensitive")
    epsilon_high: float | None = setting(
        None,
        "upper clip 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28: lets unlikely tokens of good "
        "completions grow faster, against entropy collapse; null: epsilon)",
        resume="sensitive",
    )
    loss_type: str = setting(
        "dapo",
        "how tokens are averaged over the global batch: dapo/bnpo (every token alike), grpo "
        "(per completion, then over completions: favours short ones), dr_grpo (/ completions x max length)",
        resume="sensitive",
    )
    scale_rewards: str = setting(
        "group", "advantages divided by the std of the group, of the batch, or none", resume="sensitive"
    )
    num_iterations: int = setting(
        1,
        "optimizer steps per generation round (μ): > 1 reuses completions, clipped by "
        "the ratio to the log-probs they were generated with",
        resume="sensitive",
        check=checks.at_least(1),
    )
    mask_truncated_completions: bool = setting(
        False, "completions cut at max_completion_length count for no token of the loss", resume="sensitive"
    )

    # --- rewards -------------------------------------------------------------------------------------------------------
    reward_funcs: list[str] = setting(
        default_factory=list,
        help="rewards: built-ins (exact_match, partial_match, numeric_answer, format, length_penalty), "
        "package.module:function, path/file.py:function, or a reward-model folder (one-label classifier)",
        resume="sensitive",
        check=checks.required("name at least one (e.g. exact_match, or my_module:my_reward)"),
    )
    reward_weights: list[float] | None = setting(
        None, "one weight per reward function (null: all 1.0)", resume="sensitive"
    )
    reward_answer_column: str = setting(
        "answer", "the column exact_match, partial_match and numeric_answer compare with", resume="sensitive"
    )
    reward_format_pattern: str = setting(
        rewards.RewardOptions.format_pattern, "the regex the format reward matches", resume="sensitive"
    )

    def generation_settings(self, *, batch_size: int, seed: int) -> rollouts.GenerationSettings:
        return rollouts.GenerationSettings(
            self.max_completion_length, self.temperature, self.top_p, self.top_k, batch_size, seed
        )

    def generation_footprint(self) -> tuple[int, int, bool]:
        return self.per_device_eval_batch_size, self.max_length, self.gather_weights_for_generation

    def reference_mode(self) -> str | None:
        """What the KL term compares with: None (beta 0), the policy with its LoRA adapters off, or a frozen copy."""
        if self.beta == 0:
            return None
        return "adapters" if self.use_peft else "model"

    def frozen_model_copies(self) -> int:
        return 1 if self.reference_mode() == "model" else 0

    def reward_options(self) -> rewards.RewardOptions:
        return rewards.RewardOptions(self.reward_answer_column, self.reward_format_pattern, self.max_completion_length)

    def weights(self) -> list[float]:
        return self.reward_weights or [1.0] * len(self.reward_funcs)

    def cross_field_problems(self) -> list[str]:
        problems = policy_gradient.objective_problems(
            self.beta, self.epsilon, self.epsilon_high, self.loss_type, self.scale_rewards
        )
        problems += rollouts.sampling_problems(self.temperature, self.top_p, self.top_k)
        if not 1 <= self.max_completion_length < self.max_length:
            problems.append(
                f"max_completion_length must be >= 1 and < max_length ({self.max_length}), leaving room for the "
                f"prompt; got {self.max_completion_length}"
            )
        if self.num_iterations >= 1 and self.save_steps and self.save_steps % self.num_iterations:
            problems.append(
                f"save_steps ({self.save_steps}) must be a multiple of num_iterations ({self.num_iterations}): a "
                "checkpoint falls between generation rounds, so a resume regenerates nothing it had"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            problems.append(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        return problems
