"""Recipes write their training loop out on purpose (a reader sees forward, loss, backward and step), so the copies
must not drift apart: a fix in one recipe's loop must reach the others (accelerate's own examples are kept in step
the same way). Each section is compared as text."""

from __future__ import annotations

from helpers.paths import REPO


def section(recipe: str, first_line: str, last_line: str) -> list[str]:
    lines = [line.strip() for line in (REPO / "recipes" / f"{recipe}.py").read_text().splitlines()]
    start = lines.index(first_line)
    return lines[start : lines.index(last_line, start) + 1]


def test_the_token_loss_loops_are_the_same():
    loop = ("for step in training.steps():", "training.checkpoints.maybe_save(step)")
    assert section("sft", *loop) == section("pretrain", *loop)


TRAINING_RECIPES = ("sft", "pretrain", "dpo", "kto", "grpo", "reward", "distill", "classify")


def test_every_training_recipe_ends_its_steps_with_the_one_optimizer_step():
    """Clip, step, schedule, zero_grad, progress and the fault point are `training.optimizer_step`, called once per
    step of `training.steps()`; forward, loss and backward stay written out in each recipe."""
    for recipe in TRAINING_RECIPES:
        text = (REPO / "recipes" / f"{recipe}.py").read_text()
        assert text.count("grad_norm = training.optimizer_step(step, model, optimizer, scheduler)") == 1, recipe
        assert text.count("for step in training.steps():") == 1, recipe
        assert "accelerator.backward(" in text, recipe
        assert not any(
            call in text for call in ("optimizer.step()", "clip_grad_norm_(", "zero_grad(", "fault_point(")
        ), recipe


SET_UP = (  # in this order, each once, each line as written here (its start)
    "if config.gradient_checkpointing:",
    "modeling.checkpoint_activations(model, config.gradient_checkpointing_kwargs)",
    "model = adapters.apply(model, config, task=",
    "router_balance.attach(",
    "optimizer = loop.build_optimizer(model, config)",
    "accelerator.prepare(model, optimizer",
    "scheduler = loop.build_scheduler(optimizer, config, total_steps=total_steps)",
    "training = run.begin(",
)


def test_every_training_recipe_sets_up_with_the_same_lines_in_the_same_order():
    """The set-up stays inline (docs/architecture.md says why): load, activation checkpointing, LoRA, the loss and
    the router balance it carries, optimizer, prepare, schedule, begin. What differs between recipes (what is loaded,
    which loss, what else is prepared) sits between these lines; their order and wording do not drift."""
    for recipe in TRAINING_RECIPES:
        lines = [line.strip() for line in (REPO / "recipes" / f"{recipe}.py").read_text().splitlines()]
        loads = [i for i, line in enumerate(lines) if line.startswith(("model = run.load_model(", "model = load()"))]
        positions = []
        for start in SET_UP:
            found = [i for i, line in enumerate(lines) if start in line and not line.startswith("#")]
            assert len(found) == 1, (recipe, start, found)
            positions.append(found[0])
        assert len(loads) == 1 and [loads[0], *positions] == sorted([loads[0], *positions]), recipe
        assert lines[positions[0] + 1] == SET_UP[1], recipe  # checkpointing is the whole body of its `if`
