"""Tokenizer and model loading (Hub id, local folder, or a config to initialise from), and the FSDP wrap classes
resolved against the real model before any weights are read."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from fsdp_recipes.common import steps
from fsdp_recipes.common.errors import ConfigError, InputError
from fsdp_recipes.models import experts
from fsdp_recipes.models.vision import vision_block_classes

# What a recipe trains: the transformers Auto class that builds it, and the Hub's pipeline tag for its card.
TASKS = {
    "causal-lm": (AutoModelForCausalLM, "text-generation"),
    "sequence-classification": (AutoModelForSequenceClassification, "text-classification"),
}


def auto_model_class(task: str, config: PretrainedConfig | None = None):
    """The transformers Auto class that builds `task`'s model; for a causal LM whose `config` is a vision-language
    model's that AutoModelForCausalLM does not build (Llava, Qwen2.5-VL, Idefics3...), AutoModelForImageTextToText:
    the whole model, both towers, which generates text."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {sorted(TASKS)}")
    if task == "causal-lm" and config is not None and is_vision_language(config):
        if type(config) not in AutoModelForCausalLM._model_mapping:
            return AutoModelForImageTextToText
    return TASKS[task][0]


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether the model sees images: its config has a vision tower's (`vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def model_class_for(config: PretrainedConfig, task: str):
    """The transformers class `task`'s auto class builds for `config`; None for a type it does not map (remote
    code)."""
    try:
        return auto_model_class(task, config)._model_mapping[type(config)]
    except KeyError:
        return None


def checkpoint_lacks_task_weights(config: PretrainedConfig, task: str) -> bool:
    """Whether a checkpoint of `config` lacks weights the task's model has: a classification head on a checkpoint
    saved by another architecture (a causal LM), which loading initialises anew."""
    architectures = getattr(config, "architectures", None) or []
    return task == "sequence-classification" and not any(a.endswith("ForSequenceClassification") for a in architectures)


def pipeline_tag(task: str) -> str:
    return TASKS[task][1]


