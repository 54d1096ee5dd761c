"""The policy's weights as an inference server loads them: a plain transformers checkpoint (safetensors, the
checkpoint's names, tied duplicates written once, fused experts written back per expert as `save_pretrained` does),
gathered from the FSDP2 (or TP) shards, LoRA adapters merged into their base, in the server's dtype. One writer (the
main process); every rank takes part in the gather."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from fsdp_recipes.distributed import tensor_parallel
from fsdp_recipes.models.export_dtype import cast_floating, kept_in_fp32
from fsdp_recipes.models.modeling import tied_duplicate_names


def gathered_state(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every tensor of the prepared model whole, on CPU, on the main process (empty elsewhere)."""
    state = accelerator.get_state_dict(model)
    # torchao's float8 training keeps each converted weight in a subclass around the trained (high-precision) tensor
    return {name: getattr(tensor, "_tensor", tensor) for name, tensor in state.items()}


def merged_lora_state(adapted, state: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(the base model's class instance holding the merged weights, its state dict) for a peft model whose gathered
    tensors are `state`: a weightless copy of the peft model takes the tensors, then peft merges every adapter into its
    base layer (W + scale x B A), whatever kind of layer it adapts."""
    import peft
    from transformers import AutoModelForCausalLM

    base_config = adapted.get_base_model().config
    with torch.device("meta"):
        shadow = peft.get_peft_model(
            AutoModelForCausalLM.from_config(base_config), adapted.peft_config[adapted.active_adapter]
        )
    # peft merges in place: the base weights are copied first (unsharded, the gathered tensors are the live ones)
    state = {name: tensor.clone() if ".base_layer." in name else tensor for name, tensor in state.items()}
    missing, unexpected = shadow.load_state_dict(state, strict=False, assign=True)
    if unexpected or [name for name in missing if "lora_" in name or name.endswith("weight")]:
        raise RuntimeError(
            f"the adapted model's tensors do not fit its copy: missing {missing}, unexpected {unexpected}"
        )
    merged = shadow.merge_and_unload()
    return merged, merged.state_dict()


def write_serving_weights(
    accelerator, model: torch.nn.Module, folder: str | Path, *, dtype: torch.dtype | None
) -> Path | None:
    """Collective. The main process writes the policy's whole weights into `folder` (new, or emptied first) as a
    transformers checkpoint in `dtype` (None: as trained) and returns it; None on the other ranks."""
    import peft

    state = gathered_state(accelerator, model)
    if not accelerator.is_main_process:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unwrapped = accelerator.unwrap_model(model)
    if isinstance(unwrapped, peft.PeftModel):
        unwrapped, state = merged_lora_state(unwrapped, state)
    for name in tied_duplicate_names(unwrapped.config):
        state.pop(name, None)
    if dtype is not None:
        state = cast_floating(state, dtype, kept_in_fp32(unwrapped, dtype))
    with tensor_parallel.saved_as_one_model(unwrapped), _quiet_progress():
        unwrapped.save_pretrained(folder, state_dict=dict(state), safe_serialization=True)
    return folder


@contextlib.contextmanager
def _quiet_progress():
    """No "Writing model shards" bar at every push (one per optimizer step)."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
