"""Online RL with verifiable rewards (GRPO) of a causal language model, with FSDP2: the policy generates its own data.

    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml recipes/grpo.py \\
        --config recipes/configs/grpo/<config>.yaml [--field value ...]

Names and semantics of TRL's GRPOConfig. Each round the policy samples groups of completions with its weights
gathered once, reward functions score them, group-normalised advantages weight the clipped surrogate (+ beta x KL);
completions do not depend on the rank split (`fsdp_recipes.methods.grpo`). docs/grpo.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from fsdp_recipes import run as run_lib
from fsdp_recipes.common import arguments, checks, errors
from fsdp_recipes.methods.grpo import completion_log, groups, rollouts, round_generation, sampler_mismatch
from fsdp_recipes.methods.grpo import policy_gradient as pg
from fsdp_recipes.methods.grpo import settings as online_rl
from fsdp_recipes.methods.grpo import task as grpo_task
from fsdp_recipes.models import adapters, modeling
from fsdp_recipes.train import checkpoint as checkpoint_lib
from fsdp_recipes.train import config as config_lib
from fsdp_recipes.train import frozen_copy, loop, router_balance, vllm_settings


@dataclasses.dataclass
class GRPOConfig(
    online_rl.PolicyObjectiveFields,
    online_rl.GenerationFields,
    sampler_mismatch.SamplerCorrectionFields,
    vllm_settings.VLLMFields,
    online_rl.RewardFields,
    config_lib.TrainingConfig,
):
    """The GRPO recipe's settings in six groups: the policy objective, generation, the sampler's correction, vLLM,
    rewards and tools (`methods/grpo/settings.py`, `methods/grpo/sampler_mismatch.py`, `train/vllm_settings.py`), and
    the run (every training recipe's), with defaults for RL. Names follow TRL's GRPOConfig."""

    output_dir: str = arguments.setting("outputs/grpo", "the run's folder (see sft.py)", resume="free")
    learning_rate: float = arguments.setting(
        1e-6, "AdamW's peak learning rate: RL moves a trained model a little", resume="free"
    )
    per_device_train_batch_size: int = arguments.setting(
        8, "completions per process per micro-step (a group may span processes)", resume="free"
    )
    max_length: int = arguments.setting(
        1024,
        "prompt + completion tokens; prompts keep their last max_length - max_completion_length tokens",
        resume="sensitive",
    )
    loss_implementation: str = arguments.setting(
        "full_logits",
        "full_logits only: the completion tokens' log-probabilities and entropies come from their "
        "logits at the sampling temperature (the positions before completions get none)",
        resume="free",
        check=checks.one_of(("full_logits",), note=" for GRPO (the chunked losses have no temperature)"),
    )
    dataset_prompt_column: str = arguments.setting(
        "prompt", "the column of prompts, text or chat turns (e.g. question for gsm8k)", resume="sensitive"
    )
    num_completions_to_print: int = arguments.setting(
        4, "completions (with prompt and reward) written to completions.jsonl and tables per log", resume="free"
    )


def main(argv: list[str] | None = None) -> None:
    config = arguments.parse_config(GRPOConfig, argv)
    run = run_lib.start(config, name="grpo")
    accelerator, tokenizer = run.accelerator, run.tokenizer
    world, rank = run.parallel.data_parallel_size, run.data_parallel_rank  # a TP or SP group shares its slots
    shards = run.parallel.sequence_shards  # sequence parallelism: this rank's group (None without)
    completions_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * world

    # --- rewards, tools and prompts, before any weights ---------------------------------------------------------------
    if completions_per_step % config.num_generations:
        raise errors.ConfigError(
            f"num_generations ({config.num_generations}) must divide the global batch of completions "
            f"(per_device_train_batch_size x processes x gradient_accumulation_steps = {completions_per_step})"
        )
    task = run.on_every_rank(
        lambda: grpo_task.load_task(
            config, tokenizer, device=accelerator.device, pictures=run.pictures, data_parallel_size=world
        ),
        main_process_first=True,
    )  # (a vision-language model's processor, run.pictures, reads the prompts' pictures)
    data = task.data
    prompts_per_round = completions_per_step // config.num_generations
    schedule = rollouts.PromptSchedule(len(data), prompts_per_round, seed=config.seed)
    if run.checkpoint is not None:  # the prompts dynamic sampling drew beyond their rounds shift the stream
        schedule.load_state_dict(checkpoint_lib.read_rank_state(run.checkpoint, rank))
    rounds = math.ceil(config.num_train_epochs * len(data) / prompts_per_round)
    total_steps = config.max_steps if config.max_steps > 0 else rounds * config.num_iterations

    # --- the policy, and the reference it is kept near (beta > 0) ----------------------------------------------------
    def load():
        return run.load_model(**adapters.loading_options(config, accelerator))

    def log_probs_of(policy, batch):  # the completion tokens' log-probabilities and entropies (SP: rows split)
        return rollouts.completion_log_probs(policy, batch, config.temperature, sequence_shards=shards)

    model = load()
    if config.gradient_checkpointing:
        modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)
    model = adapters.apply(model, config, task="causal-lm")
    router_balance.attach(model, log_probs_of)  # MoE only
    reference_mode = config.reference_mode()
    reference_copy = load() if reference_mode == "model" else None
    optimizer = loop.build_optimizer(model, config)
    model, optimizer = accelerator.prepare(model, optimizer)
    if reference_copy is not None:
        reference_copy = frozen_copy.shard_frozen_copy(accelerator, reference_copy)
    scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)
    settings = config.generation_settings(
        batch_size=config.per_device_eval_batch_size,
        seed=config.seed,
        server=run.generation_server,
        pictures=run.pictures,
    )
    generator = round_generation.RoundGeneration(
        run, config, task, model, settings, schedule=schedule, total_rounds=-(-total_steps // config.num_iterations)
    )  # the policy, or a vLLM server it pushes its weights to
    correction = sampler_mismatch.Correction.of(config)  # None unless vLLM samples

    def reference_log_probs(batch):
        with torch.no_grad():
            if reference_mode == "adapters":
                with model.disable_adapter():
                    return log_probs_of(model, batch)[0]
            return log_probs_of(reference_copy, batch)[0]

    training = run.begin(
        model,
        schedule,
        scheduler,
        total_steps=total_steps,
        summary=dict(
            train_prompts=len(data),
            prompts_truncated=data.truncated,
            prompts_per_step=prompts_per_round,
            completions_per_step=completions_per_step,
            reward_funcs=[name for name, _ in task.functions],
            loss=config.describe_objective(),
            reference="none (beta 0)" if reference_mode is None else reference_mode,
            generation=generator.describe(model),
        ),
        save_multiple=config.num_iterations,  # a preemption saves between generation rounds
    )
    if (training.first_step - 1) % config.num_iterations:
        raise errors.ConfigError("the checkpoint falls inside a generation round: resume from one between rounds")

    # --- the loop: generate -> score -> advantages -> loss -> backward -> step --------------------------------------------
    model.train()
    watch, rollout = rollouts.Stopwatch(), None
    shown = completion_log.CompletionLog(accelerator, config.output_dir, count=config.num_completions_to_print)
    for step in training.steps():
        round_index, iteration = divmod(step - 1, config.num_iterations)
        if iteration == 0:  # generate -> score, again for more groups with a reward spread (dynamic_sampling)
            pool = groups.GroupPool(prompts_per_round, config.num_generations, dynamic_sampling=config.dynamic_sampling)
            for attempt in range(config.generation_passes()):
                indices = (
                    schedule.more_prompts(prompts_per_round) if attempt else schedule.prompts_for_round(round_index)
                )
                slots = rollouts.rank_slots(indices, config.num_generations, rank=rank, world_size=world)
                with watch.phase("generation"):  # the policy's completions, its tool calls answered
                    rolled = generator.generate(model, step, round_index, attempt, slots, watch)
                with watch.phase("scoring"):
                    scored = task.score(accelerator, tokenizer, slots, rolled, run.on_every_rank, parallel=run.parallel)
                    pool.add(scored)
                if pool.full():
                    break
            chosen, kept_groups = pool.batch()
            micro, global_tokens, rollout, mine, advantages = rollouts.assemble_round(
                chosen, pool.generated, data.prompt_ids, rank=rank, world_size=world, device=accelerator.device,
                function_names=[name for name, _ in task.functions], num_generations=config.num_generations,
                scale_rewards=config.scale_rewards, advantage_estimator=config.advantage_estimator,
                mask_truncated_completions=config.mask_truncated_completions,
                rows_per_micro_batch=config.per_device_train_batch_size, pad_token_id=tokenizer.pad_token_id,
                padding_free=config.padding_free, kept_groups=kept_groups, generation_passes=len(pool.passes),
                pixel_inputs=task.pixel_inputs,
            )  # fmt: skip
            shown.keep(
                step, [data.prompts[p] for p in mine.prompt_indices],
                tokenizer.batch_decode(mine.completion_ids, skip_special_tokens=True), mine.rewards, advantages,
            )  # fmt: skip

        with watch.phase("training"):
            rollouts.values_before_step(
                accelerator, model, micro, parallel=run.parallel, first_of_round=iteration == 0,
                keep_old_log_probs=config.num_iterations > 1, temperature=config.temperature,
                reference_log_probs=reference_log_probs if reference_mode else None,
                top_entropy_quantile=config.top_entropy_quantile,
            )  # fmt: skip
            loss_sum, figures = 0.0, {}
            for part in loop.micro_batches_in_sync(accelerator, model, micro, parallel=run.parallel):
                training.metrics.count_batch(rollouts.rows_run(part))
                log_probs, entropy = log_probs_of(model, part)
                old_log_probs = part.get("old_log_probs", log_probs.detach())
                # vLLM sampled the tokens: each token's loss weighed by p_trainer / p_vLLM (TRL's correction)
                sampling_weights = correction.weights(old_log_probs, part, global_tokens) if correction else None
                terms = pg.per_token_losses(
                    log_probs, old_log_probs, part["advantages"],
                    epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=config.beta,
                    reference_log_probs=part.get("reference_log_probs"), loss_type=config.loss_type,
                    importance_sampling_level=config.importance_sampling_level, mask=part["completion_mask"],
                    delta=config.delta, sapo_temperatures=(config.sapo_temperature_pos, config.sapo_temperature_neg),
                    entropy_mask=part.get("entropy_mask"), sampling_weights=sampling_weights,
                )  # fmt: skip
                token_weights = pg.token_weights(
                    part["completion_mask"], config.loss_type, global_completions=completions_per_step,
                    global_tokens=global_tokens, max_completion_length=config.max_completion_length,
                )  # fmt: skip
                bonus = config.entropy_coef * entropy * part.get("entropy_mask", 1.0)  # on the trained tokens
                loss = ((terms["loss"] - bonus) * token_weights).sum()
                accelerator.backward(loss * world)  # FSDP averages gradients over ranks: undo it, the sum is global
                loss_sum += loss.detach()  # summed on the device: no host sync per micro-batch
                for name, value in pg.loss_figures(terms, entropy, part["completion_mask"]).items():
                    figures[name] = figures.get(name, 0.0) + value / max(global_tokens, 1.0)
            grad_norm = training.optimizer_step(step, model, optimizer, scheduler)  # clip, step, schedule, zero_grad

        sampler_sums, extremes = correction.figures() if correction else ({}, {})
        timing = watch.shares()
        speed = {}
        if iteration == 0:
            speed["tokens/generated_per_second"] = rollout["tokens/generated"] / max(watch.seconds["generation"], 1e-9)
        if training.metrics.due(step):
            shown.write(step)
        training.metrics.log_step(
            step, loss_sum=loss_sum, grad_norm=grad_norm, sums={**figures, **sampler_sums}, extremes=extremes,
            **rollout, **timing, **speed,
        )  # fmt: skip
        watch = rollouts.Stopwatch()
        training.evaluation.maybe_evaluate(step)  # benchmark_tasks every benchmark_steps (GRPO has no held-out loss)
        training.checkpoints.maybe_save(step)

    # --- finish: summary, export, card, Hub ---------------------------------------------------------------------------
    phases = ("generation", "scoring", "training") + (("weight_sync",) if run.generation_server else ())
    shares = {key: training.log.mean(f"time/{key}_share") for key in phases}
    training.finish(
        model, summary={"step_time_shares": shares, **generator.close()}
    )  # means over the logged steps (each since the last log)


if __name__ == "__main__":
    errors.exit_on_user_error(lambda: main(sys.argv[1:]))
