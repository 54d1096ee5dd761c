"""Float8 training: an Accelerate config with `mixed_precision: fp8` and `fp8_config: {backend: AO}`
(accelerate_configs/fsdp_8gpu_float8.yaml). accelerate converts the linear layers to torchao's `Float8Linear` before
FSDP2 wraps them (not the first and the last, nor any whose sizes are not multiples of 16), FSDP2 all-gathers their
weights in float8, everything else computes in bf16. What it needs is checked here before anything loads."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch

INSTALL = "pip install -r requirements-gpu.txt (torchao==0.18.0)"
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L4, L40S, RTX 4090) and Hopper (H100, H200) onwards


def launch_problem(environ: Mapping[str, str], *, use_peft: bool = False) -> str | None:
    """What the launch environment of an fp8 Accelerate config asks that cannot run here, before the accelerator is
    built: torchao missing, another float8 backend, a layout or LoRA, which float8 is not composed with here."""
    if use_peft:
        return (
            "mixed_precision fp8 with use_peft: float8 training would convert the frozen base's and the adapters' "
            "linear layers, which is not composed with LoRA's export here; train LoRA under a bf16 Accelerate config "
            "(fsdp_8gpu.yaml), where the frozen base is already cheap"
        )
    if torchao_missing():
        return f"mixed_precision fp8 (float8 training) needs torchao, which is not installed: {INSTALL}"
    backend = environ.get("ACCELERATE_FP8_BACKEND", "AO").upper()
    if backend != "AO":
        return (
            f"fp8_config backend {backend} in the Accelerate config: only AO (torchao's float8 training, which FSDP2 "
            "shards) is wired here; set fp8_config: {backend: AO}"
        )
    sizes = {name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")) for name in ("tp", "ep")}
    parallel = [f"{name}_size {size}" for name, size in sizes.items() if size > 1]
    if parallel:
        return (
            f"mixed_precision fp8 with {' and '.join(parallel)}: float8 training is composed with FSDP2 and HSDP here, "
            "not with tensor or expert parallelism (their sharded linear layers would need torchao's float8 plans); "
            "use bf16 with this layout, or fp8 with an FSDP-only config (fsdp_8gpu_float8.yaml)"
        )
    return None


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


def machine_note() -> str | None:
    """What this machine lacks to launch an fp8 config that is itself valid: accelerate's launcher checks for a float8
    library before it starts any process, so no recipe can say it (its own traceback is all a launch here prints)."""
    if not torchao_missing():
        return None
    return (
        "the file is valid, and this machine lacks torchao, which float8 training needs: `accelerate launch` with it "
        f'stops here with "FP8 is not available on this machine" before any recipe starts. Before launching: {INSTALL}'
    )


def device_problem(device: torch.device) -> str | None:
    """A GPU without float8 tensor cores. The CPU runs the same path, for rehearsals and tests (torch's float8
    matmul has a CPU kernel): correct, not faster."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_CAPABILITY:
        return None
    return (
        f"mixed_precision fp8 needs a GPU with float8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200); "
        f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use a bf16 Accelerate config "
        "(fsdp_8gpu.yaml)"
    )


def converted_layers(model: torch.nn.Module) -> int:
    """How many of the model's layers compute in float8 (torchao's `Float8Linear`, FSDP2's wrapped class included),
    for the run summary."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(module, Float8Linear) for module in model.modules())