def meta_model(
    config: PretrainedConfig,
    *,
    task: str = "causal-lm",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """A weightless copy of the model (on the meta device): its structure, for checks before any weights load. The
    config is copied: from_config writes the attention implementation it settles on into the config it is given."""
    with torch.device("meta"):
        return auto_model_class(task, config).from_config(
            copy.deepcopy(config), attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )


def load_tokenizer(
    name_or_path: str,
    *,
    revision: str = "main",
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    setting: str = "tokenizer_name_or_path",
    chat_template_path: str | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer, with the config's chat template if given (else its own, if any) and a pad token. Data that
    needs a template and finds none is refused when it is tokenised (fsdp_recipes.data.chat). `setting`: the config
    field that named it, for the message if it cannot be loaded."""
    with steps.step(
        f"loading the tokenizer from {name_or_path!r} ({setting})",
        name=name_or_path,
        setting=setting,
        explain=_model_files_problem,
    ):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    if chat_template_path is not None:  # TRL's field: a .jinja file, or a tokenizer (folder or Hub id) to take it from
        with steps.step(
            f"reading chat_template_path {chat_template_path!r}", name=chat_template_path, setting="chat_template_path"
        ):
            source = Path(chat_template_path).expanduser()
            if source.is_file():
                tokenizer.chat_template = source.read_text()
            elif not source.exists() and (
                chat_template_path.endswith(".jinja") or not steps.looks_like_hub_id(chat_template_path)
            ):
                raise InputError(
                    f"chat_template_path: there is no such local file ({source.resolve()}): point it at a .jinja "
                    "file, or at a tokenizer folder or Hub id whose template to use"
                )
            else:
                tokenizer.chat_template = AutoTokenizer.from_pretrained(
                    chat_template_path, trust_remote_code=trust_remote_code
                ).chat_template
    if chat_template is not None:
        if _is_inline_template(chat_template):  # the handbook's recipes write the template itself in the YAML
            tokenizer.chat_template = chat_template
        else:
            with steps.step(f"reading chat_template {chat_template!r}", name=chat_template, setting="chat_template"):
                template_path = Path(chat_template).expanduser()
                if not template_path.is_file():
                    raise InputError(
                        f"chat_template: there is no such file ({template_path.resolve()}); give a path to a .jinja "
                        "file, or the template itself (Jinja text, with {% ... %} or {{ ... }})"
                    )
                tokenizer.chat_template = template_path.read_text()
    if tokenizer.pad_token is None:
        # Padding never carries loss and never attends to real tokens, so any id will do; eos is always there.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _is_inline_template(value: str) -> bool:
    """Jinja text rather than a path: it holds a tag or an expression (no template is without one)."""
    return "{%" in value or "{{" in value


def load_model_config(
    model_name_or_path: str | None,
    model_config: str | None,
    *,
    revision: str = "main",
    trust_remote_code: bool = False,
    setting: str | None = None,
) -> PretrainedConfig:
    """The model's config (no weights): from `model_config` (a config.json) if given, else from `model_name_or_path`
    (a folder or Hub id). `setting`: the config field that named it, for the message if it cannot be loaded."""
    name = model_config if model_config is not None else model_name_or_path
    setting = setting or ("model_config" if model_config is not None else "model_name_or_path")
    with steps.step(
        f"loading the model config from {name!r} ({setting})", name=name, setting=setting, explain=_model_files_problem
    ):
        if model_config is not None:
            return AutoConfig.from_pretrained(model_config, trust_remote_code=trust_remote_code)
        return AutoConfig.from_pretrained(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)


def _model_files_problem(error: BaseException, step: steps.Step) -> steps.Problem | None:
    """What transformers says of a local folder that holds no model config or no tokenizer."""
    text = " ".join(str(error).split())
    if isinstance(error, ValueError) and text.startswith("Couldn't instantiate the backend tokenizer"):
        fix = (
            "Set tokenizer_name_or_path to the tokenizer the model was trained with (a folder or Hub id)"
            if step.setting != "tokenizer_name_or_path"
            else "Point tokenizer_name_or_path at a folder with one"
        )
        return steps.Problem(
            "it holds no tokenizer files (tokenizer.json, or a vocabulary its tokenizer_config.json names)", fix
        )
    if isinstance(error, ValueError) and text.startswith("Unrecognized model in"):
        return steps.Problem(
            "it has no config.json naming a model_type, so it is not a model folder",
            f"Point {step.setting} at a model folder (with config.json) or a Hub id",
        )
    if isinstance(error, OSError) and "does not appear to have a file named" in text:
        return steps.Problem(
            text.split(". Checkout")[0].rstrip("."), f"Point {step.setting} at a complete model folder or Hub id"
        )
    return None


def module_class_names(
    config: PretrainedConfig, *, task: str = "causal-lm", trust_remote_code: bool = False
) -> tuple[set[str], list[str], list[str]]:
    """(class names of every submodule, the model's `_no_split_modules`, its vision tower's block class if it has
    one) from a weightless copy on the meta device."""
    model = meta_model(config, task=task, trust_remote_code=trust_remote_code)
    names = {type(module).__name__ for module in model.modules()}
    return names, list(getattr(model, "_no_split_modules", None) or []), vision_block_classes(model)


def resolve_wrap_classes(
    accelerator: Accelerator, config: PretrainedConfig, *, task: str = "causal-lm", trust_remote_code: bool = False
):
    """The transformer-layer classes FSDP will wrap, checked against the model. Raises ConfigError before any weights
    load if the Accelerate config names a class the model does not contain, or leaves out a vision-language model's
    vision blocks (its whole image encoder would sit in the root unit). Without classes named there: the model's
    `_no_split_modules` that it contains (a vision-language model's list can name classes of a tower it lacks, as
    Llava's names CLIP's text embeddings) and its vision tower's blocks. None when not wrapping by class."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.auto_wrap_policy
    policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", str(policy))
    if "transformer" not in str(policy_name).lower():
        return None
    present, no_split, vision_blocks = module_class_names(config, task=task, trust_remote_code=trust_remote_code)
    # sorted: a model's _no_split_modules may be a set, whose order changes from one process to the next
    own = sorted(name for name in no_split if name in present) + [n for n in vision_blocks if n not in no_split]
    requested = plugin.transformer_cls_names_to_wrap or own
    if not requested:
        raise ConfigError(
            f"the Accelerate config wraps by transformer layer class but names none, and {config.model_type} models "
            "declare no _no_split_modules: set fsdp_transformer_layer_cls_to_wrap to the model's decoder layer class."
        )
    missing = [name for name in requested if name not in present]
    if missing:
        suggestion = ", ".join(own) if own else "its decoder layer class"
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which this {config.model_type} model "
            f"does not contain. Set it to {suggestion} in the Accelerate config (or omit it to use the model's "
            "_no_split_modules and vision blocks)."
        )
    left_out = [name for name in vision_blocks if name not in requested]
    if left_out:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(requested)} but not the vision tower's blocks "
            f"({', '.join(left_out)}): the whole image encoder would stay in the root FSDP unit, gathered at every "
            f"forward. Add {', '.join(left_out)} to it in the Accelerate config (or omit it to wrap {', '.join(own)})."
        )
    return list(requested)


