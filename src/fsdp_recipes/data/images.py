"""Images in conversations, TRL's vision format: an `images` column (or `image`, one per row) beside messages whose
content is a list of parts, `{"type": "image"}` and `{"type": "text", "text": ...}`. The chat template renders each
image part as the processor's placeholder token; the conversation's tokens and loss mask come from the same code as
text (`chat_masks.conversation_tokens`), then each placeholder is replaced by the processor's own expansion of that
picture (Llava: its patches' tokens; Gemma 3: the begin/end markers around its soft tokens), which never carries
loss. The pictures themselves are kept as their file bytes and become pixel values in the collator
(`ImageInputs.pixel_inputs`), where the same image processor that counted the tokens resizes them.

An image is a path (absolute, or relative to the data files' folder, then to the working directory), `datasets`'
Image value ({"bytes", "path"}) or a PIL image."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data.rows import IGNORE_INDEX

IMAGE_COLUMNS = ("images", "image")
IGNORE_TARGET = (
    -100
)  # data.rows.IGNORE_INDEX (rows imports this module)  # TRL's names: a list per row, or one image per row
# what a collated batch of rows with pictures adds to the forward's inputs (those the processor returns)
PIXEL_INPUTS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask")
VISION_INPUTS = (*PIXEL_INPUTS, "token_type_ids", "mm_token_type_ids")


def image_column(column_names: list[str]) -> str | None:
    return next((name for name in IMAGE_COLUMNS if name in column_names), None)


def require_reader(column: str | None, pictures, name: str) -> None:
    """DataError when the data has an images column that nothing here reads (`pictures`, the model's processor, is
    None): the model is text-only, or the recipe does not train on images."""
    if column is not None and pictures is None:
        raise DataError(
            f"the {name} data has an {column!r} column, but nothing here reads images: the model is text-only (it has "
            "no vision tower), or this recipe does not take images (SFT, DPO, KTO and GRPO do; docs/vision.md). Use a "
            "vision-language model (Qwen2.5-VL, Gemma 3, Llava...) with one of those, or drop the column"
        )


def pictures_named_in(folder: Path) -> list[Path]:
    """The picture files a local dataset folder's JSON lines name by relative path, found as the data reads them
    (from the folder): what a copy of the folder needs beside it (`fsdp-recipes cp`)."""
    import json

    found = set()
    for data_file in sorted(folder.rglob("*.jsonl")):
        for line in data_file.read_text().splitlines():
            if '"image' not in line:
                continue
            row = json.loads(line)
            for column in IMAGE_COLUMNS:
                named = row.get(column)
                for value in named if isinstance(named, list) else [named]:
                    if isinstance(value, str) and not Path(value).is_absolute() and (folder / value).is_file():
                        found.add((folder / value).resolve())
    return sorted(found)


def images_of(example: dict[str, Any], column: str) -> list:
    value = example.get(column)
    if value is None:
        return []
    return list(value) if column == "images" else [value]


def image_parts(messages: Any) -> int:
    """The `{"type": "image"}` parts of a conversation, in every turn."""
    count = 0
    for turn in messages or []:
        content = turn.get("content") if isinstance(turn, dict) else None
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return count


def image_bytes(value: Any, roots: list[Path]) -> bytes:
    """The picture's encoded bytes (PNG, JPEG...), checked to be an image. ValueError says what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = value.get("bytes") or value["path"]
    if isinstance(value, str):
        path = Path(value).expanduser()
        candidates = [path] if path.is_absolute() else [root / path for root in roots] + [path]
        found = next((candidate for candidate in candidates if candidate.is_file()), None)
        if found is None:
            raise ValueError(
                f"the image {value!r} does not exist (looked in {', '.join(str(c.parent.resolve()) for c in candidates)})"
            )
        value = found.read_bytes()
        where = f"the file {found}"
    elif isinstance(value, bytes):
        where = "its bytes"
    else:
        raise ValueError(f"an image must be a path, datasets' Image value or a PIL image, got {type(value).__name__}")
    try:
        with Image.open(io.BytesIO(value)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"{where} is not an image PIL can read ({type(error).__name__})") from None
    return value


def open_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


