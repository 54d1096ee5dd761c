"""What a rehearsal runs on instead of the real thing, made from the real thing:

- the model: the real config (same class, attention kinds, MoE routing, RoPE, sliding window, vocabulary), shrunk to
  two narrow layers with head, key/value-head and expert counts divisible by the rehearsal's TP and EP sizes, random
  weights, saved with the real tokenizer (and its chat template) beside them. A vision-language model has both towers
  shrunk, kept consistent (its vision tower two narrow blocks whose output width is the language model's; Qwen's
  3-D rotary sections rescaled to the narrow heads) and what its processor reads kept (patch, merge and image sizes,
  the image tokens): the real processor is saved beside it;
- the data: the first rows of each split the recipe reads, through the real loader (Hub, file, folder or mixture),
  written as local JSON lines (the recipe prepares them itself, as it would the real ones), their pictures as files
  beside them.
Names are resolved offline: a Hub id must be in the local cache (HF_HUB_OFFLINE=1 keeps it from the network), or be
given a local stand-in with `--local NAME=PATH`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fsdp_recipes.common.errors import ConfigError

HEAD_DIM = 16
VISION_HEAD_DIM = 32  # a vision tower's stand-in: two heads of this width (Qwen's vision rotary halves it twice)
# config keys -> their value in the stand-in, where the real config has the key
_NARROW = {
    "q_lora_rank": 16,  # multi-head latent attention (DeepSeek): low ranks, small rope/nope dimensions
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def resolve(name: str, locals_: dict[str, str]) -> str:
    """`name`, or the local stand-in `--local` gives it."""
    return locals_.get(name, name)


def load_real_config(name: str, *, trust_remote_code: bool = False):
    """The real model config, offline or from the cache; ConfigError naming HF_HUB_OFFLINE and --local."""
    from transformers import AutoConfig

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=offline)
    except Exception as error:  # noqa: BLE001 - any way of not finding it is the same advice
        first = (str(error).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"the model {name!r} cannot be resolved here ({type(error).__name__}: {first[:200]}): put it in the local "
            "Hugging Face cache (and set HF_HUB_OFFLINE=1 so nothing is fetched), or pass a local folder holding its "
            f"config.json and tokenizer files with --local {name}=/path/to/folder"
        ) from None


def shrunk_config(real, *, tp: int = 1, ep: int = 1):
    """The real config with two narrow layers (one of each attention kind it mixes, a dense and a sparse layer where
    it has both) and head / key-value-head / expert counts divisible by `tp` and `ep`; everything else as it is. A
    composite config (a vision-language model) has each of its parts shrunk so."""
    from transformers import AutoConfig

    values: dict[str, Any] = real.to_dict()
    values.pop("quantization_config", None)
    _shrink(values, tp=tp, ep=ep)
    for key, part in values.items():  # text_config, audio_config, ...: the parts of a composite model
        if (
            key.endswith("_config")
            and key != "vision_config"
            and isinstance(part, dict)
            and part.get("num_hidden_layers")
        ):
            _shrink(part, tp=tp, ep=ep)
    if isinstance(values.get("vision_config"), dict):  # after the text part: its output width is the text's
        text = values["text_config"] if isinstance(values.get("text_config"), dict) else values
        _shrink_vision(values["vision_config"], int(text["hidden_size"]), tp=tp)
    model_type = values.pop("model_type")
    values.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **values)


def _shrink_vision(vision: dict[str, Any], text_hidden: int, *, tp: int) -> None:
    """A vision tower's config as two narrow blocks (its own key names: Qwen's depth / num_heads, CLIP's and SigLIP's
    num_hidden_layers / num_attention_heads), its output in the language model's width; the sizes its processor
    reads (patch, merge, temporal patch and image sizes, position embeddings) as they are."""
    heads = max(2, tp)
    width = heads * VISION_HEAD_DIM
    for key, value in (("depth", 2), ("num_hidden_layers", 2), ("num_heads", heads), ("num_attention_heads", heads)):
        if vision.get(key):
            vision[key] = value
    if vision.get("embed_dim"):  # Qwen2-VL: embed_dim is the tower's width, hidden_size its merger's output
        vision.update(embed_dim=width, hidden_size=text_hidden)
    else:
        vision["hidden_size"] = width
    for key, value in (("intermediate_size", 2 * width), ("projection_dim", width), ("out_hidden_size", text_hidden)):
        if vision.get(key):
            vision[key] = value
    if vision.get("fullatt_block_indexes"):  # Qwen2.5-VL: the last block attends over the whole picture
        vision["fullatt_block_indexes"] = [1]
    if vision.get("deepstack_visual_indexes"):  # Qwen3-VL: one block's features join the first decoder layer
        vision["deepstack_visual_indexes"] = [0]


def _rescale_mrope(values: dict[str, Any]) -> None:
    """Qwen-VL's 3-D rotary sections (time, height, width) rescaled to sum to the narrow heads' half width."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            _, height, width = (int(v) for v in rope["mrope_section"])
            half, total = HEAD_DIM // 2, sum(int(v) for v in rope["mrope_section"])
            height, width = max(1, height * half // total), max(1, width * half // total)
            rope["mrope_section"] = [half - height - width, height, width]


def _shrink(values: dict[str, Any], *, tp: int, ep: int) -> None:
    if not values.get("num_hidden_layers"):
        return
    _rescale_mrope(values)
    heads = int(values.get("num_attention_heads") or 4)
    kv_heads = int(values.get("num_key_value_heads") or heads)
    group = max(heads // max(kv_heads, 1), 1)
    new_kv = tp * max(1, min(kv_heads, 2) // tp) if kv_heads >= tp else tp
    new_heads = new_kv * min(group, 2)
    if "num_attention_heads" in values:
        values["num_attention_heads"] = new_heads
    if "num_key_value_heads" in values:
        values["num_key_value_heads"] = new_kv
    hidden = new_heads * HEAD_DIM
    values["hidden_size"] = hidden
    values.update({key: value for key, value in _NARROW.items() if values.get(key) is not None})
    if values.get("head_dim") is not None:  # multi-head latent attention: the rotary part is what head_dim sizes
        values["head_dim"] = values.get("qk_rope_head_dim") or HEAD_DIM
    for key in ("intermediate_size", "ffn_dim"):
        if values.get(key) is not None:
            values[key] = 2 * hidden
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"):
        if values.get(key):
            values[key] = hidden
    for key in _EXPERT_COUNTS:
        if values.get(key):
            values[key] = max(4, 2 * ep)
            for per_token in ("num_experts_per_tok", "moe_topk"):
                if values.get(per_token):
                    values[per_token] = min(int(values[per_token]), 2)
    layers = 2
    if values.get("layer_types"):
        kinds = list(dict.fromkeys(values["layer_types"]))[:2]
        values["layer_types"] = kinds + kinds[:1] * (layers - len(kinds))
    if values.get("first_k_dense_replace"):
        values["first_k_dense_replace"] = 1  # one dense layer, then one with experts
    values["num_hidden_layers"] = layers
    if values.get("max_window_layers") is not None:
        values["max_window_layers"] = min(int(values["max_window_layers"]), layers)


def write_model(
    name: str,
    tokenizer_name: str | None,
    folder: Path,
    *,
    tp: int,
    ep: int,
    locals_: dict[str, str],
    trust_remote_code: bool = False,
) -> tuple[Path, Any, Any]:
    """A stand-in model folder (random weights of the shrunk config, safetensors, the real tokenizer) for `name`:
    (folder, the real config, the stand-in's config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.models.modeling import auto_model_class, is_vision_language

    real = load_real_config(resolve(name, locals_), trust_remote_code=trust_remote_code)
    small = shrunk_config(real, tp=tp, ep=ep)
    tokenizer_source = resolve(tokenizer_name or name, locals_)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001
        raise ConfigError(
            f"the tokenizer {tokenizer_name or name!r} cannot be loaded here ({type(error).__name__}): pass a local "
            f"folder with its tokenizer files with --local {tokenizer_name or name}=/path/to/folder"
        ) from None
    torch.manual_seed(0)
    builder = auto_model_class("causal-lm", small) if is_vision_language(small) else AutoModelForCausalLM
    model = builder.from_config(small, trust_remote_code=trust_remote_code)
    if is_vision_language(small):  # Gemma 3's projector starts at zero: random, as trained weights would be, so that
        with torch.no_grad():  # the stand-in reads its pictures and its tower gets gradients from the first step
            for parameter in model.parameters():
                if parameter.dim() > 1 and not parameter.any():
                    parameter.normal_(std=0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if is_vision_language(small):  # the real processor (image processor, tokenizer, chat template), as the run loads it
        from fsdp_recipes.models.vision import load_processor

        processor = load_processor(tokenizer_source, tokenizer, revision="main", trust_remote_code=trust_remote_code)
        processor.save_pretrained(folder)
    if real.architectures:  # what the recipes read the task from (a *ForSequenceClassification is a classifier)
        saved = json.loads((folder / "config.json").read_text())
        saved["architectures"] = list(real.architectures)
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder, real, small


def write_data(
    dataset_name: str | None,
    dataset_config: str | None,
    mixture: dict | None,
    splits: dict[str, str],
    folder: Path,
    *,
    rows: int,
    locals_: dict[str, str],
) -> dict[str, str]:
    """The first `rows` rows of each split in `splits` ({the recipe's split field: the real split name}) written to
    `folder/<field's usual name>.jsonl`; returns {split field: the split name the stand-in has}. DataError (the real
    loader's) when the data cannot be read."""
    from fsdp_recipes.data import files, images

    if dataset_name in locals_:  # a --local folder stands for the subset the config names (its files have none)
        dataset_config = None
    source = resolve(dataset_name, locals_) if dataset_name else None
    raw = files.load_raw_dataset(source, dataset_config, mixture=mixture)
    folder.mkdir(parents=True, exist_ok=True)
    # where relative picture paths are read from (the data files' folder); the copies go beside the data folder, not
    # in it (datasets would read a folder of mostly pictures as an image folder)
    roots = [Path(source).expanduser()] if source and Path(source).expanduser().is_dir() else []
    roots += [Path(source).expanduser().parent] if source and Path(source).expanduser().is_file() else []
    renamed = {}
    for field, split in splits.items():
        if split not in raw:
            continue  # the recipe says what it does without the split (a held-out part carved from train, none)
        new_name = "train" if "train" in field else "test"
        part = raw[split].select(range(min(rows, len(raw[split]))))
        column = images.image_column(part.column_names)
        with open(folder / f"{new_name}.jsonl", "w") as out:
            for index, row in enumerate(part):
                if column is not None:
                    row[column] = _picture_files(row, column, folder.with_name(f"{folder.name}_images"),
                                                 f"{new_name}-{index}", roots)  # fmt: skip
                out.write(json.dumps(row, default=str) + "\n")
        renamed[field] = new_name
    return renamed


def _picture_files(row: dict[str, Any], column: str, folder: Path, stem: str, roots: list[Path]):
    """A row's pictures (paths, bytes, `datasets` Image values or PIL images) written as files: their absolute paths,
    as the column held them (a list for `images`, one for `image`). DataError for one that is not a picture."""
    from fsdp_recipes.common.errors import DataError
    from fsdp_recipes.data import images

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, value in enumerate(images.images_of(row, column)):
        try:
            data = images.image_bytes(value, roots)
        except ValueError as error:
            raise DataError(f"row {stem} of the data: {error}") from None
        path = folder / f"{stem}-{number}.img"  # PIL reads the format from the bytes, not the name
        path.write_bytes(data)
        paths.append(str(path.resolve()))
    return paths if column == "images" else (paths[0] if paths else None)
