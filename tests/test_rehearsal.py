"""`fsdp-recipes rehearse` (fsdp_recipes.tools.rehearsal): the launch line read as the launcher reads it, the model
shrunk with its features kept and its counts divisible by the scaled layout, the Accelerate config scaled with its
mesh's shape, the real sizes checked as the real run checks them, in this process; one real rehearsal of a shipped
TP config (2 processes, a checkpoint, a resume that reproduces the loss) and one with data of the wrong columns,
which fails with the recipe's own error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.tools import cli
from fsdp_recipes.tools.rehearsal import command, launch_line, layout, stand_ins
from helpers.paths import DEMO_DATA, REPO, TOKENIZER

LLAMA_70B = dict(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
TP_LINE = (
    "accelerate launch --config_file accelerate_configs/tp8_fsdp_4x8gpu.yaml --machine_rank 0 --main_process_ip "
    "10.0.0.1 --main_process_port 29500 --rdzv_backend c10d recipes/sft.py --config "
    "recipes/configs/sft/llama-3.1-70b_ultrachat_tp8.yaml"
)


@pytest.fixture(scope="module")
def stand_in_files(tmp_path_factory) -> dict[str, Path]:
    """A local Llama-3.1-70B (its real config.json, the repo's tokenizer) and an UltraChat-like dataset (train_sft and
    test_sft splits, declared in its README as the Hub repo does)."""
    import shutil

    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("stand_ins")
    model = folder / "llama70"
    shutil.copytree(TOKENIZER, model)
    LlamaConfig(**LLAMA_70B).save_pretrained(model)
    data = folder / "ultrachat"
    data.mkdir()
    rows = [json.loads(line) for line in (DEMO_DATA / "train.jsonl").read_text().splitlines()[:80]]
    for split, part in (("train_sft", rows[:64]), ("test_sft", rows[64:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt_id": "p", **row}) + "\n" for row in part))
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n    path: train_sft.jsonl\n"
        "  - split: test_sft\n    path: test_sft.jsonl\n---\n"
    )
    wrong = folder / "wrong_columns"
    wrong.mkdir()
    (wrong / "train_sft.jsonl").write_text(
        "".join(json.dumps({"question": "q", "reply": "r"}) + "\n" for _ in range(8))
    )
    (wrong / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n    path: train_sft.jsonl\n---\n"
    )
    return {"model": model, "data": data, "wrong": wrong}


def test_the_launch_line_is_read_as_the_launcher_and_the_recipe_read_it(monkeypatch):
    monkeypatch.chdir(REPO)
    launch = launch_line.parse_launch(TP_LINE + " --learning_rate 3.0e-5 --save_steps null")
    assert launch.recipe == Path("recipes/sft.py") and launch.accelerate_config.name == "tp8_fsdp_4x8gpu.yaml"
    assert any(note.startswith("--main_process_ip 10.0.0.1") for note in launch.launcher_notes)
    values = launch_line.recipe_values(launch)
    assert values["learning_rate"] == 3e-5 and values["save_steps"] is None  # the flags win over the file
    assert values["model_name_or_path"] == "meta-llama/Llama-3.1-70B" and values["dataset_train_split"] == "train_sft"
    assert launch_line.parse_launch(["recipes/dpo.py", "--config", "x.yaml"]).accelerate_config is None
    sized = launch_line.parse_launch(TP_LINE.replace("launch ", "launch --num_processes 16 ") + " --eos_token *")
    assert sized.num_processes == 16 and launch_line.recipe_values(sized)["eos_token"] == "*"  # not YAML: kept as text
    with pytest.raises(ConfigError, match="not a recipe launch"):
        launch_line.parse_launch("accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train.sh")
    with pytest.raises(ConfigError, match="--deepspeed_config_file is not an accelerate launch option"):
        launch_line.parse_launch("accelerate launch --deepspeed_config_file ds.json recipes/sft.py")


def test_a_script_of_the_user_s_own_and_a_missing_local_folder_are_named_as_such(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("import torch\nprint('training')\n")
    with pytest.raises(ConfigError) as refused:
        launch_line.parse_launch(
            f"accelerate launch --config_file {REPO}/accelerate_configs/fsdp_8gpu.yaml my_train.py --lr 1e-4"
        )
    assert str(refused.value).startswith("my_train.py is not one of this repository's recipes: rehearse runs those (")
    assert (
        "dpo.py" in str(refused.value)
        and "sft.py" in str(refused.value)
        and "fsdp-recipes cp sft" in str(refused.value)
    )
    copied = tmp_path / "recipes" / "sft.py"  # a copy `fsdp-recipes cp` made is a recipe
    copied.parent.mkdir()
    copied.write_text((REPO / "recipes" / "sft.py").read_text())
    assert launch_line.parse_launch("python recipes/sft.py --config x.yaml").recipe == Path("recipes/sft.py")
    line = ["--local", "meta-llama/Llama-3.1-8B=no/such/folder", "--", *TP_LINE.split()]
    assert cli.main(["rehearse", *line]) == 2
    assert capsys.readouterr().err == (
        f"error: --local meta-llama/Llama-3.1-8B=no/such/folder: the folder no/such/folder does not exist (looked "
        f"for {tmp_path}/no/such/folder): give the folder holding the model's config.json and tokenizer files, or the "
        "dataset's file or folder\n"
    )


@pytest.mark.parametrize("family", ["llama-70b", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_stand_in_keeps_the_model_s_features_with_counts_the_layout_divides(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.tiny_moe import COMMON, FAMILIES

    if family == "llama-70b":
        real = AutoConfig.for_model("llama", **LLAMA_70B)
    else:
        real = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    for tp, ep in ((2, 1), (1, 2)):
        small = stand_ins.shrunk_config(real, tp=tp, ep=ep)
        assert type(small) is type(real) and small.num_hidden_layers == 2 and small.vocab_size == real.vocab_size
        assert small.num_key_value_heads % tp == 0 and small.num_attention_heads % small.num_key_value_heads == 0
        assert getattr(small, "layer_types", None) == (
            list(dict.fromkeys(real.layer_types))[:2] if getattr(real, "layer_types", None) else None
        )  # one layer of each attention kind
        experts = next((getattr(small, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if getattr(small, k, None)), None)  # fmt: skip
        assert (experts is None) == (family == "llama-70b") and (experts is None or experts % ep == 0)
    if family != "llama-70b":  # its stand-in (16M parameters, the vocabulary's) is built by the launch below
        model = AutoModelForCausalLM.from_config(small)
        assert type(model) is AutoModelForCausalLM._model_mapping[type(real)]


def test_the_accelerate_config_is_scaled_with_its_mesh_s_shape():
    def scaled(name, processes=None):
        mapping = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
        return layout.scaled_config(mapping, processes)

    config, real, mesh, notes = scaled("tp8_fsdp_4x8gpu.yaml")
    assert (real.dp_shard, real.tp, real.processes) == (4, 8, 32) and (mesh.dp_shard, mesh.tp, mesh.processes) == (
        2,
        2,
        4,
    )
    assert config["num_machines"] == 1 and config["num_processes"] == 4 and "main_process_ip" not in config
    assert config["parallelism_config"]["parallelism_config_tp_size"] == 2 and config["mixed_precision"] == "bf16"
    assert any("4 machines -> one" in note for note in notes)
    assert scaled("fsdp_ep8_8gpu.yaml")[2] == layout.Mesh(dp_shard=2, ep=2)
    assert scaled("hsdp_2x8gpu.yaml")[2] == layout.Mesh(dp_replicate=2, dp_shard=2)
    assert scaled("fsdp_8gpu.yaml")[2].processes == 2 and scaled("tp8_fsdp_4x8gpu.yaml", 2)[2] == layout.Mesh(tp=2)
    offload = scaled("fsdp_8gpu_offload.yaml")
    assert offload[0]["fsdp_config"]["fsdp_offload_params"] is False and any("pinned" in n for n in offload[3])
    with pytest.raises(ConfigError, match="must be a multiple of 2"):
        scaled("tp8_fsdp_4x8gpu.yaml", 3)


def test_the_real_sizes_are_checked_as_the_real_run_checks_them_before_any_stand_in(
    stand_in_files, tmp_path, monkeypatch
):
    from transformers import LlamaConfig

    from fsdp_recipes.distributed import tensor_parallel
    from fsdp_recipes.distributed.parallel_dims import ParallelDims
    from fsdp_recipes.models.modeling import model_class_for

    monkeypatch.chdir(REPO)
    odd = tmp_path / "odd"
    odd.mkdir()
    LlamaConfig(
        **{**LLAMA_70B, "hidden_size": 7680, "num_attention_heads": 60, "num_key_value_heads": 12}
    ).save_pretrained(odd)
    work = tmp_path / "work"
    with pytest.raises(ConfigError) as refused:
        command.rehearse(
            TP_LINE.split(), processes=None, steps=2, rows=8, work_dir=work,
            locals_={"meta-llama/Llama-3.1-70B": str(odd)},
        )  # fmt: skip
    real_run = tensor_parallel.model_problems(
        ParallelDims(dp_replicate=1, dp_shard=4, tp=8, ep=1),
        LlamaConfig.from_pretrained(odd),
        model_class_for(LlamaConfig(), "causal-lm"),
    )
    assert real_run and refused.value.problems == [f"for the real model and layout: {p}" for p in real_run]
    assert not (work / "model_name_or_path").exists()  # refused before any stand-in was made
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a rehearsal's: choose another folder"):
        command.rehearse(TP_LINE.split(), processes=None, steps=2, rows=8, work_dir=mine, locals_={})
    assert (mine / "notes.txt").read_text() == "keep me"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1 .* --local meta-llama/Llama-3.1-70B=/path/to/folder"):
        command.rehearse(TP_LINE.split(), processes=None, steps=2, rows=8, work_dir=work, locals_={})


@pytest.mark.slow
def test_a_shipped_tp_job_rehearses_with_a_resume_and_a_broken_one_fails_with_its_own_error(
    stand_in_files, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))
    locals_ = {"meta-llama/Llama-3.1-70B": str(stand_in_files["model"]),
               "meta-llama/Llama-3.1-70B-Instruct": str(stand_in_files["model"]),
               "HuggingFaceH4/ultrachat_200k": str(stand_in_files["data"])}  # fmt: skip
    line = TP_LINE.split() + ["--max_length", "256"]
    assert command.rehearse(line, processes=2, steps=2, rows=40, work_dir=tmp_path / "ok", locals_=locals_) == 0
    report = json.loads((tmp_path / "ok" / "rehearsal.json").read_text())
    assert report["result"].startswith("ran: 2 steps, checkpoint at 1, resumed to the same loss")
    assert report["processes"] == 2 and report["exported"]
    estimate = report["estimate_real_sizes"]  # at the real sizes, the launch line's --max_length 256 included
    assert estimate.startswith("fits: 70.6B parameters,") and "GiB per GPU of 67.1 GiB usable on 80GB GPUs" in estimate
    assert any("mesh fsdp 4 x tp 8 (32 processes) -> tp 2 (2)" in note for note in report["changed_for_cpu"])
    scaled = yaml.safe_load((tmp_path / "ok" / "accelerate.yaml").read_text())
    assert scaled["parallelism_config"]["parallelism_config_tp_size"] == 2 and scaled["mixed_precision"] == "bf16"

    # one process (the recipe run by Python, no launcher): the data's error comes before any process group would
    broken = {"meta-llama/Llama-3.1-8B": str(stand_in_files["model"]), "HuggingFaceH4/ultrachat_200k":
              str(stand_in_files["wrong"]), "meta-llama/Llama-3.1-8B-Instruct": str(stand_in_files["model"])}  # fmt: skip
    line = "accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/sft.py --config "
    line += "recipes/configs/sft/llama-3.1-8b_ultrachat.yaml"
    assert command.rehearse(line.split(), processes=1, steps=2, rows=8, work_dir=tmp_path / "bad", locals_=broken) == 1
    failed = json.loads((tmp_path / "bad" / "rehearsal.json").read_text())["result"]
    assert failed.startswith("failed: error: ") and "messages" in failed  # the recipe's own line: the column it needs
