"""How long an example a model can read: `max_length` against the model's positions, checked before any weights
load. Rotary models run past `max_position_embeddings` without an error, at positions they were never trained on
(the loss looks normal, the model learns little there); models with a learned position table index past it and
crash mid-run. Packed rows are bounded by the example, not the row: their positions restart at each example."""

from __future__ import annotations

from transformers import PretrainedConfig

from fsdp_recipes.common.errors import ConfigError


def _positions_part(config: PretrainedConfig) -> PretrainedConfig | None:
    """The config, or its text part (a composite config's `text_config`), that declares the positions."""
    for part in (config, getattr(config, "text_config", None)):
        positions = getattr(part, "max_position_embeddings", None) if part is not None else None
        if isinstance(positions, int) and positions > 0:
            return part
    return None


def model_positions(config: PretrainedConfig) -> int | None:
    """The positions the model was trained on (or extended to, by rope scaling): `max_position_embeddings` (GPT-2's
    `n_positions` reads as it); None for a model that declares none."""
    part = _positions_part(config)
    return None if part is None else part.max_position_embeddings


def _is_rotary(part: PretrainedConfig) -> bool:
    """Whether the positions are rotary (rope settings, flat or one mapping per layer type as Gemma 3 keeps them)."""
    rope = getattr(part, "rope_parameters", None) or getattr(part, "rope_scaling", None)
    return bool(rope) or getattr(part, "rope_theta", None) is not None


def check_example_fits_positions(config: PretrainedConfig, max_length: int | None, *, setting: str = "max_length"):
    """ConfigError when one example of `max_length` tokens would reach past the model's positions."""
    part = _positions_part(config)
    positions = None if part is None else part.max_position_embeddings
    if max_length is None or positions is None or max_length <= positions:
        return
    if _is_rotary(part):
        past = "at positions this rotary model was never trained on (no error: it learns little there)"
        extend = (
            "extend them in the model config: rope scaling (rope_parameters with rope_type yarn, factor "
            f"{-(-max_length // positions)} and original_max_position_embeddings {positions}), and "
            f"max_position_embeddings {max_length}"
        )
    else:
        past = "past the positions the model has (its position table or buckets end there)"
        extend = "use a model with more positions (they are not rotary: rope scaling does not extend them)"
    raise ConfigError(
        f"{setting} {max_length} is longer than the model's positions (max_position_embeddings {positions}): an "
        f"example that long would be read {past}. Set {setting} <= {positions}, or {extend}. Packed rows may be "
        "longer: their positions restart at each example."
    )
