"""Knowledge distillation: a student causal LM trained on a frozen teacher's next-token distributions, with FSDP2.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/distill.py \\
        --config recipes/configs/distill/<config>.yaml [--field value ...]

SFT's data; `(1 - kd_ratio) x CE + kd_ratio x KD` against a frozen teacher sharded like the student, computed a
chunk of tokens at a time so neither model's logits exist whole (`fsdp_recipes.methods.distill`). With kd_ratio 0
it is SFT's loss exactly. On-policy (TRL's GKD): `lmbda` of the steps train on the student's own samples, KD alone;
`seq_kd` trains the others on the teacher's samples. docs/reward-and-distillation.md.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, checks, errors
from fsdp_recipes.data import rows
from fsdp_recipes.methods.distill import distillation, on_policy
from fsdp_recipes.methods.sft import supervised
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import frozen_copy, generation, loop, losses, router_balance, vllm_settings


@dataclasses.dataclass
class DistillConfig(supervised.SupervisedFields, vllm_settings.VLLMFields, config_lib.TrainingConfig):
    """The distillation recipe's own settings (SFT's data settings, and the teacher's), on top of those every training
    recipe has. Names follow TRL's SFTConfig/GKDConfig and torchtune's KD recipes."""

    output_dir: str = arguments.setting(
        "outputs/distill",
        "the run's folder: at the end the distilled student (a peft adapter folder with use_peft), "
        "during the run checkpoints/, metrics.jsonl, run_summary.json and tracker logs",
        resume="free",
    )
    teacher_model_name_or_path: str | None = arguments.setting(
        None,
        "the teacher: a model folder or Hub id with the student's vocabulary and tokenizer; frozen, "
        "loaded in the compute dtype and sharded like the student (one more model in memory, one more forward "
        "per step)",
        resume="sensitive",
        check=checks.required("the model whose distributions the student learns"),
    )
    kd_ratio: float = arguments.setting(
        0.5,
        "weight of the distillation loss: (1 - kd_ratio) x cross-entropy on the data + kd_ratio x KD. "
        "1: the teacher alone; 0: plain SFT",
        resume="sensitive",
        check=checks.within(0, 1, include_high=True, note=" (0: plain SFT, 1: the teacher alone)"),
    )
    temperature: float = arguments.setting(
        1.0,
        "softens both distributions before comparing them: > 1 teaches the teacher's ranking of unlikely "
        "tokens too, at the cost of a weaker signal on the likely ones",
        resume="sensitive",
        check=checks.above(0, note=" (1.0: the distributions as they are)"),
    )
    kd_loss: str = arguments.setting(
        "forward_kl",
        "forward_kl: KL(teacher || student), covers all the teacher's mass; reverse_kl: KL(student || "
        "teacher), mode-seeking; jsd: Jensen-Shannon, symmetric and bounded",
        resume="sensitive",
        check=checks.one_of(distillation.KD_LOSSES),
    )

    lmbda: float = arguments.setting(
        0.0,
        "share of the steps trained on completions the student samples from the data's prompts (TRL GKD's name), "
        "scored by the teacher with KD alone: the student learns on its own mistakes, at the cost of a generation "
        "pass per such step (max_new_tokens, at `temperature`); 0: the data's completions only. Needs packing: false",
        resume="sensitive",
        check=checks.within(0, 1, include_high=True, note=" (0: off-policy only, 1: every step on-policy)"),
    )
    seq_kd: bool = arguments.setting(
        False,
        "the steps that are not on-policy train on completions the teacher samples instead of the data's "
        "(sequence-level KD, TRL GKD's name): one teacher generation pass per step. Needs packing: false",
        resume="sensitive",
    )
    generation_backend: str = generation.backend_setting()  # lmbda, seq_kd: how the samples are written

    def cross_field_problems(self) -> list[str]:
        problems = []
        if self.generation_backend == "vllm" and self.seq_kd:
            problems.append(
                "seq_kd samples with the teacher, and the vLLM server serves the student (lmbda's samples): use "
                "seq_kd with a transformers generation_backend, or vLLM for lmbda alone"
            )
        if (self.lmbda > 0 or self.seq_kd) and self.packing:
            problems.append(
                "lmbda > 0 or seq_kd samples a completion for each row's prompt, and a packed row holds several "
                "examples: set packing: false"
            )
        return problems

    def frozen_models(self) -> list[str]:
        return [self.teacher_model_name_or_path] if self.teacher_model_name_or_path else []

    def loss_chunk_buffers(self) -> int:
        return distillation.PEAK_CHUNK_BUFFERS if self.kd_ratio > 0 or self.lmbda > 0 else 1


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(DistillConfig, argv)
    run = run_lib.start(config, name="distill")
    accelerator, tokenizer = run.accelerator, run.tokenizer

    def check_teacher():  # its config and tokenizer only: no weights yet
        options = dict(revision="main", trust_remote_code=config.trust_remote_code)
        adapters.check_not_an_adapter_folder(
            config.teacher_model_name_or_path, setting="teacher_model_name_or_path", role="a teacher"
        )
        teacher_tokenizer = modeling.load_tokenizer(
            config.teacher_model_name_or_path, setting="teacher_model_name_or_path", **options
        )
        teacher_config = modeling.load_model_config(
            config.teacher_model_name_or_path, None, setting="teacher_model_name_or_path", **options
        )
        distillation.check_shared_vocabulary(
            run.model_config, teacher_config, tokenizer, teacher_tokenizer, teacher=config.teacher_model_name_or_path
        )
        distillation.check_no_logits_transform(run.model_config, which="student")
        distillation.check_no_logits_transform(teacher_config, which="teacher")
        distillation.check_teacher_splits(teacher_config, run.parallel.sp)  # SP: its heads split like the student's
        return teacher_config

    teacher_config = run.on_every_rank(check_teacher)

    # --- data: SFT's tokens with loss masks, then rows (packed or not) ------------------------------------------------
    data = run.on_every_rank(lambda: supervised.prepare(config, tokenizer), main_process_first=True)
    train_rows, eval_rows = data.train_rows, data.eval_rows
    train_loader = rows.train_dataloader(
        train_rows, config, num_processes=run.parallel.data_parallel_size, pad_token_id=tokenizer.pad_token_id
    )

    # --- the student, the frozen teacher, optimizer, schedule --------------------------------------------------------
    model = run.load_model(**adapters.loading_options(config, accelerator))
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="causal-lm")  # use_peft: LoRA adapters on a frozen base
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    teacher_model = run.load_model_from(teacher_config, config.teacher_model_name_or_path, dtype=compute_dtype)
    teacher = distillation.TeacherHidden(teacher_model)
    distill_loss = distillation.DistillationLoss(
        model,
        teacher,
        kd_ratio=config.kd_ratio,
        temperature=config.temperature,
        kd_loss=config.kd_loss,
        chunk_size=config.loss_chunk_size,
        sequence_shards=run.parallel.sequence_shards,  # sequence parallelism: each rank runs its slice of every row
    )
    router_balance.attach(model, distill_loss.router_logits_of, real_of=router_balance.real_token_mask)  # MoE only
    optimizer = loop.build_optimizer(model, config)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    teacher.teacher = frozen_copy.shard_frozen_copy(accelerator, teacher_model)
    teacher.gather_head()  # a collective under FSDP2: the teacher's output layer, whole on every rank
    total_steps = loop.total_optimizer_steps(len(train_loader), config)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    gkd = on_policy.OnPolicy.from_config(config, run)  # lmbda, seq_kd: sampled completions (vLLM: weights pushed)
    training = run.begin(
        model,
        train_loader,
        scheduler,
        total_steps=total_steps,
        evaluator=run.loss_evaluator(model, eval_rows, distill_loss.loss_sum),
        summary=dict(
            train_rows=len(train_rows),
            eval_rows=len(eval_rows or []),
            data=data.train_stats,
            loss=distill_loss.description
            + (f"; on {config.lmbda:g} of the steps KD alone on the student's samples" if config.lmbda else "")
            + ("; the other steps on the teacher's samples" if config.seq_kd else ""),
            teacher=dict(
                model=config.teacher_model_name_or_path,
                dtype=str(compute_dtype).removeprefix("torch."),
                parameters=sum(p.numel() for p in teacher_model.parameters()),
            ),
        ),
    )

    def exact_match() -> dict:
        return supervised.exact_match(accelerator, model, tokenizer, data, config, parallel=run.parallel)

    results = {}
    if supervised.exact_match_wanted(config, data):
        results["exact_match_before"] = training.measured_once("exact_match", lambda: exact_match()["exact_match"])
        accelerator.print(f"exact match before training: {results['exact_match_before']:.1%}")

    # --- the loop: forward (teacher, then student), loss, backward, step ----------------------------------------------
    model.train()
    for step in training.steps():
        micro_batches = training.batches.take(config.gradient_accumulation_steps, window=training.metrics.window)
        micro_batches, students_samples = gkd.batches(  # GKD: the student's samples, the teacher's, or the data's
            micro_batches, step, model, teacher.teacher, tokenizer, synced_gpus=accelerator.num_processes > 1
        )
        kd_ratio = 1.0 if students_samples else None  # the student's own samples: KD alone
        target_count = run.sum_over_ranks(sum(losses.count_targets(batch) for batch in micro_batches))
        scale = losses.global_mean_scale(run.parallel, target_count)
        loss_sum, parts = 0.0, {}
        for batch in loop.micro_batches_in_sync(accelerator, model, micro_batches, parallel=run.parallel):
            loss = distill_loss.loss_sum(model, batch, kd_ratio=kd_ratio)
            accelerator.backward(loss * scale)
            loss_sum += loss.detach()  # summed on the device: no host sync per micro-batch
            for name, value in distill_loss.last_parts.items():
                parts[f"loss/{name}"] = parts.get(f"loss/{name}", 0.0) + value
        grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        share_on_policy = {"on_policy": float(students_samples)} if config.lmbda else {}
        training.metrics.log_step(
            step, loss_sum=loss_sum, target_count=target_count, grad_norm=grad_norm, sums=parts, **share_on_policy
        )
        training.evaluation.maybe_evaluate(step)
        training.checkpoints.maybe_save(step)

    # --- finish: generation check, then summary, export, card, Hub ------------------------------------------------------
    if supervised.exact_match_wanted(config, data):
        after = exact_match()
        results["exact_match_after"] = after["exact_match"]
        training.log.log({"step": total_steps, "exact_match": after["exact_match"]})
        accelerator.print(f"exact match after training: {after['exact_match']:.1%} of {after['num_examples']}")
    training.finish(model, results=results, summary=gkd.close())


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
