"""The router's load-balancing loss of a mixture of experts, over the GLOBAL batch.

transformers adds `router_aux_loss_coef` x aux to a model's own loss when `output_router_logits` is on (Switch /
Mixtral form): aux = E x sum_i f_i P_i, f_i the share of (layer, token, top-k slot) assignments routed to expert i,
P_i the mean router probability of expert i, both over the tokens and layers of the batch, E the number of experts.
The recipes compute their losses without the model's `loss`, so the term is added here, taken over the optimizer
step's global batch rather than each micro-batch: a micro-batch's aux would change with the split into ranks and
micro-batches. f carries no gradient, so with the global f known, aux is linear in each micro-batch's summed router
probabilities; f comes from a forward pass without gradients over the step's micro-batches before the first backward
(its cost: one more forward per step, only for models whose config asks for the loss). Same model config fields as
transformers and TRL (`output_router_logits`, `router_aux_loss_coef`); logged as `aux_loss` (aux, before the
coefficient)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_recipes.distributed.collectives import sum_tensor_over_ranks
from fsdp_recipes.models.experts import expert_routing, router_aux_loss_coefficient


@dataclass
class RouterBalance:
    coefficient: float
    shares: torch.Tensor  # [experts] f: the global batch's assignments per expert / (layers x real tokens)
    assignments: float  # layers x real tokens of the global batch
    aux_loss: float  # E x sum f P over the global batch (logged)

    def loss_share(self, router_logits: tuple[torch.Tensor, ...], real: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of coefficient x aux (its router probabilities carry the gradient): summed over
        micro-batches and ranks, it is coefficient x aux."""
        experts = self.shares.numel()
        summed = router_probability_sums(router_logits, real)
        return self.coefficient * experts * (self.shares.to(summed.device) * summed).sum() / self.assignments


def summary(config) -> dict[str, str]:
    """The run summary's `router_aux_loss` line for a recipe that adds the loss (none when the model does not ask)."""
    coefficient = router_aux_loss_coefficient(config)
    if not coefficient:
        return {}
    return {
        "router_aux_loss": f"added: {coefficient:g} x aux over each step's global batch (one more forward without "
        "gradients per step), logged as aux_loss"
    }


def real_token_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows x width] True on the tokens that are not padding (rows are right-padded to `real_tokens`)."""
    input_ids = batch["input_ids"]
    if "real_tokens" not in batch:
        return torch.ones(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
    width = input_ids.shape[-1]
    positions = torch.arange(width, device=input_ids.device)
    return (positions.unsqueeze(0) < batch["real_tokens"].to(input_ids.device).unsqueeze(1)).flatten()


def router_probability_sums(router_logits: tuple[torch.Tensor, ...], real: torch.Tensor) -> torch.Tensor:
    """[experts] each expert's router probability summed over the real tokens of every layer (fp32)."""
    return sum(torch.softmax(logits.float(), dim=-1)[real].sum(dim=0) for logits in router_logits)


def router_assignment_counts(router_logits: tuple[torch.Tensor, ...], real: torch.Tensor, top_k: int) -> torch.Tensor:
    """[experts] how many (layer, real token, top-k slot) assignments each expert got."""
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(experts, dtype=torch.float64, device=router_logits[0].device)
    for logits in router_logits:
        chosen = torch.topk(logits[real].float(), top_k, dim=-1).indices
        counts += torch.bincount(chosen.flatten(), minlength=experts).double()
    return counts


class RouterLogitsRecorder:
    """The router logits (one [tokens, experts] tensor per layer) and real-token mask of the last forward of a mixture
    of experts' decoder, read by a hook on the decoder itself: for recipes whose model output does not carry them (a
    sequence-classification head returns scores only) or whose rows mark padding in their own way (GRPO's
    left-padded prompts and packed rows). The mask is the decoder's 2-D attention mask where it gets one, else every
    token (packed rows have no padding)."""

    def __init__(self, model: torch.nn.Module):
        self.router_logits: tuple[torch.Tensor, ...] = ()
        self.real: torch.Tensor | None = None
        decoder = _decoder_of(model)
        self._handle = decoder.register_forward_hook(self._record, with_kwargs=True)

    @classmethod
    def for_model(cls, accelerator, model) -> RouterLogitsRecorder | None:
        """A recorder on `model`, or None when its config does not ask for the load-balancing loss."""
        return cls(model) if router_aux_loss_coefficient(accelerator.unwrap_model(model).config) else None

    def _record(self, module, args, kwargs, output) -> None:
        self.router_logits = tuple(getattr(output, "router_logits", None) or ())  # none while generating
        if not self.router_logits:
            self.real = None
            return
        tokens = self.router_logits[0].shape[0]
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2 and mask.numel() == tokens:
            self.real = mask.bool().flatten()
        else:
            self.real = torch.ones(tokens, dtype=torch.bool, device=self.router_logits[0].device)

    def balance_for_step(self, accelerator, model, micro_batches, run_forward) -> RouterBalance | None:
        """Collective: `for_step` with the recipe's own forward `run_forward(model, batch)` (its output unused: the
        router logits and mask come from the hook)."""

        def forward(model, batch):
            run_forward(model, batch)
            return self._recorded()

        return for_step(accelerator, model, micro_batches, forward, real_of=lambda: self.real)

    def loss_share(self, balance: RouterBalance) -> torch.Tensor:
        """The last forward's part of the step's coefficient x aux."""
        return balance.loss_share(self._recorded(), self.real)

    def _recorded(self) -> tuple[torch.Tensor, ...]:
        if not self.router_logits:
            raise RuntimeError("the last forward returned no router_logits although the model config asks for them")
        return self.router_logits


def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (what returns router_logits) inside a task model, a peft model or an accelerate wrapper."""
    for module in model.modules():
        if type(module).__name__.endswith("Model") and hasattr(module, "layers") and hasattr(module, "config"):
            return module
    raise RuntimeError(f"no decoder stack (a *Model module with layers) found in {type(model).__name__}")


def for_step(accelerator, model, micro_batches, forward, real_of=None) -> RouterBalance | None:
    """Collective (every rank, every step): the step's RouterBalance, or None when the model does not ask for the
    loss. `forward(model, batch)` runs the recipe's own forward and returns the router logits (one tensor [tokens,
    experts] per layer); it runs here without gradients. `real_of()`: the real-token mask of that forward (default:
    `real_token_mask(batch)`; a RouterLogitsRecorder's `real`)."""
    config = accelerator.unwrap_model(model).config
    coefficient = router_aux_loss_coefficient(config)
    if not coefficient:
        return None
    routing = expert_routing(config)
    totals = torch.zeros(2 * routing.num_experts + 1, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in micro_batches:
            router_logits = forward(model, batch)
            real = real_token_mask(batch) if real_of is None else real_of()
            totals[: routing.num_experts] += router_assignment_counts(router_logits, real, routing.experts_per_token)
            totals[routing.num_experts : -1] += router_probability_sums(router_logits, real).double()
            totals[-1] += float(real.sum()) * len(router_logits)
    totals = sum_tensor_over_ranks(accelerator, totals)
    assignments = max(float(totals[-1]), 1.0)
    shares = (totals[: routing.num_experts] / assignments).float()
    probabilities = totals[routing.num_experts : -1] / assignments
    aux = float(routing.num_experts * (shares.double() * probabilities).sum())
    return RouterBalance(coefficient, shares, assignments, aux)
