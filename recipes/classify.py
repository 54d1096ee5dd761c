"""Sequence classification (reward models, routers, moderation) from a causal-LM or encoder base, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/classify.py \\
        --config recipes/configs/classify/<config>.yaml [--field value ...]

A text (and text-pair) column with labels; a new head with one row per class, the (optionally class-weighted)
mean cross-entropy over the global batch; accuracy and F1 over all ranks (`fsdp_recipes.methods.classify`).
docs/classification-and-evaluation.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, errors
from fsdp_recipes.data import files, rows
from fsdp_recipes.methods.classify import classification, classifier
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.publish import model_index
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import evaluation, loop, losses, router_balance


@dataclasses.dataclass
class ClassifyConfig(config_lib.TrainingConfig):
    """The classification recipe's own settings, on top of those every training recipe has."""

    output_dir: str = arguments.setting(
        "outputs/classify",
        "the run's folder: at the end the classifier (a peft adapter folder with use_peft) with "
        "eval_results.json, during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    max_length: int = arguments.setting(
        512, "tokens per example (text and pair together); longer ones lose their end", resume="sensitive"
    )
    text_column: str = arguments.setting("text", "the column holding the text to classify", resume="sensitive")
    text_pair_column: str | None = arguments.setting(
        None,
        "a second text (e.g. the response a reward model judges), joined by the tokenizer (null: none)",
        resume="sensitive",
    )
    label_column: str = arguments.setting(
        "label", "ClassLabel, integers or strings; the classes are those seen in training", resume="sensitive"
    )
    ignore_mismatched_sizes: bool = arguments.setting(
        False,
        "model_name_or_path is already a classifier for another number of classes: start a new head for "
        "the data's classes (transformers' option; the trained head is dropped). false: refused before loading",
        resume="free",
    )
    class_weights: str | None = arguments.setting(
        None,
        "null: plain cross-entropy. balanced: each class weighs in inversely to its frequency (rare "
        "classes count more, at some cost to accuracy on frequent ones); or comma-separated weights w0,w1,... "
        "in label-id order",
        resume="sensitive",
    )

    def min_max_length(self) -> tuple[int, str]:
        # the tokenizer's own special tokens are counted once it is loaded (classification.tokenize)
        return 2, "a special token the tokenizer adds (BOS or CLS) and at least one token of the text"

    def cross_field_problems(self) -> list[str]:
        problems = []
        if self.text_pair_column is not None and self.text_pair_column == self.text_column:
            problems.append("text_pair_column must differ from text_column (null: no pair)")
        if self.class_weights not in (None, "balanced"):
            try:
                weights = [float(value) for value in self.class_weights.split(",")]
            except ValueError:
                weights = []
            if not weights or not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
                problems.append(
                    f"class_weights {self.class_weights!r} is not 'balanced' nor comma-separated weights >= 0"
                )
        return problems


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(ClassifyConfig, argv)
    run = run_lib.start(config, name="classify", task="sequence-classification")
    accelerator, tokenizer = run.accelerator, run.tokenizer
    metrics = run.on_every_rank(lambda: evaluation.load_metrics(["accuracy", "f1"]))

    # --- data: label ids from the training split, token ids -----------------------------------------------------------
    def prepare_data():
        raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
        train_raw, eval_raw = files.split_train_eval(
            raw, config.dataset_train_split, config.dataset_test_split, config.held_out_split_size(), config.seed
        )
        if eval_raw is None:
            raise errors.DataError(
                f"the dataset has no {config.dataset_test_split!r} split and eval_split_size is 0: "
                "classification needs held-out data for its metrics. Set one of them."
            )
        columns = dict(text_column=config.text_column, text_pair_column=config.text_pair_column)
        classification.check_columns(train_raw, **columns, label_column=config.label_column, name="train")
        classification.check_columns(eval_raw, **columns, label_column=config.label_column, name="eval")
        names = classification.label_names(train_raw, config.label_column)
        label2id = {name: index for index, name in enumerate(names)}
        train_labels = classification.label_ids(train_raw, config.label_column, label2id, name="train")
        eval_labels = classification.label_ids(eval_raw, config.label_column, label2id, name="eval")
        options = dict(**columns, max_length=config.max_length, num_proc=config.dataset_num_proc)
        train_rows, stats = classification.tokenize(train_raw, tokenizer, labels=train_labels, name="train", **options)
        eval_rows, _ = classification.tokenize(eval_raw, tokenizer, labels=eval_labels, name="eval", **options)
        weights = classification.class_weights(train_labels, len(names), config.class_weights)
        split = (
            config.dataset_test_split
            if config.dataset_test_split in raw
            else f"{config.dataset_train_split} (held out)"
        )
        return names, train_rows, eval_rows, weights, split, stats

    names, train_rows, eval_rows, weights, eval_split, train_stats = run.on_every_rank(
        prepare_data, main_process_first=True
    )
    if run.resumed:
        classifier.check_resumed_labels(run.checkpoint, names)
    classifier.check_head_fits(
        run.model_config,
        names,
        ignore_mismatched_sizes=config.ignore_mismatched_sizes,
        source=config.model_name_or_path,
    )
    classifier.configure(run.model_config, names, pad_token_id=tokenizer.pad_token_id)
    collator = classification.Collator(tokenizer.pad_token_id)
    train_loader = rows.train_dataloader(
        train_rows,
        config,
        num_processes=run.parallel.data_parallel_size,
        pad_token_id=tokenizer.pad_token_id,
        collate_fn=collator,
    )
    eval_loader = classification.eval_dataloader(
        eval_rows, batch_size=config.per_device_eval_batch_size, pad_token_id=tokenizer.pad_token_id
    )

    # --- model, optimizer, schedule -----------------------------------------------------------------------------------
    model = run.load_model(
        ignore_mismatched_sizes=config.ignore_mismatched_sizes, **adapters.loading_options(config, accelerator)
    )
    head = classifier.head_module_names(model)
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="sequence-classification")  # use_peft: LoRA adapters on a frozen base
    shards = run.parallel.sequence_shards  # sequence parallelism: the loss's forward splits rows by position
    router_balance.attach(model, functools.partial(classifier.loss_sum, sequence_shards=shards))  # MoE only
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    evaluator = evaluation.MetricEvaluator(
        accelerator, model, eval_loader, predict=classifier.predict, metrics=metrics, every=config.eval_steps
    )
    training = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=evaluator,
        summary=dict(
            train_rows=len(train_rows),
            eval_rows=len(eval_rows),
            labels=names,
            classifier_head=head,
            class_weights=weights.tolist() if weights is not None else None,
            data=train_stats,
        ),
    )

    # --- the loop: forward, loss, backward, step ------------------------------------------------------------------------
    weights = None if weights is None else weights.to(accelerator.device)  # once: a copy per batch would wait
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        weight_total = run.sum_over_ranks(sum(classifier.weight_sum(batch, weights) for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, weight_total)
        loss_sum = 0.0
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel):
            loss = classifier.loss_sum(model, batch, weights, sequence_shards=shards)
            accelerator.backward(loss * scale)
            loss_sum += loss.detach()  # summed on the device: no host sync per micro-batch
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        training.metrics.log_step(step, loss_sum=loss_sum, target_count=weight_total, grad_norm=grad_norm)
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: held-out metrics (per class too), summary, export, card with model-index, Hub ---------------------------
    results = training.evaluation.final_results()
    if evaluator.gathered:  # held-out predictions (none with eval_strategy: no)
        results["eval_f1_per_class"] = classifier.per_class(metrics["f1"], evaluator.gathered, names)
    card_results = model_index.eval_results(
        results,
        task="text-classification",
        dataset=config.dataset_name,
        dataset_config=config.dataset_config,
        split=eval_split,
    )
    training.finish(model, results=results, eval_results=card_results)


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
