"""A model's shapes, read from a weightless copy built on the meta device: every parameter's shape, the module that
owns it, the decoder layer class, the embeddings and the linear layers LoRA adapts. A Hub id, a folder with a
config.json or a config.json file; the shapes of the Hub models the shipped configs name are in model_shapes/."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.models.experts import (
    ExpertRouting,
    active_parameter_count,
    expert_routing,
    is_routed_expert_parameter,
)
from fsdp_recipes.models.modeling import auto_model_class, load_model_config
from fsdp_recipes.models.vision import vision_block_classes
from fsdp_recipes.tools.estimator.vision import VisionShapes, is_image_side, vision_shapes


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    def rows_on(self, rank: int, shards: int) -> int:
        """Rows of dim 0 that `rank` holds when split over `shards` (torch.chunk: ceil-sized chunks, last ones short
        or empty)."""
        rows = self.shape[0] if self.shape else 1
        chunk = -(-rows // shards)
        return max(0, min(chunk, rows - rank * chunk))

    def padded_rows(self, shards: int) -> int:
        rows = self.shape[0] if self.shape else 1
        return -(-rows // shards)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1


@dataclass
class ModelInfo:
    """Shapes of a causal LM, read from a weightless copy on the meta device."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    no_split_modules: list[str]
    params: list[Param]
    module_params: dict[str, list[Param]]  # module path -> its own (direct) parameters
    module_class: dict[str, str]  # module path -> class name
    embedding_path: str | None
    output_path: str | None
    final_norm_path: str | None
    linear_shapes_in_layers: list[tuple[int, int]]  # (in, out) of every nn.Linear inside the layers (for LoRA)
    linear_names_in_layers: list[str] = field(default_factory=list)  # their module names (q_proj, ...), same order
    routing: ExpertRouting | None = None  # mixture of experts: experts per layer, experts per token
    config: Any = None  # the model config it was read from
    vision_blocks: list[str] = field(default_factory=list)  # a vision-language model's vision block class (wrapped too)
    vision: VisionShapes | None = None  # a vision-language model's image side (estimator.vision)
    linear_image_side: list[bool] = field(default_factory=list)  # per linear above: under the tower or projector

    @property
    def wrap_classes(self) -> list[str]:
        """What the recipes wrap when the Accelerate config names no class (models.modeling.resolve_wrap_classes):
        the _no_split_modules the model has, sorted, and its vision blocks."""
        present = set(self.module_class.values())
        own = sorted(name for name in self.no_split_modules if name in present)
        return own + [name for name in self.vision_blocks if name not in own]

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def mlp_width_per_token(self) -> int:
        """The MLP width one token runs through in a layer: the intermediate size of a dense model; for a mixture of
        experts, its top-k routed experts' widths plus its shared experts' (Qwen2-MoE's shared_expert_intermediate_size,
        DeepSeek's n_shared_experts x moe_intermediate_size). Mixtral and gpt-oss name the expert width
        intermediate_size."""
        if self.routing is None or self.config is None:
            return self.intermediate_size
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        expert = int(getattr(text, "moe_intermediate_size", None) or self.intermediate_size)
        shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
        shared += int(getattr(text, "n_shared_experts", None) or 0) * expert
        return self.routing.experts_per_token * expert + shared

    @property
    def active_params(self) -> int:
        """Parameters a token runs through (a mixture of experts: the routed experts' top-k share)."""
        return active_parameter_count(((p.name, p.numel) for p in self.params), self.routing)


