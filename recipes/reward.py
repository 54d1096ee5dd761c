"""Reward modelling: a sequence scorer trained on preference pairs with the Bradley-Terry loss, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/reward.py \\
        --config recipes/configs/reward/<config>.yaml [--field value ...]

dpo.py's pair formats with an optional `margin`; a one-output sequence classifier trained with the Bradley-Terry
loss (TRL's RewardConfig names, `fsdp_recipes.methods.reward`); the folder serves as a GRPO reward function.
docs/reward-and-distillation.md.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, checks, errors
from fsdp_recipes.data import files, rows
from fsdp_recipes.methods.classify import classifier
from fsdp_recipes.methods.preference import paired
from fsdp_recipes.methods.reward import reward_model
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.publish import model_index
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import evaluation, loop, losses, router_balance


@dataclasses.dataclass
class RewardConfig(config_lib.TrainingConfig):
    """The reward recipe's own settings, on top of those every training recipe has. Names follow TRL's RewardConfig."""

    output_dir: str = arguments.setting(
        "outputs/reward",
        "the run's folder: at the end the reward model (a peft adapter folder with use_peft) with "
        "eval_results.json, during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    learning_rate: float = arguments.setting(
        1e-5, "AdamW's peak learning rate (reward models overfit pairs quickly)", resume="free"
    )
    center_rewards_coefficient: float | None = arguments.setting(
        None,
        "adds this x (r_chosen + r_rejected)^2 to each pair's loss: keeps rewards centred on 0 (1e-2 is "
        "usual), at a small cost in how freely the scores move (null: off)",
        resume="sensitive",
        check=checks.non_negative(or_null=True),
    )
    max_prompt_length: int | None = arguments.setting(
        None, "prompts longer than this keep their end (null: only max_length applies)", resume="sensitive"
    )
    ignore_mismatched_sizes: bool = arguments.setting(
        False,
        "model_name_or_path is already a classifier with another number of outputs: start a new "
        "one-output head (its trained head is dropped). false: refused before loading",
        resume="free",
    )

    def micro_batch_rows(self) -> int:
        return 2 * self.per_device_train_batch_size  # a pair: its chosen and its rejected row

    def min_max_length(self) -> tuple[int, str]:
        return 2, "a pair's rows need a prompt token and an answer token"

    def cross_field_problems(self) -> list[str]:
        problems = []
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.max_length:
            problems.append(f"max_prompt_length must be >= 1 and < max_length ({self.max_length}), or null")
        return problems


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(RewardConfig, argv)
    run = run_lib.start(config, name="reward", task="sequence-classification")
    accelerator, tokenizer = run.accelerator, run.tokenizer
    center = config.center_rewards_coefficient or 0.0

    # --- data: pairs of answers to one prompt, the chosen one first, and their margins --------------------------------
    def prepare_data():
        raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
        train_raw, eval_raw = files.split_train_eval(
            raw, config.dataset_train_split, config.dataset_test_split, config.held_out_split_size(), config.seed
        )
        options = dict(
            max_length=config.max_length, max_prompt_length=config.max_prompt_length, num_proc=config.dataset_num_proc
        )
        train_pairs, stats = paired.tokenize_pairs(train_raw, tokenizer, name="train", **options)
        train_pairs, stats["margin_column"] = reward_model.add_margins(train_pairs, train_raw, name="train")
        eval_pairs = split = None
        if eval_raw is not None:
            eval_pairs = paired.tokenize_pairs(eval_raw, tokenizer, name="eval", **options)[0]
            eval_pairs = reward_model.add_margins(eval_pairs, eval_raw, name="eval")[0]
            split = config.dataset_test_split if config.dataset_test_split in raw else "train (held out)"
        return train_pairs, eval_pairs, split, stats

    train_pairs, eval_pairs, eval_split, train_stats = run.on_every_rank(prepare_data, main_process_first=True)
    reward_model.check_head(
        run.model_config, ignore_mismatched_sizes=config.ignore_mismatched_sizes, source=config.model_name_or_path
    )
    reward_model.configure(run.model_config, pad_token_id=tokenizer.pad_token_id)
    collate = reward_model.RewardCollator(tokenizer.pad_token_id)
    train_loader = rows.train_dataloader(
        train_pairs,
        config,
        num_processes=run.parallel.data_parallel_size,
        pad_token_id=tokenizer.pad_token_id,
        collate_fn=collate,
        unit="pairs",
    )
    eval_loader = None
    if eval_pairs is not None:
        eval_loader = torch.utils.data.DataLoader(
            eval_pairs, batch_size=config.per_device_eval_batch_size, collate_fn=collate
        )

    # --- model (one output), optimizer, schedule ------------------------------------------------------------------------
    model = run.load_model(
        ignore_mismatched_sizes=config.ignore_mismatched_sizes, **adapters.loading_options(config, accelerator)
    )
    head = classifier.head_module_names(model)
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="sequence-classification")  # use_peft: the head trained in full
    shards = run.parallel.sequence_shards  # sequence parallelism: the forwards split rows by position
    router_balance.attach(model, functools.partial(reward_model.rewards, sequence_shards=shards))  # MoE only
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loader = accelerator.prepare(eval_loader) if eval_loader is not None else None
    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    held_out = reward_model.make_predict(center, sequence_shards=shards)  # per pair: loss, accuracy, margin
    evaluator = evaluation.MetricEvaluator(
        accelerator, model, eval_loader, predict=held_out, metrics={}, every=config.eval_steps
    )
    training = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=evaluator,
        summary=dict(
            train_pairs=len(train_pairs),
            eval_pairs=len(eval_pairs or []),
            reward_head=head,
            data=train_stats,
            loss="Bradley-Terry -log sigmoid(r_chosen - r_rejected - margin)"
            + (f" + {center} x (r_chosen + r_rejected)^2" if center else ""),
        ),
    )

    # --- the loop: forward (chosen and rejected rows together), loss, backward, step ----------------------------------
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        pair_count = run.sum_over_ranks(sum(paired.count_pairs(batch) for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, pair_count)  # a rank's share of the global mean over pairs
        loss_sum, figures = 0.0, {}
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel):
            chosen, rejected = reward_model.rewards(model, batch, sequence_shards=shards)
            pair_loss = reward_model.bradley_terry_losses(
                chosen, rejected, margin=batch["margin"], center_rewards_coefficient=center
            )
            accelerator.backward(pair_loss.sum() * scale)
            loss_sum += pair_loss.sum().detach()  # on the device: no host sync per micro-batch
            for name, value in reward_model.metric_sums(chosen, rejected).items():
                figures[name] = figures.get(name, 0.0) + value
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        training.metrics.log_step(step, loss_sum=loss_sum, target_count=pair_count, grad_norm=grad_norm, sums=figures)
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: held-out accuracy and margin, summary, export, card with model-index, Hub -------------------------------
    results = training.evaluation.final_results()
    card_results = model_index.eval_results(
        {key: results[key] for key in ("eval_accuracy", "eval_margin") if key in results},
        task="text-classification",
        dataset=config.dataset_name,
        dataset_config=config.dataset_config,
        split=eval_split,
    )
    training.finish(model, results=results, eval_results=card_results)


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