def parameter_shapes(
    config: PretrainedConfig, *, task: str = "causal-lm", trust_remote_code: bool = False
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter and buffer, from a weightless copy (what a checkpoint must match)."""
    model = meta_model(config, task=task, trust_remote_code=trust_remote_code)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_same_shapes(
    saved: PretrainedConfig, current: PretrainedConfig, *, task: str = "causal-lm", trust_remote_code: bool = False
) -> None:
    """ConfigError naming the first differences if a model of `current` cannot load weights saved from `saved`.
    A classifier's head rows follow the classes of its data, which are read later: the recipe checks those itself."""
    if task == "sequence-classification":
        current = copy.deepcopy(current)
        current.num_labels = saved.num_labels
    before = parameter_shapes(saved, task=task, trust_remote_code=trust_remote_code)
    now = parameter_shapes(current, task=task, trust_remote_code=trust_remote_code)
    differences = [
        f"{name}: {before.get(name)} in the checkpoint, {now.get(name)} now"
        for name in sorted(before.keys() | now.keys())
        if before.get(name) != now.get(name)
    ]
    if differences:
        shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
        raise ConfigError(
            f"the checkpoint holds a model of other shapes than this run builds ({len(differences)} tensors differ: "
            f"{shown}). Resume with the model settings it was trained with (its config is in the checkpoint's model/ "
            "folder), or start a new run in another output_dir."
        )


def tied_duplicate_names(
    config: PretrainedConfig, *, task: str = "causal-lm", trust_remote_code: bool = False
) -> set[str]:
    """State-dict names that share storage with an earlier name (tied embeddings): written once, as save_pretrained
    does for an unsharded model. Gathered FSDP state dicts hold them as separate copies, so they are found on a
    weightless copy of the model instead."""
    model = meta_model(config, task=task, trust_remote_code=trust_remote_code)
    seen, duplicates = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            duplicates.add(name)
        seen.add(id(tensor))
    return duplicates


def dequantized_for_training(config: PretrainedConfig):
    """What `from_pretrained` needs told to train a checkpoint released quantized: gpt-oss ships its experts in MXFP4,
    which transformers keeps packed (inference only) where Triton and the `kernels` package are installed, as on most
    GPU machines, and dequantizes to plain weights elsewhere. Training asks for the plain weights everywhere
    (`Mxfp4Config(dequantize=True)`, as TRL's gpt-oss recipes do); the export then holds plain weights too. None for
    a checkpoint that is not quantized so."""
    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if str(getattr(method, "value", method)) != "mxfp4":
        return None
    from transformers import Mxfp4Config

    return Mxfp4Config(dequantize=True)


def load_model(
    config: PretrainedConfig,
    *,
    model_name_or_path: str | None,
    task: str = "causal-lm",
    revision: str = "main",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    quantization_config=None,
    device=None,
    ignore_mismatched_sizes: bool = False,
    distributed_config=None,
) -> torch.nn.Module:
    """Weights in fp32 by default: FSDP's mixed-precision policy (from the Accelerate YAML) casts for compute and keeps
    fp32 master weights (a frozen LoRA base is loaded in its compute dtype instead: fsdp_recipes.models.adapters). Create the
    Accelerator first, so that low-RAM loading under FSDP can see the process group. `quantization_config` (QLoRA)
    quantises while loading, on `device`. `ignore_mismatched_sizes`: weights of another shape than `config` gives them
    (a classifier's head for other classes) are initialised anew instead of refused. `distributed_config`
    (tensor parallelism: fsdp_recipes.distributed.tensor_parallel) has transformers shard the model while loading."""
    model_class = auto_model_class(task, config)
    if model_name_or_path is None and distributed_config is not None:
        raise ValueError("a model sharded while loading needs weights to load: save the initialised model first")
    if model_name_or_path is None:
        return model_class.from_config(
            config, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, dtype=dtype
        )
    quantized = (
        {}
        if quantization_config is None
        else dict(quantization_config=quantization_config, device_map={"": device if device is not None else "cpu"})
    )
    if quantization_config is None and (dequantized := dequantized_for_training(config)) is not None:
        quantized = {"quantization_config": dequantized}
    return model_class.from_pretrained(
        model_name_or_path,
        config=config,
        revision=revision,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        **quantized,
        **({"ignore_mismatched_sizes": True} if ignore_mismatched_sizes else {}),
        **({"distributed_config": distributed_config} if distributed_config is not None else {}),
    )


_PACKING_NOT_ISOLATED = {
    "opt": "OPT builds its causal mask without position_ids",
    "bloom": "Bloom's ALiBi bias ignores position_ids",
}


def check_packing_is_isolated(config: PretrainedConfig) -> None:
    reason = _PACKING_NOT_ISOLATED.get(config.model_type)
    if reason:
        raise ConfigError(
            f"packing is on, but in {config.model_type} models packed examples would attend to each other ({reason}). "
            "Set packing: false for this model."
        )


def fsdp_activation_checkpointing(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP and bool(
        accelerator.state.fsdp_plugin.activation_checkpointing
    )


def check_one_activation_checkpointing(accelerator: Accelerator, *, model_gradient_checkpointing: bool) -> None:
    """Exactly one activation-checkpointing mechanism: with both, transformers raises deep inside prepare()."""
    if model_gradient_checkpointing and fsdp_activation_checkpointing(accelerator):
        raise ConfigError(
            "gradient_checkpointing is on in the recipe config and fsdp_activation_checkpointing in the Accelerate "
            "config: use one. Keep the Accelerate one (set gradient_checkpointing: false) under FSDP."
        )


def activation_checkpointing_mechanism(accelerator: Accelerator, model_gradient_checkpointing: bool) -> str:
    if fsdp_activation_checkpointing(accelerator):
        return "fsdp (Accelerate config)"
    return "model (gradient_checkpointing)" if model_gradient_checkpointing else "none"


def checkpoint_activations(model: torch.nn.Module, options: dict | None) -> None:
    """transformers' gradient checkpointing on `model`; `options` go to `gradient_checkpointing_enable` (None:
    non-reentrant, which FSDP2 and frozen inputs such as LoRA's need)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options or {"use_reentrant": False})


def count_non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters a token runs through, minus the input embedding table (a lookup, not a matmul), for FLOPs per
    token. A linear layer's weight counts as in_features x out_features: a 4-bit (QLoRA) weight is stored packed, two
    to four weights per element, and counting its elements undercounted a QLoRA run's FLOPs 2.4-fold (docs/gpu.md).
    Of a mixture of experts' routed experts only the share a token uses counts (`models.experts`: active, not
    total, parameters)."""
    embedding = model.get_input_embeddings().weight.numel()
    sizes = []
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            is_linear_weight = isinstance(module, torch.nn.Linear) and name == "weight"
            size = module.in_features * module.out_features if is_linear_weight else param.numel()
            sizes.append((f"{path}.{name}" if path else name, size))
    return experts.active_parameter_count(sizes, experts.expert_routing(model.config)) - embedding


def check_tokenizer_fits_model(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {vocab_size} rows: token ids "
            "past the embedding would crash training. Use the tokenizer that belongs to the model, or a model_config "
            f"with vocab_size >= {len(tokenizer)}."
        )
