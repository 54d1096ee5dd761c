"""Vision-language models (Llava, Gemma 3, Qwen2.5-VL, Idefics3...): their processor, and their parts by role: the
vision tower (the image encoder), the multi-modal projector (image features into the language model's width) and the
language model. transformers names them differently per family; `vision_parts` finds them by those names."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoProcessor, PretrainedConfig, PreTrainedTokenizerBase

from fsdp_recipes.common import steps
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.common.errors import ConfigError

# attribute names under the model (or its `.model`), per role, across transformers' vision-language families
_TOWERS = ("vision_tower", "visual", "vision_model")
_PROJECTORS = ("multi_modal_projector", "connector", "merger")


@dataclasses.dataclass
class VisionFields:
    """What of a vision-language model trains (text models refuse them before loading)."""

    freeze_vision_tower: bool = setting(
        False,
        "vision-language models: keep the image encoder's weights as they are (no gradients or optimizer state for "
        "them: less memory; the model's reading of images does not adapt)",
        resume="sensitive",
    )
    freeze_multi_modal_projector: bool = setting(
        False,
        "vision-language models: keep the projector from image features to the language model as it is",
        resume="sensitive",
    )


def load_processor(name_or_path: str, tokenizer: PreTrainedTokenizerBase, *, revision: str, trust_remote_code: bool):
    """The model's processor (image processor, tokenizer, chat template) from `name_or_path`, with the run's own
    tokenizer in it (its chat template and pad token as the config set them)."""
    with steps.step(
        f"loading the processor (image processor and tokenizer) of a vision-language model from {name_or_path!r}",
        name=name_or_path,
        setting="tokenizer_name_or_path",
    ):
        try:
            processor = AutoProcessor.from_pretrained(
                name_or_path, revision=revision, trust_remote_code=trust_remote_code
            )
        except (ImportError, AttributeError, ValueError) as error:  # torchvision missing (a video processor)
            processor = _grid_processor(name_or_path, tokenizer, revision=revision, error=error)
    if not hasattr(processor, "image_processor"):  # a folder with no processor class: an image processor, maybe
        try:
            processor = _grid_processor(name_or_path, tokenizer, revision=revision, error=ValueError())
        except (OSError, ValueError):
            processor = None
    if processor is None:
        raise ConfigError(
            f"{name_or_path!r} holds a tokenizer but no image processor, and the model is a vision-language model: "
            "point tokenizer_name_or_path at the model's processor folder (preprocessor_config.json or "
            "processor_config.json beside the tokenizer)"
        )
    processor.tokenizer = tokenizer
    if tokenizer.chat_template:
        processor.chat_template = tokenizer.chat_template
    return processor


def _grid_processor(name_or_path: str, tokenizer, *, revision: str, error: BaseException):
    """The families whose processor needs torchvision here, from their image processor and tokenizer with their own
    expansion: Qwen-VL (data.images.GridImageProcessor), Pixtral and Mistral 3 (data.images.PatchRowsProcessor);
    anything else re-raises the processor's own error."""
    import json

    from transformers import AutoImageProcessor
    from transformers.utils import cached_file

    from fsdp_recipes.data.images import GridImageProcessor, PatchRowsProcessor

    image_processor = AutoImageProcessor.from_pretrained(name_or_path, revision=revision)
    vocabulary = tokenizer.get_vocab()
    if hasattr(image_processor, "merge_size") and GridImageProcessor.image_token in vocabulary:
        return GridImageProcessor(image_processor, tokenizer, tokenizer.chat_template)
    found = cached_file(
        name_or_path, "processor_config.json", revision=revision, _raise_exceptions_for_missing_entries=False
    )
    settings = json.loads(open(found).read()) if found else {}
    if settings.get("processor_class") == "PixtralProcessor" and settings.get("image_token", "[IMG]") in vocabulary:
        return PatchRowsProcessor(image_processor, tokenizer, tokenizer.chat_template, settings=settings)
    raise error


