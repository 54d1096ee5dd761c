"""Float8 training (an Accelerate config with mixed_precision: fp8, torchao's backend): what is refused before
loading, and what the estimator counts. That it trains, exports and stays near fp32 on CPU is the shipped config's
1-process rehearsal in tests/test_precision_rehearsal.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from fsdp_recipes.distributed import float8
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.estimator.formulas import buffer_bytes, gathered_bytes, plan_units
from fsdp_recipes.tools.estimator.shapes import load_model_info
from helpers.paths import REPO

LLAMA_8B = REPO / "tests" / "data" / "llama-3-8b-like_config.json"


@pytest.mark.parametrize(
    "environ, use_peft, expected",
    [
        ({}, True, "mixed_precision fp8 with use_peft"),
        ({"ACCELERATE_FP8_BACKEND": "TE"}, False, "fp8_config backend TE in the Accelerate config: only AO"),
        ({"PARALLELISM_CONFIG_TP_SIZE": "2"}, False, "mixed_precision fp8 with tp_size 2: float8 training is composed"),
        ({"PARALLELISM_CONFIG_EP_SIZE": "4"}, False, "mixed_precision fp8 with ep_size 4"),
        ({"ACCELERATE_FP8_BACKEND": "AO"}, False, None),
    ],
)
def test_what_float8_is_not_composed_with_is_refused_before_loading(environ, use_peft, expected, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace())  # torchao "installed"
    problem = float8.launch_problem(environ, use_peft=use_peft)
    assert problem == expected if expected is None else problem.startswith(expected), problem


def test_float8_without_torchao_names_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert float8.launch_problem({}) == (
        "mixed_precision fp8 (float8 training) needs torchao, which is not installed: pip install -r "
        "requirements-gpu.txt (torchao==0.18.0)"
    )


@pytest.mark.parametrize("has_torchao", [False, True])
def test_validate_config_tells_a_valid_file_from_a_machine_without_torchao(has_torchao, monkeypatch, capsys):
    """The shipped fp8 file is valid wherever it is checked (exit 0); a machine without torchao (a login node) gets a
    note saying what to install before launching, and one with it gets nothing."""
    monkeypatch.setattr(float8, "torchao_missing", lambda: not has_torchao)
    config = REPO / "accelerate_configs" / "fsdp_8gpu_float8.yaml"
    assert cli.main(["validate-config", str(config)]) == 0
    out = capsys.readouterr().out
    if has_torchao:
        assert out == f"{config}: 0 error(s), 0 warning(s)\n"
        return
    assert f"{config}: note: mixed_precision: the file is valid, and this machine lacks torchao" in out
    assert out.rstrip().endswith("before any recipe starts. Before launching: pip install -r requirements-gpu.txt "
                                 f"(torchao==0.18.0)\n{config}: 0 error(s), 0 warning(s), 1 note(s) about this machine")  # fmt: skip
    assert "error:" not in out


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_without_float8_tensor_cores_is_refused(capability, refused, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    problem = float8.device_problem(torch.device("cuda", 0))
    assert (problem is not None) == refused
    if refused:
        assert "compute capability 8.9+" in problem and "A100 has 8.0" in problem and "fsdp_8gpu.yaml" in problem
    assert float8.device_problem(torch.device("cpu")) is None  # the same path runs on CPU, for rehearsals


def test_the_estimator_gathers_a_layers_linear_weights_in_one_byte_under_fp8():
    info = load_model_info(str(LLAMA_8B))
    bf16, fp8 = (
        LaunchLayout(ParallelDims(dp_shard=8), mixed_precision="bf16"),
        LaunchLayout(ParallelDims(dp_shard=8), mixed_precision="fp8"),
    )
    units = plan_units(info, fp8)
    layer = next(unit for unit in units if unit.kind == "layer")
    matrices = sum(p.numel for p in layer.params if len(p.shape) == 2)
    assert gathered_bytes(layer, fp8) == matrices + 2 * (layer.numel - matrices)  # norms stay bf16
    embedding = next(unit for unit in units if unit.kind == "embedding")
    assert gathered_bytes(embedding, fp8) == gathered_bytes(embedding, bf16) == 2 * embedding.numel  # not converted
    gathered_bf16, gathered_fp8 = buffer_bytes(info, plan_units(info, bf16), bf16), buffer_bytes(info, units, fp8)
    assert gathered_fp8["in_flight"] < gathered_bf16["in_flight"]
    assert gathered_fp8["reduce_scatter"] == gathered_bf16["reduce_scatter"]  # gradients stay in bf16


@pytest.mark.parametrize("bf16, refused", [(True, False), (None, False), (False, True)])
def test_bf16_in_a_recipe_config_agrees_with_fp8_whose_rest_runs_in_bf16(bf16, refused):
    from fsdp_recipes.train.trainer_arguments import precision_problem

    problem = precision_problem(SimpleNamespace(bf16=bf16, fp16=None), "fp8")
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("the config says bf16: false but the Accelerate config's mixed_precision is 'fp8'")
