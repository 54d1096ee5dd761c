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

import collections
import weakref
from dataclasses import dataclass

import torch

from fsdp_recipes.distributed.collectives import sum_tensor_over_ranks
from fsdp_recipes.distributed.parallel_dims import ParallelDims
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


class RouterBalanceLoss:
    """The load-balancing loss of a mixture of experts, attached to the model once at set-up (`attach`) so that the
    training loop is the same loop as a dense model's. Its two parts ride on what every loop already does:

    - `loop.micro_batches_in_sync` calls `before_step` with the step's micro-batches: the pass without gradients that
      finds the global expert shares f (`for_step`), running the recipe's own `forward` on each micro-batch's rows;
    - a forward hook on the decoder stack adds each later forward-with-gradients' share of coefficient x aux to the
      backward of whatever uses the decoder's output (`_AddLossGradient`): the loop's losses, values and logs are
      those of the dense model, and the router's parameters get the balance's gradient, as if the share had been
      added to the loss the loop passes to `backward`.

    The forwards with gradients of a step must be the micro-batches' forwards, in their order (each recipe runs one
    per micro-batch; its other forwards, the reference's, the KL estimate's, generation, evaluation, run without
    gradients): each takes the real-token mask the pass found for its micro-batch, and a forward with another token
    count, one too many, or one missing is an error, not a silently wrong loss."""

    def __init__(self, model: torch.nn.Module, forward, rows_of=None, real_of=None):
        self.coefficient = router_aux_loss_coefficient(model.config)
        self.forward, self.rows_of, self.real_of = forward, rows_of, real_of
        self.step: RouterBalance | None = None  # the current step's shares and aux (None before the first step)
        self._pending: collections.deque[torch.Tensor] = collections.deque()  # real masks of forwards still to come
        self._capture: list | None = None  # during the pass: [router logits, decoder attention mask] of the forward
        self._gradient_weight = 1.0
        self._scaler = None
        decoder = decoder_of(model)
        decoder.register_forward_hook(self._on_decoder_output, with_kwargs=True)
        _ATTACHED[decoder] = self

    def before_step(self, accelerator, model, micro_batches, *, parallel: ParallelDims) -> None:
        """Collective: the step's global expert shares, from the recipe's forward on every micro-batch (summed over
        the data-parallel ranks of the run's layout, `parallel`)."""
        if self._pending:
            raise RuntimeError(
                f"the last step ran {len(self._pending)} forward(s) with gradients fewer than its micro-batches: "
                "the router's load-balancing loss expects one per micro-batch"
            )
        # FSDP averages gradients over the data-parallel ranks; the shares sum to the global loss (undo the average)
        self._gradient_weight = float(parallel.data_parallel_size)
        self._scaler = accelerator.scaler  # fp16: the loss scale applies to this loss too
        reals: list[torch.Tensor] = []

        def forward(model, batch):
            rows = batch if self.rows_of is None else self.rows_of(batch)
            self._capture = [(), None]
            try:
                self.forward(model, rows)
                router_logits, mask = self._capture
            finally:
                self._capture = None
            if not router_logits:
                raise RuntimeError("the forward returned no router_logits although the model config asks for them")
            if self.real_of is not None:
                reals.append(self.real_of(rows))
            elif mask is not None:
                reals.append(mask)
            else:  # packed rows: no padding
                reals.append(torch.ones(router_logits[0].shape[0], dtype=torch.bool, device=router_logits[0].device))
            return router_logits

        self.step = for_step(accelerator, model, micro_batches, forward, real_of=lambda: reals[-1], parallel=parallel)
        self._pending = collections.deque(reals)

    def figures(self) -> dict[str, float]:
        """What the step's log record carries: `aux_loss` (aux over the step's global batch, before the coefficient)."""
        return {} if self.step is None else {"aux_loss": self.step.aux_loss}

    def summary(self) -> dict[str, str]:
        return {
            "router_aux_loss": f"added: {self.coefficient:g} x aux over each step's global batch (one more forward "
            "without gradients per step), logged as aux_loss"
        }

    def _on_decoder_output(self, module, args, kwargs, output):
        router_logits = tuple(getattr(output, "router_logits", None) or ())
        if self._capture is not None:
            tokens = router_logits[0].shape[0] if router_logits else -1
            mask = kwargs.get("attention_mask")
            self._capture[:] = (
                router_logits,
                (
                    mask.bool().flatten()
                    if torch.is_tensor(mask) and mask.dim() == 2 and mask.numel() == tokens
                    else None
                ),
            )
            return None
        if not router_logits or not torch.is_grad_enabled():
            return None  # generation, evaluation, reference values: no gradient, nothing to add
        if not self._pending:
            raise RuntimeError(
                "a forward with gradients outside the step's micro-batches (or one more than their count): the "
                "router's load-balancing loss has no expert shares for it (loop.micro_batches_in_sync computes them)"
            )
        real = self._pending.popleft()
        if real.numel() != router_logits[0].shape[0]:
            raise RuntimeError(
                f"the forward routed {router_logits[0].shape[0]} tokens where its micro-batch had {real.numel()}: "
                "the step's forwards with gradients must be its micro-batches' forwards, in order"
            )
        share = self.step.loss_share(router_logits, real)
        if not share.requires_grad:  # checkpointing_problem refuses the known cause before loading
            raise RuntimeError(
                "the router logits of a forward with gradients carry none: the balance would add nothing"
            )
        output.last_hidden_state = _AddLossGradient.apply(output.last_hidden_state, share, self._weight)
        return output

    def _weight(self) -> float:
        scale = 1.0 if self._scaler is None else float(self._scaler.get_scale())
        return self._gradient_weight * scale


