"""The checks a run makes before any weight loads, as lists of named checks over what start-up resolved (the recipe
config, the launch's layout, the model config): `TRAINING` for the training recipes, `EVALUATION` for eval.py. Each
check is small and answers alone: it applies or not, and names a problem (a line or several) or none. The first
problem stops every rank with one `error:` line (fsdp_recipes.common.errors); the run summary lists the checks that
ran (`checks_before_loading`).

A new parallel dimension adds one field to `ParallelDims` (fsdp_recipes.distributed.parallel_dims) and one check here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed import sequence_parallel, tensor_parallel
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models import adapters, fused_kernels
from fsdp_recipes.models.experts import expert_routing
from fsdp_recipes.models.modeling import (
    check_one_activation_checkpointing,
    check_packing_is_isolated,
    check_same_shapes,
    load_model_config,
    model_class_for,
)
from fsdp_recipes.models.positions import check_example_fits_positions
from fsdp_recipes.train import checkpoint as checkpoints_lib
from fsdp_recipes.train import expert_bias, generation_backends, router_balance
from fsdp_recipes.train.losses import loss_implementation_problem

Problem = str | list[str] | None


@dataclasses.dataclass(frozen=True)
class BeforeLoading:
    """What the checks read: resolved once at start-up, never rebuilt by a check."""

    config: Any
    parallel: ParallelDims
    model_config: Any
    task: str
    recipe: str
    accelerator: Any
    attn_implementation: str | None
    launch: LaunchLayout | None = None  # the Accelerate settings (training)
    checkpoint: Path | None = None  # the checkpoint a training run resumes
    saved_recipe: dict | None = None  # that checkpoint's recipe config
    adapter: bool = False  # evaluating a LoRA adapter folder (merged into its base before sharding)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    problem: Callable[[BeforeLoading], Problem]  # or raises its ConfigError itself (the models layer's checks)
    applies: Callable[[BeforeLoading], bool] = lambda _facts: True
    prefix: str = ""


def run_checks(checks: list[Check], facts: BeforeLoading) -> list[str]:
    """Runs `checks` in order; the first problem raises ConfigError. Returns the names of those that applied."""
    ran = []
    for check in checks:
        if not check.applies(facts):
            continue
        problem = check.problem(facts)
        if problem:
            raise ConfigError(f"{check.prefix}{problem}" if isinstance(problem, str) else problem)
        ran.append(check.name)
    return ran


# --- the checks, each alone -------------------------------------------------------------------------------------------
def _saved_model_config(facts: BeforeLoading):
    path = checkpoints_lib.saved_model_config_path(facts.checkpoint)
    return load_model_config(None, str(path), trust_remote_code=facts.config.trust_remote_code)


def tensor_parallel_problems(facts: BeforeLoading) -> list[str]:
    """Under a TP/EP launch: the model can be split `tp` (and its experts `ep`) ways, and nothing the route cannot do
    is asked for (a LoRA adapter to merge before sharding, LoRA training)."""
    parallel, config = facts.parallel, facts.config
    routing = expert_routing(facts.model_config)
    problems = tensor_parallel.model_problems(
        parallel, facts.model_config, model_class_for(facts.model_config, facts.task), routing and routing.num_experts
    )
    layout = tensor_parallel.layout_text(parallel)
    fsdp_alone = "FSDP alone (parallelism_config_tp_size: 1, parallelism_config_ep_size: 1)"
    if facts.adapter:
        problems.append(
            f"a LoRA adapter under {layout}: it is merged into its base before sharding, which the sharded "
            f"loading cannot do; merge it first (fsdp-recipes export) and evaluate the merged folder, or evaluate with "
            f"{fsdp_alone}"
        )
    if getattr(config, "use_peft", False):
        problems.append(
            f"use_peft under {layout}: peft's LoRA layers do not wrap the tensor- or expert-sharded layers "
            f"transformers builds (a whole-width update on a sharded output); train LoRA with {fsdp_alone}"
        )
    return problems


POSITIONS = Check("positions", lambda f: check_example_fits_positions(f.model_config, f.config.max_length))
EXPERT_BIAS_RATE = Check("expert_bias_rate", lambda f: expert_bias.rate_problem(f.model_config, f.config))
SAME_SHAPES_AS_CHECKPOINT = Check(
    "same_shapes_as_checkpoint",
    lambda f: check_same_shapes(
        _saved_model_config(f), f.model_config, task=f.task, trust_remote_code=f.config.trust_remote_code
    ),
    applies=lambda f: f.checkpoint is not None and checkpoints_lib.saved_model_config_path(f.checkpoint).is_file(),
)
EXPERT_BIAS_RESUME = Check(
    "expert_bias_resume",
    lambda f: expert_bias.resume_problem(f.model_config, f.config, f.saved_recipe),
    applies=lambda f: f.saved_recipe is not None,
)
PACKING_ISOLATED = Check(
    "packing_isolated", lambda f: check_packing_is_isolated(f.model_config), applies=lambda f: f.config.packs_examples()
)
ONE_ACTIVATION_CHECKPOINTING = Check(
    "one_activation_checkpointing",
    lambda f: check_one_activation_checkpointing(
        f.accelerator, model_gradient_checkpointing=f.config.gradient_checkpointing
    ),
)
ROUTER_BALANCE_CHECKPOINTING = Check(
    "router_balance_checkpointing",
    lambda f: router_balance.checkpointing_problem(
        f.model_config,
        fsdp_checkpointing=f.launch.activation_checkpointing,
        wrap_policy=f.launch.wrap_policy,
        gradient_checkpointing=f.config.gradient_checkpointing,
        kwargs=f.config.gradient_checkpointing_kwargs,
    ),
)
ADAPTERS = Check(
    "adapters",
    lambda f: adapters.check_before_loading(
        f.config,
        f.model_config,
        task=f.task,
        is_fsdp=f.accelerator.distributed_type.value == "FSDP",
        trust_remote_code=f.config.trust_remote_code,
    ),
    applies=lambda f: f.config.use_peft,
)
LOSS_IMPLEMENTATION = Check(
    "loss_implementation",
    lambda f: loss_implementation_problem(f.config.loss_implementation, f.accelerator.device.type),
)
TENSOR_PARALLEL = Check("tensor_parallel", tensor_parallel_problems, applies=lambda f: f.parallel.sharded_layers)
SEQUENCE_PARALLEL = Check(
    "sequence_parallel",
    lambda f: sequence_parallel.model_problems(
        f.parallel.sp, f.model_config, attn_implementation=f.attn_implementation, recipe=f.recipe
    ),
    applies=lambda f: f.parallel.sp > 1,
)
SEQUENCE_SPLIT = Check(
    "sequence_split",
    lambda f: f.config.sequence_split_problem(),
    applies=lambda f: f.parallel.sp > 1,
    prefix="under sequence parallelism: ",
)
GENERATION_BACKEND = Check(
    "generation_backend",
    lambda f: generation_backends.backend_problem(
        getattr(f.config, "generation_backend", "generate"), f.model_config, sharded_layers=f.parallel.sharded_layers
    ),
)
LIGER_KERNEL = Check(
    "liger_kernel",
    lambda f: fused_kernels.liger_problem(
        f.model_config, device_type=f.accelerator.device.type, sharded_layers=f.parallel.sharded_layers
    ),
    applies=lambda f: f.config.use_liger_kernel,
)

TRAINING = [
    POSITIONS,
    EXPERT_BIAS_RATE,
    SAME_SHAPES_AS_CHECKPOINT,
    EXPERT_BIAS_RESUME,
    PACKING_ISOLATED,
    ONE_ACTIVATION_CHECKPOINTING,
    ROUTER_BALANCE_CHECKPOINTING,
    ADAPTERS,
    LOSS_IMPLEMENTATION,
    TENSOR_PARALLEL,
    SEQUENCE_PARALLEL,
    SEQUENCE_SPLIT,
    GENERATION_BACKEND,
    LIGER_KERNEL,
]
EVALUATION = [TENSOR_PARALLEL, SEQUENCE_PARALLEL, GENERATION_BACKEND]
