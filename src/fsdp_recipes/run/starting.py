"""The start of a run, before any weights load: the accelerator for this launch, the seed, and every check that
needs no weights, run on all ranks together (`start` for training, `start_evaluation` for a trained model)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, TorchDynamoPlugin, set_seed

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.outputs import output_dir_problem
from fsdp_recipes.data.images import ImageInputs
from fsdp_recipes.distributed import expert_parallel, float8, logs
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.accelerator import build_accelerator
from fsdp_recipes.distributed.collectives import on_every_rank_together
from fsdp_recipes.distributed.launch_checks import check_launch_environment
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.models import vision
from fsdp_recipes.models.attention import resolve_attn_implementation
from fsdp_recipes.models.experts import apply_router_aux_loss_coef
from fsdp_recipes.models.modeling import (
    check_tokenizer_fits_model,
    is_vision_language,
    load_model_config,
    load_tokenizer,
    resolve_wrap_classes,
)
from fsdp_recipes.publish.hub import require_hub_token
from fsdp_recipes.publish.model_source import resolve as resolve_model_source
from fsdp_recipes.publish.model_source import task_of as model_source_task
from fsdp_recipes.run import checks as before_loading
from fsdp_recipes.run.runs import EvaluationRun, Run
from fsdp_recipes.train import benchmarks, preemption, trainer_arguments, vllm_settings
from fsdp_recipes.train import checkpoint as checkpoints_lib
from fsdp_recipes.train.compilation import compile_choice
from fsdp_recipes.train.config import RunConfig, TrainingConfig


def start(config: TrainingConfig, *, name: str, task: str = "causal-lm") -> Run:
    """The accelerator for this launch (refusing launches that cannot give what was asked), the seed, and every
    check that needs no weights, run on all ranks together so that a problem stops all of them before anything
    expensive: the Accelerate config, the checkpoint to resume (same global batch, same model), output_dir, the Hub
    token, tokenizer and model config, the wrap classes, activation checkpointing, the attention implementation."""
    accelerator, parallel = accelerator_for(config)
    compiled, compile_note = on_every_rank_together(
        accelerator,
        lambda: compile_choice(
            config.torch_compile,
            device_type=accelerator.device.type,
            max_steps=config.max_steps,
            sequence_parallel=parallel.sp,
        ),
    )
    if compiled:  # read by prepare; attached here because the device decides `auto`
        accelerator.state.dynamo_plugin = compile_plugin(config)
    if not config.resume_from_checkpoint and (reason := preemption.automatic_resume(config.output_dir)):
        logs.info(reason)
        config.resume_from_checkpoint = "latest"
    checked = on_every_rank_together(accelerator, lambda: _before_loading(accelerator, parallel, config, task, name))
    return Run(
        config=config, name=name, task=task, accelerator=accelerator, parallel=parallel, compile_note=compile_note,
        **checked,
    )  # fmt: skip


def pictures_of(config, model_config, tokenizer, processor_from: str) -> ImageInputs | None:
    """A vision-language model's processor (image parts become tokens, pictures pixel values); None for a text
    model."""
    if not is_vision_language(model_config):
        return None
    processor = vision.load_processor(
        processor_from, tokenizer, revision=config.model_revision, trust_remote_code=config.trust_remote_code
    )
    return ImageInputs(processor)


def start_evaluation(
    config: RunConfig, *, name: str, task: str | None = None, base_model_name_or_path: str | None = None
) -> EvaluationRun:
    """`start` for a recipe that loads a trained model to measure it: the same accelerator and checks before loading,
    on a model folder, Hub id, LoRA adapter folder or recipe checkpoint; `task` None: the model's own (a
    *ForSequenceClassification is a classifier). output_dir None: the model folder itself. `base_model_name_or_path`:
    a LoRA adapter's base, instead of the one it records."""
    accelerator, parallel = accelerator_for(config)

    def checks() -> dict[str, Any]:
        source = resolve_model_source(config.model_name_or_path, base_model_name_or_path=base_model_name_or_path)
        output_dir = config.output_dir or (str(source.local_folder) if source.local_folder else None)
        if output_dir is None:
            raise ConfigError(
                "output_dir is required when evaluating a Hub id or a checkpoint: the folder for the "
                "results and the card"
            )
        problem = output_dir_problem(output_dir, overwrite=True)
        hub_model_id = config.hub_model_id or (source.name if source.kind == "hub" else None)
        if config.push_to_hub and not hub_model_id:
            problem = problem or "push_to_hub needs hub_model_id: the repo whose card gets the results"
        if problem:
            raise ConfigError(problem)
        hub_token = require_hub_token() if config.push_to_hub else None
        # an adapter folder has no model config of its own (its base's applies) but carries the tokenizer it used
        tokenizer, model_config = load_model_files(
            config,
            source.config_files,
            tokenizer_name_or_path=source.files,
            model_setting="base_model_name_or_path" if source.kind == "adapter" else "model_name_or_path",
        )
        model_task = task or model_source_task(source, model_config)
        facts = before_loading.BeforeLoading(
            config=config, parallel=parallel, model_config=model_config, task=model_task, recipe=name,
            accelerator=accelerator, attn_implementation=config.attn_implementation, adapter=source.kind == "adapter",
        )  # fmt: skip
        checks_ran = before_loading.run_checks(before_loading.EVALUATION, facts)
        planned = benchmarks.plan(config, parallel=parallel, language_model=model_task == "causal-lm")
        server = generation_server(config, model_config, model_name=source.config_files)
        return dict(
            pictures=pictures_of(config, model_config, tokenizer, str(source.files)),
            checks_before_loading=checks_ran,
            benchmarks=planned,
            generation_server=server,
            source=source,
            output_dir=Path(output_dir),
            hub_model_id=hub_model_id,
            hub_token=hub_token,
            tokenizer=tokenizer,
            model_config=model_config,
            task=model_task,
            **model_layout(accelerator, parallel, config, model_config, model_task),
        )

    started = on_every_rank_together(accelerator, checks)
    accelerator.project_configuration.set_directories(str(started["output_dir"]))  # trackers write beside results
    return EvaluationRun(config=config, name=name, accelerator=accelerator, parallel=parallel, **started)


