"""Direct preference optimisation (DPO) of a causal language model on preference pairs, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/dpo.py \\
        --config recipes/configs/dpo/<config>.yaml [--field value ...]

TRL's preference formats; TRL's DPO loss catalogue alone or weighted, SimPO and ORPO; the reference as the policy
with its adapters off, a frozen sharded copy or precomputed values (`fsdp_recipes.methods.preference`). Formulas and
figures: docs/preference.md; LoRA and the reference modes' costs: docs/lora-and-dpo.md.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, errors
from fsdp_recipes.data import files, rows
from fsdp_recipes.methods.preference import objectives, paired, reference
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import evaluation, loop, losses, router_balance


@dataclasses.dataclass
class DPOConfig(reference.ReferenceFields, config_lib.TrainingConfig):
    """The DPO recipe's settings: the preference losses', the reference's (`methods/preference/reference.py`: beta, prompt length,
    precomputed values) and those every training recipe has. Names follow TRL's DPOConfig."""

    output_dir: str = arguments.setting(
        "outputs/dpo",
        "the run's folder: at the end the trained policy (a peft adapter folder with use_peft), "
        "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    learning_rate: float = arguments.setting(
        1e-6,
        "AdamW's peak learning rate. DPO moves a trained model a little: full fine-tuning rates are ~10x too high",
        resume="free",
    )
    loss_type: str | list[str] = arguments.setting(
        default_factory=lambda: "sigmoid",
        help="one loss or a list, summed with loss_weights (TRL's names). Reference-based: "
        + ", ".join(objectives.NEEDS_REFERENCE)
        + "; needing no reference model (none is loaded when all are): sft (chosen NLL; [sigmoid, sft] is RPO), "
        "simpo, orpo. docs/preference.md gives each formula",
        resume="sensitive",
    )
    loss_weights: list[float] | None = arguments.setting(
        None, "one weight >= 0 per loss_type entry (null: each weighs 1)", resume="sensitive"
    )
    label_smoothing: float = arguments.setting(
        0.0, "chance a label is wrong: sigmoid, robust, aot(_unpaired), simpo; exo_pair's e", resume="sensitive"
    )
    discopop_tau: float = arguments.setting(0.05, "discopop: how sharply it mixes its terms", resume="sensitive")
    simpo_gamma: float = arguments.setting(0.5, "simpo: the target reward margin", resume="sensitive")
    cpo_alpha: float = arguments.setting(
        0.0, "simpo: weight of the chosen NLL added (TRL's default 1.0 is CPO-SimPO)", resume="sensitive"
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.loss_type, list) and len(self.loss_type) == 1:  # `--loss_type ipo` parses as a list
            self.loss_type = self.loss_type[0]

    def micro_batch_rows(self) -> int:
        return 2 * self.per_device_train_batch_size  # a pair: its chosen and its rejected row

    def needs_reference(self) -> bool:
        return objectives.needs_reference(self.loss_type)  # simpo, orpo, sft: no reference model, no pass

    def min_max_length(self) -> tuple[int, str]:
        return 2, "a pair's rows need a prompt token and an answer token predicted from it"

    def cross_field_problems(self) -> list[str]:
        problems = objectives.configuration_problems(
            self.loss_type,
            self.loss_weights,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            discopop_tau=self.discopop_tau,
            simpo_gamma=self.simpo_gamma,
            cpo_alpha=self.cpo_alpha,
        )
        if self.precompute_ref_log_probs and self.reference_mode() is None:
            problems.append(
                f"precompute_ref_log_probs: loss_type {self.loss_type} needs no reference, so there is nothing to "
                "precompute: remove it (or add a loss that compares with the reference)"
            )
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
        # (a vision-language model's processor, run.pictures, reads the prompts' images)
        options = dict(
            max_length=config.max_length, max_prompt_length=config.max_prompt_length, num_proc=config.dataset_num_proc,
            pictures=run.pictures, image_roots=files.data_folders(config.dataset_name),
        )  # fmt: skip
        train_pairs, train_stats = paired.tokenize_pairs(train_raw, tokenizer, name="train", **options)
        eval_pairs = None
        if eval_raw is not None:
            eval_pairs = paired.tokenize_pairs(eval_raw, tokenizer, name="eval", **options)[0]
        return train_pairs, eval_pairs, train_stats

    train_pairs, eval_pairs, train_stats = run.on_every_rank(prepare_data, main_process_first=True)
    stored = None  # resuming with precomputed reference values: those the checkpoint holds, one for every pair
    if run.resumed and config.reference_mode() == "precomputed":
        splits = {"train": train_pairs, "eval": eval_pairs}
        stored = run.on_every_rank(lambda: reference.read_checked(run.checkpoint, splits))
    collate = paired.PairCollator(tokenizer.pad_token_id, pictures=run.pictures)
    train_loader = rows.train_dataloader(
        train_pairs,
        config,
        num_processes=run.parallel.data_parallel_size,
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
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="causal-lm")  # use_peft: LoRA adapters on a frozen base
    shards = run.parallel.sequence_shards  # sequence parallelism: the loss's forward splits rows by position
    token_loss = losses.TokenLoss(
        model, config.loss_implementation, chunk_size=config.loss_chunk_size, sequence_shards=shards
    )
    router_balance.attach(model, token_loss.router_logits_of, real_of=router_balance.real_token_mask)  # MoE only
    reference_mode = config.reference_mode()
    reference_copy = load() if reference_mode == "model" else None  # the starting weights, frozen
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    in_order = {name: accelerator.prepare(loader) for name, loader in in_order.items()}
    references, tables = reference.for_splits(  # the reference's values for each split, or None (no loss needs it)
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

    objective = objectives.PreferenceLoss.from_config(config)

    def pair_losses(model, batch, reference_log_probs):
        """Per-pair losses, rewards and components, and the policy's log-probabilities of each answer."""
        reference_chosen = reference_rejected = None
        if reference_log_probs is not None:
            reference_chosen, reference_rejected = reference_log_probs(batch).chunk(2)
        policy_chosen, policy_rejected = losses.sequence_log_probs(token_loss.token_losses(model, batch)).chunk(2)
        lengths = (batch["targets"] != losses.IGNORE_INDEX).sum(dim=1).chunk(2)
        result = objective(policy_chosen, policy_rejected, reference_chosen, reference_rejected, *lengths)
        return result, policy_chosen, policy_rejected

    def held_out(model, batch):
        result, policy_chosen, policy_rejected = pair_losses(model, batch, references["eval"])
        return {"loss": result.loss, **objectives.pair_figures(result, policy_chosen, policy_rejected)}

    evaluator = evaluation.MetricEvaluator(
        accelerator, model, in_order.get("eval"), predict=held_out, metrics={}, every=config.eval_steps
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
            data=train_stats,
            loss=f"{objective.description}; token log-probs: {token_loss.description}",
            reference=f"{references['train'].description}, for {', '.join(needing)}"
            if (needing := objectives.needs_reference(config.loss_type))
            else f"none: loss_type {config.loss_type} needs no reference model and no precompute pass",
        ),
        checkpoint_files={reference.PRECOMPUTED_FILE: reference.tables_json(tables)}  # kept with every checkpoint
        if reference_mode == "precomputed"
        else None,
        frozen_models={"reference_model": getattr(references["train"], "copy", None)},  # its bytes in the summary
    )

    # --- the loop: forward (reference, then policy), loss, backward, step -------------------------------------------------
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        pair_count = run.sum_over_ranks(sum(paired.count_pairs(batch) for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, pair_count)
        loss_sum, figures = 0.0, {}
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel):
            result, policy_chosen, policy_rejected = pair_losses(model, batch, references["train"])
            accelerator.backward(result.loss.sum() * scale)
            loss_sum += result.loss.sum().detach()  # on the device: no host sync per micro-batch
            for name, value in objectives.pair_figures(result, policy_chosen, policy_rejected).items():
                figures[name] = figures.get(name, 0.0) + value.sum().detach()
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        training.metrics.log_step(step, loss_sum=loss_sum, target_count=pair_count, grad_norm=grad_norm, sums=figures)
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: held-out preference figures, summary, export, card, Hub -------------------------------------------------
    training.finish(model, results=training.evaluation.final_results())


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
