"""Mixture-of-experts models: how many experts a layer has and how many each token uses, read from the config under
the names the families transformers ships use (Qwen2/3-MoE, OLMoE: num_experts; Mixtral, gpt-oss: num_local_experts;
DeepSeek-V3: n_routed_experts), and the parameters a token actually runs through (active), which is what FLOPs per
token (MFU) count. Routed experts' weights are those under an `experts` module (held fused by transformers 5,
`mlp.experts.gate_up_proj`, or per expert); shared experts (`shared_expert`, `shared_experts`) run for every token and
count as dense. Also what `generate` needs told for such a model (`generation_options`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fsdp_recipes.common.errors import ConfigError

_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ExpertRouting:
    num_experts: int
    experts_per_token: int


def expert_routing(config) -> ExpertRouting | None:
    """The routing of a mixture-of-experts config (its text config for multimodal ones); None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = next((getattr(text, name) for name in _EXPERT_COUNT_NAMES if getattr(text, name, None)), None)
    per_token = getattr(text, "num_experts_per_tok", None)
    if not count or not per_token:
        return None
    return ExpertRouting(int(count), int(per_token))


def is_routed_expert_parameter(name: str) -> bool:
    return ".experts." in f".{name}"


def active_parameter_count(named_sizes: Iterable[tuple[str, int]], routing: ExpertRouting | None) -> int:
    """Parameters a token runs through: every dense one, and of the routed experts' the share top-k / experts."""
    dense = expert = 0
    for name, size in named_sizes:
        if routing is not None and is_routed_expert_parameter(name):
            expert += size
        else:
            dense += size
    if routing is None:
        return dense
    return dense + expert * routing.experts_per_token // routing.num_experts


def generation_options(model: torch.nn.Module) -> dict:
    """What `generate` must be told for this model beyond sampling: a mixture of experts configured to return router
    logits (for its load-balancing loss) is asked not to while decoding, because transformers (5.24) computes that
    loss on every cached step from the new token's router logits against the whole attention mask, and fails."""
    config = getattr(getattr(model, "module", model), "config", None)
    return {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}


def router_aux_loss_coefficient(config) -> float:
    """The load-balancing loss's coefficient when the model config asks for the loss (a mixture of experts with
    `output_router_logits` and `router_aux_loss_coef` > 0, transformers' and TRL's switches), else 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if expert_routing(config) is None or not getattr(text, "output_router_logits", False):
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def apply_router_aux_loss_coef(config, coefficient: float | None) -> None:
    """A recipe's `router_aux_loss_coef` (TRL's name) set on the model config, where transformers and TRL read it:
    > 0 turns the load-balancing loss on with that weight (`output_router_logits`), 0 turns it off, None keeps the
    config's own. The exported config.json carries the choice. Raises ConfigError for a weight on a dense model."""
    if coefficient is None:
        return
    if expert_routing(config) is None:
        if coefficient > 0:
            name = type(config).__name__.removesuffix("Config")
            raise ConfigError(
                f"router_aux_loss_coef {coefficient:g} on {name}, a dense model (no router to balance): remove it"
            )
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.output_router_logits = coefficient > 0
    text.router_aux_loss_coef = coefficient


def describe_experts(config) -> dict | None:
    """The run summary's `mixture_of_experts` entry (None for a dense model), saying what happens to the router's
    load-balancing loss: the recipes compute their losses without the model's own `loss`, so a recipe that does not
    add it itself (`train.router_balance`; a copied recipe that dropped it) leaves it out."""
    routing = expert_routing(config)
    if routing is None:
        return None
    asked = router_aux_loss_coefficient(config) > 0
    return {
        "num_experts": routing.num_experts,
        "experts_per_token": routing.experts_per_token,
        "router_aux_loss": "asked for by the model config (output_router_logits, router_aux_loss_coef) but not added "
        "to this recipe's objective (every shipped training recipe adds it through train/router_balance.py): "
        "docs/moe.md"
        if asked
        else "off (the model config's output_router_logits is false)",
    }
