"""Keys that TRL, `transformers.TrainingArguments` and alignment-handbook configs carry but that are no field here,
read before a config is typed (`fsdp_recipes.common.arguments.parse_config`): an old name becomes today's
(`max_seq_length` -> `max_length`), a setting that lives elsewhere here gets one error saying where, and a key with a
harmless meaning is accepted and recorded as ignored, with why (the run summary lists it once). Every key this
module knows is in docs/coming-from-trl.md. A key that a config class has as a field is always that field: this
table only speaks for keys no field takes."""

from __future__ import annotations

from typing import Any

# old name -> (today's name, the note printed with it)
RENAMED = {
    "max_seq_length": ("max_length", "TRL renamed max_seq_length to max_length"),
    "torch_dtype": ("dtype", "transformers 5 renamed torch_dtype to dtype"),
    "vllm_importance_sampling_cap": (
        "vllm_importance_sampling_clip_max",
        "TRL renamed vllm_importance_sampling_cap to vllm_importance_sampling_clip_max",
    ),
}

_ACCELERATE_CONFIG = "accelerate launch --config_file accelerate_configs/<topology>.yaml"

# key -> where that setting lives here (each is one error: the key cannot mean anything in this file)
ELSEWHERE = {
    "deepspeed": "DeepSpeed is not used here: sharding is FSDP2, set in the Accelerate config "
    f"({_ACCELERATE_CONFIG}); `fsdp-recipes from-deepspeed ds_config.json` translates a DeepSpeed JSON into one",
    "fsdp": f"FSDP settings live in the Accelerate config ({_ACCELERATE_CONFIG})",
    "fsdp_config": f"FSDP settings live in the Accelerate config ({_ACCELERATE_CONFIG})",
    "accelerator_config": f"Accelerator settings live in the Accelerate config ({_ACCELERATE_CONFIG})",
    "parallelism_config": f"parallelism lives in the Accelerate config ({_ACCELERATE_CONFIG})",
    "local_rank": "the launcher sets each process's rank (accelerate launch); a config file cannot",
    "ddp_backend": f"the process-group backend comes from the launcher and the Accelerate config ({_ACCELERATE_CONFIG})",
    "ddp_find_unused_parameters": "FSDP2 shards every parameter and needs no unused-parameter search; remove it",
    "half_precision_backend": f"mixed precision is the Accelerate config's mixed_precision ({_ACCELERATE_CONFIG})",
    "use_cpu": "the device comes from the launch: with no GPU the recipes run on CPU (gloo) by themselves",
    "no_cuda": "the device comes from the launch: with no GPU the recipes run on CPU (gloo) by themselves",
}

# key -> (values with the no-op meaning, why nothing needs doing here). Another value is refused, with the why.
IGNORED = {
    "remove_unused_columns": (
        (True, False),
        "the recipe's data format picks the columns it reads; no other column reaches the model",
    ),
    "average_tokens_across_devices": (
        (True,),
        "the loss is always the mean over every target token of the global batch (all processes, all micro-steps)",
    ),
    "include_tokens_per_second": ((True, False), "tokens per second is always logged (metrics.jsonl)"),
    "include_num_input_tokens_seen": ((True, False), "tokens seen are always logged (metrics.jsonl)"),
    "logging_dir": (None, "trackers write under output_dir"),
    "log_level_replica": (
        None,
        "processes other than each machine's main one log warnings and errors only, and show no progress bars",
    ),
    "logging_first_step": ((True, False), "the first step's figures are always logged"),
    "disable_tqdm": ((True, False), "only the main process shows the step progress bar"),
    "lmbda": (
        (0,),
        "on-policy distillation (TRL GKD's lmbda: a share of batches whose completions the student samples and the "
        "teacher scores) is recipes/distill.py's setting; this recipe trains on the data's completions (lmbda 0)",
    ),
    "vllm_group_port": (
        None,
        "TRL's NCCL group for pushing weights: here the weights reach the vLLM server through files (vllm_weights_dir)",
    ),
    "seq_kd": (
        (False,),
        "sequence-level KD (TRL GKD's seq_kd: training on completions the teacher generates) is recipes/distill.py's "
        "setting; this recipe trains on the data's completions",
    ),
}


# key -> (the field it sets, the value it gives that field when true, the note): a TRL switch that is a choice here
SWITCHES = {
    "use_transformers_paged": (
        "generation_backend",
        "paged",
        "TRL's use_transformers_paged is generation_backend: paged here (transformers' continuous batching)",
    ),
    "use_vllm": (
        "generation_backend",
        "vllm",
        "TRL's use_vllm is generation_backend: vllm here (a vLLM server the run pushes its weights to; docs/vllm.md)",
    ),
}


def translate(values: dict[str, Any], fields: set[str], where: str) -> tuple[dict[str, Any], dict[str, str], list]:
    """(values under this project's names, {key: "renamed: ..." or "ignored: why"}, problems) for a config file's mapping; `fields`: the
    config class's field names (a field always wins over this table)."""
    translated, ignored, problems = {}, {}, []
    for key, value in values.items():
        if key in fields:
            translated[key] = value
        elif key in RENAMED:
            new, note = RENAMED[key]
            if new in values and values[new] != value:
                problems.append(
                    f"{key} ({value!r}) and {new} ({values[new]!r}) in {where} disagree: {note}; keep only {new}"
                )
            elif new in fields:
                translated.setdefault(new, value)
                ignored[key] = f"renamed: read as {new} ({note})"
            else:
                problems.append(f"{key!r} in {where}: this recipe has no {new}; remove it")
        elif key in SWITCHES and key not in fields:
            field, chosen, note = SWITCHES[key]
            if field not in fields and not value:
                ignored[key] = f"ignored: this recipe does not generate ({note})"
            elif field not in fields:
                problems.append(f"{key!r} in {where}: this recipe has no {field}; remove it")
            elif value and values.get(field, chosen) != chosen:
                problems.append(f"{key}: true and {field}: {values[field]!r} in {where} disagree: {note}; keep one")
            else:
                if value:
                    translated.setdefault(field, chosen)
                ignored[key] = f"renamed: read as {field}: {chosen if value else 'unchanged'} ({note})"
        elif key in ELSEWHERE:
            problems.append(f"{key!r} in {where} cannot be set here: {ELSEWHERE[key]}")
        elif key in IGNORED:
            accepted, why = IGNORED[key]
            if accepted is not None and value not in accepted:
                problems.append(f"{key}: {value!r} in {where} is not available here: {why}; remove it")
            else:
                ignored[key] = f"ignored: {why}"
        else:
            translated[key] = value  # the caller reports it as unknown, with its own "did you mean"
    return translated, ignored, problems


def command_line_message(key: str) -> str | None:
    """The message for an upstream key given as a command-line flag (None: not one of them)."""
    if key in RENAMED:
        new, note = RENAMED[key]
        return f"--{key} is called --{new} here ({note})"
    if key in ELSEWHERE:
        return f"--{key} cannot be set here: {ELSEWHERE[key]}"
    if key in IGNORED:
        return f"--{key} has no effect here ({IGNORED[key][1]}); remove it"
    if key in SWITCHES:
        field, chosen, note = SWITCHES[key]
        return f"--{key} is --{field} {chosen} here ({note})"
    return None
