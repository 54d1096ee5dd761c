"""The parts `Run.begin` puts together after `accelerator.prepare`, one job each: where the data resumes, the run
summary, the metrics log and trackers, the bytes each rank really holds, the step logger and the checkpointer. Each
takes the `Run` (what `start` checked and built) and returns its part; `begin` hands them to the loop as `TrainingLoop`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from fsdp_recipes.common.tables import format_table
from fsdp_recipes.common.yaml_json import write_json
from fsdp_recipes.distributed import logs
from fsdp_recipes.distributed.accelerator import describe_run
from fsdp_recipes.models import adapters, experts
from fsdp_recipes.models.export_dtype import dtype_name
from fsdp_recipes.models.modeling import activation_checkpointing_mechanism, count_non_embedding_parameters
from fsdp_recipes.tools.estimator.live import estimate_for_run, readable_estimate
from fsdp_recipes.train import checkpoint as checkpoints_lib
from fsdp_recipes.train import expert_bias, loop, router_balance, trainer_arguments
from fsdp_recipes.train.config import config_to_dict
from fsdp_recipes.train.loop import BatchStream
from fsdp_recipes.train.metrics import (
    MetricsLog,
    StepLogger,
    device_name,
    held_state_bytes,
    numeric_fields,
    peak_flops_per_device,
)


def shared(train_loader) -> bool:
    """A prepared DataLoader, whose position progress.json records for any world size; otherwise a stream that keeps
    each rank's own position (`BatchStream`'s `take`, `epoch`, `batches_into_epoch` and `state_dict()`)."""
    return isinstance(train_loader, DataLoader)


def resume_position(run, train_loader, scheduler) -> tuple[Any, int]:
    """(the batch stream, the first step to run). Resuming: the checkpoint's weights, optimizer and schedule loaded,
    the data at its position (a per-rank stream was restored by the recipe before loading weights), and the
    optimizer's settings as the config now says."""
    batches = BatchStream(run.accelerator, train_loader) if shared(train_loader) else train_loader
    if run.checkpoint is None:
        return batches, 1
    progress = checkpoints_lib.load_checkpoint(run.accelerator, run.checkpoint)
    if shared(train_loader):
        batches = BatchStream(
            run.accelerator,
            train_loader,
            epoch=progress.epoch,
            batches_into_epoch=progress.batches_into_epoch_for(
                run.parallel.data_parallel_size, run.config.per_device_train_batch_size
            ),
        )
    loop.apply_settings_on_resume(scheduler, run.config)
    return batches, progress.step + 1


def run_summary(run, model, train_loader, summary: dict[str, Any] | None) -> dict[str, Any]:
    """Collective: what this run really does (the launch from accelerate's resolved state, the model, its data and
    the choices made for it) and the memory the estimator predicts, with the recipe's own `summary` fields."""
    config, accelerator = run.config, run.accelerator
    described = describe_run(accelerator, run.parallel, model, run.wrap_classes)
    moe = experts.describe_experts(accelerator.unwrap_model(model).config)
    balance = router_balance.attached(model)
    if moe is not None:
        if balance is not None:  # the recipe adds it (train/router_balance.py), said below
            del moe["router_aux_loss"]
        described["mixture_of_experts"] = moe
    rows = len(getattr(train_loader, "dataset", None) or []) if shared(train_loader) else None
    if rows is not None and rows < run.global_batch_rows:  # allowed by repeat_small_dataset (else refused)
        described["repeated_data"] = (
            f"{rows} training rows, fewer than one optimizer step takes ({run.global_batch_rows}): every step repeats "
            "rows"
        )
    described.update(
        recipe=run.name,
        task=run.task,
        checks_before_loading=run.checks_before_loading,
        attn_implementation=run.attention_note,
        **(summary or {}),
        **(balance.summary() if balance is not None else {}),
        **bias_summary(model, config),
        upstream_keys=trainer_arguments.upstream_key_notes(config) or None,
        **adapters.parameter_counts(model),
        lora=adapters.describe(config),
        optimizer_steps=run.total_steps,
        global_batch_rows=run.global_batch_rows,
        activation_checkpointing=activation_checkpointing_mechanism(accelerator, config.gradient_checkpointing),
        torch_compile=run.compile_note,
        use_liger_kernel=run.fused_kernels or False,
        optim=config.optim,
        export_dtype=dtype_name(run.export_dtype),
        device_name=device_name(accelerator.device),
        memory_estimate=estimate_for_run(
            accelerator,
            run.model_config,
            dataclasses.replace(config, attn_implementation=run.attn_implementation),
            parallel=run.parallel,
        ),
    )
    return described


def bias_summary(model, config) -> dict[str, str]:
    """The run summary's `router_bias_update`: the update `expert_bias.attach` set up, or why there is none where it
    matters (LoRA keeps the base's bias as loaded; a rate set > 0 on a model whose routers keep no bias)."""
    updates, rate = expert_bias.attached(model), config.router_bias_update_rate
    if updates is not None:
        return updates.summary()
    if config.use_peft and rate is None and expert_bias.routers_with_bias(model):
        return {"router_bias_update": f"none under LoRA: the base's {expert_bias.BIAS} stays as loaded"}
    if rate is None and expert_bias.routers_with_bias(model):
        return {
            "router_bias_update": f"none by default for {getattr(model.config, 'model_type', 'this model')} (tested "
            f"on {', '.join(expert_bias.UPDATED_BY_DEFAULT)}): set router_bias_update_rate to train its "
            f"{expert_bias.BIAS}"
        }
    if rate:
        return {
            "router_bias_update": f"none: router_bias_update_rate {rate:g}, but no router of this model keeps an "
            f"{expert_bias.BIAS} (DeepSeek-style balancing)"
        }
    return {}