class ExpandingProcessor:
    """A processor for the families whose own needs torchvision here, built from their image processor (its
    torchvision-free `*Pil` class) and tokenizer: each placeholder becomes the picture's tokens as their processor
    writes them (`tokens_for`), and the pictures their pixel values. Saved as the image processor, tokenizer and chat
    template it holds."""

    image_token: str
    model_input_names: tuple[str, ...] = ("input_ids", "pixel_values")

    def __init__(self, image_processor, tokenizer, chat_template: str | None = None):
        self.image_processor, self.tokenizer, self.chat_template = image_processor, tokenizer, chat_template

    def pixels(self, images: list, return_tensors: str | None = "pt") -> dict:
        return dict(self.image_processor(images=images, return_tensors=return_tensors))

    def tokens_for(self, image) -> str:
        raise NotImplementedError

    def __call__(
        self, text: list[str], images: list, add_special_tokens: bool = True, return_tensors=None, padding=False
    ) -> dict:
        images = [one for image in images for one in (image if isinstance(image, list) else [image])]
        pending, expanded = list(images), []
        for piece in text:
            parts = piece.split(self.image_token)
            out = parts[0]
            for part in parts[1:]:
                out += self.tokens_for(pending.pop(0)) + part
            expanded.append(out)
        encoded = self.tokenizer(
            expanded, add_special_tokens=add_special_tokens, return_tensors=return_tensors, padding=padding
        )
        encoded = dict(encoded)
        return {**encoded, **(self.pixels(images, return_tensors) if images and return_tensors else {})}

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def save_pretrained(self, folder) -> None:
        self.image_processor.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)


