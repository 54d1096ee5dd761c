"""liger-kernel's fused Triton kernels in the model (`use_liger_kernel: true`, the name TrainingArguments and TRL
give it): its RMSNorm, rotary embedding and SwiGLU/GeGLU MLP patched into the loaded model before LoRA and FSDP2 wrap
it (what `liger_kernel.transformers._apply_liger_kernel_to_instance` patches for each model type). Its cross-entropy
patches are left off: the loss is computed from the hidden states by `loss_implementation` (`liger`: liger's fused
linear cross-entropy there). Triton kernels run on CUDA GPUs only: anything else is refused before loading."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

INSTALL = "pip install liger-kernel==0.8.5 (requirements-gpu.txt)"
# each model type's patch function takes the names it knows (geglu for Gemma, swiglu for Llama...); the model's own
# forward never computes the loss here, so neither of liger's cross-entropy patches applies
PATCHES = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def liger_problem(model_config, *, device_type: str, sharded_layers: bool) -> str | None:
    """Why `use_liger_kernel: true` cannot run here, before any weights load (None: it can)."""
    off = "set use_liger_kernel: false (the same operations then run unfused)"
    if device_type != "cuda":
        return (
            f"use_liger_kernel: true needs a CUDA GPU (liger-kernel's kernels are Triton's); this run is on "
            f"{device_type}: run it on a GPU, or {off}"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        return f"use_liger_kernel: true needs liger-kernel, which is not installed: {INSTALL}, or {off}"
    if sharded_layers:
        return (
            "use_liger_kernel: true under tensor or expert parallelism: liger's kernels are not written for the "
            f"sharded layers transformers builds; train with FSDP alone, or {off}"
        )
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (
            f"use_liger_kernel: true: liger-kernel {importlib.metadata.version('liger-kernel')} has no kernels for "
            f"model type {model_config.model_type!r} (it has {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); {off}"
        )
    return None


def apply_liger_kernels(model: torch.nn.Module) -> str:
    """Patches the loaded model in place (and its model type's modules, as liger does); returns what it patched, for
    the run summary."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **PATCHES)
    version = importlib.metadata.version("liger-kernel")
    return f"liger-kernel {version}: RMSNorm, rotary embedding, SwiGLU/GeGLU MLP (the loss: loss_implementation)"
