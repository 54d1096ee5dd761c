"""What a recipe config runs, in the estimator's terms: the rows of one micro-batch and their width (`Workload`), the
LoRA adapters it trains (`Adapters`), and the activation checkpointing it adds to the launch. Everything is asked of
the config (`TrainingConfig.row_length()`, `micro_batch_rows()` and the fields every recipe shares): the estimator
knows no recipe's own fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools.estimator.shapes import ModelInfo, Param
from fsdp_recipes.train.config import TrainingConfig

LORA_RANK = 16


@dataclass(frozen=True)
class Workload:
    row_length: int = 1024  # tokens per row
    micro_batch_rows: int = 8  # rows one process runs forward per micro-step
    attn_implementation: str = "sdpa"
    gradient_accumulation_steps: int = 1
    loss_implementation: str = "chunked"
    loss_chunk_size: int = 1024
    generation_sequences: int = 0  # online RL: sequences of one generation pass (its KV cache)
    generation_tokens: int = 0  # ... and tokens each
    generation_gathers_weights: bool = False  # the whole model held on every rank for that pass
    loss_chunk_buffers: int = 1  # chunked loss: fp32 chunk x vocabulary tensors held at its peak (distillation: 7)
    packs_examples: bool = False  # rows hold several examples (auto attention takes flex for them on a GPU)

    @property
    def tokens(self) -> int:
        return self.row_length * self.micro_batch_rows


def workload_for(config: TrainingConfig) -> Workload:
    """The micro-batch a recipe config runs: its rows (a preference pair is two), each as wide as its row length
    (packed rows may be narrower than max_length)."""
    return Workload(
        int(config.row_length()),
        int(config.micro_batch_rows()),
        str(config.attn_implementation or "auto"),
        int(config.gradient_accumulation_steps),
        str(config.loss_implementation),
        int(config.loss_chunk_size),
        *config.generation_footprint(),
        loss_chunk_buffers=int(config.loss_chunk_buffers()),
        packs_examples=bool(config.packs_examples()),
    )


@dataclass(frozen=True)
class Adapters:
    """LoRA as the recipes apply it (fsdp_recipes.models.adapters): rank-`rank` A (rank x in) and B (out x rank) matrices,
    fp32 and trainable, on the linear layers of the decoder blocks named in `target_modules` (None: all of them but a
    vision-language model's image side, which `models.adapters.lora_config` leaves alone), plus DoRA's magnitude
    vector (out) per adapted layer; the base frozen at `frozen_bytes` per element (its compute dtype: no fp32 master
    copy, no gradient, no optimizer state). Modules trained in full beside the adapters (`lora_modules_to_save`) are
    not counted."""

    rank: int = LORA_RANK
    target_modules: tuple[str, ...] | None = None
    frozen_bytes: int = 2
    dora: bool = False

    def adapter_params(self, info: ModelInfo) -> list[Param]:
        if self.target_modules is None and info.routing is not None and info.config is not None:
            return self._adapters_peft_makes(info)
        shapes = info.linear_shapes_in_layers
        names = info.linear_names_in_layers or [""] * len(shapes)
        image_side = info.linear_image_side or [False] * len(shapes)
        params = []
        for index, ((fan_in, fan_out), name) in enumerate(zip(shapes, names)):
            if self.target_modules is not None and name not in self.target_modules:
                continue
            if self.target_modules is None and image_side[index]:  # all-linear leaves the image side alone
                continue
            params += [Param(f"{index}.lora_A", (self.rank, fan_in)), Param(f"{index}.lora_B", (fan_out, self.rank))]
            if self.dora:
                params.append(Param(f"{index}.magnitude", (fan_out,)))
        return params

    def _adapters_peft_makes(self, info: ModelInfo) -> list[Param]:
        """What peft's all-linear adds to a mixture of experts, read off peft itself on a weightless copy: besides the
        linear layers it wraps the fused expert weights, with shapes of its own choosing (gate_up_proj gets twice the
        rank), so they are not re-derived here."""
        from peft import LoraConfig, get_peft_model

        from fsdp_recipes.models.modeling import meta_model

        options = dict(r=self.rank, target_modules="all-linear", lora_dropout=0.0, use_dora=self.dora)
        adapted = get_peft_model(meta_model(info.config), LoraConfig(**options))
        return [Param(name, tuple(param.shape)) for name, param in adapted.named_parameters() if param.requires_grad]


def adapters_for(config: TrainingConfig, compute_bytes: int) -> Adapters | None:
    """The Adapters a recipe config trains, or None without use_peft."""
    if not config.use_peft:
        return None
    targets = config.lora_target_modules
    frozen = 1 if config.load_in_4bit else compute_bytes  # 4 bits + quantisation constants: ~0.5 byte, say 1
    return Adapters(
        rank=int(config.lora_r or LORA_RANK),
        target_modules=tuple(targets) if targets else None,
        frozen_bytes=frozen,
        dora=bool(config.use_dora),
    )


def layout_for_recipe(layout: LaunchLayout, config: TrainingConfig) -> LaunchLayout:
    """The launch as the recipe config changes it: the model's own activation checkpointing
    (`gradient_checkpointing: true`) saves the same activations as FSDP's."""
    if config.gradient_checkpointing and not layout.activation_checkpointing:
        return dataclasses.replace(layout, activation_checkpointing=True)
    return layout
