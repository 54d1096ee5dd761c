"""Offline export of checkpoints, `accelerate merge-weights` on them, and pruning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fsdp_recipes.publish.checkpoint_export import export_checkpoint
from fsdp_recipes.train.checkpoint import complete_checkpoints, latest_checkpoint

pytestmark = pytest.mark.slow


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_same_tensors(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


@pytest.fixture(scope="module")
def sharded_run(reference_run):
    return reference_run


def test_save_total_limit_keeps_the_newest(sharded_run):
    assert [p.name for p in complete_checkpoints(sharded_run)] == ["step-00000009", "step-00000012"]
    assert latest_checkpoint(sharded_run).name == "step-00000012"


def test_offline_export_equals_the_recipe_export(tmp_path, sharded_run):
    folder = export_checkpoint(latest_checkpoint(sharded_run), tmp_path / "exported")
    assert_same_tensors(all_tensors(folder), all_tensors(sharded_run))
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (folder / name).read_text() == (sharded_run / name).read_text(), name
    assert "learning_rate" in (folder / "README.md").read_text()


def test_offline_export_in_shards_loads_with_from_pretrained(tmp_path, sharded_run):
    from transformers import AutoModelForCausalLM

    folder = export_checkpoint(latest_checkpoint(sharded_run), tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for file in folder.glob("*.safetensors"):
        assert file.stat().st_size < 40_000 + 20_000  # a shard is at most the limit, plus one tensor's header
    exported = AutoModelForCausalLM.from_pretrained(folder)
    trained = AutoModelForCausalLM.from_pretrained(sharded_run)
    ids = torch.arange(4, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)


def test_export_command_line(tmp_path, sharded_run, capsys):
    from fsdp_recipes.tools import cli

    checkpoint = latest_checkpoint(sharded_run)
    assert cli.main(["export", str(checkpoint), str(tmp_path / "cli"), "--max-shard-size", "60KB"]) == 0
    assert (tmp_path / "cli" / "model.safetensors.index.json").is_file()
    assert_same_tensors(all_tensors(tmp_path / "cli"), all_tensors(sharded_run))
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "is not a recipe checkpoint" in capsys.readouterr().err


def test_export_refuses_a_non_empty_destination(tmp_path, sharded_run):
    from fsdp_recipes.common.errors import ConfigError

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export_checkpoint(latest_checkpoint(sharded_run), tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_accelerate_merge_weights_reads_our_checkpoints(tmp_path, sharded_run):
    accelerate = Path(sys.executable).with_name("accelerate")
    checkpoint = latest_checkpoint(sharded_run)
    result = subprocess.run(
        [str(accelerate), "merge-weights", str(checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_tensors(load_file(tmp_path / "merged" / "model.safetensors"), all_tensors(sharded_run))


def test_full_state_dict_checkpoint_of_a_tied_model_exports_the_same(tmp_path, full_state_dict_run):
    checkpoint = latest_checkpoint(full_state_dict_run)
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file()
    folder = export_checkpoint(checkpoint, tmp_path / "exported")
    exported = all_tensors(folder)
    assert "lm_head.weight" not in exported  # tied: stored once, as save_pretrained does
    assert_same_tensors(exported, all_tensors(full_state_dict_run))
