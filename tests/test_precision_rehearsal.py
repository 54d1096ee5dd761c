"""Every shipped Accelerate config's settings, and every recipe, under the mixed precision the GPU configs ship.

Each run is a 1-process launch of the config in this process (`run_recipe_launched_here`): the launcher's own
environment for that YAML, FSDP2 over a 1-rank gloo group, so accelerate's wrapping (autocast, the output conversion
to fp32) and FSDP2's mixed-precision policy are those a GPU launch gets. bf16 mixed precision once crashed every
recipe's first step here (the chunked loss's fp32 losses were cast to bf16 by FSDP2's output_dtype); nothing in the
suite ran mixed precision then. Configs whose rehearsable settings are the same share one run. What one process cannot
show (sharding across ranks in bf16) is the 2-process launch of tests/test_topology_rehearsal.py; what CPU cannot run
at all (FSDP1) is refused with its one line. accelerate_configs/README.md says, per config, what ran here."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from fixtures.every_recipe import TRAINING_RECIPES
from helpers.host_reads import host_reads_recorded
from helpers.kernels import kernel_packages_on_path
from helpers.paths import REPO, TOKENIZER
from helpers.recipes import base_recipe_values, launch_environment_of, read_metrics, run_recipe_launched_here

CONFIGS = sorted(path for path in (REPO / "accelerate_configs").glob("*.yaml") if path.name != "topologies.yaml")
FP32_CONFIG = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
BF16_CONFIG = REPO / "accelerate_configs" / "fsdp_8gpu.yaml"
STEPS = 3


def rehearsable_settings(config: Path) -> tuple:
    """What a 1-process launch of `config` on CPU depends on: the exported environment less the rendezvous."""
    environment = launch_environment_of(config)
    return tuple(sorted((k, v) for k, v in environment.items() if k not in ("MASTER_PORT",)))


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tiny_model_config, small_chat_data):
    """A function of a config: the output folder of its SFT run, or (exit code, `error:` lines, whether a traceback
    was printed) where the run stopped. One run per distinct rehearsable settings, run when first asked for."""
    tmp, runs = tmp_path_factory.mktemp("precision"), {}

    def run(config: Path):
        if yaml.safe_load(config.read_text()).get("mixed_precision") == "fp8":
            kernel_packages_on_path()  # torchao, which the launcher requires for fp8
        key = rehearsable_settings(config)
        if key not in runs:
            name = f"run{len(runs)}"
            values = base_recipe_values(
                tiny_model_config, small_chat_data, tmp / name, max_steps=STEPS, warmup_steps=0,
                exact_match_eval_samples=0, eval_steps=None, save_steps=None,
            )  # fmt: skip
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    run_recipe_launched_here("sft", tmp, name, values, config)
                runs[key] = tmp / name
            except SystemExit as stop:
                errors = [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]
                runs[key] = (stop.code, errors, "Traceback" in stderr.getvalue())
        return runs[key]

    return run


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_each_shipped_config_trains_and_exports_as_far_as_cpu_allows(config, sft_runs):
    raw = yaml.safe_load(config.read_text())
    result = sft_runs(config)
    fsdp = raw.get("fsdp_config", {})
    if raw["distributed_type"] == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1:
        # FSDP1 needs an accelerator device: refused before anything loads, with the way out
        code, errors, traceback = result
        assert code == 2 and not traceback and len(errors) == 1
        assert "FSDP1 cannot run on CPU" in errors[0] and "fsdp_version: 2" in errors[0]
        return
    assert isinstance(result, Path), f"{config.name}: the run stopped ({result})"
    summary = json.loads((result / "run_summary.json").read_text())
    assert summary["mixed_precision"] == raw.get("mixed_precision", "no")
    if raw["distributed_type"] == "FSDP":
        assert summary["distributed_type"] == "FSDP"
        assert summary["fsdp"]["reshard_after_forward"] == str(fsdp["fsdp_reshard_after_forward"])
        assert summary["fsdp"]["cpu_offload"] == fsdp["fsdp_offload_params"]
        assert summary["fsdp"]["activation_checkpointing"] == fsdp["fsdp_activation_checkpointing"]
    if raw.get("mixed_precision") == "fp8":  # torchao's float8 matmuls, FSDP2 gathering their weights in float8
        assert summary["float8_linear_layers"] > 0
    trained = losses(result)
    assert len(trained) == STEPS and all(math.isfinite(loss) for loss in trained)
    # against the same run in fp32: the first step's loss differs only by the compute dtype's rounding
    reference = losses(sft_runs(FP32_CONFIG))
    tolerance = {"bf16": 2e-2, "fp16": 5e-3, "fp8": 5e-2}.get(raw.get("mixed_precision"), 1e-5)
    torch.testing.assert_close(torch.tensor(trained), torch.tensor(reference), rtol=tolerance, atol=0)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(result)  # written, read back and compared by the run itself
    assert all(torch.isfinite(p).all() for p in exported.parameters())


# ------------------------------------------------------------------------------------------------- every recipe
@pytest.fixture(scope="module")
def bf16_output(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_recipes")

    def run(recipe: str, values_for) -> Path:
        output = tmp / recipe
        run_recipe_launched_here(recipe, tmp, recipe, values_for(output), BF16_CONFIG)
        return output

    return run


@pytest.mark.parametrize("recipe", TRAINING_RECIPES)
def test_every_training_recipe_runs_bf16_and_compiled_without_waiting_for_the_device(
    recipe, bf16_output, short_run_values, monkeypatch
):
    """Each recipe's own loss path under the shipped bf16, its decoder layers compiled (traced by dynamo; the eager
    backend skips code generation, which is all that differs on a GPU): 2 finite losses, the export verified by the
    recipe itself. (That a new row width recompiles a layer once, not per batch, under a launch's environment:
    tests/test_losses.py.) The same run shows that the hot path reads no tensor value on the host (each such read on
    a GPU waits for every kernel queued before it): step 2 (for GRPO the second step of a generation round) reads
    only whether the gradient norm is finite, which must be known before the update. Logging steps, generation, saves
    and the end read by design (tests/helpers/host_reads.py)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    values_for = short_run_values(recipe)
    torch._dynamo.reset()
    counters.clear()
    with host_reads_recorded(monkeypatch) as reads:
        # no held-out pass at the end: a pass without gradients is compiled anew, which costs here and shows nothing
        compiled = {"torch_compile": True, "torch_compile_backend": "eager", "eval_strategy": "no"}
        output = bf16_output(recipe, lambda out: {**values_for(out), **compiled})
    summary = json.loads((output / "run_summary.json").read_text())
    assert (summary["distributed_type"], summary["mixed_precision"]) == ("FSDP", "bf16")
    assert summary["torch_compile"] == "on (torch_compile: true)" and counters["stats"]["unique_graphs"] > 0
    trained = losses(output)
    assert len(trained) == 2 and all(math.isfinite(loss) for loss in trained)
    assert dict(reads.by_step[2]) == {"the finite-norm guard": 1}, dict(reads.by_step[2])
    torch._dynamo.reset()


