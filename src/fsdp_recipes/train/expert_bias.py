"""DeepSeek-V3's auxiliary-loss-free load balancing: the routing bias `e_score_correction_bias`, updated outside the
gradient after each optimizer step from the experts' loads of that step.

DeepSeek-V3's router (transformers' `DeepseekV3TopkRouter`, and the DeepSeek-style routers that keep the same buffer:
GLM-4-MoE, dots1, Nemotron-H, LongCat-Flash, MiniMax-M3, DeepSeek-V4, ...) chooses each token's experts by top-k of
score + bias; the bias takes no part in the weights that mix the experts' outputs. After each step every layer's bias
moves by a fixed rate towards balance (the DeepSeek-V3 technical report, section 2.1.2): bias_i += rate x
sign(mean load - load_i), up for an expert chosen less than the mean, down for one chosen more. torchtitan
(`load_balance_coeff`) and Megatron-LM (`moe_router_bias_update_rate`) do the same; torchtitan also centres the update
to mean zero, which changes no choice (top-k and the group scores are unchanged by a shift of every bias).

- **The loads are the experts each router CHOSE**, read from the router's own output (a forward hook: the integer
  tensor it returns, the model's group-limited top-k of score + bias), never re-routed here. They count each forward
  with gradients of the step (its micro-batches), not a forward without (evaluation, generation, reference values)
  nor the recomputation inside a backward (activation checkpointing). Padding does not count where the forward says
  which tokens are real: the decoder's 2-D attention mask, else the micro-batch's `real_tokens` when the forward runs
  on rows of that micro-batch (`loop.micro_batches_in_sync` hands it over); otherwise every routed token counts.
- **Global and identical on every rank**: each layer's counts (float64) are summed over the data-parallel ranks in one
  all-reduce, and every rank applies the same arithmetic to the same sums. FSDP2 does not shard buffers, and under
  tensor or expert parallelism the router stays replicated: every rank holds each bias whole. The update is a sign,
  so a uniform scale of the counts (sequence parallelism's) changes nothing.
- **Exact on resume**: the bias is a persistent buffer of the model, in every checkpoint and the export; the counts
  live only within a step.

Logged as `moe/load_imbalance`: the step's largest load over the mean load (1 is balanced), of the most imbalanced
layer, before the update."""

from __future__ import annotations

import weakref

import torch

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.collectives import sum_tensor_over_ranks
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models.experts import expert_routing
from fsdp_recipes.train import router_balance
from fsdp_recipes.train.router_balance import decoder_of, real_token_mask

BIAS = "e_score_correction_bias"
DEFAULT_RATE = 0.001  # DeepSeek-V3's bias update speed (gamma) over most of its pretraining
IMBALANCE = "moe/load_imbalance"


