"""Direct preference optimisation (DPO) of a causal language model on preference pairs, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/dpo.py \
        --config recipes/configs/dpo/<config>.yaml [--field value ...]

Top to bottom: the config; the run (accelerator, seed, every check that needs no weights, on all ranks together); the
data (TRL's preference formats: `prompt`/`chosen`/`rejected`, or `chosen`/`rejected` with the prompt they share;
strings or chat turns; loss on the answers' tokens only); the policy (the model being trained: usually an SFT
model, e.g. the folder `recipes/sft.py` exported) and the frozen reference it is compared with, one of three ways
(`fsdp_recipes.train.reference`): the policy with its LoRA adapters off (`use_peft`), a frozen copy sharded like the policy,
or values precomputed before the first step (`precompute_ref_log_probs`); `accelerator.prepare`; the loop: for a batch
of pairs (chosen and rejected rows in one forward), the summed log-probability of each answer under the policy and the
reference, the DPO loss (`loss_type` sigmoid, ipo or hinge, `beta`, `label_smoothing`), averaged over every pair of the
global batch; and the finish as every recipe's (export, card, Hub). Logged under TRL's names: `rewards/chosen`,
`rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, and the same with
`eval_` on held-out pairs every `eval_steps`.

Errors raised before any weights load, on every rank: those of every recipe (see sft.py), and: columns that match
no preference format, a pair whose answers are equal, an answer left empty by truncation, beta <= 0, fewer pairs
than one optimizer step, a resume with another beta, loss_type, ... (docs/errors.md).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, errors
from fsdp_recipes.data import files, preference, rows
from fsdp_recipes.models import adapters
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import evaluation, loop, losses, reference


@dataclasses.dataclass
class DPOConfig(config_lib.TrainingConfig):
    """The DPO recipe's own settings, on top of those every training recipe has. Names follow TRL's DPOConfig."""

    output_dir: str = dataclasses.field(
        default="outputs/dpo",
        metadata={
            "help": "the run's folder: at the end the trained policy (a peft adapter folder with use_peft), "
            "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs"
        },
    )
    learning_rate: float = dataclasses.field(
        default=1e-6,
        metadata={
            "help": "AdamW's peak learning rate. DPO moves a trained model a little: full fine-tuning rates are "
            "~10x too high"
        },
    )
    beta: float = dataclasses.field(
        default=0.1, metadata={"help": "how far the policy may drift from the reference: larger keeps it closer"}
    )
    loss_type: str = dataclasses.field(
        default="sigmoid",
        metadata={"help": "sigmoid (DPO), ipo (averages over tokens; resists overfitting), hinge (SLiC)"},
    )
    label_smoothing: float = dataclasses.field(
        default=0.0, metadata={"help": "sigmoid only: the chance a preference label is wrong (conservative DPO)"}
    )
    max_prompt_length: int | None = dataclasses.field(
        default=None, metadata={"help": "prompts longer than this keep their end (null: only max_length applies)"}
    )
    precompute_ref_log_probs: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "one pass before training stores the reference's values: no reference model in memory or "
            "forward per step afterwards, at the cost of that pass"
        },
    )

    def micro_batch_rows(self) -> int:
        return 2 * self.per_device_train_batch_size  # a pair: its chosen and its rejected row

    def reference_mode(self) -> str:
        return reference.mode_for(precompute=self.precompute_ref_log_probs, use_peft=self.use_peft)

    def frozen_model_copies(self) -> int:
        return reference.frozen_copies(self.reference_mode())

    def min_max_length(self) -> tuple[int, str]:
        return 2, "a pair's rows need a prompt token and an answer token predicted from it"

    def resume_sensitive_fields(self) -> tuple[str, ...]:
        return super().resume_sensitive_fields() + ("beta", "loss_type", "label_smoothing", "max_prompt_length")

    def memory_saving_alternatives(self) -> list[tuple[str, dict]]:
        if not self.frozen_model_copies():
            return []
        return [
            (
                "no reference model copy: one pass of the starting model over the data before training; no copy kept",
                {"precompute_ref_log_probs": True},
            )
        ]

    def validate(self) -> list[str]:
        problems = super().validate()
        if not (math.isfinite(self.beta) and self.beta > 0):
            problems.append(f"beta must be a number > 0, got {self.beta} (0.1 is usual; it scales the implicit reward)")
        if self.loss_type not in losses.DPO_LOSS_TYPES:
            problems.append(f"loss_type {self.loss_type!r} is not one of {', '.join(losses.DPO_LOSS_TYPES)}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        elif self.label_smoothing and self.loss_type != "sigmoid":
            problems.append("label_smoothing applies to loss_type sigmoid only")
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.max_length:
            problems.append(f"max_prompt_length must be >= 1 and < max_length ({self.max_length}), or null")
        return problems


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(DPOConfig, argv)
    run = run_lib.start(config, name="dpo")
    accelerator, tokenizer = run.accelerator, run.tokenizer

    # --- data: pairs of answers to one prompt, the chosen one first ---------------------------------------------------
    def prepare_data():
        raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
        train_raw, eval_raw = files.split_train_eval(
            raw, config.dataset_train_split, config.dataset_test_split, config.held_out_split_size(), config.seed
        )
        options = dict(
            max_length=config.max_length, max_prompt_length=config.max_prompt_length, num_proc=config.dataset_num_proc
        )
        train_pairs, train_stats = preference.tokenize_pairs(train_raw, tokenizer, name="train", **options)
        eval_pairs = None
        if eval_raw is not None:
            eval_pairs = preference.tokenize_pairs(eval_raw, tokenizer, name="eval", **options)[0]
        return train_pairs, eval_pairs, train_stats

    train_pairs, eval_pairs, train_stats = run.on_every_rank(prepare_data, main_process_first=True)
    stored = None  # resuming with precomputed reference values: those the checkpoint holds, one for every pair
    if run.resumed and config.reference_mode() == "precomputed":

        def read_stored():
            tables = reference.read_tables(run.checkpoint)
            reference.check_tables(tables, {"train": train_pairs, "eval": eval_pairs}, run.checkpoint)
            return tables

        stored = run.on_every_rank(read_stored)
    collate = preference.PairCollator(tokenizer.pad_token_id)
    train_loader = rows.train_dataloader(
        train_pairs,
        config,
        num_processes=accelerator.num_processes,
        pad_token_id=tokenizer.pad_token_id,
        collate_fn=collate,
        unit="pairs",
    )
    in_order = {
        name: torch.utils.data.DataLoader(pairs, batch_size=config.per_device_eval_batch_size, collate_fn=collate)
        for name, pairs in (("train", train_pairs), ("eval", eval_pairs))
        if pairs is not None
    }

    # --- the policy, and the reference it is compared with ---------------------------------------------------------------
    def load():
        return run.load_model(**adapters.loading_options(config, accelerator))

    model = load()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs or {"use_reentrant": False}
        )
    model = adapters.apply(model, config, task="causal-lm")  # use_peft: LoRA adapters on a frozen base
    token_loss = losses.TokenLoss(model, config.loss_implementation, chunk_size=config.loss_chunk_size)
    reference_mode = config.reference_mode()
    reference_copy = load() if reference_mode == "model" else None  # the starting weights, frozen
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    in_order = {name: accelerator.prepare(loader) for name, loader in in_order.items()}
    references = {}
    if reference_mode == "model":
        copy_loss = losses.TokenLoss(reference_copy, config.loss_implementation, chunk_size=config.loss_chunk_size)
        copy = reference.shard_frozen_copy(accelerator, reference_copy)
        references = dict.fromkeys(in_order, reference.ReferenceLogProbs("model", copy=copy, copy_loss=copy_loss))
    elif reference_mode == "adapters":
        references = dict.fromkeys(
            in_order, reference.ReferenceLogProbs("adapters", policy=model, token_loss=token_loss)
        )
    else:  # the untrained policy's values, or (resuming) those it computed before its first step
        tables = stored or {
            name: reference.precompute(accelerator, model, token_loss, loader) for name, loader in in_order.items()
        }
        if accelerator.is_main_process and not run.resumed:
            reference.write_tables(config.output_dir, tables)
        references = {name: reference.ReferenceLogProbs("precomputed", table=table) for name, table in tables.items()}

    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)

    def pair_losses(model, batch, reference_log_probs):
        """Per-pair losses, implicit rewards and the policy's log-probabilities of the chosen and rejected answers."""
        reference_chosen, reference_rejected = reference_log_probs(batch).chunk(2)
        policy_chosen, policy_rejected = losses.sequence_log_probs(token_loss.token_losses(model, batch)).chunk(2)
        lengths = (batch["targets"] != losses.IGNORE_INDEX).sum(dim=1).chunk(2)
        values = losses.dpo_losses(
            policy_chosen,
            policy_rejected,
            reference_chosen,
            reference_rejected,
            beta=config.beta,
            loss_type=config.loss_type,
            label_smoothing=config.label_smoothing,
            chosen_lengths=lengths[0],
            rejected_lengths=lengths[1],
        )
        return (*values, policy_chosen, policy_rejected)

    def held_out(model, batch):
        pair_loss, chosen_rewards, rejected_rewards, policy_chosen, policy_rejected = pair_losses(
            model, batch, references["eval"]
        )
        return {
            "loss": pair_loss,
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": policy_chosen,
            "logps/rejected": policy_rejected,
        }

    evaluator = evaluation.MetricEvaluator(
        accelerator, model, in_order.get("eval"), predict=held_out, metrics={}, every=config.eval_steps
    )
    batches, first_step = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=evaluator,
        summary=dict(
            train_pairs=len(train_pairs),
            eval_pairs=len(eval_pairs or []),
            data=train_stats,
            loss=f"{config.loss_type} DPO, beta {config.beta}; token log-probs: {token_loss.description}",
            reference=references["train"].description,
        ),
        checkpoint_files={reference.PRECOMPUTED_FILE: reference.tables_json(tables)}  # kept with every checkpoint
        if reference_mode == "precomputed"
        else None,
    )

    # --- the loop: forward (reference, then policy), loss, backward, step -------------------------------------------------
    model.train()
    bar = run.progress_bar(first_step)
    for step in range(first_step, total_steps + 1):
        micro_batches = batches.take(config.gradient_accumulation_steps, window=run.metrics.window)
        pair_count = run.sum_over_ranks(sum(preference.count_pairs(batch) for batch in micro_batches))
        scale = losses.global_mean_scale(accelerator, pair_count)
        loss_sum, figures = 0.0, {}
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches):
            pair_loss, chosen_rewards, rejected_rewards, policy_chosen, policy_rejected = pair_losses(
                model, batch, references["train"]
            )
            accelerator.backward(pair_loss.sum() * scale)
            loss_sum += pair_loss.sum().item()
            for name, value in losses.dpo_metric_sums(
                chosen_rewards, rejected_rewards, policy_chosen, policy_rejected
            ).items():
                figures[name] = figures.get(name, 0.0) + value
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm) if config.max_grad_norm else None
        )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        run.fault_point(step)

        run.metrics.log_step(step, loss_sum=loss_sum, target_count=pair_count, grad_norm=grad_norm, sums=figures)
        run.evaluation.maybe_evaluate(step)
        run.checkpoints.maybe_save(step)
    bar.close()

    # --- finish: held-out preference figures, summary, export, card, Hub -------------------------------------------------
    run.finish(model, results=run.evaluation.final_results())


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
