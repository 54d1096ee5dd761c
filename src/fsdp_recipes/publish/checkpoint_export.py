"""Offline export: any checkpoint -> the Hugging Face folder the recipe writes at the end of training.

Runs in one CPU process, whatever world size wrote the checkpoint. Sharded (DCP) weights are read tensor by tensor
and written in safetensors files of at most `max_shard_bytes`, so host RAM peaks at about one output file, not the
whole model. FULL_STATE_DICT checkpoints (one pickle written by rank 0) are memory-mapped instead of read whole.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.common.outputs import output_dir_problem
from fsdp_recipes.models.export_dtype import (
    cast_floating,
    kept_in_fp32,
    recipe_dtype_override,
    resolve_export_dtype,
    write_config_dtype,
)
from fsdp_recipes.models.modeling import meta_model, tied_duplicate_names
from fsdp_recipes.publish.export import ExportVerificationError, verify_by_loading, write_model_card
from fsdp_recipes.train.checkpoint import MODEL_FILES, RUN_INFO, read_progress

SHARDED_MODEL = "pytorch_model_fsdp_0"
FULL_MODEL = "pytorch_model_fsdp.bin"
UNSHARDED_MODEL = "model.safetensors"  # what save_state writes without FSDP (a plain `python recipes/x.py` run)
_DCP_PREFIX = "model."  # accelerate saves {"model": state_dict}; DCP flattens the nesting into the key


def export_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    merged: bool = False,
    dtype: str | None = None,
) -> Path:
    """A LoRA checkpoint becomes a peft adapter folder (and with `merged`, also OUTPUT_DIR/merged: the base from the
    recipe's model_name_or_path with the adapter merged in, which loads that base into memory). Weights are written
    in `dtype` (auto/None: the run's export_dtype, i.e. the base model's dtype, as the recipe's own export)."""
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    model_files = checkpoint / MODEL_FILES
    if not (model_files / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is not a recipe checkpoint: it has no {MODEL_FILES}/config.json")
    problem = output_dir_problem(output_dir, overwrite=overwrite)
    if problem:
        raise ConfigError(problem)
    config = AutoConfig.from_pretrained(model_files)
    run_info = _json_or_empty(model_files / RUN_INFO)
    task = run_info.get("task", "causal-lm")
    tensors = _tensor_source(checkpoint)
    recipe_config = _json_or_empty(model_files / "recipe_config.json")
    weights_dtype = resolve_export_dtype(
        dtype if dtype not in (None, "auto") else recipe_config.get("export_dtype"),
        config,
        override=recipe_dtype_override(recipe_config),
    )
    if recipe_config.get("use_peft"):
        return _export_adapter_checkpoint(
            checkpoint, output_dir, tensors, recipe_config, task, merged=merged, dtype=weights_dtype
        )
    names = _names_to_save(config, tensors.names(), task)
    skeleton = meta_model(config, task=task)
    fp32 = kept_in_fp32(skeleton, weights_dtype)

    output_dir.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(names, tensors.nbytes, max_shard_bytes)
    weight_map, total, converted = {}, 0, False
    for index, shard in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        loaded = cast_floating({name: tensors.load(name).contiguous() for name in shard}, weights_dtype, fp32)
        # the checkpoint format transformers writes and reads (MoE experts per expert), as save_pretrained does
        written = {name: tensor.contiguous() for name, tensor in revert_weight_conversion(skeleton, loaded).items()}
        converted = converted or written.keys() != loaded.keys()
        save_file(written, output_dir / file, metadata={"format": "pt"})
        _check_file(output_dir / file, written)
        weight_map.update(dict.fromkeys(written, file))
        total += sum(tensor.nbytes for tensor in written.values())
        del loaded, written
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    config.save_pretrained(output_dir)
    write_config_dtype(output_dir, weights_dtype)
    generation = model_files / "generation_config.json"
    generation_config = (
        GenerationConfig.from_pretrained(model_files)
        if generation.is_file()
        else GenerationConfig.from_model_config(config)
    )
    generation_config.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(model_files).save_pretrained(output_dir)
    if converted:  # names changed on the way out: what loads back must be the checkpoint's tensors
        pairs = ((name, cast_floating({name: tensors.load(name)}, weights_dtype, fp32)[name]) for name in names)
        verify_by_loading(output_dir, pairs, type(skeleton), dtype=weights_dtype)
    progress = read_progress(checkpoint)
    write_model_card(
        output_dir,
        recipe=run_info.get("recipe", "export"),
        task=task,
        recipe_config=_json_or_empty(model_files / "recipe_config.json"),
        accelerate_config=_json_or_empty(model_files / "accelerate_config.json"),
        metrics={"step": progress.step, "exported_from": str(checkpoint)},
        base_model=None,
        dataset=None,
    )
    return output_dir


def _export_adapter_checkpoint(
    checkpoint: Path, output_dir: Path, tensors, recipe_config: dict, task: str, *, merged: bool, dtype
) -> Path:
    """The adapter tensors (stored under peft's own names) as adapter_model.safetensors, the LoRA settings of the run
    as adapter_config.json, the tokenizer and a card."""
    from types import SimpleNamespace

    from fsdp_recipes.models.adapter_export import MERGED_FOLDER, load_base, reload_adapter, save_merged_model
    from fsdp_recipes.models.adapters import lora_config

    settings = SimpleNamespace(**recipe_config)
    names = tensors.names()
    output_dir.mkdir(parents=True, exist_ok=True)
    loaded = {name: tensors.load(name).contiguous() for name in names}
    save_file(loaded, output_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    _check_file(output_dir / "adapter_model.safetensors", loaded)
    base_config = AutoConfig.from_pretrained(checkpoint / MODEL_FILES)  # the model config the checkpoint keeps
    adapter_config = lora_config(
        settings, task, vision_language=getattr(base_config, "vision_config", None) is not None
    )
    adapter_config.base_model_name_or_path = settings.model_name_or_path
    adapter_config.inference_mode = True
    adapter_config.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(checkpoint / MODEL_FILES).save_pretrained(output_dir)
    progress = read_progress(checkpoint)
    card = dict(
        recipe=_json_or_empty(checkpoint / MODEL_FILES / RUN_INFO).get("recipe", "export"),
        task=task,
        recipe_config=recipe_config,
        accelerate_config=_json_or_empty(checkpoint / MODEL_FILES / "accelerate_config.json"),
        metrics={"step": progress.step, "exported_from": str(checkpoint)},
        base_model=settings.model_name_or_path,
        dataset=None,
    )
    write_model_card(output_dir, library_name="peft", **card)
    if merged:
        model_config = AutoConfig.from_pretrained(checkpoint / MODEL_FILES)
        merged_model = reload_adapter(output_dir, settings, task=task, model_config=model_config, quantized=False)
        merged_dir = output_dir / MERGED_FOLDER
        save_merged_model(merged_model, merged_dir, dtype=dtype, task=task)
        AutoTokenizer.from_pretrained(checkpoint / MODEL_FILES).save_pretrained(merged_dir)
        write_model_card(merged_dir, **card)
        load_base(str(merged_dir), task=task)  # it loads as a plain transformers model
    return output_dir


class _DcpTensors:
    def __init__(self, folder: Path):
        self.folder = folder
        self.metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata

    def names(self) -> list[str]:
        return [key[len(_DCP_PREFIX) :] for key in self.metadata if key.startswith(_DCP_PREFIX)]

    def nbytes(self, name: str) -> int:
        meta = self.metadata[_DCP_PREFIX + name]
        return meta.size.numel() * meta.properties.dtype.itemsize

    def load(self, name: str) -> torch.Tensor:
        meta = self.metadata[_DCP_PREFIX + name]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {name: tensor}}, checkpoint_id=str(self.folder), no_dist=True)
        return tensor


class _PickledTensors:
    def __init__(self, file: Path):
        self.state_dict = torch.load(file, map_location="cpu", mmap=True, weights_only=True)

    def names(self) -> list[str]:
        return list(self.state_dict)

    def nbytes(self, name: str) -> int:
        return self.state_dict[name].nbytes

    def load(self, name: str) -> torch.Tensor:
        return self.state_dict[name]


class _SafetensorsTensors:
    def __init__(self, file: Path):
        self.file = file
        with file.open("rb") as handle:  # the header alone: 8 bytes of length, then JSON with each tensor's offsets
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        self.sizes = {
            name: entry["data_offsets"][1] - entry["data_offsets"][0]
            for name, entry in header.items()
            if name != "__metadata__"
        }

    def names(self) -> list[str]:
        return list(self.sizes)

    def nbytes(self, name: str) -> int:
        return self.sizes[name]

    def load(self, name: str) -> torch.Tensor:
        with safe_open(self.file, framework="pt") as reader:
            return reader.get_tensor(name)


def _tensor_source(checkpoint: Path):
    if (checkpoint / SHARDED_MODEL).is_dir():
        return _DcpTensors(checkpoint / SHARDED_MODEL)
    if (checkpoint / FULL_MODEL).is_file():
        return _PickledTensors(checkpoint / FULL_MODEL)
    if (checkpoint / UNSHARDED_MODEL).is_file():
        return _SafetensorsTensors(checkpoint / UNSHARDED_MODEL)
    raise ConfigError(f"{checkpoint} holds no model weights ({SHARDED_MODEL}/, {FULL_MODEL} or {UNSHARDED_MODEL})")


def _names_to_save(config, available: list[str], task: str) -> list[str]:
    """The checkpoint's tensors in the model's own order, without tied duplicates (as the recipe's export)."""
    model = meta_model(config, task=task)
    duplicates = tied_duplicate_names(config, task=task)
    expected = [name for name in model.state_dict() if name not in duplicates]
    missing = [name for name in expected if name not in available]
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    config.architectures = [type(model).__name__]
    return expected


def _plan_shards(names: list[str], nbytes, max_shard_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name in names:
        if current and size + nbytes(name) > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes(name)
    return shards + [current] if current else shards


def _check_file(file: Path, expected: dict[str, torch.Tensor]) -> None:
    with safe_open(file, framework="pt") as reader:
        if set(reader.keys()) != set(expected):
            raise ExportVerificationError(f"{file}: written keys differ from the checkpoint's")
        for name in reader.keys():
            if not torch.equal(reader.get_tensor(name), expected[name]):
                raise ExportVerificationError(f"{file}: {name} differs from the checkpoint")


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