def compile_plugin(config: TrainingConfig) -> TorchDynamoPlugin:
    """Each decoder layer compiled in place before FSDP2 wraps it (accelerate's regional compilation: one layer's
    compile serves every layer), with the config's backend and mode."""
    mode = {"mode": config.torch_compile_mode} if config.torch_compile_mode else {}
    plugin = TorchDynamoPlugin(backend=config.torch_compile_backend, use_regional_compilation=True, **mode)
    # `accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False, which the plugin takes: every new row width
    # was then a new graph, until dynamo's recompile limit left the layers uncompiled. None: torch's own automatic
    # dynamic shapes, one recompile at the first new width and none after (packed rows keep one width: no recompile).
    plugin.dynamic = None
    return plugin


def accelerator_for(config: RunConfig) -> tuple[Accelerator, ParallelDims]:
    """The launch's layout, read once; the Accelerate config as exported checked (its errors stop every rank here, its
    warnings are printed); the accelerator built from it with the config's trackers and process-group timeout, and
    the layout's meshes attached; logging set up (`log_level`), and the seed set. bf16/fp16 must agree with the
    Accelerate config's mixed_precision; run without one, they set it (as Trainer does)."""
    expert_parallel.export_launched_size()  # the one size accelerate's launcher does not export
    parallel = ParallelDims.from_environment(os.environ)  # the launch's layout, read once
    launch_warnings = check_launch_environment(os.environ, parallel=parallel)
    launch_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")  # set by accelerate launch from its config
    problem = trainer_arguments.precision_problem(config, launch_precision)
    if launch_precision == "fp8":
        problem = problem or float8.launch_problem(os.environ, use_peft=getattr(config, "use_peft", False))
    if problem:
        raise ConfigError(problem)
    precision = (
        {} if launch_precision else {"mixed_precision": trainer_arguments.mixed_precision_without_launch_config(config)}
    )
    accelerator, parallel = build_accelerator(
        parallel,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=config.trackers() or None,
        project_dir=config.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=config.ddp_timeout))],
        **precision,
    )
    if launch_precision == "fp8" and (problem := float8.device_problem(accelerator.device)):
        raise ConfigError(problem)
    logs.configure(accelerator, config.log_level)
    set_seed(config.seed)
    for warning in launch_warnings:
        logs.warning(f"warning: the Accelerate config: {warning.key}: {warning.message}")
    return accelerator, parallel


def load_model_files(
    config: RunConfig,
    model_name_or_path: str | None,
    model_config_file: str | None = None,
    *,
    tokenizer_name_or_path: str | None = None,
    model_setting: str = "model_name_or_path",
):
    """(tokenizer, model config) of the model to load, checked against each other; no weights. The tokenizer is the
    config's `tokenizer_name_or_path`, else `tokenizer_name_or_path`, else the model's own. `model_setting`: the field
    that named `model_name_or_path`, for messages."""
    tokenizer = load_tokenizer(
        config.tokenizer_name_or_path or tokenizer_name_or_path or model_name_or_path,
        revision=config.model_revision,
        trust_remote_code=config.trust_remote_code,
        chat_template=config.chat_template,
        chat_template_path=getattr(config, "chat_template_path", None),
        setting="tokenizer_name_or_path" if config.tokenizer_name_or_path else "model_name_or_path",
    )
    trainer_arguments.set_eos_token(tokenizer, config.eos_token)
    model_config = load_model_config(
        model_name_or_path,
        model_config_file,
        revision=config.model_revision,
        trust_remote_code=config.trust_remote_code,
        setting=None if model_config_file else model_setting,
    )
    check_tokenizer_fits_model(tokenizer, model_config)
    return tokenizer, model_config


