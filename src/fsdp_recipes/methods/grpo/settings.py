"""The settings of online RL (TRL's GRPOConfig names and semantics), in three groups that a recipe's config class
puts before `TrainingConfig` (the run): `GenerationFields` (how completions are sampled), `PolicyObjectiveFields` (the
clipped policy objective and its advantages) and `RewardFields` (reward functions, tools, environments). Each field
declares its check and what a resume may do with it; each group states the rules between its fields
(`cross_field_problems`) and tells the shared layer what it costs (a reference copy, a generation pass)."""

from __future__ import annotations

import dataclasses

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.methods.grpo import policy_gradient, rewards
from fsdp_recipes.train import generation


@dataclasses.dataclass
class GenerationFields:
    """How completions are sampled: how many per prompt, how long, at what temperature, by which engine."""

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
    generation_backend: str = generation.backend_setting()

    def generation_settings(
        self, *, batch_size: int, seed: int, server=None, pictures=None
    ) -> generation.GenerationSettings:
        return generation.GenerationSettings(
            self.max_completion_length, self.temperature, self.top_p, self.top_k, batch_size, seed,
            **generation.backend_options(self), server=server, pictures=pictures,
        )  # fmt: skip

    def generation_passes(self) -> int:
        """Generation passes a round may make (dynamic sampling's bound, else 1)."""
        return self.max_generation_rounds if self.dynamic_sampling else 1

    def generation_footprint(self) -> tuple[int, int, bool]:
        return self.per_device_eval_batch_size, self.max_length, self.gather_weights_for_generation

    def cross_field_problems(self) -> list[str]:
        problems = generation.sampling_problems(self.temperature, self.top_p, self.top_k)
        if self.generation_backend not in ("generate", "vllm") and not self.gather_weights_for_generation:
            problems.append(
                f"generation_backend {self.generation_backend} runs each rank's model on its own and needs the whole "
                "weights there: set gather_weights_for_generation: true, or use generation_backend generate"
            )
        if not 1 <= self.max_completion_length < self.max_length:
            problems.append(
                f"max_completion_length must be >= 1 and < max_length ({self.max_length}), leaving room for the "
                f"prompt; got {self.max_completion_length}"
            )
        return problems


