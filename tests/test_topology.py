"""Generated Accelerate configs and the config linter, without launching anything (no GPU needed).

The environment a config yields is computed by accelerate's own launcher code, so these tests would catch a config
that accelerate reads differently from what topologies.yaml says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.distributed.launch_checks import (
    ERROR,
    WARNING,
    check_launch_environment,
    exported_environment,
    lint_launch_environment,
)
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.linter import lint_config_file
from fsdp_recipes.tools.topology import CONFIG_DIR, cluster_config, load_topologies, stale_files
from helpers.data import write_tiny_model_config
from helpers.kernels import kernel_packages_on_path
from helpers.paths import REPO

TOPOLOGIES = load_topologies()
BY_FILE = {t.file: t for t in TOPOLOGIES}
CPU_CONFIG = CONFIG_DIR / "fsdp_2proc_cpu.yaml"

# What each shipped file must make the launcher export: written by hand, not derived from topologies.yaml.
EXPECTED_ENVIRONMENT = {
    "fsdp_8gpu_float8.yaml": {
        "ACCELERATE_MIXED_PRECISION": "fp8",
        "ACCELERATE_FP8_BACKEND": "AO",
        "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "1",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    },
    "fsdp_8gpu.yaml": {
        "WORLD_SIZE": "8",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_OFFLOAD_PARAMS": "false",
    },
    "fsdp_8gpu_fp16.yaml": {"WORLD_SIZE": "8", "ACCELERATE_MIXED_PRECISION": "fp16"},
    "fsdp_8gpu_shard_grad_op.yaml": {"WORLD_SIZE": "8", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"},
    "ddp_8gpu.yaml": {"WORLD_SIZE": "8", "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": None},
    "fsdp_8gpu_offload.yaml": {"FSDP_OFFLOAD_PARAMS": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false"},
    "fsdp_8gpu_activation_checkpointing.yaml": {
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
    },
    "fsdp1_8gpu.yaml": {"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_USE_ORIG_PARAMS": "true"},
    "fsdp_2x8gpu.yaml": {
        "WORLD_SIZE": "16",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "ACCELERATE_USE_PARALLELISM_CONFIG": None,
    },
    "fsdp_4x8gpu.yaml": {"WORLD_SIZE": "32"},
    "hsdp_2x8gpu.yaml": {
        "WORLD_SIZE": "16",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8",
    },
    "fsdp_2proc_cpu.yaml": {
        "WORLD_SIZE": "2",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "ACCELERATE_MIXED_PRECISION": "no",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": None,
    },
    "hsdp_4proc_cpu.yaml": {
        "WORLD_SIZE": "4",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "ACCELERATE_MIXED_PRECISION": "no",
    },
    "single_gpu.yaml": {"WORLD_SIZE": "1", "ACCELERATE_USE_FSDP": None},
}


# --- generation ----------------------------------------------------------------------------------------------------
def test_the_required_topologies_are_shipped():
    assert set(EXPECTED_ENVIRONMENT) <= set(BY_FILE)
    assert {path.name for path in CONFIG_DIR.glob("*.yaml")} == set(BY_FILE) | {"topologies.yaml"}


def test_checked_in_files_are_exactly_the_generator_output():
    assert stale_files() == [], "run `fsdp-recipes configs generate` and commit the result"


def test_check_fails_on_a_stale_file_and_generate_repairs_it(tmp_path, capsys):
    config_dir = tmp_path / "accelerate_configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    assert cli.main(["configs", "generate", "--check", "--config-dir", str(config_dir)]) == 0
    edited = config_dir / "fsdp_8gpu.yaml"
    edited.write_text(edited.read_text().replace("fsdp_offload_params: false", "fsdp_offload_params: true"))
    (config_dir / "fsdp_4x8gpu.yaml").unlink()
    assert cli.main(["configs", "generate", "--check", "--config-dir", str(config_dir)]) == 1
    err = capsys.readouterr().err
    assert "fsdp_8gpu.yaml" in err and "fsdp_4x8gpu.yaml" in err and "fsdp-recipes configs generate" in err
    assert cli.main(["configs", "generate", "--config-dir", str(config_dir)]) == 0
    assert cli.main(["configs", "generate", "--check", "--config-dir", str(config_dir)]) == 0
    assert edited.read_text() == (CONFIG_DIR / "fsdp_8gpu.yaml").read_text()


@pytest.mark.parametrize("name", sorted(BY_FILE))
def test_each_file_starts_with_its_launch_command_and_round_trips_through_accelerate(name):
    path = CONFIG_DIR / name
    text = path.read_text()
    header = text.split("\ncompute_environment:")[0]
    assert all(line.startswith("#") for line in header.splitlines())
    assert f"accelerate launch --config_file accelerate_configs/{name}" in header
    assert BY_FILE[name].purpose in header
    loaded = load_config_from_file(str(path))  # accelerate's loader: raises on unknown top-level keys
    assert loaded.to_dict() == cluster_config(BY_FILE[name].layout()).to_dict()
    # and the one reader of Accelerate configs reads back the layout the entry produced
    assert LaunchLayout.from_file(path) == BY_FILE[name].layout()


@pytest.mark.parametrize("name", sorted(EXPECTED_ENVIRONMENT))
def test_each_file_makes_the_launcher_export_the_expected_environment(name):
    if name == "fsdp_8gpu_float8.yaml":
        kernel_packages_on_path()  # the launcher requires torchao for fp8
    environment = exported_environment(CONFIG_DIR / name)
    for key, value in EXPECTED_ENVIRONMENT[name].items():
        assert environment.get(key) == value, (key, environment)


def test_multi_node_files_start_eight_processes_per_node():
    for name, nodes in [("fsdp_2x8gpu.yaml", 2), ("fsdp_4x8gpu.yaml", 4), ("hsdp_2x8gpu.yaml", 2)]:
        raw = yaml.safe_load((CONFIG_DIR / name).read_text())
        assert (raw["num_machines"], raw["num_processes"] // raw["num_machines"]) == (nodes, 8)
        assert "--rdzv_backend c10d" in raw_header(name) and "--machine_rank" in raw_header(name)


def raw_header(name: str) -> str:
    return (CONFIG_DIR / name).read_text().split("\ncompute_environment:")[0]


@pytest.mark.parametrize(
    "name",
    [
        "fsdp_8gpu.yaml",
        "fsdp_8gpu_shard_grad_op.yaml",
        "fsdp_8gpu_offload.yaml",
        "fsdp_8gpu_activation_checkpointing.yaml",
        "hsdp_4proc_cpu.yaml",
    ],
)
def test_fsdp2_plugin_built_from_the_exported_environment_has_the_topologys_settings(name, monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin

    for key, value in exported_environment(CONFIG_DIR / name).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    topology = BY_FILE[name]
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (topology.sharding != "SHARD_GRAD_OP")
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is topology.cpu_offload
    assert plugin.activation_checkpointing is topology.activation_checkpointing
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.transformer_cls_names_to_wrap is None  # the model's _no_split_modules


def test_topologies_file_errors_are_reported_together_with_the_fix(tmp_path):
    source = tmp_path / "topologies.yaml"
    source.write_text(
        yaml.safe_dump(
            {
                "topologies": [
                    {"file": "a.yaml", "purpose": "p", "when": "w", "sharding": "HYBRID_SHARD", "nodes": 2},
                    {"file": "b.yaml", "purpose": "p", "when": "w", "mixed_precison": "bf16"},
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as raised:
        load_topologies(source)
    message = str(raised.value)
    assert "HYBRID_SHARD needs hsdp_replicate" in message
    assert "unknown key 'mixed_precison'; did you mean 'mixed_precision'?" in message


# --- the linter ----------------------------------------------------------------------------------------------------
def cpu_config(**fsdp_changes) -> dict:
    raw = yaml.safe_load(CPU_CONFIG.read_text())
    for key, value in fsdp_changes.items():
        if value is None:
            raw["fsdp_config"].pop(key)
        else:
            raw["fsdp_config"][key] = value
    return raw


def lint(tmp_path: Path, raw: dict, **options):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, lint_config_file(path, **options)


def only(findings, severity, key):
    matches = [f for f in findings if f.severity == severity and f.key == key]
    assert len(matches) == 1, findings
    return matches[0].message


@pytest.mark.parametrize("name", sorted(BY_FILE))
def test_every_shipped_file_passes_the_linter_without_a_finding(name, tmp_path, tokenizer):
    # a model every shipped layout can split: TP 8 divides its heads, KV heads, MLP width and vocabulary
    model = write_tiny_model_config(
        tmp_path / "config.json", tokenizer, num_attention_heads=8, num_key_value_heads=8, vocab_size=104
    )
    if BY_FILE[name].ep > 1:  # expert parallelism needs a mixture of experts: 8 routed experts, EP 8 divides them
        moe = json.loads((REPO / "demo" / "tiny_qwen3_moe.json").read_text())
        moe |= {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}
        (model := tmp_path / "moe.json").write_text(json.dumps(moe))
    if BY_FILE[name].mixed_precision == "fp8":
        kernel_packages_on_path()  # the launcher requires torchao for fp8
    assert lint_config_file(CONFIG_DIR / name, model=str(model)) == []


def test_misspelled_fsdp_keys_are_errors_naming_the_closest_key(tmp_path, capsys):
    raw = cpu_config(fsdp_offload_params=None, fsdp_backward_prefetch_policy="BACKWARD_PRE", fsdp_ofload_params=True)
    path, findings = lint(tmp_path, raw)
    assert "did you mean 'fsdp_offload_params'?" in only(findings, ERROR, "fsdp_config.fsdp_ofload_params")
    assert "did you mean 'fsdp_backward_prefetch'?" in only(
        findings, ERROR, "fsdp_config.fsdp_backward_prefetch_policy"
    )
    assert cli.main(["validate-config", str(path)]) == 1
    assert "drops it without a word" in capsys.readouterr().out


def test_mixed_precision_inside_fsdp_config_points_to_the_top_level_key(tmp_path):
    _, findings = lint(tmp_path, cpu_config(fsdp_mixed_precision="bf16"))
    assert "top-level mixed_precision" in only(findings, ERROR, "fsdp_config.fsdp_mixed_precision")


def test_keys_fsdp2_ignores_are_warnings_and_exit_zero(tmp_path):
    raw = cpu_config(fsdp_sharding_strategy="SHARD_GRAD_OP", fsdp_use_orig_params=False)
    path, findings = lint(tmp_path, raw)
    assert "fsdp_reshard_after_forward" in only(findings, WARNING, "fsdp_config.fsdp_sharding_strategy")
    assert "always uses the original parameters" in only(findings, WARNING, "fsdp_config.fsdp_use_orig_params")
    assert not [f for f in findings if f.severity == ERROR]
    assert cli.main(["validate-config", str(path)]) == 0


def test_a_strategy_name_under_fsdp2_reshard_key_is_an_error(tmp_path):
    _, findings = lint(tmp_path, cpu_config(fsdp_reshard_after_forward="SHARD_GRAD_OP"))
    assert "write true (FULL_SHARD) or false" in only(findings, ERROR, "fsdp_config.fsdp_reshard_after_forward")


def test_fsdp1_strategy_under_the_reshard_key_is_an_error_naming_the_right_key(tmp_path):
    raw = cpu_config(fsdp_version=1, fsdp_reshard_after_forward="SHARD_GRAD_OP")
    _, findings = lint(tmp_path, raw)
    assert "write fsdp_sharding_strategy: SHARD_GRAD_OP" in only(
        findings, ERROR, "fsdp_config.fsdp_reshard_after_forward"
    )


def test_implicit_no_wrap_is_an_error(tmp_path):
    _, findings = lint(tmp_path, cpu_config(fsdp_auto_wrap_policy=None))
    assert "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP" in only(findings, ERROR, "fsdp_config.fsdp_auto_wrap_policy")
    _, explicit = lint(tmp_path, cpu_config(fsdp_auto_wrap_policy="NO_WRAP"))
    assert explicit == []


def test_hsdp_sizes_that_do_not_match_the_world_size_are_an_error(tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "hsdp_2x8gpu.yaml").read_text())
    raw["num_processes"] = 8  # the per-node count written where the global count belongs
    _, findings = lint(tmp_path, raw)
    message = only(findings, ERROR, "parallelism_config")
    assert "dp_replicate 2 x dp_shard 8 = 16 processes, but the launch has 8" in message


def test_unprefixed_hsdp_keys_and_uneven_nodes_are_errors(tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "hsdp_2x8gpu.yaml").read_text())
    raw["parallelism_config"] = {"dp_replicate_size": 2, "dp_shard_size": 8}
    raw["num_processes"] = 15
    _, findings = lint(tmp_path, raw)
    assert "parallelism_config_dp_replicate_size" in only(findings, ERROR, "parallelism_config.dp_replicate_size")
    assert "GLOBAL count" in only(findings, ERROR, "num_processes")


def test_what_the_launcher_itself_refuses_is_an_error(tmp_path):
    _, findings = lint(tmp_path, cpu_config(fsdp_sync_module_states=False, fsdp_cpu_ram_efficient_loading=None))
    assert "fsdp_sync_module_states: true" in only(findings, ERROR, "fsdp_config.fsdp_sync_module_states")


def test_wrap_class_the_model_lacks_is_an_error_naming_the_models_class(tmp_path, tokenizer):
    model = write_tiny_model_config(tmp_path / "config.json", tokenizer)
    path, findings = lint(tmp_path, cpu_config(fsdp_transformer_layer_cls_to_wrap="GPT2Block"), model=str(model))
    message = only(findings, ERROR, "fsdp_config.fsdp_transformer_layer_cls_to_wrap")
    assert "GPT2Block not in this llama model; set it to LlamaDecoderLayer" in message
    assert cli.main(["validate-config", str(path), "--model", str(model)]) == 1
    assert cli.main(["validate-config", str(path)]) == 0  # without a model there is nothing to check it against


def test_tied_embeddings_that_a_wrap_policy_would_split_are_reported(tmp_path, tokenizer):
    tied = str(write_tiny_model_config(tmp_path / "tied.json", tokenizer, tie_word_embeddings=True))
    untied = str(write_tiny_model_config(tmp_path / "untied.json", tokenizer))
    by_class = cpu_config(fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer,Embedding")
    _, findings = lint(tmp_path, by_class, model=tied)
    assert "share one weight" in only(findings, ERROR, "fsdp_config.fsdp_transformer_layer_cls_to_wrap")
    by_size = cpu_config(fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=1000)
    _, findings = lint(tmp_path, by_size, model=tied)
    assert "use TRANSFORMER_BASED_WRAP" in only(findings, WARNING, "fsdp_config.fsdp_auto_wrap_policy")
    assert lint(tmp_path, by_size, model=untied)[1] == []
    assert lint(tmp_path, cpu_config(), model=tied)[1] == []  # decoder layers only: both stay in the root unit


# --- the same checks at recipe start-up ------------------------------------------------------------------------------
def test_start_up_check_raises_on_the_launch_environment_of_a_bad_config(tmp_path):
    path = tmp_path / "no_wrap.yaml"
    path.write_text(yaml.safe_dump(cpu_config(fsdp_auto_wrap_policy=None)))
    with pytest.raises(ConfigError, match="fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"):
        check_launch_environment(exported_environment(path))
    assert check_launch_environment(exported_environment(CPU_CONFIG)) == []
    assert check_launch_environment({}) == []  # plain `python recipe.py`: nothing was launched


def test_start_up_check_returns_fsdp2_warnings_and_counts_processes_per_node():
    environment = {**exported_environment(CPU_CONFIG), "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"}
    assert [f.key for f in check_launch_environment(environment)] == ["fsdp_config.fsdp_backward_prefetch"]
    crowded = lint_launch_environment({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "16"}, local_device_count=8)
    assert "GLOBAL count" in only(crowded, ERROR, "num_processes")
    assert lint_launch_environment({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, local_device_count=8) == []
