"""Tensor, expert and context parallelism in an Accelerate config's parallelism_config, checked by `fsdp-recipes
validate-config` and by a recipe at start-up (every rank, before any weights load): TP layouts are read (sizes named,
what the transformers route cannot honour refused with the reason, the model's sizes checked), CP is refused
(docs/parallelism.md). All in this process: the TP runs themselves are in tests/test_tensor_parallel.py.

The last test checks why accelerate's own TP preparation is bypassed: when it stops importing the class transformers
removed, it fails and says to revisit fsdp_recipes.distributed.tensor_parallel."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.launch_checks import (
    ERROR,
    check_launch_environment,
    exported_environment,
    lint_launch_environment,
)
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.linter import lint_config_file
from fsdp_recipes.tools.topology import CONFIG_DIR
from helpers.recipes import base_recipe_values, recipe_error_in_process

TP_KEY = "parallelism_config.parallelism_config_tp_size"
CP_KEY = "parallelism_config.parallelism_config_cp_size"


def config_with(tmp_path: Path, name: str, num_processes: int, **sizes) -> Path:
    """The shipped 4-process CPU HSDP config with other parallelism_config sizes."""
    raw = yaml.safe_load((CONFIG_DIR / "hsdp_4proc_cpu.yaml").read_text())
    raw["num_processes"] = num_processes
    raw["parallelism_config"] = {f"parallelism_config_{key}_size": value for key, value in sizes.items()}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def errors_of(findings) -> dict[str, str]:
    return {f.key: f.message for f in findings if f.severity == ERROR}


def test_fsdp_times_tp_is_a_layout_that_runs_and_the_shipped_tp_configs_lint_clean(tmp_path, capsys):
    path = config_with(tmp_path, "fsdp2_tp2.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    assert errors_of(lint_config_file(path)) == {}
    for name in ("tp_2proc_cpu.yaml", "fsdp2_tp2_4proc_cpu.yaml", "tp8_fsdp_2x8gpu.yaml", "tp8_hsdp_4x8gpu.yaml"):
        assert cli.main(["validate-config", str(CONFIG_DIR / name)]) == 0, capsys.readouterr().out
        assert check_launch_environment(exported_environment(CONFIG_DIR / name)) == []


@pytest.mark.parametrize(
    "fsdp_change, named",
    [
        ({"fsdp_offload_params": True}, "fsdp_offload_params"),
        ({"fsdp_activation_checkpointing": True}, "gradient_checkpointing: true"),
        ({"fsdp_reshard_after_forward": False}, "SHARD_GRAD_OP"),
        ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, "fsdp_plan"),
        ({"fsdp_version": 1}, "fsdp_version: 2"),
    ],
)
def test_what_the_tp_route_cannot_honour_is_refused_with_its_fix(tmp_path, fsdp_change, named):
    raw = yaml.safe_load((CONFIG_DIR / "fsdp2_tp2_4proc_cpu.yaml").read_text())
    raw["fsdp_config"].update(fsdp_change)
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(raw))
    errors = errors_of(lint_config_file(path))
    assert named in errors.get(TP_KEY, "") + errors.get("fsdp_config.fsdp_version", "") + str(errors), errors


def test_fp16_under_tp_is_refused():
    environment = exported_environment(CONFIG_DIR / "fsdp2_tp2_4proc_cpu.yaml") | {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert "use bf16" in errors_of(lint_launch_environment(environment))[TP_KEY]


def test_the_estimator_and_the_catalog_read_tp_layouts_and_refuse_cp(tmp_path):
    hsdp_tp = LaunchLayout.from_file(config_with(tmp_path, "hsdp_tp.yaml", 8, dp_replicate=2, dp_shard=2, tp=2, cp=1))
    parallel = hsdp_tp.parallel
    assert (parallel.tp, parallel.shard_size, parallel.data_parallel_size, parallel.hsdp_replicas) == (2, 2, 4, 2)
    assert "2 replicas x 2 shards) x TP 2" in hsdp_tp.describe()
    with pytest.raises(ConfigError, match=r"dp_replicate_size 2 x dp_shard_size 2 x tp_size 2 != num_processes 16"):
        LaunchLayout.from_file(config_with(tmp_path, "bad.yaml", 16, dp_replicate=2, dp_shard=2, tp=2, cp=1))
    with pytest.raises(ConfigError, match=r"context parallelism \(cp_size 8\) is not supported"):
        LaunchLayout.from_file(config_with(tmp_path, "cp8.yaml", 8, dp_shard=1, cp=8))
    assert LaunchLayout.from_file(CONFIG_DIR / "tp8_fsdp_2x8gpu.yaml").parallel.shard_size == 2


def test_sizes_that_do_not_multiply_to_the_processes_name_every_dimension(tmp_path):
    path = config_with(tmp_path, "tp_wrong.yaml", 8, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    message = errors_of(lint_config_file(path))["parallelism_config"]
    assert "dp_shard 2 x tp 2 = 4 processes, but the launch has 8" in message
    assert "parallelism_config_tp_size = 8" in message


def test_validate_config_with_a_model_names_what_tp_cannot_split(tmp_path, tokenizer):
    from helpers.data import write_tiny_model_config

    path = config_with(tmp_path, "fsdp2_tp2.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1)
    fits = write_tiny_model_config(tmp_path / "fits.json", tokenizer, vocab_size=104)
    odd = write_tiny_model_config(tmp_path / "odd.json", tokenizer, vocab_size=104, intermediate_size=129)
    assert errors_of(lint_config_file(path, model=str(fits))) == {}
    assert "does not divide Llama's intermediate_size 129" in errors_of(lint_config_file(path, model=str(odd)))[TP_KEY]


def test_a_model_tp_cannot_split_is_named_with_its_numbers(tmp_path, tokenizer):
    from transformers import AutoConfig, GPT2Config, LlamaForCausalLM

    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.distributed.tensor_parallel import model_problems
    from fsdp_recipes.models.modeling import model_class_for
    from helpers.data import write_tiny_model_config

    config = AutoConfig.from_pretrained(write_tiny_model_config(tmp_path / "c.json", tokenizer, vocab_size=104))
    assert model_class_for(config, "causal-lm") is LlamaForCausalLM
    assert model_problems(ParallelDims(tp=2), config, LlamaForCausalLM) == []
    (problem,) = model_problems(ParallelDims(tp=3), config, LlamaForCausalLM)
    assert "tp_size 3 does not divide Llama's num_attention_heads 4, num_key_value_heads 2" in problem
    assert "intermediate_size 128, vocab_size 104:" in problem
    no_plan = model_problems(ParallelDims(tp=2), GPT2Config(), model_class_for(GPT2Config(), "causal-lm"))
    assert len(no_plan) == 1 and "has no tensor-parallel plan" in no_plan[0], no_plan


def test_context_parallelism_needs_cuda_on_this_machine_and_is_not_wired_anywhere(tmp_path):
    path = config_with(tmp_path, "cp8.yaml", 8, dp_replicate=1, dp_shard=1, tp=1, cp=8)
    offline = errors_of(lint_config_file(path))
    assert list(offline) == [CP_KEY]  # cp alone gives FSDP a dimension to shard over: no dp_shard error
    assert "set parallelism_config_sp_size" in offline[CP_KEY]  # what splits rows here: sequence parallelism
    environment = exported_environment(path)
    on_cpu = errors_of(lint_launch_environment(environment, has_cuda=False))[CP_KEY]
    assert on_cpu.startswith("context parallelism needs CUDA: cp_size 8")
    assert "_scaled_dot_product_flash_attention_for_cpu" in on_cpu
    on_gpu = errors_of(lint_launch_environment(environment, has_cuda=True))[CP_KEY]
    assert "needs CUDA" not in on_gpu and "not supported" in on_gpu
    assert check_launch_environment(exported_environment(CONFIG_DIR / "hsdp_4proc_cpu.yaml")) == []


@pytest.mark.parametrize(
    "sizes, expected",
    [
        (
            {"TP": "2", "DP_SHARD": "1"},
            "error: the Accelerate config: parallelism_config.parallelism_config_tp_size: tensor parallelism runs with "
            "FSDP2 around it",
        ),
        (
            {"CP": "2"},
            "error: the Accelerate config: parallelism_config.parallelism_config_cp_size: context "
            "parallelism needs CUDA: cp_size 2",
        ),
    ],
)
def test_sft_refuses_tp_without_fsdp2_and_cp_before_loading(
    sizes, expected, tmp_path, tiny_model_config, chat_data, capsys, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name}_SIZE", size)
    values = base_recipe_values(tiny_model_config, chat_data, tmp_path / "out")
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert error.startswith(expected), error
    assert not (tmp_path / "out").exists()


def test_the_reason_for_bypassing_accelerates_tensor_parallelism_still_holds():
    """accelerate's FSDP2 + TP preparation imports a class transformers no longer has, so TP goes through
    transformers' DistributedConfig and accelerate wraps nothing. If this fails, the pinned versions changed: revisit
    fsdp_recipes.distributed.tensor_parallel (docs/parallelism.md)."""
    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in inspect.getsource(
        Accelerator._prepare_tp
    )
    with pytest.raises(ImportError):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401


# --- expert parallelism --------------------------------------------------------------------------------------------
EP_KEY = "parallelism_config.parallelism_config_ep_size"
DEMO_MOE = Path(__file__).resolve().parents[1] / "demo" / "tiny_qwen3_moe.json"  # 8 routed experts


def test_ep_reaches_the_processes_from_the_launched_file_and_its_mesh_rules_are_checked(tmp_path, monkeypatch):
    from fsdp_recipes.distributed import expert_parallel, tensor_parallel
    from fsdp_recipes.distributed.parallel_dims import ParallelDims

    shipped = CONFIG_DIR / "fsdp2_tp2_ep2_4proc_cpu.yaml"
    environment = exported_environment(shipped)  # what each rank sees once it has read the file itself
    assert environment["PARALLELISM_CONFIG_EP_SIZE"] == "2" and check_launch_environment(environment) == []
    layout = ParallelDims.from_environment(environment)
    assert (layout.dp_shard, layout.tp, layout.ep) == (2, 2, 2)
    assert tensor_parallel.layout_text(layout) == "fsdp 2 x tp 2 x ep 2"
    assert LaunchLayout.from_file(shipped).parallel.ep == 2
    # the carrier: the variable when a launcher set it, else the file of the `accelerate launch` above this process
    monkeypatch.setattr(expert_parallel, "launching_config_file", lambda: shipped)
    launched = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    assert expert_parallel.export_launched_size(launched) == 2 and launched["PARALLELISM_CONFIG_EP_SIZE"] == "2"
    assert expert_parallel.export_launched_size({"PARALLELISM_CONFIG_EP_SIZE": "4"}) == 4
    assert expert_parallel.export_launched_size({}) == 1  # no parallelism_config: no ep, whatever a file says
    assert expert_parallel._is_accelerate_launch(
        ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file"]
    )
    assert expert_parallel._is_accelerate_launch(["python", "-m", "accelerate.commands.launch"])
    assert not expert_parallel._is_accelerate_launch(["torchrun", "--nproc_per_node", "4", "recipes/sft.py"])
    launched = ["/venv/bin/accelerate", "launch", "--config_file=a.yaml", "recipes/sft.py", "--config", "b.yaml"]
    assert expert_parallel.launched_config_option(launched) == "a.yaml"
    assert expert_parallel.launched_config_option(["accelerate", "launch", "recipes/sft.py"]) is None
    # transformers' mesh rules: ep a multiple of tp, dividing fsdp x tp
    path = config_with(tmp_path, "ep3.yaml", 4, dp_replicate=1, dp_shard=2, tp=2, cp=1, ep=3)
    message = errors_of(lint_config_file(path))[TP_KEY]
    assert "parallelism_config_ep_size 3 is not a multiple of parallelism_config_tp_size 2" in message
    assert "does not divide dp_shard x tp = 4" in message
    ep_alone = config_with(tmp_path, "ep8.yaml", 4, dp_replicate=1, dp_shard=4, tp=1, cp=1, ep=8)
    assert "does not divide dp_shard x tp = 4" in errors_of(lint_config_file(ep_alone))[EP_KEY]
    misspelled = config_with(tmp_path, "ep_key.yaml", 4, dp_replicate=1, dp_shard=4, tp=1, cp=1)
    raw = yaml.safe_load(misspelled.read_text())
    raw["parallelism_config"]["ep_size"] = 4
    misspelled.write_text(yaml.safe_dump(raw))
    assert (
        "the keys need the prefix: parallelism_config_ep_size"
        in errors_of(lint_config_file(misspelled))["parallelism_config.ep_size"]
    )


def test_ep_on_a_dense_model_or_one_whose_experts_it_does_not_divide_is_refused_with_the_numbers(tmp_path, tokenizer):
    from helpers.data import write_tiny_model_config

    path = config_with(tmp_path, "fsdp4_ep4.yaml", 4, dp_replicate=1, dp_shard=4, tp=1, cp=1, ep=4)
    assert errors_of(lint_config_file(path, model=str(DEMO_MOE))) == {}
    dense = write_tiny_model_config(tmp_path / "dense.json", tokenizer)
    assert "on Llama, a dense model (no routed experts)" in errors_of(lint_config_file(path, model=str(dense)))[EP_KEY]
    six = tmp_path / "six.json"
    six.write_text(DEMO_MOE.read_text().replace('"num_local_experts": 8', '"num_local_experts": 6'))
    message = errors_of(lint_config_file(path, model=str(six)))[EP_KEY]
    assert "parallelism_config_ep_size 4 does not divide Qwen3Moe's 6 routed experts" in message


def test_lora_an_adapter_or_an_unsplittable_model_under_a_running_tp_or_ep_layout_is_refused_with_the_fix(
    tiny_model_config,
):
    """The check every recipe runs on its ranks before loading (run.checks.TENSOR_PARALLEL), on the layout a TP/EP
    launch carries; each problem is named with its way out."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.run import checks

    dense = AutoConfig.from_pretrained(tiny_model_config)
    layouts = {"tp": ParallelDims(tp=2), "ep": ParallelDims(dp_shard=2, ep=2)}

    def problems(layout, config, **options):
        facts = checks.BeforeLoading(
            config=config, parallel=layouts[layout], model_config=dense, task="causal-lm", recipe="sft",
            accelerator=None, attn_implementation="sdpa", **options,
        )  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            checks.run_checks([checks.TENSOR_PARALLEL], facts)
        return str(refused.value)

    assert "use_peft under tp 2" in problems("tp", SimpleNamespace(use_peft=True)) and "train LoRA with FSDP alone" in (
        problems("tp", SimpleNamespace(use_peft=True))
    )
    assert "merge it first (fsdp-recipes export)" in problems("tp", SimpleNamespace(), adapter=True)
    assert "a dense model (no routed experts)" in problems("ep", SimpleNamespace())