def test_the_eval_recipe_scores_under_bf16(bf16_output, pretrained_tiny_model, small_chat_data):
    output = bf16_output(
        "eval",
        lambda output: dict(
            model_name_or_path=str(pretrained_tiny_model),
            dataset_name=str(small_chat_data),
            output_dir=str(output),
            max_length=64,
            per_device_eval_batch_size=4,
            max_new_tokens=4,
            max_eval_samples=8,
            metrics=["perplexity", "exact_match"],
        ),
    )
    results = json.loads((output / "eval_results.json").read_text())
    assert math.isfinite(results["eval_perplexity"]) and 0.0 <= results["eval_exact_match"] <= 1.0
    assert results["eval_samples"] == 8


def test_a_model_that_transforms_its_logits_unrecognised_stops_every_rank_with_one_error_line(
    tmp_path, tokenizer, small_chat_data, monkeypatch, capsys
):
    """A model type not known to soft-cap its logits (here Gemma-2, its entry removed from the list that recognises it
    before loading) meets the chunked loss's check at its first forward: one `error:` line starting a line of its own
    (the progress bar is open), exit 2, no traceback, no step taken."""
    from transformers import Gemma2Config

    from fsdp_recipes.train import losses as losses_module

    monkeypatch.setattr(losses_module, "_LOGITS_TRANSFORMS", {})
    model_config = tmp_path / "gemma2.json"
    Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    ).to_json_file(model_config)  # fmt: skip
    values = dict(
        model_config=str(model_config),
        tokenizer_name_or_path=str(TOKENIZER),
        dataset_name=str(small_chat_data),
        max_length=64,
        max_steps=2,
        per_device_train_batch_size=4,
        exact_match_eval_samples=0,
        output_dir=str(tmp_path / "out"),
        report_to="none",
    )
    with pytest.raises(SystemExit) as stop:
        run_recipe_launched_here("sft", tmp_path, "softcapped", values, BF16_CONFIG)
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and "Traceback" not in stderr
    assert len(errors) == 1 and "Gemma2ForCausalLM transforms the output of its output layer" in errors[0]
    assert "loss_implementation: full_logits" in errors[0]
    assert (
        not (tmp_path / "out" / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "out" / "metrics.jsonl").read_text()
    )
