"""When completions come from another engine than the trainer (vLLM), or from an older policy (asynchronous
generation), the tokens were drawn from a distribution q that is not the one the loss's ratio starts from (the
trainer's policy p when the round began). TRL's correction, with its names: each token's policy loss is weighted by
the importance ratio p / q = exp(log p - log q), per token or per completion (the exp of the summed difference), and
the ratio is truncated (clamped into [clip_min, clip_max]) or masked (set to 0 outside it). Applied to the policy
term only, before the KL term is added, as TRL does. `SamplerCorrectionFields` are the settings;
`importance_weights` the weights and what is logged of them. With asynchronous generation the same weight corrects
the staleness too: q is then the policy of a step or more before, as vLLM sampled it."""

from __future__ import annotations

import dataclasses
import math

import torch

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass
class SamplerCorrectionFields:
    """The correction for completions sampled by vLLM (TRL's fields), and generation overlapped with training."""

    vllm_importance_sampling_correction: bool = setting(
        True,
        "weight each token's policy loss by p_trainer / p_vLLM of the completion (vLLM's sampling differs from the "
        "trainer's forward: other kernels, other precision; asynchronous rounds: an older policy): unbiased at the "
        "cost of variance, which the clip bounds",
        resume="sensitive",
    )
    vllm_importance_sampling_mode: str = setting(
        "sequence_mask",
        "token_truncate / token_mask: each token's own ratio, clamped into / zeroed outside [clip_min, clip_max]; "
        "sequence_truncate / sequence_mask: one ratio per completion (the exp of its summed log-ratio), likewise: "
        "masking drops a completion the sampler saw very differently instead of keeping a capped weight",
        resume="sensitive",
        check=checks.one_of(MODES),
    )
    vllm_importance_sampling_clip_max: float | None = setting(
        3.0, "the ratio's upper bound (null: none): lower trades bias for variance", resume="sensitive"
    )
    vllm_importance_sampling_clip_min: float | None = setting(
        None, "the ratio's lower bound (null: none)", resume="sensitive"
    )
    async_generation: bool = setting(
        False,
        "generate the next round on the vLLM server while this one trains: the server's time and the trainer's "
        "overlap, and each round is sampled by a policy one push older (its staleness, corrected by the importance "
        "weights); false: every round sampled by the current policy (TRL's GRPOTrainer)",
        resume="sensitive",
    )
    max_staleness: int = setting(
        1,
        "async_generation: optimizer steps a round's sampling policy may lag the one it trains: 1 pushes weights "
        "after every step; k pushes every k steps (less time gathering and loading weights, more off-policy "
        "samples)",
        resume="sensitive",
    )

    def cross_field_problems(self) -> list[str]:
        problems = []
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for name, value in (("clip_min", low), ("clip_max", high)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                problems.append(f"vllm_importance_sampling_{name} must be a number >= 0 or null, got {value}")
        if low is not None and high is not None and low >= high:
            problems.append(
                f"vllm_importance_sampling_clip_min ({low}) must be below vllm_importance_sampling_clip_max ({high})"
            )
        if self.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
            problems.append(
                f"vllm_importance_sampling_mode {self.vllm_importance_sampling_mode} clamps the ratio into [clip_min, "
                "clip_max]: set at least one of vllm_importance_sampling_clip_min and vllm_importance_sampling_clip_max"
            )
        uses_vllm = getattr(self, "generation_backend", None) == "vllm"
        if self.async_generation:
            if not uses_vllm:
                problems.append(
                    "async_generation writes the next round on the vLLM server while the trainer learns: set "
                    "use_vllm: true (generation_backend: vllm), with a server started by fsdp-recipes vllm-serve"
                )
            if self.max_staleness < 1:
                problems.append(
                    f"max_staleness must be >= 1 with async_generation (the next round is sampled by a policy at "
                    f"least one step older than the one it trains), got {self.max_staleness}"
                )
            if getattr(self, "dynamic_sampling", False):
                problems.append(
                    "async_generation with dynamic_sampling: the next round's prompts depend on how many more this "
                    "round draws, which is known only after it is scored; use one of them"
                )
            if getattr(self, "environment_factory", None):
                problems.append(
                    "async_generation with environment_factory: a round asked for ahead holds live environment "
                    "instances, which a checkpoint cannot keep; use synchronous generation (async_generation: false)"
                )
            if getattr(self, "num_iterations", 1) > 1:
                problems.append(
                    "async_generation with num_iterations > 1: a round serves several steps, so the next one would "
                    "wait for them all and overlap nothing; use num_iterations: 1"
                )
        return problems

    def corrects_sampler(self) -> bool:
        return getattr(self, "generation_backend", None) == "vllm" and self.vllm_importance_sampling_correction

    def describe_sampler_correction(self) -> str:
        if not self.corrects_sampler():
            return "none (completions sampled by the trainer's own forward)"
        bounds = f"[{self.vllm_importance_sampling_clip_min or 0:g}, {self.vllm_importance_sampling_clip_max or 'inf'}]"
        staleness = f"; asynchronous, at most {self.max_staleness} step(s) stale" if self.async_generation else ""
        return f"vLLM importance sampling, {self.vllm_importance_sampling_mode} to {bounds}{staleness}"


def importance_weights(
    log_probs: torch.Tensor,
    sampling_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the weight of each token's policy loss [rows, width], this rank's sums and extremes of what is logged).
    `log_probs`: the trainer's (the round's starting policy, no gradient), `sampling_log_probs`: the sampler's, both
    [rows, width]; `mask` 1 on the tokens the loss counts (elsewhere the log-ratio is taken as 0, weight 1)."""
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode {mode!r} is not one of {MODES}")
    mask = mask.float()
    difference = (log_probs.detach().float() - sampling_log_probs.float()) * mask
    per_sequence = mode.startswith("sequence")
    log_ratio = difference.sum(dim=1, keepdim=True) if per_sequence else difference
    ratio = torch.exp(log_ratio)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    weights = ratio.clamp(min=clip_min, max=clip_max) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    weights, outside = weights.expand_as(difference), outside.expand_as(difference)
    token_ratio = torch.exp(difference)
    counted = mask.bool()
    figures = {
        "sampling/sampling_logp_difference/mean": (difference.abs() * mask).sum(),
        "sampling/importance_sampling_ratio/mean": (weights * mask).sum(),
        "sampling/kl": ((token_ratio - 1 - difference) * mask).sum(),  # k3 estimate of KL(sampler || trainer)
        "sampling/importance_sampling_clipped_share": (outside.float() * mask).sum(),
    }
    extremes = {
        "sampling/sampling_logp_difference/max": ("max", _extreme(difference.abs(), counted, "max")),
        "sampling/importance_sampling_ratio/min": ("min", _extreme(weights, counted, "min")),
        "sampling/importance_sampling_ratio/max": ("max", _extreme(weights, counted, "max")),
    }
    return weights, {"sums": figures, "extremes": extremes}


def _extreme(values: torch.Tensor, counted: torch.Tensor, kind: str) -> torch.Tensor:
    if not counted.any():
        return values.new_tensor(-math.inf if kind == "max" else math.inf)
    chosen = values[counted]
    return chosen.max() if kind == "max" else chosen.min()


class Correction:
    """A run's correction, step by step: `weights` for each micro-batch (its figures added up), `figures` once per
    step for the log (then reset)."""

    def __init__(self, mode: str, clip_min: float | None, clip_max: float | None):
        self.mode, self.clip_min, self.clip_max = mode, clip_min, clip_max
        self.sums: dict[str, torch.Tensor] = {}
        self.extremes: dict[str, tuple[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, config) -> Correction | None:
        if not config.corrects_sampler():
            return None
        return cls(
            config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_min,
            config.vllm_importance_sampling_clip_max,
        )

    def weights(self, log_probs: torch.Tensor, part: dict, global_tokens: float) -> torch.Tensor:
        """The importance weights of `part`'s tokens (a micro-batch with `sampling_log_probs`); its figures are
        this rank's sums over the global batch's `global_tokens` counted tokens."""
        weights, seen = importance_weights(
            log_probs, part["sampling_log_probs"], part["completion_mask"], mode=self.mode, clip_min=self.clip_min,
            clip_max=self.clip_max,
        )  # fmt: skip
        for name, value in seen["sums"].items():
            self.sums[name] = self.sums.get(name, 0.0) + value / max(global_tokens, 1.0)
        for name, (kind, value) in seen["extremes"].items():
            if name in self.extremes:
                value = (
                    torch.maximum(value, self.extremes[name][1])
                    if kind == "max"
                    else torch.minimum(value, self.extremes[name][1])
                )
            self.extremes[name] = (kind, value)
        return weights

    def figures(self) -> tuple[dict, dict]:
        """(sums, extremes) of the step, for `log_step`; reset for the next."""
        figures = (self.sums, self.extremes)
        self.sums, self.extremes = {}, {}
        return figures