@dataclasses.dataclass
class PolicyObjectiveFields:
    """What a step optimises: the clipped policy objective, its advantages, its reference, its passes."""

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
        "the per-token objective and how tokens are averaged over the global batch: dapo/bnpo (clipped "
        "surrogate, every token alike), grpo (per completion, then over completions: favours short ones), dr_grpo "
        "(/ completions x max length), cispo (the ratio capped at epsilon_high, e.g. 5.0, detached, weighs A x "
        "log p: no token's gradient is ever cut off; averaged as dapo), sapo (a soft sigmoid gate instead of the hard clip; averaged as grpo)",
        resume="sensitive",
        check=checks.one_of(policy_gradient.LOSS_TYPES),
    )
    importance_sampling_level: str = setting(
        "token",
        "token: each token's own ratio; sequence (GSPO): every token of a completion shares exp(mean log "
        "ratio over its tokens), steadier for long completions and mixture-of-experts routing",
        resume="sensitive",
        check=checks.one_of(policy_gradient.IMPORTANCE_SAMPLING_LEVELS),
    )
    delta: float | None = setting(
        None,
        "two-sided clipping: the unclipped ratio is also capped at delta (> 1 + epsilon_high), so a "
        "negative advantage cannot push a token with a huge ratio without bound; null: off",
        resume="sensitive",
    )
    sapo_temperature_pos: float = setting(
        1.0,
        "sapo: gate temperature for positive advantages (higher: the gate closes sooner as the ratio leaves 1)",
        resume="sensitive",
        check=checks.above(0),
    )
    sapo_temperature_neg: float = setting(
        1.05, "sapo: gate temperature for negative advantages", resume="sensitive", check=checks.above(0)
    )
    top_entropy_quantile: float = setting(
        1.0,
        "train only on this top share of completion tokens by entropy, over the step's global batch "
        "(0.2: the most uncertain fifth, the 'forking' tokens); < 1 costs one forward pass without gradients per step",
        resume="sensitive",
        check=policy_gradient.share_check,
    )
    entropy_coef: float = setting(
        0.0,
        "entropy bonus: subtracts entropy_coef x the mean token entropy from the loss, against entropy "
        "collapse (verl's entropy_coeff); 0: off",
        resume="sensitive",
        check=checks.non_negative(),
    )
    advantage_estimator: str = setting(
        "grpo",
        "grpo: reward minus the group mean; rloo: minus the mean of the OTHER completions of the group "
        "(leave-one-out, unbiased; TRL's RLOO), both then scaled as scale_rewards says",
        resume="sensitive",
        check=checks.one_of(policy_gradient.ADVANTAGE_ESTIMATORS),
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
    dynamic_sampling: bool = setting(
        False,
        "DAPO's dynamic sampling: groups whose rewards are all equal (no gradient) are set aside and more "
        "prompts are sampled until the round has enough groups with a reward spread (more generation per step)",
        resume="sensitive",
    )
    max_generation_rounds: int = setting(
        4,
        "dynamic_sampling: generation passes per round at most; then set-aside groups fill the batch",
        resume="sensitive",
        check=checks.at_least(1),
    )
    padding_free: bool = setting(
        False,
        "policy passes on packed rows (each micro-batch's prompt + completion sequences end to end, no "
        "padding): the same log-probabilities, less compute when lengths vary",
        resume="free",
    )
    mask_truncated_completions: bool = setting(
        False, "completions cut at max_completion_length count for no token of the loss", resume="sensitive"
    )

    def describe_objective(self) -> str:
        """The run summary's line for the objective: every option that changes what a step optimises."""
        parts = [
            f"{self.loss_type} loss, {self.importance_sampling_level}-level ratio",
            f"epsilon {self.epsilon}..{self.epsilon_high or self.epsilon}"
            + (f", delta {self.delta}" if self.delta else ""),
            f"{self.advantage_estimator} advantages scaled by {self.scale_rewards}",
            f"beta {self.beta}",
            f"{self.num_iterations} step(s) per generation round",
        ]
        if self.top_entropy_quantile < 1:
            parts.append(f"top {self.top_entropy_quantile:g} of tokens by entropy trained")
        if self.entropy_coef:
            parts.append(f"entropy bonus {self.entropy_coef:g}")
        if self.dynamic_sampling:
            parts.append(f"dynamic sampling, {self.max_generation_rounds} generation passes at most")
        return "; ".join(parts)

    def packs_examples(self) -> bool:
        return self.padding_free

    def sequence_split_problem(self) -> str | None:
        if self.padding_free:
            return None
        return (
            "GRPO's policy passes split by position from the packed layout only (left-padded rows carry an "
            "attention mask the split does not take): set padding_free: true"
        )

    def reference_mode(self) -> str | None:
        """What the KL term compares with: None (beta 0), the policy with its LoRA adapters off, or a frozen copy."""
        if self.beta == 0:
            return None
        return "adapters" if self.use_peft else "model"

    def frozen_model_copies(self) -> int:
        return 1 if self.reference_mode() == "model" else 0

    def cross_field_problems(self) -> list[str]:
        problems = policy_gradient.objective_problems(
            self.beta, self.epsilon, self.epsilon_high, self.scale_rewards, self.delta, self.loss_type
        )
        if self.num_iterations >= 1 and self.save_steps and self.save_steps % self.num_iterations:
            problems.append(
                f"save_steps ({self.save_steps}) must be a multiple of num_iterations ({self.num_iterations}): a "
                "checkpoint falls between generation rounds, so a resume regenerates nothing it had"
            )
        return problems


@dataclasses.dataclass
class RewardFields:
    """What a completion is scored by: reward functions, and the tools or environment a rollout acts on."""

    # --- rewards -------------------------------------------------------------------------------------------------------
    reward_funcs: list[str] = setting(
        default_factory=list,
        help="rewards: built-ins (exact_match, partial_match, numeric_answer, format, length_penalty), "
        "package.module:function, path/file.py:function, or a reward-model folder (one-label classifier)",
        resume="sensitive",
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

    # --- tools ---------------------------------------------------------------------------------------------------------
    tools: list[str] = setting(
        default_factory=list,
        help="functions the policy may call while it writes a completion (TRL's tools): path/file.py:function or "
        "package.module:function, each with type hints and a docstring, which the chat template shows the model; "
        "their results join the conversation and carry no loss",
        resume="sensitive",
    )
    environment_factory: str | None = setting(
        None,
        "a class whose instances the policy's tool calls act on, one per completion (TRL's environment_factory): "
        "path/file.py:Class or package.module:Class; reset(**row) starts a rollout (returned text joins the prompt's "
        "last turn), its public methods are the tools, get_reward() (optional) adds a reward named after the class; "
        "reward functions receive them as `environments`",
        resume="sensitive",
    )
    max_tool_calling_iterations: int | None = setting(
        None,
        "rounds of tool calls answered per completion (TRL's; null: until a turn calls none or "
        "max_completion_length is reached, tool messages included); each round costs one more generation pass",
        resume="sensitive",
        check=checks.at_least(1, or_null=True),
    )
    tool_timeout: float = setting(
        10.0,
        "seconds a tool call may take before the model is answered with a timeout error (the call's thread is left "
        "to finish in the background)",
        resume="free",
        check=checks.above(0),
    )

    def reward_options(self) -> rewards.RewardOptions:
        return rewards.RewardOptions(self.reward_answer_column, self.reward_format_pattern, self.max_completion_length)

    def weights(self) -> list[float]:
        return self.reward_weights or [1.0] * len(self.reward_funcs)

    def cross_field_problems(self) -> list[str]:
        problems = []
        if not self.reward_funcs and not self.environment_factory:
            problems.append(
                "reward_funcs is required: name at least one (e.g. exact_match, or my_module:my_reward), or give an "
                "environment_factory whose class has get_reward"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            problems.append(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        return problems
