"""Pretraining of a causal language model on raw text, from scratch or continued, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/pretrain.py \\
        --config recipes/configs/pretrain/demo_tiny_stories.yaml [--field value ...]

Raw text streamed or cached, each rank reading its own part of the corpus, documents packed so that they never
attend to or predict each other (`fsdp_recipes.data.text`, `fsdp_recipes.data.packing`); exact resume of every
rank's place in the corpus. Settings and what they trade: docs/pretraining.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, checks, errors
from fsdp_recipes.data import packing, text
from fsdp_recipes.distributed import collectives
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import checkpoint as checkpoint_lib
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import loop, losses, router_balance


@dataclasses.dataclass
class PretrainConfig(config_lib.TrainingConfig):
    """The pretraining recipe's own settings, on top of those every training recipe has (max_length is the row)."""

    output_dir: str = arguments.setting(
        "outputs/pretrain",
        "the run's folder: at the end the trained model (a peft adapter folder with use_peft), during "
        "the run checkpoints/ (with each rank's data position), metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    dataset_text_field: str = arguments.setting(
        "text", "the column holding the documents (TRL's name)", resume="sensitive"
    )
    streaming: bool = arguments.setting(
        False,
        "read the corpus as a stream: starts at once, never writes it to disk, tokenises on the fly (a "
        "little CPU per step; needs max_steps). false: tokenised once by datasets.map, cached for the next run",
        resume="sensitive",
    )
    packing_strategy: str = arguments.setting(
        "wrapped",
        "wrapped: concatenate and split, every row full (no padding), documents cut at row ends; bfd: "
        "whole documents fitted into rows (only those longer than a row cut), at the cost of padding",
        resume="sensitive",
        check=checks.one_of(packing.PACKING_STRATEGIES),
    )
    cross_document_attention: bool = arguments.setting(
        False,
        "the classic concatenated LM (wrapped only): tokens attend to the unrelated documents before "
        "them in the row and EOS predicts the next document; in exchange, the plain causal mask",
        resume="sensitive",
    )
    max_eval_samples: int | None = arguments.setting(
        256,
        "held-out rows evaluated each time (null: all); each costs a forward pass",
        resume="free",
        check=checks.at_least(1, or_null=True),
    )

    def packs_examples(self) -> bool:
        return not self.cross_document_attention

    def cross_field_problems(self) -> list[str]:
        problems = []
        if self.cross_document_attention and self.packing_strategy != "wrapped":
            problems.append(
                "cross_document_attention needs packing_strategy: wrapped (bfd packs to keep documents whole)"
            )
        if self.dataset_mixture is not None:
            problems.append("pretrain reads dataset_name (streamed or not), not dataset_mixture: give dataset_name")
        if self.streaming and self.max_steps <= 0:
            problems.append("streaming: true needs max_steps > 0: a stream's length is unknown until it has been read")
        return problems


def data_settings(config: PretrainConfig, *, rank: int) -> dict:
    """What shapes a rank's stream of rows: a checkpoint's data position is only valid with the same values."""
    names = (
        "dataset_name",
        "dataset_config",
        "dataset_train_split",
        "dataset_text_field",
        "streaming",
        "max_length",
        "packing_strategy",
        "cross_document_attention",
        "seed",
        "tokenizer_name_or_path",
        "model_name_or_path",
    )
    return {"rank": rank, **{name: getattr(config, name) for name in names}}


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(PretrainConfig, argv)
    run = run_lib.start(config, name="pretrain")
    accelerator, tokenizer = run.accelerator, run.tokenizer

    # --- data: documents -> tokens -> this rank's part -> packed rows, at the checkpoint's position if resuming ------
    def prepare_data():
        text.prepare_tokenizer(tokenizer)
        train_raw, eval_raw = text.load_corpus(
            config.dataset_name,
            config.dataset_config,
            text_field=config.dataset_text_field,
            streaming=config.streaming,
            train_split=config.dataset_train_split,
            test_split=config.dataset_test_split,
            eval_split_size=config.eval_split_size,
            seed=config.seed,
        )
        source, split = text.rank_documents(
            text.tokenize(train_raw, tokenizer, config.dataset_text_field, num_proc=config.dataset_num_proc),
            rank=run.data_parallel_rank,  # the ranks of a TP group read the same documents
            world_size=run.parallel.data_parallel_size,
            seed=config.seed,
            max_length=config.max_length,
            dataset_name=config.dataset_name,
            rows_per_step=config.per_device_train_batch_size * config.gradient_accumulation_steps,
            repeat_small_dataset=config.repeat_small_dataset,
        )
        packer_settings = dict(
            max_length=config.max_length,
            strategy=config.packing_strategy,
            cross_document_attention=config.cross_document_attention,
        )
        stream = text.PackedStream(
            source,
            packing.Packer(**packer_settings),
            batch_size=config.per_device_train_batch_size,
            pad_token_id=tokenizer.pad_token_id,
            device=accelerator.device,
            settings=data_settings(config, rank=run.data_parallel_rank),
        )
        if run.checkpoint is not None:
            stream.load_state_dict(checkpoint_lib.read_rank_state(run.checkpoint, accelerator.process_index))
        eval_rows = None
        if eval_raw is not None:
            eval_tokens = text.tokenize(eval_raw, tokenizer, config.dataset_text_field, name="eval")
            eval_rows = text.eval_rows(
                eval_tokens, limit=config.max_eval_samples, dataset_name=config.dataset_name, **packer_settings
            )
        return stream, split, eval_rows

    stream, split, eval_rows = run.on_every_rank(prepare_data, main_process_first=True)

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
    model, optimizer = accelerator.prepare(model, optimizer)  # the stream is this rank's already: no loader to shard
    batches_per_epoch = (
        None
        if config.streaming
        else min(split["tokens_per_rank"]) // (config.max_length * config.per_device_train_batch_size)
    )  # rows are at most max_length: no rank runs past its part
    total_steps = loop.total_optimizer_steps(batches_per_epoch or 1, config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    training = run.begin(
        model,
        stream,
        scheduler,
        total_steps=total_steps,
        evaluator=run.loss_evaluator(model, eval_rows, token_loss.loss_sum),
        summary=dict(
            data=split,
            streaming=config.streaming,
            packing_strategy=config.packing_strategy,
            eval_rows=len(eval_rows or []),
            loss=token_loss.description,
        ),
    )

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

    # --- finish: what each rank read, then summary, export, card, Hub ---------------------------------------------------
    read = {
        f"{key}_read_per_rank": [int(value) for value in collectives.values_of_all_ranks(accelerator, count)]
        for key, count in stream.counts().items()
    }
    training.log.log({"step": total_steps, **read})
    eval_loss = training.log.last("eval_loss")
    training.finish(model, results={"eval_perplexity": math.exp(eval_loss) if eval_loss is not None else None})


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
