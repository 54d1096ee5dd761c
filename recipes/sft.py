"""Supervised fine-tuning (SFT) of a causal language model on chat or prompt/completion data, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/sft.py \\
        --config recipes/configs/sft/demo_reverse.yaml [--field value ...]

Chat (`messages`) or `prompt`/`completion` data, loss on the answers only, packed rows that never attend across
examples (`fsdp_recipes.methods.sft`); the loss is the mean over every target token of the global batch, whatever its
split. What a run does and leaves: docs/runs.md; every refusal before loading: docs/errors.md. Meant to be copied:
`fsdp-recipes cp sft DEST [--with-method]`.
"""

from __future__ import annotations

import dataclasses
import sys

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, errors
from fsdp_recipes.data import rows
from fsdp_recipes.distributed import logs
from fsdp_recipes.methods.sft import supervised
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import loop, losses, router_balance


@dataclasses.dataclass
class SFTConfig(supervised.SupervisedFields, config_lib.TrainingConfig):
    """The SFT recipe's settings: the supervised data's (`methods/sft/supervised.py`: packing, loss masks, the exact-match
    check) and those every training recipe has. Field names follow TRL's SFTConfig."""

    output_dir: str = arguments.setting(
        "outputs/sft",
        "the run's folder: at the end the fine-tuned model (a peft adapter folder with use_peft), "
        "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(SFTConfig, argv)
    run = run_lib.start(config, name="sft")
    accelerator, tokenizer = run.accelerator, run.tokenizer

    # --- data: tokens with loss masks, then rows (packed or not) ------------------------------------------------------
    # (a vision-language model's processor, run.pictures, turns image parts into tokens and pictures into pixels)
    data = run.on_every_rank(lambda: supervised.prepare(config, tokenizer, run.pictures), main_process_first=True)
    train_rows, eval_rows = data.train_rows, data.eval_rows
    train_loader = rows.train_dataloader(
        train_rows, config, num_processes=run.parallel.data_parallel_size, pad_token_id=tokenizer.pad_token_id,
        pictures=run.pictures,
    )  # fmt: skip

    # --- model, optimizer, schedule -----------------------------------------------------------------------------------
    model = run.load_model(**adapters.loading_options(config, accelerator))
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="causal-lm")  # use_peft: LoRA adapters on a frozen base
    shards = run.parallel.sequence_shards  # sequence parallelism: the loss's forward splits rows by position
    token_loss = losses.TokenLoss(
        model, config.loss_implementation, chunk_size=config.loss_chunk_size, sequence_shards=shards
    )
    router_balance.attach(model, token_loss.router_logits_of, real_of=router_balance.real_token_mask)  # MoE only
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    training = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=run.loss_evaluator(model, eval_rows, token_loss.loss_sum),
        summary=dict(
            train_rows=len(train_rows),
            eval_rows=len(eval_rows or []),
            data=data.train_stats,
            loss=token_loss.description,
        ),
    )

    def exact_match() -> dict:
        return supervised.exact_match(accelerator, model, tokenizer, data, config, parallel=run.parallel)

    results = {}
    if supervised.exact_match_wanted(config, data):
        results["exact_match_before"] = training.measured_once("exact_match", lambda: exact_match()["exact_match"])
        logs.info(f"exact match before training: {results['exact_match_before']:.1%}")

    # --- the loop: forward, loss, backward, step ------------------------------------------------------------------------
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        target_count = run.sum_over_ranks(sum(losses.count_targets(batch) for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, target_count)
        loss_sum = 0.0
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel):
            loss = token_loss.loss_sum(model, batch)
            accelerator.backward(loss * scale)
            loss_sum += loss.detach()  # summed on the device: no host sync per micro-batch
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        training.metrics.log_step(step, loss_sum=loss_sum, target_count=target_count, grad_norm=grad_norm)
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: generation check, then summary, export, card, Hub ------------------------------------------------------
    if supervised.exact_match_wanted(config, data):
        after = exact_match()
        results["exact_match_after"] = after["exact_match"]
        training.log.log({"step": total_steps, "exact_match": after["exact_match"]})
        logs.info(f"exact match after training: {after['exact_match']:.1%} of {after['num_examples']}")
        for sample in after["samples"]:
            logs.info(f"  reference={sample['reference']!r} generated={sample['generated']!r}")
    training.finish(model, results=results)


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
