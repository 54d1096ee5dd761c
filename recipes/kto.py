"""KTO (Kahneman-Tversky optimisation) of a causal language model on answers marked good or bad, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/kto.py \\
        --config recipes/configs/kto/<config>.yaml [--field value ...]

Single answers marked good or bad (TRL's KTO format; preference pairs are unpaired), each step's KL estimate over
the global batch before its loss, the reference as in dpo.py (`fsdp_recipes.methods.preference`). A recipe of its
own: its data are not pairs and a step needs a pass before its loss. docs/preference.md.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, errors
from fsdp_recipes.data import files, rows
from fsdp_recipes.methods.preference import kto, reference, unpaired
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import loop, losses, router_balance


@dataclasses.dataclass
class KTOConfig(reference.ReferenceFields, config_lib.TrainingConfig):
    """The KTO recipe's settings: its loss's, the reference's (`methods/preference/reference.py`: beta, prompt length, precomputed
    values) and those every training recipe has. Names follow TRL's KTOConfig."""

    output_dir: str = arguments.setting("outputs/kto", "the run's folder (as recipes/dpo.py's)", resume="free")
    learning_rate: float = arguments.setting(
        1e-6, "AdamW's peak learning rate; like DPO, KTO moves a trained model a little", resume="free"
    )
    loss_type: str = arguments.setting(
        "kto",
        "kto (with the KL estimate), or apo_zero_unpaired (the good answers beat the model's own)",
        resume="sensitive",
    )
    desirable_weight: float = arguments.setting(
        1.0, "weight of the good answers' losses (raise it when they are the fewer)", resume="sensitive"
    )
    undesirable_weight: float = arguments.setting(
        1.0, "weight of the bad answers' losses (raise it when they are the fewer)", resume="sensitive"
    )

    def cross_field_problems(self) -> list[str]:
        return kto.configuration_problems(self.loss_type, self.beta, self.desirable_weight, self.undesirable_weight)


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(KTOConfig, argv)
    run = run_lib.start(config, name="kto")
    accelerator, tokenizer = run.accelerator, run.tokenizer

    # --- data: single answers marked good or bad, each with its KL row ------------------------------------------------
    def prepare_data():
        raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
        train_raw, eval_raw = files.split_train_eval(
            raw, config.dataset_train_split, config.dataset_test_split, config.held_out_split_size(), config.seed
        )
        options = dict(  # (a vision-language model's processor, run.pictures, reads the prompts' pictures)
            max_length=config.max_length,
            max_prompt_length=config.max_prompt_length,
            num_proc=config.dataset_num_proc,
            seed=config.seed,
            pictures=run.pictures,
            image_roots=files.data_folders(config.dataset_name),
        )
        train, stats = unpaired.tokenize_examples(train_raw, tokenizer, name="train", **options)
        held_out = (
            None if eval_raw is None else unpaired.tokenize_examples(eval_raw, tokenizer, name="eval", **options)[0]
        )
        return train, held_out, stats

    train_examples, eval_examples, train_stats = run.on_every_rank(prepare_data, main_process_first=True)
    stored = None  # resuming with precomputed reference values: those the checkpoint holds, one for every example
    if run.resumed and config.reference_mode() == "precomputed":
        splits = {"train": train_examples, "eval": eval_examples}
        stored = run.on_every_rank(lambda: reference.read_checked(run.checkpoint, splits))
    collate = unpaired.collator(tokenizer.pad_token_id, pictures=run.pictures)
    train_loader = rows.train_dataloader(
        train_examples,
        config,
        num_processes=run.parallel.data_parallel_size,
        pad_token_id=tokenizer.pad_token_id,
        collate_fn=collate,
        unit="examples",
    )
    in_order = {
        name: torch.utils.data.DataLoader(examples, batch_size=config.per_device_eval_batch_size, collate_fn=collate)
        for name, examples in (("train", train_examples), ("eval", eval_examples))
        if examples is not None
    }

    # --- the policy, and the reference it is compared with ------------------------------------------------------------
    def load():
        return run.load_model(**adapters.loading_options(config, accelerator))

    model = load()
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="causal-lm")  # use_peft: LoRA adapters on a frozen base
    shards = run.parallel.sequence_shards  # sequence parallelism: the loss's forward splits rows by position
    token_loss = losses.TokenLoss(
        model, config.loss_implementation, chunk_size=config.loss_chunk_size, sequence_shards=shards
    )
    router_balance.attach(  # MoE only: on the examples' rows, not the KL estimate's
        model, token_loss.router_logits_of, rows_of=kto.example_rows, real_of=router_balance.real_token_mask
    )
    reference_mode = config.reference_mode()
    reference_copy = load() if reference_mode == "model" else None  # the starting weights, frozen
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    in_order = {name: accelerator.prepare(loader) for name, loader in in_order.items()}
    references, tables = reference.for_splits(  # the reference's values of both rows of every example
        reference_mode,
        accelerator,
        in_order,
        parallel=run.parallel,
        policy=model,
        token_loss=token_loss,
        copy=reference_copy,
        stored=stored,
        write_to=None if run.resumed else config.output_dir,
    )

    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    objective = kto.KTOLoss(config.loss_type, config.beta, config.desirable_weight, config.undesirable_weight)
    evaluator = kto.KTOEvaluator(
        accelerator,
        model,
        in_order.get("eval"),
        reference=references.get("eval"),
        token_loss=token_loss,
        objective=objective,
        every=config.eval_steps,
    )
    training = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=evaluator,
        summary=dict(
            train_examples=len(train_examples),
            eval_examples=len(eval_examples or []),
            data=train_stats,
            loss=f"{objective.description}; token log-probs: {token_loss.description}",
            reference=references["train"].description,
        ),
        checkpoint_files={reference.PRECOMPUTED_FILE: reference.tables_json(tables)} if tables else None,
        frozen_models={"reference_model": references["train"].copy},  # its bytes in the summary
    )

    # --- the loop: KL estimate (no gradients), then forward, loss, backward, step -------------------------------------
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        examples = run.sum_over_ranks(sum(batch["label"].numel() for batch in micro_batches))
        desirable = run.sum_over_ranks(sum(batch["label"].sum() for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, examples)
        with torch.no_grad():  # both rows' reference values; the policy's on the KL rows, for the estimate
            reference_values = [references["train"](batch).chunk(2) for batch in micro_batches]
            kl_sum = 0.0
            if objective.uses_kl:
                for batch, (_, reference_kl) in zip(micro_batches, reference_values):
                    policy_kl = losses.sequence_log_probs(token_loss.token_losses(model, kto.kl_rows(batch)))
                    kl_sum += (policy_kl - reference_kl).sum()  # on the device, like every count of the step
        kl = kto.kl_estimate(run.sum_over_ranks(kl_sum), examples) if objective.uses_kl else 0.0
        loss_sum, figures = 0.0, {}
        synced = loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel)
        for batch, (reference_values_of_examples, _) in zip(synced, reference_values):
            example_batch = kto.example_rows(batch)
            policy = losses.sequence_log_probs(token_loss.token_losses(model, example_batch))
            result = objective(policy, reference_values_of_examples, batch["label"], kl)
            accelerator.backward(result.loss.sum() * scale)
            loss_sum += result.loss.sum().detach()  # on the device: no host sync per micro-batch
            for name, value in kto.class_sums(result, policy, batch["label"]).items():
                figures[name] = figures.get(name, 0.0) + value
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        training.metrics.log_step(
            step, loss_sum=loss_sum, target_count=examples, grad_norm=grad_norm, kl=kl,
            sums=functools.partial(kto.figure_sums, figures, examples=examples, desirable=desirable),  # when logged
        )  # fmt: skip
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: held-out figures, summary, export, card, Hub ---------------------------------------------------------
    training.finish(model, results=training.evaluation.final_results())


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
