"""A training run, from the launch to the exported folder, for any recipe: what a recipe does not need to see.

    run = run_lib.start(config, name="sft")        accelerator, seed, every check that needs no weights (all ranks
                                                    together), tokenizer and model config
    ... data, model, accelerator.prepare ...
    training = run.begin(model, train_loader, scheduler, total_steps=..., evaluator=...)
                                                    resume, run summary, metrics log, trackers; then the components
                                                    that decide their own cadence, all built here:
                                                    training.metrics (logging), training.evaluation (the recipe's
                                                    evaluator), training.checkpoints (saves)
    for step in training.steps(): ... training.optimizer_step(...) ...
    training.finish(model, results={...})         final metrics, curves, export (read back and compared), card, Hub

Nothing here knows a particular recipe: the recipe passes its name, its task (causal LM or sequence classification)
and its config, a `TrainingConfig` subclass.

Modules: `starting` (`start`, `start_evaluation`: the accelerator and the checks before loading), `runs` (`StartedRun`,
`EvaluationRun`, `Run` with `begin`), `training_loop` (`TrainingLoop`: the loop's parts, `optimizer_step`, `finish`).
"""

# The one re-export spot: the names recipes call as `run_lib.<name>`; everything else is imported from its module.
from fsdp_recipes.run.runs import EvaluationRun, Run, StartedRun
from fsdp_recipes.run.starting import start, start_evaluation
from fsdp_recipes.run.training_loop import TrainingLoop

__all__ = ["EvaluationRun", "Run", "StartedRun", "TrainingLoop", "start", "start_evaluation"]
