"""What stops every rank of a real 2-process launch, and says why once: an error every rank finds before any work, an
error on one rank in the middle of training, and a multi-GPU launch that degraded into independent processes. The
three jobs are short and launched side by side (one module fixture); each test reads its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.data import write_jsonl
from helpers.launch import concurrently, launch
from helpers.paths import FSDP_CPU_CONFIG, REPO, SFT
from helpers.recipes import base_recipe_values, recipe_config

pytestmark = pytest.mark.slow
SFT_CLAIMING_A_DEVICE = REPO / "tests" / "scripts" / "sft_on_a_machine_claiming_a_device.py"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model_config, chat_data) -> dict:
    """{job: (output_dir, result, seconds it took)} for the three jobs."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("bad_input", "one_rank_fails", "degraded")}

    def timed(name: str, script: Path, values: dict, **options):
        config = recipe_config(folders[name] / "recipe.yaml", **values)
        started = time.time()
        result = launch(script, ["--config", str(config)], **options)
        return Path(values["output_dir"]), result, time.time() - started

    def bad_input():
        data = write_jsonl(folders["bad_input"] / "data.jsonl", [{"text": "hello", "label": 1}] * 8)
        values = base_recipe_values(tiny_model_config, data, folders["bad_input"] / "out")
        return timed("bad_input", SFT, values, timeout=180, accelerate_config=FSDP_CPU_CONFIG)

    def one_rank_fails():
        values = base_recipe_values(
            tiny_model_config, chat_data, folders["one_rank_fails"] / "out", max_steps=40, save_steps=None
        )
        return timed("one_rank_fails", SFT, values, env={"FSDP_RECIPES_FAULT": "raise-after-step:2@1"}, timeout=180)

    def degraded():
        # Without a device a MULTI_GPU launch now runs as MULTI_CPU (tests/test_topology_rehearsal.py); the wrapper
        # makes the recipe believe a device exists, so it builds a plain Accelerator(), which accelerate leaves
        # degraded here.
        values = base_recipe_values(tiny_model_config, chat_data, folders["degraded"] / "out")
        return timed(
            "degraded",
            SFT_CLAIMING_A_DEVICE,
            values,
            accelerate_config=None,
            launcher_args=["--multi_gpu"],
            timeout=120,
        )

    jobs = {"bad_input": bad_input, "one_rank_fails": one_rank_fails, "degraded": degraded}
    return dict(zip(jobs, concurrently(*jobs.values())))


def test_an_error_every_rank_finds_stops_them_once_without_a_hang(stopped):
    """A dataset without the needed columns: a rank that failed alone would hang."""
    out, result, _ = stopped["bad_input"]
    assert result.returncode != 0, result.stdout[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-4000:]  # printed once, not once per rank
    assert "'messages'" in errors[0] and "['label', 'text']" in errors[0]
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert not out.exists()


def test_an_error_on_one_rank_stops_all_and_is_shown_once(stopped):
    _, result, seconds = stopped["one_rank_fails"]
    assert result.returncode != 0
    assert seconds < 90  # 40 steps were asked for: the other rank did not wait for them, nor hang
    assert result.stderr.count("InjectedFault: injected fault on rank 1 after step 2") == 1
    assert "[rank0]: Traceback" not in result.stderr
    assert "rank 0: stopping because another process failed" in result.stderr


def test_a_multi_gpu_launch_that_degraded_into_independent_processes_is_refused(stopped):
    out, result, _ = stopped["degraded"]
    assert result.returncode != 0
    assert "every process would train alone" in result.stderr, result.stderr[-3000:]  # the launch itself on failure
    assert not out.exists()
