"""On-policy distillation (TRL's GKD: `lmbda`, `seq_kd`) in recipes/distill.py, in this process: which steps train on
the student's own samples is drawn from (seed, step) alone; a row's prompt is its tokens before its first target; on
such a step the completions are the student's samples and the loss is KD alone; with `seq_kd` the other steps train on
the teacher's samples with the configured mix; `lmbda: 0` is today's distillation step for step; a resumed run
draws and samples what the uninterrupted one did. The 2-process run equal to one process is in the TP 2 launch of
tests/test_tensor_parallel.py."""

from __future__ import annotations

import json

from fixtures.reward_distill import distill_values
from fsdp_recipes.data.rows import collate_rows, shifted_targets
from fsdp_recipes.methods.distill import on_policy
from helpers.recipes import read_metrics, run_recipe_in_process


def test_the_on_policy_steps_are_a_share_lmbda_drawn_from_seed_and_step_alone():
    draws = [on_policy.is_on_policy_step(0.3, 7, step) for step in range(1, 2001)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03
    assert draws == [on_policy.is_on_policy_step(0.3, 7, step) for step in range(1, 2001)]  # no hidden state
    assert draws != [on_policy.is_on_policy_step(0.3, 8, step) for step in range(1, 2001)]
    assert not any(on_policy.is_on_policy_step(0.0, 7, s) for s in range(50))
    assert all(on_policy.is_on_policy_step(1.0, 7, s) for s in range(50))


def test_a_rows_prompt_is_its_tokens_before_its_first_target_and_its_key_ignores_its_place():
    rows = [
        {"input_ids": ids, "targets": shifted_targets(ids, mask), "position_ids": list(range(len(ids)))}
        for ids, mask in (([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([5, 6, 3], [0, 1, 1]))
    ]
    batch = collate_rows(rows, pad_token_id=0)
    assert on_policy.prompts_of(batch) == [[5, 6], [5]]
    assert on_policy.sampling_key(3, [5, 6]) == on_policy.sampling_key(3, [5, 6])
    assert (
        len({on_policy.sampling_key(3, [5, 6]), on_policy.sampling_key(4, [5, 6]), on_policy.sampling_key(3, [5])}) == 3
    )


def steps_of(output, key="loss") -> dict[int, float]:
    return {
        row["step"]: row[key] for row in read_metrics(output) if row.get(key) is not None and "eval_loss" not in row
    }


def test_gkd_trains_on_sampled_completions_resumes_exactly_and_lmbda_0_is_todays_distillation(
    tmp_path, student_config, pretrained_tiny_model, small_chat_data
):
    def values(name, **overrides):
        return distill_values(
            student_config, pretrained_tiny_model, small_chat_data, tmp_path / name, max_steps=3, max_new_tokens=8,
            **overrides,
        )  # fmt: skip

    run_recipe_in_process("distill", tmp_path, "default", values("default"))
    run_recipe_in_process("distill", tmp_path, "zero", values("zero", lmbda=0.0, seq_kd=False))
    assert read_metrics(tmp_path / "zero") and steps_of(tmp_path / "zero") == steps_of(tmp_path / "default")

    gkd = values("gkd", lmbda=0.26, seq_kd=True, save_steps=2)  # seed 7 draws steps 1 and 3 off, 2 on
    run_recipe_in_process("distill", tmp_path, "gkd", gkd)
    drawn = steps_of(tmp_path / "gkd", "on_policy")
    expected = {step: float(on_policy.is_on_policy_step(0.26, 7, step)) for step in (1, 2, 3)}
    assert drawn == expected == {1: 0.0, 2: 1.0, 3: 0.0}
    kd_only = steps_of(tmp_path / "gkd", "loss/ce")  # the student's samples: KD alone, no cross-entropy
    assert set(kd_only) == {step for step, value in drawn.items() if not value}  # the teacher's: the configured mix
    assert steps_of(tmp_path / "gkd") != steps_of(tmp_path / "default")
    summary = json.loads((tmp_path / "gkd" / "run_summary.json").read_text())
    assert "KD alone on the student's samples" in summary["loss"] and "teacher's samples" in summary["loss"]

    checkpoint = tmp_path / "gkd" / "checkpoints" / "step-00000002"
    resumed = {**gkd, "output_dir": str(tmp_path / "resumed"), "resume_from_checkpoint": str(checkpoint)}
    run_recipe_in_process("distill", tmp_path, "resumed", resumed)
    assert steps_of(tmp_path / "resumed")[3] == steps_of(tmp_path / "gkd")[3]
