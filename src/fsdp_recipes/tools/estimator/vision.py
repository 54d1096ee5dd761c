"""A vision-language model's image side, in the estimator's terms: the tokens a picture becomes in the language model's
rows, the patches it puts through the vision tower, and what the tower holds in memory.

Where the numbers come from (`PictureTokens.source` says it in each report):
- Gemma 3: the config's `mm_tokens_per_image` (256) for one picture at the tower's `image_size` (896 / 14 = 64 x 64
  = 4,096 patches, pooled 4 x 4); pan-and-scan (more crops per picture) is off in its processor by default.
- Llava: one token per patch of the tower's image_size x image_size input, (image_size / patch_size)^2 (576 for
  Llava-1.5's 336 / 14), as its processor counts them; CLIP's class token goes through the tower too.
- Qwen2-VL / Qwen2.5-VL / Qwen3-VL: no fixed number; the processor resizes a picture to multiples of patch_size x
  merge_size within [min_pixels, max_pixels] (transformers' `smart_resize`) and gives one token per merge_size^2
  patches. The limits are those of the published preprocessor_config.json (they are not in config.json). A picture
  can never be longer than its row (the recipes refuse one whose tokens end past max_length), so the memory counts
  each picture as large as the row holds: an upper bound, with a 640 x 480 picture's count beside it.
Other families are not modelled: their tower's parameters are counted, its activations are not, and the report says so.

The tower's activations per patch and block follow the decoder layer's formula (formulas.activation_bytes) with the
tower's own widths: c*(7h + 4i) + 4*2h + 4*heads for a gated MLP (Qwen2.5-VL), c*(7h + 2i) + ... for a plain one
(CLIP, SigLIP, Qwen3-VL), sdpa attention (no score matrix kept). A frozen tower (freeze_vision_tower, or LoRA, which
leaves the image side alone) keeps nothing for backward: only one block's activations at a time, while it runs,
before the language model's layers keep theirs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.models.adapters import NOT_LANGUAGE_MODEL
from fsdp_recipes.models.vision import vision_parts

FP32 = 4
EXAMPLE_PICTURE = (480, 640)  # height, width: a COCO-sized photo, as in llava-instruct-mix
# published preprocessor_config.json of each family: (min_pixels, max_pixels, where from)
_GRID_PROCESSORS = {
    "qwen2_vl": (3136, 12845056, "Qwen2-VL's preprocessor_config.json: min_pixels 3,136, max_pixels 12,845,056"),
    "qwen2_5_vl": (3136, 12845056, "Qwen2.5-VL's preprocessor_config.json: min_pixels 3,136, max_pixels 12,845,056"),
    "qwen3_vl": (65536, 16777216, "Qwen3-VL's preprocessor_config.json: size 65,536 to 16,777,216 pixels"),
    "qwen3_vl_moe": (65536, 16777216, "Qwen3-VL's preprocessor_config.json: size 65,536 to 16,777,216 pixels"),
}


def is_image_side(path: str) -> bool:
    """Whether a module path is under the vision tower or the projector (what all-linear LoRA leaves alone)."""
    return re.fullmatch(NOT_LANGUAGE_MODEL, path) is not None


@dataclass(frozen=True)
class PictureTokens:
    """How a picture becomes tokens. fixed: `tokens` each; grid: from `min_tokens` to `tokens`, by its size."""

    kind: str  # "fixed" or "grid"
    tokens: int
    patches_per_token: int  # patches through the tower per token in the row (merge_size^2, Gemma 3's pooling: 16)
    extra_patches: int = 0  # per picture: CLIP's class token
    min_tokens: int = 0
    example_tokens: int = 0  # grid: a 640 x 480 picture's
    source: str = ""


@dataclass(frozen=True)
class VisionShapes:
    """The image side of a model, read from its weightless copy (shapes.model_info_from_config)."""

    tower_path: str
    projector_path: str | None  # None where the projector is inside the tower (Qwen's merger)
    tower_params: int
    projector_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    gated_mlp: bool
    pictures: PictureTokens | None  # None: this family's tokens per picture are not modelled


def picture_tokens(config) -> PictureTokens | None:
    """Tokens per picture for the families the estimator knows (module docstring); None for the others."""
    vision = config.vision_config
    patch = int(getattr(vision, "patch_size", 0) or 0)
    if getattr(config, "mm_tokens_per_image", None) and getattr(vision, "image_size", None) and patch:
        tokens, patches = int(config.mm_tokens_per_image), (int(vision.image_size) // patch) ** 2
        source = (
            f"the config's mm_tokens_per_image: {tokens} per picture, from {patches:,} patches of its "
            f"{vision.image_size}x{vision.image_size} input"
        )
        return PictureTokens("fixed", tokens, max(patches // tokens, 1), source=source)
    merge = int(getattr(vision, "spatial_merge_size", 0) or 0)
    if merge and patch and config.model_type in _GRID_PROCESSORS:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        low, high, where = _GRID_PROCESSORS[config.model_type]
        factor = patch * merge
        height, width = smart_resize(*EXAMPLE_PICTURE, factor=factor, min_pixels=low, max_pixels=high)
        example = (height // factor) * (width // factor)
        source = (
            f"{where}: (height / {factor}) x (width / {factor}) tokens after its resize, {low // factor**2:,} to "
            f"{high // factor**2:,} per picture; a 640x480 picture is {example}"
        )
        return PictureTokens("grid", high // factor**2, merge**2, 0, max(low // factor**2, 1), example, source=source)
    if config.model_type == "llava" and getattr(vision, "image_size", None) and patch:
        size, patches = int(vision.image_size), (int(vision.image_size) // patch) ** 2
        full = getattr(config, "vision_feature_select_strategy", "default") == "full"  # keeps the class token
        extra = 1 if vision.model_type == "clip_vision_model" else 0
        source = (
            f"Llava's processor: one token per patch of the tower's {size}x{size} input, ({size} / {patch})^2 = "
            f"{patches}{' and the class token' if full else ''}"
        )
        return PictureTokens("fixed", patches + (extra if full else 0), 1, 0 if full else extra, source=source)
    return None


def vision_shapes(model: torch.nn.Module, config) -> VisionShapes | None:
    """The image side of a weightless model; None for a text model."""
    if getattr(config, "vision_config", None) is None:
        return None
    tower, projector = vision_parts(model)
    if tower is None:
        return None
    paths = {id(module): path for path, module in model.named_modules()}
    vision = config.vision_config
    # Qwen2-VL names its tower's width embed_dim (its hidden_size is the merger's output) and its MLP by mlp_ratio
    hidden = int(getattr(vision, "embed_dim", 0) or getattr(vision, "hidden_size", 0) or 0)
    ratio = float(getattr(vision, "mlp_ratio", 0) or 4)
    return VisionShapes(
        tower_path=paths[id(tower)],
        projector_path=paths.get(id(projector)) if projector is not None else None,
        tower_params=sum(p.numel() for p in tower.parameters()),
        projector_params=sum(p.numel() for p in projector.parameters()) if projector is not None else 0,
        layers=int(getattr(vision, "depth", 0) or getattr(vision, "num_hidden_layers", 0) or 0),
        hidden=hidden,
        intermediate=int(getattr(vision, "intermediate_size", 0) or ratio * hidden),
        heads=int(getattr(vision, "num_heads", 0) or getattr(vision, "num_attention_heads", 0) or 1),
        gated_mlp=any(name.endswith("gate_proj") for name, _ in tower.named_modules()),
        pictures=picture_tokens(config),
    )


@dataclass(frozen=True)
class TowerLoad:
    """The image side of one micro-batch: its pictures and what the tower keeps (bytes)."""

    pictures_per_row: int
    tokens_per_picture: int
    patches: int  # through the tower, for the whole micro-batch
    trained_tower: bool
    trained_projector: bool
    stored_without_checkpointing: int  # kept for backward, on top of the language model's activations
    stored_with_checkpointing: int
    transient: int  # one block's activations while the tower runs (before the language model keeps anything)

    def kept(self, checkpointing: bool) -> int:
        return self.stored_with_checkpointing if checkpointing else self.stored_without_checkpointing


def pictures_in_row(pictures: PictureTokens, row_length: int, per_row: int, *, strict: bool = True) -> int:
    """Tokens of each of `per_row` pictures in a row of `row_length` tokens: a fixed family's own count, a grid
    family's largest that the row holds. ConfigError when they do not fit (`strict`; else the smallest picture)."""
    if per_row < 0:
        raise ConfigError(f"--images-per-row must be >= 0 (it is {per_row})")
    if per_row == 0:
        return 0
    if pictures.kind == "fixed":
        if per_row * pictures.tokens > row_length and strict:
            raise ConfigError(
                f"--images-per-row {per_row}: pictures of {pictures.tokens} tokens each ({pictures.source}) fill "
                f"{per_row * pictures.tokens:,} tokens, more than a row's {row_length:,}: at most "
                f"{row_length // pictures.tokens} fit"
            )
        return pictures.tokens
    tokens = min(pictures.tokens, row_length // per_row)
    if tokens < pictures.min_tokens and not strict:
        return pictures.min_tokens
    if tokens < pictures.min_tokens:
        raise ConfigError(
            f"--images-per-row {per_row}: a row of {row_length:,} tokens leaves {row_length // per_row} per picture, "
            f"fewer than the processor's smallest picture ({pictures.min_tokens} tokens; {pictures.source})"
        )
    return tokens


def tower_load(
    shapes: VisionShapes,
    row_length: int,
    rows: int,
    compute_bytes: int,
    *,
    per_row: int = 1,
    train_tower: bool = True,
    train_projector: bool = True,
    strict: bool = True,
) -> TowerLoad | None:
    """What the tower holds for `rows` rows of `row_length` tokens, `per_row` pictures each; None when the family's
    pictures are not modelled. `strict`: pictures the row cannot hold are a ConfigError (else counted as they are)."""
    pictures = shapes.pictures
    if pictures is None:
        return None
    tokens = pictures_in_row(pictures, row_length, per_row, strict=strict)
    patches = rows * per_row * (tokens * pictures.patches_per_token + pictures.extra_patches)
    c, h, i = compute_bytes, shapes.hidden, shapes.intermediate
    per_patch_block = c * (7 * h + (4 if shapes.gated_mlp else 2) * i) + FP32 * 2 * h + FP32 * shapes.heads
    transient = per_patch_block * patches
    if train_tower:
        without = shapes.layers * per_patch_block * patches
        with_ac = shapes.layers * c * h * patches + transient  # each block's input, and one block recomputed
    else:
        # the projector, when it trains, keeps its input (the tower's output) and its hidden layer
        without = with_ac = 2 * c * h * patches if train_projector else 0
    return TowerLoad(per_row, tokens, patches, train_tower, train_projector, without, with_ac, transient)


def with_tower(activations: dict[str, int], load: TowerLoad | None) -> dict[str, int]:
    """The language model's activations with the tower's: what it keeps adds to theirs; while it runs, one block's
    activations on top of what it has kept so far."""
    if load is None:
        return activations
    out = dict(activations)
    for key, stored in (
        ("without_checkpointing", load.stored_without_checkpointing),
        ("with_checkpointing", load.stored_with_checkpointing),
    ):
        out[key] = max(activations[key] + stored, stored + load.transient)
    return out


def image_side(
    shapes: VisionShapes | None, workload, compute_bytes: int, *, lora: bool, freeze: tuple[bool, bool], per_row: int
) -> tuple[TowerLoad | None, Callable[[Any], bool] | None]:
    """(the tower's load for `workload`'s micro-batch, which parameters are frozen: a predicate on the estimator's
    Param, None when none is) for a run that freezes `freeze` = (its tower, its projector) or trains LoRA adapters
    (which leave the image side as it is). The tower holds Qwen's merger (models.vision.vision_parts finds no
    projector beside it): freezing the tower freezes it too, as a run does (models.vision.freeze)."""
    if shapes is None:
        return None, None
    tower = not lora and not freeze[0]
    projector = not lora and not freeze[1] and (tower or shapes.projector_path is not None)
    load = tower_load(
        shapes, workload.row_length, workload.micro_batch_rows, compute_bytes, per_row=per_row,
        train_tower=tower, train_projector=projector,
    )  # fmt: skip
    return load, frozen_parameters(shapes, lora=lora, freeze=freeze)


def frozen_parameters(
    shapes: VisionShapes | None, *, lora: bool, freeze: tuple[bool, bool]
) -> Callable[[Any], bool] | None:
    """Which of the estimator's Params a full fine-tuning run freezes (`freeze`: its tower, its projector); None when
    none is (a text model, nothing frozen, or LoRA, whose own count has the base frozen already)."""
    if shapes is None or lora:
        return None
    paths = ([shapes.tower_path] if freeze[0] else []) + ([shapes.projector_path] if freeze[1] else [])
    prefixes = tuple(f"{path}." for path in paths if path)
    return (lambda param: param.name.startswith(prefixes)) if prefixes else None


def record(shapes: VisionShapes | None, load: TowerLoad | None) -> dict | None:
    """The report's `vision` object."""
    if shapes is None:
        return None
    pictures = shapes.pictures
    return {
        "tower_parameters": shapes.tower_params,
        "projector_parameters": shapes.projector_params,
        "tower_blocks": shapes.layers,
        "tower_width": shapes.hidden,
        "tokens_per_picture": pictures.tokens if pictures and pictures.kind == "fixed" else None,
        "tokens_per_picture_range": [pictures.min_tokens, pictures.tokens]
        if pictures and pictures.kind == "grid"
        else None,
        "tokens_of_a_640x480_picture": pictures.example_tokens if pictures and pictures.kind == "grid" else None,
        "patches_per_token": pictures.patches_per_token if pictures else None,
        "source": pictures.source
        if pictures
        else "not modelled for this family: its tower's parameters are counted, its activations are not",
        **({"load": dataclasses.asdict(load)} if load else {}),
    }


def render(record: dict | None) -> list[str]:
    """The report's lines about the image side (after the micro-batch line)."""
    if not record:
        return []
    load = record.get("load")
    projector = f"projector {record['projector_parameters'] / 1e6:.1f}M" if record["projector_parameters"] else ""
    tower = (
        f"vision tower {record['tower_parameters'] / 1e6:.1f}M parameters ({record['tower_blocks']} blocks of width "
    )
    tower += f"{record['tower_width']}, projector {'in it' if not projector else projector.split(' ', 1)[1]})"
    if load is None:
        return [f"{tower}; pictures: {record['source']}"]
    trains = "trains" if load["trained_tower"] else "frozen: nothing kept for backward, one block at a time"
    lines = [f"{tower}: {trains}; projector {'trains' if load['trained_projector'] else 'frozen'}"]
    if not load["pictures_per_row"]:
        return lines + [
            "pictures: none in these rows (--images-per-row 0; packed rows are taken as text: give "
            "--images-per-row N for packed rows with pictures)"
        ]
    size = f"{load['tokens_per_picture']:,} tokens each"
    if record["tokens_per_picture_range"]:
        size += f" at most (the largest a row holds; {record['tokens_of_a_640x480_picture']} for a 640x480 picture)"
    return lines + [
        f"pictures: {load['pictures_per_row']} per row (--images-per-row), {size}; {load['patches']:,} patches per "
        "micro-batch through the tower",
        f"  tokens per picture: {record['source']}",
    ]
