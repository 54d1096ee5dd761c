"""Checkpoint buffers through accelerate's FSDP2 loading: rank 0's values reach every rank.

With `fsdp_cpu_ram_efficient_loading` (the default), accelerate 1.15's `fsdp2_load_full_state_dict` broadcasts rank
0's weights into the sharded model and expects every entry of the model's state dict to be a sharded parameter. A
buffer the checkpoint holds (a *persistent* buffer, e.g. DeepSeek-V3's and GLM-4-MoE's router
`e_score_correction_bias`) is a plain tensor there, and the load dies with "'Tensor' object has no attribute
'device_mesh'" (huggingface/accelerate#3898, unfixed in the pinned release). Buffers are not sharded by FSDP2: each
rank holds the whole tensor. So they are kept out of accelerate's load and broadcast from rank 0 here, then registered
again as persistent, so that checkpoints and the export still carry them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist


def install() -> None:
    """Wrap accelerate's full-state-dict load (looked up at call time by `fsdp2_prepare_model`); idempotent."""
    from accelerate.utils import fsdp_utils

    if not getattr(fsdp_utils.fsdp2_load_full_state_dict, "loads_buffers", False):
        fsdp_utils.fsdp2_load_full_state_dict = _loading_buffers_too(fsdp_utils.fsdp2_load_full_state_dict)


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(state-dict name, owning module, attribute) of every buffer that `model.state_dict()` holds."""
    found = []
    for prefix, module in model.named_modules():
        for name, tensor in module.named_buffers(recurse=False):
            if tensor is not None and name not in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, module, name))
    return found


def _loading_buffers_too(load: Callable) -> Callable:
    @functools.wraps(load)
    def load_with_buffers(accelerator, model, full_sd, cpu_offload=False):
        buffers = persistent_buffers(model)
        if not buffers:
            return load(accelerator, model, full_sd, cpu_offload)
        names = {fqn for fqn, _, _ in buffers}
        for _, module, name in buffers:  # out of model.state_dict() while accelerate loads the parameters
            module._non_persistent_buffers_set.add(name)
        try:
            result = load(accelerator, model, {k: v for k, v in full_sd.items() if k not in names}, cpu_offload)
        finally:
            for _, module, name in buffers:
                module._non_persistent_buffers_set.discard(name)
        for fqn, module, name in buffers:
            held = getattr(module, name)  # on the meta device by now, on every rank
            if accelerator.is_main_process:
                tensor = full_sd[fqn].detach().to(accelerator.device).contiguous()
            else:
                tensor = torch.empty(held.shape, dtype=held.dtype, device=accelerator.device)
            dist.broadcast(tensor, src=0, group=dist.group.WORLD)
            module.register_buffer(name, tensor.to("cpu") if cpu_offload else tensor, persistent=True)
        return result

    load_with_buffers.loads_buffers = True
    return load_with_buffers
