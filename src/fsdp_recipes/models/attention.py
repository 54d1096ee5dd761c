"""The attention implementation a model is loaded with: `attn_implementation` resolved against what the architecture
and this machine can run (sdpa, eager, flex attention, flash attention 2/3), checked before any weights load."""

from __future__ import annotations

import importlib.util

import torch
from transformers import PretrainedConfig
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.models.modeling import meta_model

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# name -> (module, transformers' usability check, what it needs, how to install it)
_FLASH = {
    "flash_attention_2": (
        "flash_attn",
        is_flash_attn_2_available,
        "flash-attn 2.3.3 or newer",
        "pip install flash-attn --no-build-isolation",
    ),
    "flash_attention_3": (
        "flash_attn_interface",
        is_flash_attn_3_available,
        "the flash-attn-3 build",
        "build it from flash-attention's hopper/ folder",
    ),
}


def resolve_attn_implementation(
    model_config: PretrainedConfig,
    requested: str | None,
    *,
    task: str = "causal-lm",
    trust_remote_code: bool = False,
    device_type: str = "cpu",
    packs_examples: bool = False,
    training: bool = True,
    tensor_parallel: bool = False,
    generates: bool = False,
) -> tuple[str, str]:
    """(the attention implementation to pass to from_pretrained / from_config, a line for the run summary).

    None (or "auto") chooses: flex_attention for packed rows on a CUDA GPU where the model class supports it (a block
    mask keeps the examples apart; sdpa is given them as a dense 4-D mask, which rules out its flash kernel and
    repeats grouped keys/values to every head), else sdpa where the class supports it, else eager, as transformers
    itself falls back. Flex is refused on CPU (torch's FlexAttention has no backward there, and its compiled forward fails on some inputs), under tensor
    parallelism (transformers' TP plans are tested with sdpa), nor for a recipe that generates as it trains (GRPO,
    on-policy distillation: decoding with flex rebuilds its block mask every token). An explicit implementation that cannot run here is a
    ConfigError, raised before any weights load. The check is transformers' own, made by building the model on the
    meta device (no memory, a fraction of a second)."""
    if requested == "auto":
        requested = None
    if requested is not None and requested not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation {requested!r} is not one this recipe can use: choose one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)}, or auto (the default) to choose automatically."
        )
    if requested in _FLASH:
        _check_flash_attention(requested)
    if requested == "flex_attention" and device_type != "cuda":
        torch_version = torch.__version__.split("+")[0]
        if training:
            why = f"torch {torch_version}'s FlexAttention has no backward pass there"
        elif device_type == "cpu":
            why = (
                f"torch {torch_version} compiles FlexAttention there through inductor's C++ template, which fails "
                "to compile for some inputs"
            )
        else:
            why = "FlexAttention is run and tested here on CUDA GPUs only"
        raise ConfigError(
            f"attn_implementation flex_attention cannot {'train' if training else 'run'} on {device_type}: {why}. "
            "Use sdpa here (auto does), and flex_attention on a CUDA GPU."
        )
    try:
        model = meta_model(model_config, task=task, attn_implementation=requested, trust_remote_code=trust_remote_code)
    except (ValueError, ImportError) as error:  # what transformers raises for an implementation it cannot use
        if requested is None:
            raise
        model = meta_model(model_config, task=task, trust_remote_code=trust_remote_code)
        supported = _supported_attn_implementations(model)
        if requested in supported:  # supported by the class, refused for another reason: transformers says which
            raise ConfigError(
                f"attn_implementation {requested!r} cannot be used here: {' '.join(str(error).split())}. Choose "
                "another, or leave attn_implementation unset to choose automatically."
            ) from None
        raise ConfigError(
            f"attn_implementation {requested!r}: {type(model).__name__} does not support it (it supports "
            f"{', '.join(supported)}). Choose one of those, or leave attn_implementation unset to choose "
            "automatically."
        ) from None
    chosen = model.config._attn_implementation
    name = type(model).__name__
    if requested is not None:
        return chosen, f"{chosen} (requested)"
    flex_wanted = packs_examples and device_type == "cuda" and not tensor_parallel and not generates
    if flex_wanted and "flex_attention" in _supported_attn_implementations(model):
        return "flex_attention", (
            f"flex_attention (auto: packed rows on CUDA, and {name} supports it: a block mask keeps the examples "
            "apart without sdpa's dense mask)"
        )
    if chosen == "sdpa":
        why = "" if not flex_wanted else f"; {name} does not support flex_attention, which packed rows would use"
        return chosen, f"sdpa (auto: {name} supports it{why})"
    return chosen, f"{chosen} (auto: {name} does not support sdpa)"


def _supported_attn_implementations(model: torch.nn.Module) -> list[str]:
    flags = {
        "sdpa": "_supports_sdpa",
        "flex_attention": "_supports_flex_attn",
        "flash_attention_2": "_supports_flash_attn",
        "flash_attention_3": "_supports_flash_attn",
    }
    return ["eager"] + [name for name, flag in flags.items() if getattr(model, flag, False)]


def _check_flash_attention(name: str) -> None:
    """Checked here rather than left to transformers, which without the package may fetch a kernel from the Hub
    instead, and which only finds a missing GPU once the weights have loaded."""
    package, available, requirement, install = _FLASH[name]
    if not torch.cuda.is_available():
        raise ConfigError(
            f"attn_implementation {name} needs a CUDA GPU, and this machine has none visible. Use sdpa here (or "
            "leave attn_implementation unset to choose automatically)."
        )
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"attn_implementation {name} needs the {package} package, which is not installed: {install}, or use "
            "sdpa (or leave attn_implementation unset to choose automatically)."
        )
    if not available():
        raise ConfigError(
            f"attn_implementation {name} needs {requirement}, and transformers cannot use the installed {package}: "
            f"reinstall it ({install}), or use sdpa."
        )


# Architectures whose attention ignores position_ids, so packed examples would attend to each other whatever the
# implementation: OPT builds its causal mask without them, Bloom's ALiBi bias is computed from the row.
