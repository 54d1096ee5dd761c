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
    loop = ("for step in range(first_step, total_steps + 1):", "run.checkpoints.maybe_save(step)")
    assert section("sft", *loop) == section("pretrain", *loop)


def test_every_training_recipe_steps_the_same_way():
    step = ("grad_norm = (", "run.fault_point(step)")
    sft = section("sft", *step)
    assert len(sft) == 8 and "accelerator.clip_grad_norm_(" in sft[1]
    for recipe in ("pretrain", "classify", "dpo"):
        assert section(recipe, *step) == sft, recipe