class GridImageProcessor(ExpandingProcessor):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (their processor holds a video processor beside the image one): each
    `<|image_pad|>` becomes one token per merged patch, grid_t x grid_h x grid_w / merge_size^2, as their processors
    expand it."""

    image_token = "<|image_pad|>"
    model_input_names = ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")

    def tokens_for(self, image) -> str:
        grid = self.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        return self.image_token * (int(grid.prod()) // int(self.image_processor.merge_size) ** 2)


class PatchRowsProcessor(ExpandingProcessor):
    """Pixtral and Mistral 3 (`PixtralProcessor` requires torchvision): the picture resized to whole merged patches
    (patch_size x spatial_merge_size pixels), and its `[IMG]` written as one row of `[IMG]` tokens per row of merged
    patches, each row closed by `[IMG_BREAK]` and the last by `[IMG_END]`, as `PixtralProcessor` writes them. The
    settings are its processor_config.json's."""

    model_input_names = ("input_ids", "pixel_values", "image_sizes")

    def __init__(self, image_processor, tokenizer, chat_template=None, *, settings: dict):
        super().__init__(image_processor, tokenizer, chat_template)
        self.settings = dict(settings)
        self.step = int(settings.get("patch_size", 16)) * int(settings.get("spatial_merge_size", 1))
        self.image_token = settings.get("image_token", "[IMG]")
        self.row_end, self.end = (
            settings.get("image_break_token", "[IMG_BREAK]"),
            settings.get("image_end_token", "[IMG_END]"),
        )

    def pixels(self, images: list, return_tensors: str | None = "pt") -> dict:
        return dict(self.image_processor(images=images, patch_size=self.step, return_tensors=return_tensors))

    def tokens_for(self, image) -> str:
        height, width = (int(size) for size in self.pixels([image])["image_sizes"][0])
        rows = [self.image_token * (width // self.step) + self.row_end] * (height // self.step)
        return "".join(rows)[: -len(self.row_end)] + self.end

    def save_pretrained(self, folder) -> None:
        import json

        super().save_pretrained(folder)
        settings = {"processor_class": "PixtralProcessor", **self.settings}
        (Path(folder) / "processor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


class ImageInputs:
    """The processor's view of images for training: which token the chat template writes for an image part, what
    each picture becomes in tokens, and its pixel values for a batch."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}], tokenize=False
        )
        candidates = [getattr(processor, "image_token", None), getattr(processor, "boi_token", None)]
        found = [token for token in candidates if token and token in rendered]
        if not found:
            raise DataError(
                f"the chat template never renders an image part as the processor's image token "
                f"({' or '.join(repr(t) for t in candidates if t)}): the model would never see the pictures. Set "
                "chat_template to a template that renders {'type': 'image'} parts (the model's own does)"
            )
        self.placeholder = found[0]
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        # the marker tokens a template writes around an image (Qwen's vision start/end): never targets either
        text_only = self.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
        with_image = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
        )
        added = set(self.tokenizer.get_added_vocab().values()) | set(self.tokenizer.all_special_ids)
        self.marker_ids = (set(with_image["input_ids"]) - set(text_only["input_ids"])) & added
        # the token that carries image features: the one a picture's expansion repeats (Llava's <image>; Gemma 3's
        # soft token between the begin and end markers its template writes)
        from PIL import Image

        expanded = self.expansion(Image.new("RGB", (64, 64), "white"))
        self.image_token_id = max(set(expanded), key=expanded.count)
        # what a completion must never hold: a picture's tokens without a picture (the model's forward would refuse
        # the count, and they mean nothing as text)
        self.never_generated = sorted({self.image_token_id, self.placeholder_id} | self.marker_ids)
        names = getattr(processor, "model_input_names", ())
        self.needs_token_types = "token_type_ids" in names  # Gemma 3: its pictures' tokens attend both ways
        # Qwen-VL: which tokens are a picture's, from which the model computes its 3-D positions (without them it
        # would use text positions: Qwen2.5-VL silently, Qwen3-VL refuses)
        self.needs_modality_types = "mm_token_type_ids" in names

    def expansion(self, image) -> list[int]:
        """The tokens the processor writes for this picture in place of its placeholder."""
        encoded = self.processor(text=[self.placeholder], images=[image], add_special_tokens=False)
        return list(encoded["input_ids"][0])

    def with_blank_picture(self, row: dict) -> dict:
        """`row` with a blank picture's tokens after it, as an example of its own (positions from 0, no targets),
        and the picture: a batch that holds it runs the vision tower; nothing else attends to it, so no loss or
        gradient changes."""
        if not hasattr(self, "_blank"):
            from PIL import Image

            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), "white").save(buffer, format="PNG")
            self._blank = (self.expansion(open_image(buffer.getvalue())), buffer.getvalue())
        tokens, picture = self._blank
        return {
            **row,
            "input_ids": list(row["input_ids"]) + tokens,
            "targets": list(row["targets"]) + [IGNORE_INDEX] * len(tokens),
            "position_ids": list(row["position_ids"]) + list(range(len(tokens))),
            "images": [picture],
        }

    def last_image_token(self, ids: list[int]) -> int:
        """Where the last picture's tokens end (-1 without pictures): a cut must keep everything before it."""
        return max((i for i, token in enumerate(ids) if token == self.image_token_id), default=-1)

    def first_image_token(self, ids: list[int]) -> int | None:
        return next((i for i, token in enumerate(ids) if token == self.image_token_id), None)

    def expand(self, ids: list[int], mask: list[int], images: list) -> tuple[list[int], list[int]]:
        """Each placeholder replaced by its picture's tokens (in order), none of them a target, nor the markers the
        template writes around it."""
        places = [index for index, token in enumerate(ids) if token == self.placeholder_id]
        if len(places) != len(images):
            raise ValueError(
                f"the chat template wrote {len(places)} image placeholder(s) for {len(images)} image part(s)"
            )
        out_ids, out_mask, at = [], [], 0
        for place, image in zip(places, images):
            tokens = self.expansion(image)
            out_ids += ids[at:place] + tokens
            out_mask += mask[at:place] + [0] * len(tokens)
            at = place + 1
        out_ids, out_mask = out_ids + ids[at:], out_mask + mask[at:]
        return out_ids, [0 if token in self.marker_ids else keep for token, keep in zip(out_ids, out_mask)]

    def pixel_inputs(self, input_ids: torch.Tensor, images: list[list[bytes]]) -> dict[str, torch.Tensor]:
        """The model's vision inputs for a batch: every row's pictures in row order, and (Gemma 3, Qwen-VL) which
        tokens are image tokens."""
        flat = [open_image(data) for row in images for data in row]
        inputs = {}
        if flat:  # the processor's own call, so its pictures are resized as it resized them to count their tokens
            one_each = [[image] for image in flat]  # one text per picture (Gemma 3's processor counts them per text)
            # (padded: pictures of one batch may make different numbers of tokens, Qwen-VL's and Pixtral's)
            processed = self.processor(
                text=[self.placeholder] * len(flat), images=one_each, return_tensors="pt", padding=True
            )
            inputs = {key: value for key, value in processed.items() if key in PIXEL_INPUTS}
        if self.needs_token_types:
            inputs["token_type_ids"] = (input_ids == self.image_token_id).long()
        if self.needs_modality_types:
            inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return inputs
