"""LoRA and QLoRA (peft) for every training recipe, under FSDP2.

A recipe calls `adapters.apply(model, config, task=...)` between loading the model and `accelerator.prepare`; with
`use_peft: false` it returns the model unchanged. Everything else follows from the model being a peft model:

- FSDP2 units stay the decoder layers of the Accelerate config: frozen base weights and trainable adapters share a
  unit (FSDP2 shards per parameter, and frozen parameters may have another dtype than trainable ones). Trainable
  parameters are made fp32, so one unit never holds two trainable dtypes (which FSDP2 refuses).
- The base is loaded in the compute dtype of the Accelerate config's mixed precision (bf16 under `bf16`): frozen
  weights need no fp32 master copy. QLoRA (`load_in_4bit`) stores them in 4 bits, in a floating storage dtype so that
  FSDP2 shards them (with bitsandbytes' default uint8 storage accelerate leaves them whole on every rank).
- Checkpoints hold the trainable state and its optimizer state, not the frozen base (`checkpoint_state_filter`).
- The export at the end of a run (fsdp_recipes.models.adapter_export) gathers every adapter tensor from the shards of
  all ranks, writes a peft adapter folder, reads it back onto a fresh copy of the base and compares its logits with the
  trained model's; optionally the merged model too (`export_merged_model`), compared the same way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANT_TYPES = ("nf4", "fp4")
QUANT_STORAGE = (*DTYPES, "uint8")
_PEFT_TASK = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}


def adapter_config_problems(config) -> list[str]:
    """Problems with the LoRA/QLoRA values themselves (no files read), for `TrainingConfig.cross_field_problems`."""
    problems = []
    if config.load_in_4bit and not config.use_peft:
        problems.append(
            "load_in_4bit quantises a frozen base for QLoRA: set use_peft: true as well (4-bit weights "
            "cannot be trained in full)"
        )
    if config.export_merged_model and not config.use_peft:
        problems.append("export_merged_model merges LoRA adapters: it needs use_peft: true")
    if not config.use_peft and (config.lora_target_modules or config.lora_modules_to_save):
        problems.append(
            "lora_target_modules and lora_modules_to_save choose what LoRA adapts: set use_peft: true, or "
            "remove them (without LoRA every weight is trained)"
        )
    if not config.use_peft:
        return problems
    if config.lora_r < 1:
        problems.append(f"lora_r must be >= 1, got {config.lora_r} (the adapter rank: 8 to 64 are usual)")
    if config.lora_alpha <= 0:
        problems.append(f"lora_alpha must be > 0, got {config.lora_alpha} (the adapter scale is lora_alpha / lora_r)")
    if not 0 <= config.lora_dropout < 1:
        problems.append(f"lora_dropout must be in [0, 1), got {config.lora_dropout}")
    if config.model_name_or_path is None:
        problems.append(
            "use_peft adapts pretrained weights: set model_name_or_path to a model folder or Hub id (a "
            "model built from model_config has random weights that no adapter folder could be loaded onto)"
        )
    if config.lora_target_modules is not None and not config.lora_target_modules:
        problems.append(
            "lora_target_modules is an empty list: name modules (e.g. [q_proj, v_proj]) or null for every "
            "linear layer of the decoder blocks"
        )
    if config.load_in_4bit:
        if config.bnb_4bit_quant_type not in QUANT_TYPES:
            problems.append(
                f"bnb_4bit_quant_type {config.bnb_4bit_quant_type!r} is not one of {', '.join(QUANT_TYPES)}"
            )
        if config.bnb_4bit_compute_dtype not in DTYPES:
            problems.append(
                f"bnb_4bit_compute_dtype {config.bnb_4bit_compute_dtype!r} is not one of {', '.join(DTYPES)}"
            )
        if config.bnb_4bit_quant_storage not in (None, *QUANT_STORAGE):
            problems.append(
                f"bnb_4bit_quant_storage {config.bnb_4bit_quant_storage!r} is not null or one of "
                f"{', '.join(QUANT_STORAGE)}"
            )
    return problems


def check_before_loading(config, model_config, *, task: str, is_fsdp: bool, trust_remote_code: bool = False) -> None:
    """Collective-free checks on a weightless copy: the target modules exist, QLoRA can run here. Raises ConfigError."""
    if not config.use_peft:
        return
    if config.load_in_4bit:
        if is_fsdp and (config.bnb_4bit_quant_storage or config.bnb_4bit_compute_dtype) == "uint8":
            raise ConfigError(
                "bnb_4bit_quant_storage uint8 under FSDP: FSDP shards only floating-point tensors, so the 4-bit "
                "weights would stay whole on every rank (and are reported to train silently wrong). Set "
                f"bnb_4bit_quant_storage: {config.bnb_4bit_compute_dtype} (or null: the compute dtype)"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                "load_in_4bit needs the bitsandbytes package: pip install -r requirements-qlora.txt "
                "(or train LoRA without quantisation: load_in_4bit: false)"
            )
    from fsdp_recipes.models.modeling import meta_model

    base = meta_model(model_config, task=task, trust_remote_code=trust_remote_code)
    check_module_names(base, config)
    _peft_model(base, config, task)


def check_module_names(model: torch.nn.Module, config) -> None:
    """ConfigError naming every entry of lora_target_modules and lora_modules_to_save that matches no module of
    `model` (peft matches a name or a dotted suffix of one, and skips a name that matches nothing as long as another
    matches), with the names that exist."""
    modules = [name for name, _ in model.named_modules() if name]

    def unmatched(names):
        return [name for name in names or [] if not any(m == name or m.endswith("." + name) for m in modules)]

    problems = []
    missing_targets = unmatched(config.lora_target_modules)
    if missing_targets:
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        )
        problems.append(
            f"lora_target_modules names {', '.join(map(repr, missing_targets))}, which match no module of "
            f"this {model.config.model_type} model. Its linear modules are: {', '.join(linear)}; set "
            "lora_target_modules to some of them (or null for all of them)"
        )
    missing_saved = unmatched(config.lora_modules_to_save)
    if missing_saved:
        owners = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if name and any(True for _ in module.parameters(recurse=False))
            }
        )
        problems.append(
            f"lora_modules_to_save names {', '.join(map(repr, missing_saved))}, which match no module of "
            f"this {model.config.model_type} model (it would be reported as trained in full, and is not). "
            f"Its modules with weights are: {', '.join(owners)}; name some of them, or null"
        )
    if problems:
        raise ConfigError(problems)


def _peft_model(model: torch.nn.Module, config, task: str):
    from peft import get_peft_model
    from peft.tuners.tuners_utils import NoMatchingPeftModuleError

    try:
        vision_language = getattr(model.config, "vision_config", None) is not None
        return get_peft_model(model, lora_config(config, task, vision_language=vision_language))
    except (NoMatchingPeftModuleError, ValueError) as error:
        names = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        )
        message = str(error).strip().splitlines()[0]
        if "ParamWrapper" in message and "dropout" in message:  # peft 0.21 on fused MoE expert weights
            raise ConfigError(
                f"LoRA on this {model.config.model_type} model's experts: peft wraps a mixture of experts' fused "
                "expert weights (lora.ParamWrapper, what lora_target_modules null, all-linear, includes) only with "
                "lora_dropout 0. Set lora_dropout: 0, or leave the experts out by naming the modules to adapt in "
                "lora_target_modules (e.g. [q_proj, k_proj, v_proj, o_proj])"
            ) from None
        raise ConfigError(
            f"LoRA cannot be applied to this {model.config.model_type} model: {message}. Its linear "
            f"modules are: {', '.join(names)}; set lora_target_modules to some of them (or null for "
            "all of them)"
        ) from None


# module paths of a vision-language model's image side (models.vision's names), which all-linear LoRA leaves alone
NOT_LANGUAGE_MODEL = r".*\b(vision_tower|visual|vision_model|multi_modal_projector|merger|connector)\b.*"


def lora_config(config, task: str, *, vision_language: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        task_type=_PEFT_TASK[task],
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules or "all-linear",
        # all-linear on a vision-language model: its language model's layers only, not the image encoder's
        exclude_modules=NOT_LANGUAGE_MODEL if vision_language and not config.lora_target_modules else None,
        modules_to_save=config.lora_modules_to_save,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
    )


def quantization_config(config):
    """The bitsandbytes settings for `from_pretrained` (QLoRA), or None."""
    if not (config.use_peft and config.load_in_4bit):
        return None
    from transformers import BitsAndBytesConfig

    compute = DTYPES[config.bnb_4bit_compute_dtype]
    storage = config.bnb_4bit_quant_storage or config.bnb_4bit_compute_dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_use_double_quant=config.use_bnb_nested_quant,
        bnb_4bit_quant_storage=torch.uint8 if storage == "uint8" else DTYPES[storage],
    )


def base_dtype(config, mixed_precision: str) -> torch.dtype:
    """The dtype of the weights as loaded. Full training: fp32 (FSDP's mixed precision keeps fp32 master weights).
    LoRA: the frozen base needs no master copy, so it is loaded in the compute dtype (QLoRA: bnb_4bit_compute_dtype
    for what is not quantised)."""
    if not config.use_peft:
        return torch.float32
    if config.load_in_4bit:
        return DTYPES[config.bnb_4bit_compute_dtype]
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def loading_options(config, accelerator) -> dict[str, Any]:
    """`modeling.load_model` keywords for this config: the base's dtype, and QLoRA's quantisation."""
    return dict(
        dtype=base_dtype(config, accelerator.mixed_precision),
        quantization_config=quantization_config(config),
        device=accelerator.device,
    )


def apply(model: torch.nn.Module, config, *, task: str) -> torch.nn.Module:
    """The model with LoRA adapters (a peft model) when `use_peft`, else `model` itself. Call it before
    `accelerator.prepare` and before building the optimizer (which takes only trainable parameters)."""
    if not config.use_peft:
        return model
    if config.gradient_checkpointing:
        # The frozen embedding's output needs requires_grad, or checkpointed layers get no gradient path.
        model.enable_input_require_grads()
    model = _peft_model(model, config, task)
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()  # one trainable dtype per FSDP2 unit; fp32 optimizer math
    return model


def check_not_an_adapter_folder(name: str, *, setting: str, role: str) -> None:
    """ConfigError when `name` is a LoRA adapter folder where a whole model is needed (`role`, e.g. the teacher),
    naming the base it records and whether that base is here."""
    adapter_config = Path(name).expanduser() / "adapter_config.json"
    if not adapter_config.is_file():
        return
    base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    missing = bool(base) and not steps.looks_like_hub_id(base) and not Path(base).expanduser().exists()
    raise ConfigError(
        f"{setting} {name!r} is a LoRA adapter folder (for the base model {base!r}"
        f"{', which does not exist here' if missing else ''}): {role} is loaded as a whole model. Give the merged "
        f"model instead: {Path(name) / 'merged'} when the adapter's run had export_merged_model: true, or merge it "
        "into its base yourself (peft's merge_and_unload)"
    )


def is_adapter_model(model: torch.nn.Module) -> bool:
    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def describe(config) -> str | None:
    """One line for the run summary, or None without LoRA."""
    if not config.use_peft:
        return None
    targets = ", ".join(config.lora_target_modules) if config.lora_target_modules else "all-linear"
    kind = "DoRA" if config.use_dora else "LoRA"
    line = f"{kind} r={config.lora_r} alpha={config.lora_alpha}{' (rsLoRA)' if config.use_rslora else ''} on {targets}"
    if config.lora_modules_to_save:
        line += f", {', '.join(config.lora_modules_to_save)} trained in full"
    if config.load_in_4bit:
        storage = config.bnb_4bit_quant_storage or config.bnb_4bit_compute_dtype
        line += (
            f"; base in 4 bits (QLoRA {config.bnb_4bit_quant_type}, compute {config.bnb_4bit_compute_dtype}, "
            f"storage {storage}{', nested' if config.use_bnb_nested_quant else ''})"
        )
    return line


def register_generate_as_forward(model: torch.nn.Module) -> None:
    """peft's `generate` calls the base model directly, past the FSDP2 root (the peft model) whose forward hooks
    gather the parameters it holds itself: make `generate` run those hooks. No-op for other models and without FSDP2."""
    if is_adapter_model(model):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameters (whole tensors, whatever the sharding), for the run summary."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_parameters": trainable, "total_parameters": total}


@contextlib.contextmanager
def checkpoint_state_filter(accelerator):
    """Within it, `accelerator.save_state` / `load_state` write and read only the adapters (the trainable state) of
    a prepared peft model under FSDP, not a copy of the frozen base. accelerate's FSDP model save has an
    `adapter_only` switch that `save_state` does not expose, so it is turned on here for the duration."""
    from accelerate import accelerator as accelerator_module
    from accelerate.utils import DistributedType

    prepared = getattr(accelerator, "_models", [])  # what save_state saves: the models given to prepare
    if accelerator.distributed_type != DistributedType.FSDP or not any(
        is_adapter_model(accelerator.unwrap_model(model)) for model in prepared
    ):
        yield
        return
    saved = accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model
    accelerator_module.save_fsdp_model = functools.partial(saved[0], adapter_only=True)
    accelerator_module.load_fsdp_model = functools.partial(saved[1], adapter_only=True)
    try:
        yield
    finally:
        accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model = saved


def merge_into(model: torch.nn.Module, adapter_folder: str | Path) -> torch.nn.Module:
    """`model` (the base, loaded unsharded) with the adapter in `adapter_folder` merged into its weights: a plain model
    that FSDP shards like any other, for evaluation."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_folder)).merge_and_unload()