def routers_with_bias(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module holding an `e_score_correction_bias` buffer (a router), in the model's order.
    A parameter of that name (ERNIE-4.5's) is not a buffer and is left alone."""
    return [(name, module) for name, module in model.named_modules() if BIAS in module._buffers]


def bias_update(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """[experts] (float64) rate x sign(mean load - load_i): + for an expert chosen less than the mean, - for one chosen
    more, 0 at the mean."""
    loads = loads.double()
    return rate * torch.sign(loads.mean() - loads)


def load_imbalance(loads: torch.Tensor) -> torch.Tensor:
    """[layers, experts] -> the largest load over the mean load of the most imbalanced layer (1: balanced; layers
    that routed nothing are left out)."""
    loads = loads.double()
    means = loads.mean(dim=-1)
    ratios = loads.max(dim=-1).values / means.clamp(min=1e-30)
    return torch.where(means > 0, ratios, torch.ones_like(ratios)).max()


# Where null means DeepSeek-V3's rate: the families whose routers this update is tested on. Others that keep the bias
# (GLM-4-MoE, dots1, LongCat-Flash, ...) are updated only when the rate is set.
UPDATED_BY_DEFAULT = ("deepseek_v3",)


def resolved_rate(rate: float | None, model_type: str | None) -> float:
    """The recipe field: null is DeepSeek-V3's rate for the families tested (UPDATED_BY_DEFAULT), 0 for others."""
    if rate is None:
        return DEFAULT_RATE if model_type in UPDATED_BY_DEFAULT else 0.0
    return float(rate)


def rate_problem(model_config, config) -> str | None:
    """Before loading: a rate set > 0 on a dense model (no router), as `router_aux_loss_coef` is refused there, or
    with LoRA (the bias belongs to the frozen base, and an adapter folder cannot carry it)."""
    rate = config.router_bias_update_rate
    if rate is None or rate <= 0:
        return None
    if expert_routing(model_config) is None:
        name = type(model_config).__name__.removesuffix("Config")
        return f"router_bias_update_rate {rate:g} on {name}, a dense model (no router to balance): remove it"
    if getattr(model_config, "zero_expert_num", 0):
        return (
            f"router_bias_update_rate {rate:g} on {model_config.model_type}: its router also chooses "
            f"{model_config.zero_expert_num} zero-computation experts, which this update would balance as ordinary "
            "ones; it is not wired for them: remove it"
        )
    if config.use_peft:
        return (
            f"router_bias_update_rate {rate:g} with use_peft: LoRA trains adapters on a frozen base, and the router "
            f"bias ({BIAS}) is the base's, which neither an adapter checkpoint nor the adapter folder holds: remove it "
            "(null: no update under LoRA)"
        )
    return None


def resume_problem(model_config, config, saved_recipe: dict) -> str | None:
    """A checkpoint saved before `router_bias_update_rate` existed trained no bias: resuming it with the default rate
    (DeepSeek-V3's) would change the training halfway, which the resume check exists to stop."""
    field = "router_bias_update_rate"
    if field in saved_recipe or field in (config.allow_config_change or []) or config.use_peft:
        return None
    if not resolved_rate(config.router_bias_update_rate, model_config.model_type):
        return None
    return (
        f"the checkpoint was trained before {field} existed, with no update of the routers' {BIAS}; resuming would "
        f"start updating it halfway. Set {field}: 0 to resume as it was trained, or allow the change: "
        f"--allow_config_change {field}"
    )


class ExpertBias:
    """The routers' bias updates of one model: counts of the experts each router chose over the step's forwards with
    gradients (`_on_router_output`), then, after the optimizer step, one all-reduce and the update (`update`)."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.rate = rate
        self.routers = [module for _, module in routers_with_bias(model)]
        self.experts = max(getattr(module, BIAS).numel() for module in self.routers)
        self.counts: torch.Tensor | None = None  # [routers, experts] float64, this rank's, since the last update
        self.imbalance: torch.Tensor | None = None  # the last step's, before its update (logged)
        self.micro_batch: dict | None = None  # the micro-batch the loop runs (its real tokens)
        self._real: torch.Tensor | None = None  # the current forward's real-token mask, where known
        for index, module in enumerate(self.routers):
            module.register_forward_hook(
                lambda module, args, output, index=index: self._on_router_output(index, output)
            )
        decoder = decoder_of(model)
        decoder.register_forward_pre_hook(self._on_decoder_input, with_kwargs=True)
        _ATTACHED[decoder] = self

    def update(self, accelerator, parallel: ParallelDims) -> None:
        """Collective, after each optimizer step that was applied: the step's loads summed over the data-parallel
        ranks (of `parallel`, the run's layout), every router's bias moved by `bias_update`, the counts reset."""
        loads = self._take_counts(accelerator.device)
        loads = sum_tensor_over_ranks(accelerator, loads, parallel=parallel)
        with torch.no_grad():
            for module, layer_loads in zip(self.routers, loads):
                bias = getattr(module, BIAS)
                experts = bias.numel()
                step = bias_update(layer_loads[:experts], self.rate).to(bias.device)
                bias.copy_((bias.double() + step).to(bias.dtype))
        self.imbalance = load_imbalance(loads)

    def discard(self) -> None:
        """A step whose update was skipped (a gradient that is not finite): its loads move no bias."""
        self.counts = None

    def figures(self) -> dict[str, torch.Tensor]:
        return {} if self.imbalance is None else {IMBALANCE: self.imbalance}

    def summary(self) -> dict[str, str]:
        return {
            "router_bias_update": f"rate {self.rate:g}: after each step, the {BIAS} of {len(self.routers)} routers "
            "moves by rate x sign(mean load - load) from the step's global expert loads (DeepSeek-V3's "
            f"auxiliary-loss-free balancing), logged as {IMBALANCE}"
        }

    def _take_counts(self, device) -> torch.Tensor:
        counts = self.counts
        self.counts = None
        if counts is None:  # no forward with gradients on this rank: it still joins the all-reduce
            return torch.zeros(len(self.routers), self.experts, dtype=torch.float64, device=device)
        return counts.to(device)

    def _on_decoder_input(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_tensor(mask) and mask.dim() == 2:
            self._real = mask.bool().flatten()
        elif self.micro_batch is not None and torch.is_tensor(input_ids):
            self._real = rows_real_mask(input_ids, self.micro_batch)
        else:
            self._real = None

    def _on_router_output(self, index: int, output) -> None:
        if torch.compiler.is_compiling():
            torch.compiler.disable(self._count)(index, output)
        else:
            self._count(index, output)

    def _count(self, index: int, output) -> None:
        # a forward with gradients, not the recomputation of one inside a backward (activation checkpointing)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        chosen = chosen_experts(output)
        if chosen is None:  # every rank meets it in the same forward: one error line, no rank left waiting
            raise ConfigError(
                f"{type(self.routers[index]).__name__} returned no integer tensor of chosen experts: the "
                f"{BIAS} update cannot read the loads (set router_bias_update_rate: 0 and report the model type)"
            )
        per_token = chosen.shape[-1] if chosen.dim() > 1 else 1
        chosen = chosen.reshape(-1, per_token)
        weight = torch.ones(chosen.shape, dtype=torch.float64, device=chosen.device)
        if self._real is not None and self._real.numel() == chosen.shape[0]:
            weight = weight * self._real.to(chosen.device).unsqueeze(1)
        # indices outside the routed experts (LongCat's zero-computation experts, a -1 for none) are no load here
        weight = weight * ((chosen >= 0) & (chosen < self.experts))
        if self.counts is None:
            self.counts = torch.zeros(len(self.routers), self.experts, dtype=torch.float64, device=chosen.device)
        self.counts[index].scatter_add_(0, chosen.clamp(0, self.experts - 1).flatten(), weight.flatten())


def chosen_experts(output) -> torch.Tensor | None:
    """The experts a router chose, from its output: the integer tensor among what it returns (transformers' routers:
    (logits, weights, indices); DeepSeek's own code: (indices, weights))."""
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    return next((value for value in outputs if torch.is_tensor(value) and not value.is_floating_point()), None)


def rows_real_mask(input_ids: torch.Tensor, batch: dict) -> torch.Tensor | None:
    """The real-token mask of a forward's `input_ids` when they are rows of the micro-batch `batch` (the tensor
    itself, a view of some of its rows, or all of them laid end to end), from the batch's `real_tokens`; else None."""
    source, real = batch.get("input_ids"), batch.get("real_tokens")
    if not (torch.is_tensor(source) and torch.is_tensor(real) and source.dim() == 2 and source.numel()):
        return None
    if input_ids.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return None
    if not (source.is_contiguous() and input_ids.is_contiguous()):
        return None
    width = source.shape[1]
    start = input_ids.storage_offset() - source.storage_offset()
    if start < 0 or start % width or input_ids.numel() % width:
        return None
    first, rows = start // width, input_ids.numel() // width
    if first + rows > source.shape[0]:
        return None
    return real_token_mask({"input_ids": source[first : first + rows], "real_tokens": real[first : first + rows]})


_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, ExpertBias] = weakref.WeakKeyDictionary()


def attach(model: torch.nn.Module, config) -> ExpertBias | None:
    """At the start of a run (`run.begin`), from the recipe's `router_bias_update_rate`: the model's bias updates, or
    None where there is nothing to update (no router keeps the bias), the rate is 0, or under LoRA. Refuses
    reentrant activation checkpointing, under which a layer's first forward runs without gradients and its second
    inside the backward: no load would count, silently."""
    rate = resolved_rate(config.router_bias_update_rate, getattr(getattr(model, "config", None), "model_type", None))
    if not rate or getattr(config, "use_peft", False) or not routers_with_bias(model):
        return None  # LoRA: the base is frozen, its bias included (rate_problem refuses a rate set > 0)
    if config.gradient_checkpointing and (config.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        raise ConfigError(
            f"the router bias update ({BIAS}) with gradient_checkpointing_kwargs use_reentrant: true: reentrant "
            "checkpointing runs the layers without gradients first, so no expert load would be counted; set "
            "use_reentrant: false (the default), or router_bias_update_rate: 0"
        )
    return ExpertBias(model, rate)


def attached(model: torch.nn.Module) -> ExpertBias | None:
    """The bias updates `attach` put on this model (through any wrapper), or None."""
    return router_balance.attached_in(_ATTACHED, model)