def vision_parts(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(vision tower, multi-modal projector) of a vision-language model; (None, None) for a text model."""
    holders = [model, getattr(model, "model", None)]

    def find(names):
        for holder in holders:
            for name in names:
                part = getattr(holder, name, None) if holder is not None else None
                if isinstance(part, torch.nn.Module):
                    return part
        return None

    return find(_TOWERS), find(_PROJECTORS)


def freezing_problem(config, model_config: PretrainedConfig) -> str | None:
    """freeze_vision_tower / freeze_multi_modal_projector on a model without a vision tower."""
    asked = [name for name in ("freeze_vision_tower", "freeze_multi_modal_projector") if getattr(config, name, False)]
    if asked and getattr(model_config, "vision_config", None) is None:
        return (
            f"{' and '.join(asked)}: the model ({model_config.model_type}) is text-only, it has no vision tower or "
            "projector to freeze. Remove the setting, or train a vision-language model"
        )
    return None


def freeze(model: torch.nn.Module, *, tower: bool, projector: bool) -> dict[str, int]:
    """Parameters of the asked parts set not to train (their gradients are then never computed or stored). Returns
    the parameters frozen per part."""
    vision_tower, multi_modal_projector = vision_parts(model)
    frozen = {}
    for name, part, wanted in (
        ("vision_tower", vision_tower, tower),
        ("multi_modal_projector", multi_modal_projector, projector),
    ):
        if wanted and part is not None:
            for parameter in part.parameters():
                parameter.requires_grad_(False)
            frozen[name] = sum(parameter.numel() for parameter in part.parameters())
    return frozen


def vision_block_classes(model: torch.nn.Module) -> list[str]:
    """The class of the vision tower's repeated blocks (the largest stack of one class under it): what FSDP must wrap
    beside the decoder layers, or the whole tower stays in the root unit, gathered at every forward."""
    tower, _ = vision_parts(model)
    if tower is None:
        return []
    stacks = []
    for module in tower.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            kinds = {type(child).__name__ for child in module}
            if len(kinds) == 1:
                stacks.append((sum(p.numel() for p in module.parameters()), kinds.pop()))
    return [max(stacks)[1]] if stacks else []


def rope_index_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that computes the model's rotary positions from its pictures (Qwen-VL's 3-D positions, from the
    input ids, the attention mask and the pictures' grids: positions passed in would be text positions), or None."""
    return next((module for module in model.modules() if hasattr(module, "get_rope_index")), None)


def computes_own_positions(model: torch.nn.Module) -> bool:
    return rope_index_module(model) is not None


def vision_positions(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The `position_ids` of rows with pictures, packed or not (positions restart at each example; padding is an
    example of its own). Most families take the text positions, and the attention keeps examples apart by them.
    Qwen-VL's rotary positions are 3-D over each picture's patches: each example's are computed on its own, as the
    model computes them for a row of one example, and given with the text positions first ([4, rows, width]: the model
    keeps examples apart by that first row)."""
    positions = batch["position_ids"]
    core = rope_index_module(model)  # one walk over the modules per forward
    if core is None:
        return positions
    merge = core.config.vision_config.spatial_merge_size**2
    grids = list(batch.get("image_grid_thw", torch.empty(0, 3, dtype=torch.long)))
    spatial = torch.zeros((3, *positions.shape), dtype=positions.dtype, device=positions.device)
    for row in range(positions.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
        for start, end in zip(starts, starts[1:]):
            ids, types = batch["input_ids"][row, start:end], batch["mm_token_type_ids"][row, start:end]
            tokens, shown = int((types == 1).sum()), []
            while tokens > 0:  # the example's pictures: the next grids, in order, until their tokens are counted
                shown.append(grids.pop(0))
                tokens -= int(shown[-1].prod()) // merge
            if not shown:
                spatial[:, row, start:end] = torch.arange(end - start, device=positions.device)
                continue
            found, _ = core.get_rope_index(ids[None], types[None], image_grid_thw=torch.stack(shown))
            spatial[:, row, start:end] = found[:, 0]
    return torch.cat([positions[None], spatial])
