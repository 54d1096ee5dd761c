"""The dtype an exported model is written in: the base model's, as Trainer/TRL users get it.

Training keeps fp32 master weights (FSDP's mixed-precision policy casts for compute); only the folder written at the
end (full model, merged LoRA model, offline export) is cast, so a bf16 base comes back as a bf16 folder of the same
size, whose config.json says bfloat16.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path

import torch

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORT_DTYPE_CHOICES = ("auto", *EXPORT_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_dtype(model_config) -> torch.dtype | None:
    """The dtype a model config declares (`dtype`, or `torch_dtype` in configs written before transformers 5), or None
    when it declares none (a config written by hand, or `auto`)."""
    value = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return EXPORT_DTYPES.get(str(value).removeprefix("torch.")) if value else None


def resolve_export_dtype(requested: str | None, model_config, override: str | None = None) -> torch.dtype:
    """`requested` (export_dtype) when it names a dtype; else `override` (the recipe config's torch_dtype/dtype, the
    dtype the user said the model is in) when it names one; else the model config's own dtype; else float32 (a model
    initialised from a config that names none). Only floating dtypes a checkpoint can hold are returned."""
    for choice in (requested, override):
        if choice not in (None, "auto"):
            return EXPORT_DTYPES[str(choice).removeprefix("torch.")]
    declared = config_dtype(model_config)
    return declared if declared in EXPORT_DTYPES.values() else torch.float32


def recipe_dtype_override(config) -> str | None:
    """The recipe config's torch_dtype / dtype (TRL's and the handbook's names), if it has such a field and it is
    set: read with getattr, as not every recipe config has them."""
    for name in ("torch_dtype", "dtype"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value not in (None, "auto") and str(value).removeprefix("torch.") in EXPORT_DTYPES:
            return str(value).removeprefix("torch.")
    return None


def cast_floating(
    state_dict: dict[str, torch.Tensor], dtype: torch.dtype, keep_fp32: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype`; integer buffers (and anything quantised) as they are; tensors under a module
    named in `keep_fp32` (`kept_in_fp32`) in float32."""
    kept = re.compile(rf"(^|\.)({'|'.join(map(re.escape, keep_fp32))})($|\.)") if keep_fp32 else None

    def target(name: str) -> torch.dtype:
        return torch.float32 if kept is not None and kept.search(name) else dtype

    return {
        name: tensor.to(target(name)) if tensor.is_floating_point() and tensor.dtype != target(name) else tensor
        for name, tensor in state_dict.items()
    }


def kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """What transformers keeps in float32 when it loads this model in `dtype` (`_keep_in_fp32_modules_strict` under
    bf16 and fp16, `_keep_in_fp32_modules` under fp16 too): DeepSeek-V3's router weight and its trained
    `e_score_correction_bias`, whose 0.001 steps bf16 would round away. Written so, they load back as trained."""
    names = []
    if dtype in (torch.bfloat16, torch.float16):
        names += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return names


def write_config_dtype(folder: str | Path, dtype: torch.dtype) -> None:
    """config.json says the dtype its weights are in: save_pretrained writes the dtype of the model's parameters (the
    fp32 master weights), not of the state dict it was given."""
    path = Path(folder) / "config.json"
    values = json.loads(path.read_text())
    values["dtype"] = dtype_name(dtype)
    values.pop("torch_dtype", None)
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