def model_layout(
    accelerator: Accelerator, parallel: ParallelDims, config: RunConfig, model_config, task: str
) -> dict[str, Any]:
    """What the Accelerate config will wrap (checked against the model) and the attention implementation to load."""
    wrap_classes = resolve_wrap_classes(
        accelerator, model_config, task=task, trust_remote_code=config.trust_remote_code
    )
    if (
        wrap_classes
    ):  # what accelerate wraps: the checked list (a vision-language model's _no_split_modules alone fails)
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = wrap_classes
    training = hasattr(config, "packs_examples")  # a training recipe's config (RecipeTraits); eval's is not
    attn_implementation, attention_note = resolve_attn_implementation(
        model_config,
        config.attn_implementation,
        task=task,
        trust_remote_code=config.trust_remote_code,
        device_type=accelerator.device.type,
        packs_examples=training and config.packs_examples(),
        training=training,
        tensor_parallel=parallel.sharded_layers,
        generates=training and config.generation_footprint()[0] > 0,
    )
    return dict(wrap_classes=wrap_classes, attn_implementation=attn_implementation, attention_note=attention_note)


def generation_server(config: RunConfig, model_config, *, model_name: str | None):
    """With `generation_backend: vllm`, the server, connected and checked against the model
    (`train.vllm_settings.connect`); else None (the backend itself is checked before: `checks.GENERATION_BACKEND`)."""
    if getattr(config, "generation_backend", "generate") != "vllm":
        return None
    owner = str(Path(config.output_dir or model_name).resolve())  # the run: pushes from another are told apart
    return vllm_settings.connect(
        config, model_config, model_name=model_name, max_length=config.longest_request(), owner=owner
    )


def _before_loading(
    accelerator: Accelerator, parallel: ParallelDims, config: TrainingConfig, task: str, name: str
) -> dict[str, Any]:
    """What a training run resolves before loading (the checkpoint to resume, output_dir, the Hub token, tokenizer
    and model config, the wrap classes and attention), then the named checks over them (`checks.TRAINING`)."""
    checkpoint = None
    if config.resume_from_checkpoint:
        checkpoint = checkpoints_lib.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
        checkpoints_lib.read_progress(checkpoint).check_resumable(
            world_size=parallel.data_parallel_size,
            per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
    resuming_here = checkpoint is not None and Path(config.output_dir).resolve() in checkpoint.resolve().parents
    problem = output_dir_problem(config.output_dir, overwrite=config.overwrite_output_dir or resuming_here)
    problem = problem or checkpoints_lib.checkpoint_conflict(config.output_dir, checkpoint)
    if problem:
        raise ConfigError(problem)
    hub_token = require_hub_token() if config.push_to_hub else None
    tokenizer, model_config = load_model_files(config, config.model_name_or_path, config.model_config)
    if problem := vision.freezing_problem(config, model_config):
        raise ConfigError(problem)
    pictures = pictures_of(config, model_config, tokenizer, config.tokenizer_name_or_path or config.model_name_or_path)
    apply_router_aux_loss_coef(model_config, config.router_aux_loss_coef)
    config_changes, saved_recipe = {}, None
    if checkpoint is not None and checkpoints_lib.saved_recipe_config_path(checkpoint).is_file():
        saved_recipe = json.loads(checkpoints_lib.saved_recipe_config_path(checkpoint).read_text())
        config_changes = checkpoints_lib.check_resume_config(config, saved_recipe, checkpoint)
    layout = model_layout(accelerator, parallel, config, model_config, task)
    facts = before_loading.BeforeLoading(
        config=config, parallel=parallel, model_config=model_config, task=task, recipe=name, accelerator=accelerator,
        attn_implementation=layout["attn_implementation"], launch=LaunchLayout.from_accelerator(accelerator, parallel),
        checkpoint=checkpoint, saved_recipe=saved_recipe,
    )  # fmt: skip
    checks_ran = before_loading.run_checks(before_loading.TRAINING, facts)
    planned = benchmarks.plan(config, parallel=parallel, language_model=task == "causal-lm")
    return dict(
        benchmarks=planned,
        pictures=pictures,
        generation_server=generation_server(config, model_config, model_name=config.model_name_or_path),
        checkpoint=checkpoint,
        hub_token=hub_token,
        tokenizer=tokenizer,
        model_config=model_config,
        config_changes=config_changes,
        checks_before_loading=checks_ran,
        **layout,
    )