def test_every_shipped_config_gives_one_layout_offline_and_from_what_its_launcher_exports():
    """The two ways ParallelDims is built agree: from the YAML (linter, estimator, ls, rehearse) and from the
    variables accelerate's own launcher code exports for it (what each rank reads at start-up), with the per-node
    count torchrun adds. The launches themselves record theirs in run_summary.json (tests/test_hsdp.py and the
    four-process fixture compare it with this one)."""
    from fsdp_recipes.distributed.accelerate_config import read_accelerate_yaml
    from fsdp_recipes.distributed.parallel_dims import ParallelDims

    shipped = sorted(path for path in CONFIG_DIR.glob("*.yaml") if path.name != "topologies.yaml")
    assert len(shipped) > 20
    seen = set()
    for path in shipped:
        raw = read_accelerate_yaml(path)
        offline = ParallelDims.from_accelerate_config(raw)
        environment = exported_environment(path)
        machines = int(raw.get("num_machines", 1) or 1)
        environment["LOCAL_WORLD_SIZE"] = str(int(environment["WORLD_SIZE"]) // machines)
        live = ParallelDims.from_environment(environment)
        assert live == offline, path.name
        assert offline.world_size == int(raw.get("num_processes", 1)) or raw.get("distributed_type") == "NO"
        assert LaunchLayout.from_file(path).parallel == offline, path.name
        seen.add((offline.dp_replicate > 1, offline.dp_shard > 1, offline.tp > 1, offline.ep > 1, offline.sp > 1))
    assert len(seen) >= 7  # DDP, FSDP, HSDP, TP, TP x EP, EP, SP among them


def test_the_layouts_derived_sizes():
    from fsdp_recipes.distributed.parallel_dims import ParallelDims

    hsdp_tp = ParallelDims(dp_replicate=2, dp_shard=2, tp=8)
    assert (hsdp_tp.world_size, hsdp_tp.data_parallel_size, hsdp_tp.batch_sharing_size) == (32, 4, 8)
    assert (hsdp_tp.shard_size, hsdp_tp.fsdp_size, hsdp_tp.hsdp_replicas) == (2, 4, 2)
    assert [hsdp_tp.data_parallel_rank(rank) for rank in (0, 7, 8, 31)] == [0, 0, 1, 3]
    sp = ParallelDims(dp_shard=4, sp=8)
    assert (sp.world_size, sp.data_parallel_size, sp.shard_size, sp.fsdp_size, sp.hsdp_replicas) == (
        32,
        4,
        32,
        32,
        None,
    )
    ddp = ParallelDims(dp_replicate=8)
    assert (ddp.shard_size, ddp.hsdp_replicas, ddp.data_parallel_size, ddp.sharded_layers) == (1, None, 8, False)
    assert ParallelDims(dp_shard=8, ep=8).sharded_layers and ParallelDims(dp_shard=8, ep=8).world_size == 8
    assert ParallelDims.fsdp1("HYBRID_SHARD", 16, 2) == ParallelDims(dp_replicate=2, dp_shard=8)
    assert ParallelDims.fsdp1("3", 8, 1) == ParallelDims(dp_replicate=8)  # NO_SHARD by its number


def test_the_checks_before_loading_are_named_each_answers_alone_and_the_first_problem_stops(tiny_model_config):
    """run/checks.py: each check applies to a layout or not and names its problem; run_checks lists those that ran."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.run import checks

    names = [check.name for check in checks.TRAINING]
    assert len(names) == len(set(names)) and {check.name for check in checks.EVALUATION} <= set(names)
    model_config = AutoConfig.from_pretrained(tiny_model_config)
    config = SimpleNamespace(sequence_split_problem=lambda: "a reason", generation_backend="generate")

    def facts(parallel, attn="sdpa"):
        return checks.BeforeLoading(
            config=config, parallel=parallel, model_config=model_config, task="causal-lm", recipe="sft",
            accelerator=None, attn_implementation=attn,
        )  # fmt: skip

    layout_checks = [checks.TENSOR_PARALLEL, checks.SEQUENCE_PARALLEL, checks.SEQUENCE_SPLIT, checks.GENERATION_BACKEND]
    assert checks.run_checks(layout_checks, facts(ParallelDims(dp_shard=4))) == ["generation_backend"]
    with pytest.raises(ConfigError, match="^under sequence parallelism: a reason$"):
        checks.run_checks(layout_checks, facts(ParallelDims(dp_shard=2, sp=2)))
    with pytest.raises(ConfigError, match="sequence parallelism wraps sdpa attention, not eager"):  # the first wins
        checks.run_checks(layout_checks, facts(ParallelDims(dp_shard=2, sp=2), attn="eager"))
    config.sequence_split_problem = lambda: None
    ran = checks.run_checks(layout_checks, facts(ParallelDims(dp_shard=2, sp=2)))
    assert ran == ["sequence_parallel", "sequence_split", "generation_backend"]
