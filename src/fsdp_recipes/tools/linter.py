"""`fsdp-recipes validate-config FILE [--model M]`: the launch checks on a file, plus what needs the model (wrap
classes it lacks, tied embeddings a wrap policy would split)."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_recipes.distributed import expert_parallel, float8, sequence_parallel, tensor_parallel
from fsdp_recipes.distributed.accelerate_config import (
    UnreadableAccelerateConfig,
    fsdp_settings,
    read_accelerate_yaml,
    wrap_class_names,
)
from fsdp_recipes.distributed.launch_checks import (
    ERROR,
    NOTE,
    WARNING,
    Finding,
    exported_environment,
    lint_config_dict,
    lint_launch_environment,
)
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models.experts import expert_routing
from fsdp_recipes.models.modeling import auto_model_class, load_model_config
from fsdp_recipes.models.vision import vision_block_classes


# --- the model ---------------------------------------------------------------------------------------------------
def _lint_tensor_parallel_model(raw: dict, config, model_class) -> list[Finding]:
    """Under `parallelism_config_tp_size` or `_ep_size` > 1: the model has the plans they need and they divide its
    sizes (heads, widths, vocabulary; routed experts)."""
    sizes = {k.removeprefix("parallelism_config_"): v for k, v in (raw.get("parallelism_config") or {}).items()}
    tp, ep = int(sizes.get("tp_size", 1) or 1), expert_parallel.size_in_config(raw)
    if tp <= 1 and ep <= 1:
        return []
    layout = ParallelDims(
        dp_replicate=int(sizes.get("dp_replicate_size", 1) or 1),
        dp_shard=int(sizes.get("dp_shard_size", 1) or 1),
        tp=tp,
        ep=ep,
    )
    routing = expert_routing(config)
    found = tensor_parallel.model_problems(layout, config, model_class, routing and routing.num_experts)
    key = (
        "parallelism_config.parallelism_config_tp_size"
        if tp > 1
        else f"parallelism_config.{expert_parallel.CONFIG_KEY}"
    )
    return [Finding(ERROR, key, problem) for problem in found]


def lint_model(raw: dict, model: str, *, trust_remote_code: bool = False) -> list[Finding]:
    """Wrap classes and tied embeddings against a weightless copy of `model` (Hub id, folder, or config.json); under
    tensor parallelism, what the model must allow."""
    fsdp = fsdp_settings(raw)
    if str(raw.get("distributed_type")) != "FSDP":
        return []
    is_config_file = Path(model).is_file()
    config = load_model_config(
        None if is_config_file else model, model if is_config_file else None, trust_remote_code=trust_remote_code
    )
    with torch.device("meta"):  # a vision-language model whole (AutoModelForImageTextToText where it has no causal LM)
        instance = auto_model_class("causal-lm", config).from_config(config, trust_remote_code=trust_remote_code)
    present = {type(module).__name__ for module in instance.modules()}
    no_split = list(getattr(instance, "_no_split_modules", None) or [])
    findings = _lint_tensor_parallel_model(raw, config, type(instance))
    sp = int((raw.get("parallelism_config") or {}).get("parallelism_config_sp_size", 1) or 1)
    findings += [  # the heads the all-to-all splits (the recipe and attention are checked at start-up)
        Finding(ERROR, sequence_parallel.KEY, problem)
        for problem in sequence_parallel.model_problems(sp, config, attn_implementation=None, recipe="sft")
    ]
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
    requested = list(wrap_class_names(fsdp.get("fsdp_transformer_layer_cls_to_wrap")) or [])
    if policy == "TRANSFORMER_BASED_WRAP":
        missing = [name for name in requested if name not in present]
        if missing:
            fix = f"set it to {', '.join(no_split)}" if no_split else "set it to the model's decoder layer class"
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    f"{', '.join(missing)} not in this {config.model_type} model; {fix}, or remove the key to use the "
                    "model's _no_split_modules",
                )
            )
        # unnamed: the recipes wrap the _no_split_modules the model has (a vision-language model's list can name classes
        # of a tower it lacks, on which accelerate alone would raise) and the vision blocks (models.modeling)
        left_out = [name for name in vision_block_classes(instance) if requested and name not in requested]
        if left_out:
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    f"names {', '.join(requested)} but not the vision tower's blocks ({', '.join(left_out)}): the "
                    "whole image encoder would stay in the root FSDP unit; add them, or remove the key",
                )
            )
        if not requested and not no_split:
            findings.append(
                Finding(
                    ERROR,
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    f"not set and {config.model_type} models declare no _no_split_modules: name the decoder layer class",
                )
            )
    findings += _tied_embedding_findings(instance, policy, requested)
    return findings


def _tied_embedding_findings(model, policy: str, requested: list[str]) -> list[Finding]:
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or inputs.weight is not outputs.weight:
        return []
    # One tensor used by two modules must live in one FSDP unit (accelerate PR #4171): a policy that puts the
    # embedding or the output head in a unit of its own splits it.
    split_classes = {type(inputs).__name__, type(outputs).__name__} & set(requested)
    if policy == "TRANSFORMER_BASED_WRAP" and split_classes:
        return [
            Finding(
                ERROR,
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                f"wraps {', '.join(sorted(split_classes))}, but the input embedding and the output head share one weight "
                "(tie_word_embeddings): wrapping either on its own splits it between FSDP units; wrap only the decoder "
                "layer class",
            )
        ]
    if policy == "SIZE_BASED_WRAP":
        return [
            Finding(
                WARNING,
                "fsdp_config.fsdp_auto_wrap_policy",
                "SIZE_BASED_WRAP with tied embeddings (tie_word_embeddings): the size policy can put the embedding and the "
                "output head in different FSDP units; use TRANSFORMER_BASED_WRAP, which leaves both in the root unit",
            )
        ]
    return []


# --- all of it ---------------------------------------------------------------------------------------------------
def lint_config_file(path: str | Path, *, model: str | None = None, trust_remote_code: bool = False) -> list[Finding]:
    try:
        raw = read_accelerate_yaml(path)
    except UnreadableAccelerateConfig as error:
        return [Finding(ERROR, error.path, error.reason)]
    findings = lint_config_dict(raw)
    if not any(f.severity == ERROR for f in findings):  # the launcher's own code would trip over those first
        try:
            environment = exported_environment(path)
        except (ValueError, KeyError, TypeError) as error:
            findings.append(Finding(ERROR, "accelerate launch", f"refuses this file: {error}"))
        else:
            seen = {(f.key, f.severity) for f in findings}
            findings += [f for f in lint_launch_environment(environment) if (f.key, f.severity) not in seen]
    if model is not None:
        findings += lint_model(raw, model, trust_remote_code=trust_remote_code)
    if str(raw.get("mixed_precision", "no")).lower() == "fp8" and (note := float8.machine_note()):
        findings.append(Finding(NOTE, "mixed_precision", note))
    return findings