class _AddLossGradient(torch.autograd.Function):
    """`hidden` unchanged; in the backward, `loss` (a scalar with its own graph) also gets `weight()` as its gradient,
    so it joins the backward of whatever uses `hidden` at that fixed weight, whatever that use's own scale. Megatron-LM
    adds its MoE auxiliary loss the same way (MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, hidden, loss, weight):
        ctx.weight, ctx.loss_like = weight, (loss.shape, loss.dtype, loss.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden):
        shape, dtype, device = ctx.loss_like
        return grad_hidden, torch.full(shape, ctx.weight(), dtype=dtype, device=device), None


_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, RouterBalanceLoss] = weakref.WeakKeyDictionary()


def attach(model: torch.nn.Module, forward, *, rows_of=None, real_of=None) -> RouterBalanceLoss | None:
    """At set-up: the model's router balance, added to the gradient of every step from then on, or None when its
    config does not ask for the loss (a dense model, or `router_aux_loss_coef` 0). `forward(model, rows)`: the
    recipe's own forward with gradients (the pass before each step runs it without). `rows_of(batch)`: the rows of a
    micro-batch that forward runs on (default: all of them; KTO: the examples', not the KL estimate's).
    `real_of(rows)`: the real-token mask of those rows (`real_token_mask` for right-padded rows; default: the
    decoder's 2-D attention mask where it gets one, else every token)."""
    if not router_aux_loss_coefficient(model.config):
        return None
    return RouterBalanceLoss(model, forward, rows_of, real_of)


def checkpointing_problem(
    model_config, *, fsdp_checkpointing: bool, wrap_policy: str, gradient_checkpointing: bool, kwargs: dict | None
) -> str | None:
    """Before loading: the activation checkpointing the balance cannot ride on, with the fix (None: fine). Its hook
    sits on the decoder stack and reads the router logits of a forward with gradients: FSDP's checkpointing under a
    wrap policy other than the layer classes may checkpoint the whole stack (the hook would run again in the
    backward), and reentrant checkpointing runs the layers' first forward without gradients (the loss would add
    nothing, silently)."""
    if not router_aux_loss_coefficient(model_config):
        return None
    if fsdp_checkpointing and wrap_policy != "TRANSFORMER_BASED_WRAP":
        return (
            f"the router's load-balancing loss with fsdp_activation_checkpointing under {wrap_policy}: the whole "
            "decoder stack may be checkpointed, which the loss cannot ride on; use fsdp_auto_wrap_policy: "
            "TRANSFORMER_BASED_WRAP (one checkpointed unit per layer), or router_aux_loss_coef: 0"
        )
    if gradient_checkpointing and (kwargs or {}).get("use_reentrant"):
        return (
            "the router's load-balancing loss with gradient_checkpointing_kwargs use_reentrant: true: reentrant "
            "checkpointing runs the layers without gradients first, so the loss would reach no router; set "
            "use_reentrant: false (the default), or router_aux_loss_coef: 0"
        )
    return None


def attached(model: torch.nn.Module) -> RouterBalanceLoss | None:
    """The router balance `attach` put on this model (through any wrapper), or None."""
    return attached_in(_ATTACHED, model)


def attached_in(registry, model: torch.nn.Module):
    """What a registry keyed by module (weakly) holds for this model or any module inside it (through any wrapper)."""
    if not registry:
        return None
    return next((registry[module] for module in model.modules() if module in registry), None)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (what returns router_logits) inside a task model, a peft model or an accelerate wrapper."""
    for module in model.modules():
        if type(module).__name__.endswith("Model") and hasattr(module, "layers") and hasattr(module, "config"):
            return module
    raise RuntimeError(f"no decoder stack (a *Model module with layers) found in {type(model).__name__}")


def for_step(
    accelerator, model, micro_batches, forward, real_of=None, *, parallel: ParallelDims
) -> RouterBalance | None:
    """Collective (every rank, every step): the step's RouterBalance, or None when the model does not ask for the
    loss. `forward(model, batch)` runs the recipe's own forward and returns the router logits (one tensor [tokens,
    experts] per layer); it runs here without gradients. `real_of()`: the real-token mask of that forward (default:
    `real_token_mask(batch)`; `RouterBalanceLoss` gives the mask its pass found). `parallel`: the run's layout, whose
    data-parallel ranks the counts are summed over."""
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
    totals = sum_tensor_over_ranks(accelerator, totals, parallel=parallel)
    assignments = max(float(totals[-1]), 1.0)
    shares = (totals[: routing.num_experts] / assignments).float()
    probabilities = totals[routing.num_experts : -1] / assignments
    aux = float(routing.num_experts * (shares.double() * probabilities).sum())
    return RouterBalance(coefficient, shares, assignments, aux)