def tensor_parallel_local(info: ModelInfo, tp: int, ep: int = 1) -> ModelInfo:
    """The shapes one rank of a TP/EP group holds: every matrix split `tp` ways (transformers' plans split the linear
    layers, the embeddings and the output layer along one dimension, counted here as dim 0, which FSDP then shards),
    vectors (norms) whole; under expert parallelism the routed experts split `ep` ways by expert instead (the EP plan
    takes precedence over the TP plan for them; fused experts hold the expert index in dim 0)."""
    if tp <= 1 and ep <= 1:
        return info

    def local(param: Param) -> Param:
        if len(param.shape) < 2:
            return param
        ways = ep if ep > 1 and is_routed_expert_parameter(param.name) else tp
        return Param(param.name, (-(-param.shape[0] // ways), *param.shape[1:]))

    return dataclasses.replace(
        info,
        params=[local(p) for p in info.params],
        module_params={path: [local(p) for p in own] for path, own in info.module_params.items()},
    )


def load_model_info(model: str, *, trust_remote_code: bool = False) -> ModelInfo:
    """`model` is a Hub id, a folder with config.json, or a config.json file."""
    config = _load_config(model, trust_remote_code=trust_remote_code)
    return model_info_from_config(config, trust_remote_code=trust_remote_code)


def _load_config(model: str, *, trust_remote_code: bool = False):
    path = Path(model).expanduser()
    looks_local = model.startswith(("/", "./", "../", "~")) or model.endswith(".json") or model.count("/") > 1
    if looks_local and not path.exists():
        raise ConfigError(
            f"model {model!r}: no such file or folder. Give a config.json, a folder holding one, or a Hub model id."
        )
    try:
        if path.is_file():
            return load_model_config(None, str(path), trust_remote_code=trust_remote_code)
        return load_model_config(str(path) if path.is_dir() else model, None, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, EnvironmentError...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"could not read a model config from {model!r} ({first_line}). Give a config.json, a folder holding one, "
            "or a Hub model id (the Hub needs network access, or the model in the local cache)."
        ) from None


def model_info_from_config(config, *, trust_remote_code: bool = False) -> ModelInfo:
    try:
        with torch.device("meta"):
            # a vision-language model whole (both towers): AutoModelForImageTextToText where AutoModelForCausalLM has none
            model = auto_model_class("causal-lm", config).from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise ConfigError(
            f"{config.model_type} is not a causal language model transformers can build: {error}"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    seen: set[int] = set()
    params: list[Param] = []
    module_params: dict[str, list[Param]] = {}
    module_class: dict[str, str] = {}
    for path, module in model.named_modules():
        module_class[path] = type(module).__name__
        own = []
        for name, tensor in module.named_parameters(recurse=False):
            if id(tensor) in seen:  # tied: counted once, where first seen
                continue
            seen.add(id(tensor))
            param = Param(f"{path}.{name}" if path else name, tuple(tensor.shape))
            own.append(param)
            params.append(param)
        module_params[path] = own
    paths = {id(m): p for p, m in model.named_modules()}
    embed, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and out is not None and embed.weight is out.weight
    base_prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_prefix, None) if base_prefix else model
    final_norm = None
    if isinstance(base, torch.nn.Module):
        for _, child in base.named_children():
            if "Norm" in type(child).__name__:
                final_norm = child
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    inside_layers = {
        id(inner)
        for path, layer in model.named_modules()
        if path and type(layer).__name__ in no_split
        for inner in layer.modules()
        if inner is not layer
    }
    layer_paths = [
        path
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not out and id(module) in inside_layers
    ]
    modules = dict(model.named_modules())
    layer_linears = [(path.rsplit(".", 1)[-1], modules[path]) for path in layer_paths]
    linears = [(module.in_features, module.out_features) for _, module in layer_linears]
    return ModelInfo(
        model_type=str(config.model_type),
        hidden_size=hidden,
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab_size=int(text.vocab_size),
        tied_embeddings=tied,
        no_split_modules=no_split,
        vision_blocks=vision_block_classes(model),
        params=params,
        module_params=module_params,
        module_class=module_class,
        embedding_path=paths.get(id(embed)) if embed is not None else None,
        output_path=paths.get(id(out)) if out is not None else None,
        final_norm_path=paths.get(id(final_norm)) if final_norm is not None else None,
        linear_shapes_in_layers=linears,
        linear_names_in_layers=[name for name, _ in layer_linears],
        routing=expert_routing(config),
        config=config,
        vision=vision_shapes(model, config),
        linear_image_side=[is_image_side(path) for path in layer_paths],
    )