def printed_summary(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The run summary's rows as printed: the memory estimate as a few lines in GiB (run_summary.json has it all)."""
    rows = []
    for name, value in summary.items():
        rows += readable_estimate(value) if name == "memory_estimate" and value else [(name, value)]
    return rows


def start_metrics_log(run, first_step: int) -> MetricsLog:
    """The metrics log (metrics.jsonl on the main process, the step lines, the trackers), started at `first_step`
    with run_summary.json written and printed, the trackers initialised with the config, and a resume logged with
    the settings it changed."""
    config, accelerator = run.config, run.accelerator
    log = MetricsLog(
        config.output_dir,
        enabled=accelerator.is_main_process,
        printer=logs.info,
        tracker=lambda record: accelerator.log(numeric_fields(record), step=record["step"]),
    )
    if accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        log.start(resumed_step=first_step - 1 if run.resumed else None)
        write_json(Path(config.output_dir) / "run_summary.json", run.summary)
        logs.info("run summary:\n" + format_table(printed_summary(run.summary)))
    accelerator.init_trackers(
        config=numeric_fields(config_to_dict(config), keep_text=True),
        **trainer_arguments.tracker_options(config, run.name),
    )
    if run.resumed:
        changes = {"config_changes": run.config_changes} if run.config_changes else {}
        resumed = {"event": "resumed", "checkpoint": str(run.checkpoint), "world_size": accelerator.num_processes}
        log.log({"step": first_step - 1, **resumed, **changes})
        for name, (old, new) in run.config_changes.items():
            logs.warning(f"warning: resumed with {name} {old!r} -> {new!r} (allow_config_change)")
    return log


def record_state_bytes_after_first_step(run, model, optimizer, frozen_models=None) -> None:
    """After the first optimizer step (collective, as every rank steps), the run summary gets the bytes each rank
    really holds (`state_bytes_per_rank`) beside what the estimator predicted for it (`memory_estimate`).
    `frozen_models`: {name: a frozen model kept beside the policy, or None}, shown under that name (0 for None)."""
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)

    def record(*_):
        hook.remove()
        held = held_state_bytes(
            model, torch_optimizer, frozen_models, split_experts=not getattr(run.config, "use_peft", False)
        )
        run.summary["state_bytes_per_rank"] = gather_object([held]) if run.accelerator.num_processes > 1 else [held]
        if run.accelerator.is_main_process:
            write_json(Path(run.config.output_dir) / "run_summary.json", run.summary)

    hook = torch_optimizer.register_step_post_hook(record)


def step_logger(run, model, log: MetricsLog, batches, scheduler) -> StepLogger:
    """The step figures at `logging_steps`: loss, speed against the device's peak, position and learning rate."""
    accelerator = run.accelerator
    # a mixture of experts' aux_loss and load imbalance: figures the loop does not pass
    parts = [part.figures for part in (router_balance.attached(model), expert_bias.attached(model)) if part is not None]
    return StepLogger(
        accelerator,
        log,
        parallel=run.parallel,
        every=run.config.logging_steps,
        total_steps=run.total_steps,
        model_config=run.model_config,
        non_embedding_parameters=count_non_embedding_parameters(accelerator.unwrap_model(model)),
        peak_flops=peak_flops_per_device(run.summary["device_name"], run.config.peak_flops_per_device),
        position=lambda: {"epoch": batches.epoch, "lr": scheduler.get_last_lr()[0]},
        step_figures=lambda: {name: value for figures in parts for name, value in figures().items()},
    )


def checkpointer(
    run, model, log: MetricsLog, batches, *, per_rank_stream: bool, pause, files: dict[str, str] | None
) -> checkpoints_lib.Checkpointer:
    """Resumable checkpoints at `save_steps`: the sharded state, the data position (per rank for a per-rank
    stream), `files` ({name: text} a resume needs, committed with each checkpoint), the model files an export
    needs, and a Hub push after each save where `hub_strategy` asks."""
    config, accelerator = run.config, run.accelerator
    return checkpoints_lib.Checkpointer(
        accelerator,
        config.output_dir,
        every=config.save_steps,
        total_steps=run.total_steps,
        save_total_limit=config.save_total_limit,
        pause=pause,
        position=lambda step: checkpoints_lib.TrainingProgress(
            step=step,
            epoch=batches.epoch,
            batches_into_epoch=batches.batches_into_epoch,
            world_size=run.parallel.data_parallel_size,  # the ranks reading distinct data
            per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            data_state_per_rank=per_rank_stream,
        ),
        rank_state=batches.state_dict if per_rank_stream else None,
        extra_files=files,
        after_save=lambda step: run.push_at_save(model, step, train_loss=log.last("loss")),
        model_files_writer=lambda folder: checkpoints_lib.write_model_files(
            folder,
            model_config=run.model_config,
            tokenizer=run.tokenizer,
            generation_config=getattr(accelerator.unwrap_model(model), "generation_config", None),
            recipe_config=config_to_dict(config),
            accelerate_config=run.accelerate_settings,
            run_info={"recipe": run.name, "task": run.task},
        ),
    )
