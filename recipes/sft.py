"""Supervised fine-tuning (SFT) of a causal language model with Accelerate and FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/sft.py \
        --config recipes/configs/sft/demo_reverse.yaml [--field value ...]

What it does, top to bottom:
- config: a YAML file plus `--field value` overrides; unknown keys and bad values are reported together.
- accelerator: FSDP settings (wrap class, sharding, offload, state-dict type, precision) come only from the Accelerate
  YAML. On a machine without GPUs an FSDP2 launch still shards for real, over gloo; a launch that would degrade
  into independent processes is refused.
- data: `messages` or `prompt`/`completion` data from the Hub or local files; loss on assistant/completion tokens
  only (switchable); packing without attention across examples; a held-out split for eval loss.
- model: a Hub id or folder (`model_name_or_path`), or a config to initialise from (`model_config`).
- loop: global batch = per_device_train_batch_size x processes x gradient_accumulation_steps rows; the loss is the
  mean over every target token of that global batch, so it does not depend on how the batch is split. Warmup and
  schedule, clipping, eval every `eval_steps`; loss, speed (tokens/s, MFU), padding, memory and data wait logged to
  stdout, output_dir/metrics.jsonl and the tracker.
- checkpoints: every `save_steps`, complete or not at all; `--resume_from_checkpoint latest` continues exactly,
  also on another number of processes.
- export: output_dir becomes a Hugging Face model folder (safetensors, config, tokenizer, model card), whatever the
  state-dict type, checked after writing, and optionally pushed to the Hub.

Errors raised before any weights load: bad config, non-empty or unwritable output_dir, missing Hub token with
push_to_hub, degraded launch, FSDP1 on CPU, wrap class absent from the model, two activation-checkpointing
mechanisms, no chat template, no complete checkpoint to resume, dataset without the needed columns, empty dataset.

This file is meant to be copied and edited: the distributed details live in `fsdp_recipes`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from accelerate.utils import DataLoaderConfiguration, TorchDynamoPlugin, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from fsdp_recipes.checkpoint import (
    TrainingProgress,
    checkpoint_conflict,
    load_checkpoint,
    read_progress,
    resolve_checkpoint,
    save_checkpoint,
    write_model_files,
)
from fsdp_recipes.config import SFTConfig, config_to_dict, parse_config
from fsdp_recipes.config_lint import check_launch_environment
from fsdp_recipes.data.chat import generation_examples, tokenize_dataset
from fsdp_recipes.data.files import load_raw_dataset, split_train_eval
from fsdp_recipes.data.rows import LengthGroupedSampler, RowCollator, build_rows
from fsdp_recipes.distributed import (
    build_accelerator,
    describe_run,
    launch_environment,
    on_every_rank_together,
    sum_over_ranks,
)
from fsdp_recipes.errors import ConfigError, exit_on_user_error
from fsdp_recipes.export import export_model_folder
from fsdp_recipes.faults import inject_fault
from fsdp_recipes.losses import causal_lm_loss_sum, count_targets, global_mean_scale
from fsdp_recipes.hub import push_folder_to_hub, require_hub_token
from fsdp_recipes.memory import estimate_for_run
from fsdp_recipes.metrics import (
    MetricsLog,
    ThroughputWindow,
    device_name,
    format_table,
    numeric_fields,
    peak_flops_per_device,
    plot_training_curves,
    throughput_record,
    write_json,
)
from fsdp_recipes.modeling import (
    activation_checkpointing_mechanism,
    check_one_activation_checkpointing,
    check_tokenizer_fits_model,
    count_non_embedding_parameters,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_wrap_classes,
)
from fsdp_recipes.outputs import output_dir_problem
from fsdp_recipes.training import (
    BatchStream,
    build_optimizer,
    build_scheduler,
    evaluate_loss,
    exact_match_accuracy,
    total_optimizer_steps,
)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SFTConfig, argv)

    # --- accelerator, and every check that needs no weights ------------------------------------------------------
    launch_warnings = check_launch_environment()  # the Accelerate config as exported: errors stop every rank here
    accelerator = build_accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=config.output_dir,
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if config.torch_compile else None,
    )
    set_seed(config.seed)
    for warning in launch_warnings:
        accelerator.print(f"warning: the Accelerate config: {warning.key}: {warning.message}")

    def preflight():
        checkpoint = resolve_checkpoint(config.output_dir, config.resume_from_checkpoint) if config.resume_from_checkpoint else None
        if checkpoint is not None:  # refuses a data position this world size cannot reproduce, before loading
            read_progress(checkpoint).batches_into_epoch_for(accelerator.num_processes, config.per_device_train_batch_size)
        resuming_here = checkpoint is not None and Path(config.output_dir).resolve() in checkpoint.resolve().parents
        problem = output_dir_problem(config.output_dir, overwrite=config.overwrite_output_dir or resuming_here)
        problem = problem or checkpoint_conflict(config.output_dir, checkpoint)
        if problem:
            raise ConfigError(problem)
        hub_token = require_hub_token() if config.push_to_hub else None
        tokenizer = load_tokenizer(
            config.tokenizer_name_or_path or config.model_name_or_path,
            revision=config.model_revision,
            trust_remote_code=config.trust_remote_code,
            chat_template=config.chat_template,
        )
        model_config = load_model_config(
            config.model_name_or_path, config.model_config,
            revision=config.model_revision, trust_remote_code=config.trust_remote_code,
        )
        check_tokenizer_fits_model(tokenizer, model_config)
        wrap_classes = resolve_wrap_classes(accelerator, model_config, trust_remote_code=config.trust_remote_code)
        check_one_activation_checkpointing(accelerator, model_gradient_checkpointing=config.gradient_checkpointing)
        return checkpoint, hub_token, tokenizer, model_config, wrap_classes

    checkpoint, hub_token, tokenizer, model_config, wrap_classes = on_every_rank_together(accelerator, preflight)

    # --- data -----------------------------------------------------------------------------------------------------
    def prepare_data():
        raw = load_raw_dataset(config.dataset_name, config.dataset_config)
        train_raw, eval_raw = split_train_eval(
            raw, config.dataset_train_split, config.dataset_test_split, config.eval_split_size, config.seed
        )
        options = dict(
            assistant_only_loss=config.assistant_only_loss, completion_only_loss=config.completion_only_loss,
            max_length=config.max_length, num_proc=config.dataset_num_proc,
        )
        train_tokens, train_stats = tokenize_dataset(train_raw, tokenizer, name="train", **options)
        train_rows = build_rows(
            train_tokens, max_length=config.packing_row_length or config.max_length, packing=config.packing
        )
        eval_rows = None
        if eval_raw is not None:
            eval_tokens, _ = tokenize_dataset(eval_raw, tokenizer, name="eval", **options)
            eval_rows = build_rows(eval_tokens, max_length=config.max_length, packing=False)
        return eval_raw, train_rows, eval_rows, train_stats

    eval_raw, train_rows, eval_rows, train_stats = on_every_rank_together(
        accelerator, prepare_data, main_process_first=True
    )
    if config.train_sampling_strategy == "group_by_length":
        sampler = LengthGroupedSampler(
            [len(ids) for ids in train_rows["input_ids"]], seed=config.seed,
            group_size=config.per_device_train_batch_size * accelerator.num_processes,
        )
    else:
        sampler = None  # shuffled; accelerate makes the order depend only on seed and epoch
    train_loader = DataLoader(
        train_rows, batch_size=config.per_device_train_batch_size, shuffle=sampler is None, sampler=sampler,
        collate_fn=RowCollator(tokenizer.pad_token_id), drop_last=False, num_workers=config.dataloader_num_workers,
    )

    # --- model, optimizer, schedule -------------------------------------------------------------------------------
    model = load_model(
        model_config, model_name_or_path=config.model_name_or_path, revision=config.model_revision,
        attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code,
    )
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    non_embedding_parameters = count_non_embedding_parameters(model)
    optimizer = build_optimizer(
        model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, fused=config.optim == "adamw_torch_fused",
    )
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    total_steps = total_optimizer_steps(
        len(train_loader), config.gradient_accumulation_steps, max_steps=config.max_steps, epochs=config.num_train_epochs
    )
    scheduler = build_scheduler(
        optimizer, config.lr_scheduler_type, total_steps=total_steps,
        warmup_steps=config.warmup_steps, warmup_ratio=config.warmup_ratio,
    )
    accelerator.register_for_checkpointing(scheduler)
    batches = BatchStream(accelerator, train_loader)
    start_step = 1
    if checkpoint is not None:
        progress = load_checkpoint(accelerator, checkpoint)
        batches = BatchStream(
            accelerator, train_loader, epoch=progress.epoch,
            batches_into_epoch=progress.batches_into_epoch_for(accelerator.num_processes, config.per_device_train_batch_size),
        )
        start_step = progress.step + 1

    summary = describe_run(accelerator, model, wrap_classes)
    summary.update(
        train_rows=len(train_rows), eval_rows=len(eval_rows) if eval_rows is not None else 0,
        data=train_stats, optimizer_steps=total_steps,
        global_batch_rows=config.per_device_train_batch_size * accelerator.num_processes * config.gradient_accumulation_steps,
        activation_checkpointing=activation_checkpointing_mechanism(accelerator, config.gradient_checkpointing),
        torch_compile=config.torch_compile, optim=config.optim, device_name=device_name(accelerator.device),
    )
    summary["memory_estimate"] = estimate_for_run(accelerator, model_config, config)
    peak_flops = peak_flops_per_device(summary["device_name"], config.peak_flops_per_device)
    accelerate_settings = {"launch_environment": launch_environment(), "resolved": summary}
    log = MetricsLog(
        config.output_dir, enabled=accelerator.is_main_process, printer=tqdm.write,
        tracker=lambda record: accelerator.log(numeric_fields(record), step=record["step"]),
    )
    if accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        log.start(resumed_step=start_step - 1 if checkpoint is not None else None)
        write_json(f"{config.output_dir}/run_summary.json", summary)
        accelerator.print("run summary:\n" + format_table(list(summary.items())))
    accelerator.init_trackers("sft", config=numeric_fields(config_to_dict(config), keep_text=True))

    if checkpoint is not None:
        log.log({"step": start_step - 1, "event": "resumed", "checkpoint": str(checkpoint), "world_size": accelerator.num_processes})

    exact_match_examples = []
    if config.exact_match_eval_samples and eval_raw is not None:
        exact_match_examples = generation_examples(eval_raw, tokenizer, config.exact_match_eval_samples)
    results = {}
    if exact_match_examples and checkpoint is None:
        before = exact_match_accuracy(
            accelerator, model, tokenizer, exact_match_examples,
            max_new_tokens=config.max_new_tokens, batch_size=config.per_device_eval_batch_size,
        )
        log.log({"step": 0, "exact_match": before["exact_match"]})
        results["exact_match_before"] = before["exact_match"]
    elif exact_match_examples and log.first("exact_match") is not None:  # measured before the interruption
        results["exact_match_before"] = log.first("exact_match")
        accelerator.print(f"exact match before training: {before['exact_match']:.1%} of {before['num_examples']}")

    def run_eval(step: int) -> None:
        if eval_rows is None:
            return
        eval_loss = evaluate_loss(
            accelerator, model, eval_rows, batch_size=config.per_device_eval_batch_size,
            pad_token_id=tokenizer.pad_token_id,
        )
        log.log({"step": step, "eval_loss": eval_loss})

    # --- training loop --------------------------------------------------------------------------------------------
    def save(step: int) -> None:
        position = TrainingProgress(
            step=step, epoch=batches.epoch, batches_into_epoch=batches.batches_into_epoch,
            world_size=accelerator.num_processes, per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
        save_checkpoint(
            accelerator, config.output_dir, position, save_total_limit=config.save_total_limit,
            model_files_writer=lambda folder: write_model_files(
                folder, model_config=model_config, tokenizer=tokenizer,
                generation_config=getattr(accelerator.unwrap_model(model), "generation_config", None),
                recipe_config=config_to_dict(config), accelerate_config=accelerate_settings,
            ),
        )

    model.train()
    bar = tqdm(total=total_steps, initial=start_step - 1, disable=not accelerator.is_main_process, desc="sft")
    window = ThroughputWindow()
    for step in range(start_step, total_steps + 1):
        waiting = time.perf_counter()
        micro_batches = [batches.next() for _ in range(config.gradient_accumulation_steps)]
        window.data_wait += time.perf_counter() - waiting
        global_targets = sum_over_ranks(accelerator, sum(count_targets(batch) for batch in micro_batches))
        scale = global_mean_scale(accelerator, global_targets)
        step_loss = 0.0
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            # Gradients are reduced across ranks once per optimizer step, on the last micro-batch.
            with accelerator.no_sync(model) if not last else contextlib.nullcontext():
                loss_sum = causal_lm_loss_sum(model, batch)
                accelerator.backward(loss_sum * scale)
            step_loss += loss_sum.item()
            window.add_batch(batch)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm) if config.max_grad_norm > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        window.steps += 1
        inject_fault("after-step", step, accelerator.process_index)

        if step % config.logging_steps == 0 or step == total_steps:
            log.log({
                "step": step,
                "epoch": batches.epoch,
                "loss": sum_over_ranks(accelerator, step_loss) / max(global_targets, 1.0),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                **throughput_record(
                    accelerator, window, model_config=model_config,
                    non_embedding_parameters=non_embedding_parameters, peak_flops=peak_flops,
                ),
            })
            window.reset()
        if config.eval_steps and step % config.eval_steps == 0 and step != total_steps:
            run_eval(step)
        if config.save_steps and (step % config.save_steps == 0 or step == total_steps):
            save(step)
    bar.close()
    run_eval(total_steps)

    if exact_match_examples:
        after = exact_match_accuracy(
            accelerator, model, tokenizer, exact_match_examples,
            max_new_tokens=config.max_new_tokens, batch_size=config.per_device_eval_batch_size,
        )
        results["exact_match_after"] = after["exact_match"]
        log.log({"step": total_steps, "exact_match": after["exact_match"]})
        accelerator.print(f"exact match after training: {after['exact_match']:.1%} of {after['num_examples']}")
        for sample in after["samples"]:
            accelerator.print(f"  reference={sample['reference']!r} generated={sample['generated']!r}")

    # --- export -----------------------------------------------------------------------------------------------------
    final_metrics = {
        "train_loss": log.last("loss"), "eval_loss": log.last("eval_loss"), **results,
        **{key: log.mean(key) for key in ("tokens_per_second", "tokens_per_second_per_device", "padding_fraction",
                                          "data_wait_fraction", "mfu", "achieved_flops_per_device")},
        "peak_memory_gib_max": max(log.last("peak_memory_gib_per_rank") or [0.0]),
        "estimated_memory_gib_per_gpu": summary["memory_estimate"]["predicted_per_gpu_bytes"]["total"] / 2**30,
    }
    if accelerator.is_main_process:
        accelerator.print("final metrics (speeds: means over logged windows):\n" + format_table(list(final_metrics.items())))
        plot_training_curves(log.records, Path(config.output_dir) / "training_curves.png")
    folder = export_model_folder(
        accelerator, model, tokenizer, config.output_dir,
        card=dict(
            recipe="sft", recipe_config=config_to_dict(config),
            accelerate_config=accelerate_settings,
            metrics={k: v for k, v in final_metrics.items() if v is not None},
            base_model=config.model_name_or_path, dataset=config.dataset_name, hub_model_id=config.hub_model_id,
        ),
    )
    if accelerator.is_main_process:
        if results:
            write_json(folder / "eval_results.json", results)
        if config.push_to_hub:
            url = push_folder_to_hub(folder, config.hub_model_id, token=hub_token, private=config.hub_private_repo)
            accelerator.print(f"pushed to the Hub: {url}")
        accelerator.print(f"model exported to {folder.resolve()}")
    accelerator.end_training()


if __name__ == "__main__":
    exit_on_user_error(lambda: main(sys.argv[1:]))
