"""Vision-language models in this process: conversations with images become tokens whose loss masks are those of
the same conversation without them (images in the first and a later turn, and in a reply), image tokens never
targets; collated rows feed the model; a one-process SFT run exports a folder that reloads with the Auto classes;
bad input is refused with one line. The 2-rank FSDP2 runs against one process: tests/test_two_ranks_in_one_launch.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.paths import REPO
from helpers.recipes import recipe_error_in_process, run_recipe_in_process
from helpers.vision import LLAVA, PROCESSOR, SHAPES, llava_folder, shapes_pairs, shapes_subset, vision_values


@pytest.fixture(scope="module")
def pictures():
    from transformers import AutoProcessor

    from fsdp_recipes.data.images import ImageInputs

    return ImageInputs(AutoProcessor.from_pretrained(PROCESSOR))


def picture(index: int) -> str:
    return str(REPO / "demo" / "assets" / "shapes_images" / f"test-{index:04d}.png")


def family_model(family: str, pictures, request):
    """(ImageInputs, model) of a family: the demo's Llava with its processor, or the family's fixture."""
    if family != "llava":
        return request.getfixturevalue(family)
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    return pictures, AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA))


def two_turns(image_in_reply: bool = False) -> dict:
    """A picture in the first user turn, another in the second (after its text), and a third in a reply if asked."""
    reply = [{"type": "text", "text": "blue square"}] + ([{"type": "image"}] if image_in_reply else [])
    return {
        "images": [picture(0), picture(1)] + ([picture(2)] if image_in_reply else []),
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red circle"}]},
            {"role": "user", "content": [{"type": "text", "text": "and this?"}, {"type": "image"}]},
            {"role": "assistant", "content": reply},
        ],
    }


def tokenized(rows, tokenizer, pictures, max_length=200):
    from datasets import Dataset

    from fsdp_recipes.data import chat

    options = dict(assistant_only_loss=True, completion_only_loss=True, max_length=max_length)
    return chat.tokenize_dataset(Dataset.from_list(rows), tokenizer, pictures=pictures, **options)[0]


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep])


def test_masks_with_images_in_the_first_and_a_later_turn_are_those_of_the_text(pictures):
    tokenizer = pictures.tokenizer
    with_images = tokenized([two_turns()], tokenizer, pictures)[0]
    text_only = two_turns()
    for turn in text_only["messages"]:
        turn["content"] = "".join(part.get("text", "") for part in turn["content"])
    del text_only["images"]
    plain = tokenized([text_only], tokenizer, None)[0]
    assert (
        trained_text(tokenizer, with_images) == trained_text(tokenizer, plain) == "red circle<|end|>blue square<|end|>"
    )
    image_tokens = [i for i, token in enumerate(with_images["input_ids"]) if token == pictures.image_token_id]
    assert len(image_tokens) == 2 * 16  # 32x32 pictures in 8x8 patches, the class token dropped
    assert not any(with_images["loss_mask"][i] for i in image_tokens)
    assert len(with_images["images"]) == 2 and with_images["images"][0] == Path(picture(0)).read_bytes()


def test_an_image_in_a_reply_is_never_a_target(pictures):
    row = tokenized([two_turns(image_in_reply=True)], pictures.tokenizer, pictures)[0]
    image_tokens = [i for i, token in enumerate(row["input_ids"]) if token == pictures.image_token_id]
    assert len(image_tokens) == 48 and not any(row["loss_mask"][i] for i in image_tokens)
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>blue square<|end|>"


def test_the_image_column_and_prompt_completion_rows_take_pictures_as_trl_reads_them(pictures):
    """TRL's other vision forms: one picture per row in `image`, and conversational prompt/completion rows (loss on
    the completion only)."""
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]}]
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]
    rows = [{"image": picture(0), "prompt": question, "completion": answer}]
    row = tokenized(rows, pictures.tokenizer, pictures)[0]
    assert row["input_ids"].count(pictures.image_token_id) == 16 and len(row["images"]) == 1
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>"


def test_collated_rows_give_the_model_its_pixels_and_a_loss(pictures):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from fsdp_recipes.data import rows

    built = rows.build_rows(
        tokenized([two_turns(), two_turns(True)], pictures.tokenizer, pictures), max_length=200, packing=False
    )
    batch = rows.collate_rows([built[0], built[1]], pictures.tokenizer.pad_token_id, pictures)
    assert tuple(batch["pixel_values"].shape) == (5, 3, 32, 32)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA))
    from fsdp_recipes.train.losses import TokenLoss

    assert torch.isfinite(TokenLoss(model).loss_sum(model, batch))


@pytest.fixture(scope="module")
def gemma3():
    """A tiny Gemma 3 (SigLIP tower, 4 soft tokens per picture between begin/end markers) and its own processor,
    built from the demo tokenizer with Gemma 3's image tokens: (ImageInputs, model)."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        AutoTokenizer,
        Gemma3Config,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    from fsdp_recipes.data.images import ImageInputs

    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = AutoTokenizer.from_pretrained(REPO / "demo" / "assets" / "tokenizer", extra_special_tokens=names)
    template = (PROCESSOR / "chat_template.jinja").read_text().replace("<image>", "<start_of_image>")
    tokenizer.chat_template = template
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
        image_seq_length=4, chat_template=template,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16, max_position_embeddings=256,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=16,
        ),
        mm_tokens_per_image=4, boi_token_index=tokenizer.boi_token_id, image_token_index=tokenizer.image_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # transformers starts the projector at zero: the model would not see its pictures
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    return ImageInputs(processor), model


def test_gemma3_masks_are_exact_and_its_image_tokens_attend_as_its_processor_marks_them(gemma3):
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.models.vision import vision_block_classes
    from fsdp_recipes.train.losses import TokenLoss

    pictures, model = gemma3
    row = tokenized([two_turns(image_in_reply=True)], pictures.tokenizer, pictures)[0]
    assert pictures.placeholder == "<start_of_image>"  # the template writes the begin marker; the processor expands it
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>blue square<|end|>"
    soft = [i for i, token in enumerate(row["input_ids"]) if token == pictures.image_token_id]
    assert len(soft) == 12 and not any(row["loss_mask"][i] for i in soft)
    built = rows.build_rows(tokenized([two_turns()], pictures.tokenizer, pictures), max_length=200, packing=False)
    batch = rows.collate_rows([built[0]], pictures.tokenizer.pad_token_id, pictures)
    assert batch["token_type_ids"].sum() == 8 and tuple(batch["pixel_values"].shape) == (2, 3, 32, 32)
    assert torch.isfinite(TokenLoss(model).loss_sum(model.train(), batch))
    assert vision_block_classes(model) == ["SiglipEncoderLayer"]


def tiny_qwen_vl(folder: Path, family: str):
    """A tiny Qwen2.5-VL or Qwen3-VL (2 vision blocks, 3-D rotary positions) and the route to its processor here: its
    folder's image processor and tokenizer (its own processor class needs torchvision, for its video processor)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from fsdp_recipes.data.images import ImageInputs
    from fsdp_recipes.models import vision

    tokenizer = AutoTokenizer.from_pretrained(REPO / "demo" / "assets" / "tokenizer")
    tokenizer.add_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"], special_tokens=True)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    tokenizer.chat_template = (PROCESSOR / "chat_template.jinja").read_text().replace("<image>", image)
    patch = 14 if family == "qwen2_5_vl" else 16  # 4x4 patches of a picture, merged 2x2: 4 tokens
    Qwen2VLImageProcessorPil(
        min_pixels=(4 * patch) ** 2, max_pixels=(4 * patch) ** 2, patch_size=patch
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor = vision.load_processor(str(folder), tokenizer, revision="main", trust_remote_code=False)
    token = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )  # fmt: skip
    tower = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=patch,
        spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config

        tower.update(fullatt_block_indexes=[1], window_size=56)
    else:
        from transformers import Qwen3VLConfig as Config

        tower.update(deepstack_visual_indexes=[0], num_position_embeddings=16)
    config = Config(
        text_config=text, vision_config=tower, image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"), vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    return ImageInputs(processor), AutoModelForImageTextToText.from_config(config)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """A tiny Mistral 3 (Pixtral tower, 2x2 patch merge) and the route to its processor here: its folder's
    `PixtralImageProcessorPil`, tokenizer and processor_config.json (`PixtralProcessor` requires torchvision)."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Mistral3Config
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from fsdp_recipes.data.images import ImageInputs
    from fsdp_recipes.models import vision

    folder = tmp_path_factory.mktemp("mistral3")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "demo" / "assets" / "tokenizer")
    tokenizer.add_tokens(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], special_tokens=True)
    tokenizer.chat_template = (PROCESSOR / "chat_template.jinja").read_text().replace("<image>", "[IMG]")
    tokenizer.save_pretrained(folder)
    PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size=8).save_pretrained(folder)
    settings = {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2}
    (folder / "processor_config.json").write_text(json.dumps(settings))
    processor = vision.load_processor(str(folder), tokenizer, revision="main", trust_remote_code=False)
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
            image_size=32, patch_size=8,
        ),
        spatial_merge_size=2, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )  # fmt: skip
    torch.manual_seed(0)
    return ImageInputs(processor), AutoModelForImageTextToText.from_config(config)


def test_mistral3_through_pixtrals_image_processor_gets_its_rows_of_patches_and_exact_masks(mistral3, tmp_path):
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.data.images import PatchRowsProcessor
    from fsdp_recipes.models import vision
    from fsdp_recipes.train.losses import TokenLoss

    pictures, model = mistral3
    assert isinstance(pictures.processor, PatchRowsProcessor)  # AutoProcessor needs torchvision here
    from PIL import Image

    # a 32x32 picture: 2x2 merged patches of 16 pixels, written row by row as PixtralProcessor writes them
    assert pictures.tokenizer.decode(pictures.expansion(Image.open(picture(0)))) == (
        "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]"
    )
    row = tokenized([two_turns(image_in_reply=True)], pictures.tokenizer, pictures)[0]
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>blue square<|end|>"
    built = rows.build_rows(tokenized([two_turns()], pictures.tokenizer, pictures), max_length=200, packing=False)
    batch = rows.collate_rows([built[0]], pictures.tokenizer.pad_token_id, pictures)
    assert batch["image_sizes"].tolist() == [[32, 32], [32, 32]]
    # the model checks the pictures' features against its [IMG] tokens: a miscount would raise here
    assert torch.isfinite(TokenLoss(model).loss_sum(model.train(), batch))
    assert vision.vision_block_classes(model) == ["PixtralAttentionLayer"]
    pictures.processor.save_pretrained(tmp_path)  # reloads as the same route, its settings kept
    again = vision.load_processor(str(tmp_path), pictures.tokenizer, revision="main", trust_remote_code=False)
    assert isinstance(again, PatchRowsProcessor) and again.step == 16


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """A tiny Idefics3 (SigLIP tower, pixel shuffle by 2: 4 tokens per picture, no splitting into tiles) and its own
    processor, saved and loaded back through AutoProcessor."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Idefics3Config, Idefics3Processor
    from transformers import Idefics3ImageProcessorPil as ImageProcessor

    from fsdp_recipes.data.images import ImageInputs
    from fsdp_recipes.models import vision

    folder = tmp_path_factory.mktemp("idefics3")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "demo" / "assets" / "tokenizer")
    tokenizer.add_tokens(["<fake_token_around_image>", "<image>", "<global-img>"], special_tokens=True)
    tokenizer.chat_template = (PROCESSOR / "chat_template.jinja").read_text()
    sizes = dict(size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False)
    Idefics3Processor(image_processor=ImageProcessor(**sizes), tokenizer=tokenizer, image_seq_len=4).save_pretrained(
        folder
    )
    processor = vision.load_processor(str(folder), tokenizer, revision="main", trust_remote_code=False)
    config = Idefics3Config(
        text_config=dict(
            model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8,
        ),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )  # fmt: skip
    torch.manual_seed(0)
    return ImageInputs(processor), AutoModelForImageTextToText.from_config(config)


def test_idefics3_gets_exact_masks_and_its_pictures_through_its_own_processor(idefics3):
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.models import vision
    from fsdp_recipes.train.losses import TokenLoss

    pictures, model = idefics3
    from PIL import Image

    assert pictures.tokenizer.decode(pictures.expansion(Image.open(picture(0)))) == (
        "<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
    )
    row = tokenized([two_turns(image_in_reply=True)], pictures.tokenizer, pictures)[0]
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>blue square<|end|>"
    built = rows.build_rows(tokenized([two_turns()], pictures.tokenizer, pictures), max_length=200, packing=False)
    batch = rows.collate_rows([built[0]], pictures.tokenizer.pad_token_id, pictures)
    assert tuple(batch["pixel_values"].shape) == (2, 1, 3, 32, 32)  # one text per picture, as its processor nests them
    assert torch.isfinite(TokenLoss(model).loss_sum(model.train(), batch))
    assert "Idefics3EncoderLayer" in vision.vision_block_classes(model)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_through_its_image_processor_gets_exact_masks_and_its_own_positions(family, request):
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.data.images import GridImageProcessor
    from fsdp_recipes.models.vision import vision_block_classes
    from fsdp_recipes.train.losses import TokenLoss, model_inputs

    pictures, model = request.getfixturevalue(family)
    assert isinstance(pictures.processor, GridImageProcessor)  # AutoProcessor needs torchvision here
    row = tokenized([two_turns(image_in_reply=True)], pictures.tokenizer, pictures)[0]
    assert trained_text(pictures.tokenizer, row) == "red circle<|end|>blue square<|end|>"
    pads = [i for i, token in enumerate(row["input_ids"]) if token == pictures.image_token_id]
    assert len(pads) == 3 * 4 and not any(row["loss_mask"][i] for i in pads)  # 4x4 patches, merged 2x2
    built = rows.build_rows(tokenized([two_turns()], pictures.tokenizer, pictures), max_length=200, packing=False)
    batch = rows.collate_rows([built[0]], pictures.tokenizer.pad_token_id, pictures)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    # the 3-D positions given (text positions first) are those the model computes itself from its picture grids
    given = model_inputs(model, batch)["position_ids"]
    own, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    assert given.shape[0] == 4 and torch.equal(given[1:], own) and not torch.equal(own[1], own[0])
    # the model checks the pictures' features against its image tokens: a miscount would raise here
    assert torch.isfinite(TokenLoss(model).loss_sum(model.train(), batch))
    assert vision_block_classes(model) == [
        {"qwen2_5_vl": "Qwen2_5_VLVisionBlock", "qwen3_vl": "Qwen3VLVisionBlock"}[family]
    ]


def test_a_one_process_run_exports_a_folder_the_auto_classes_reload_with_its_processor_and_resumes_exactly(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from helpers.recipes import read_metrics

    data = shapes_subset(tmp_path / "data")
    values = vision_values(
        data, tmp_path / "out", freeze_vision_tower=True, exact_match_eval_samples=4, max_new_tokens=4, max_steps=4,
        save_steps=2, save_total_limit=2,
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "vision", values)
    out = tmp_path / "out"
    # resumed from its step-2 checkpoint, the run's steps 3 and 4 are the uninterrupted run's: weights, optimizer,
    # schedule and the data's place (rows with pictures) restored
    resumed = dict(
        values, output_dir=str(tmp_path / "resumed"), resume_from_checkpoint=str(out / "checkpoints" / "step-00000002")
    )
    run_recipe_in_process("sft", tmp_path, "resumed", resumed)
    whole, later = ([r for r in read_metrics(folder) if "loss" in r] for folder in (out, tmp_path / "resumed"))
    assert [r["step"] for r in later] == [3, 4]
    for step in later:
        expected = next(r for r in whole if r["step"] == step["step"])
        assert step["loss"] == pytest.approx(expected["loss"], rel=1e-6) and step["grad_norm"] == pytest.approx(
            expected["grad_norm"], rel=1e-6
        )
    processor, model = AutoProcessor.from_pretrained(out), AutoModelForImageTextToText.from_pretrained(out)
    assert type(processor).__name__ == "LlavaProcessor" and type(model).__name__ == "LlavaForConditionalGeneration"
    from fsdp_recipes.models.vision import vision_parts

    tower = sum(parameter.numel() for parameter in vision_parts(model)[0].parameters())
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["trainable_parameters"] == summary["total_parameters"] - tower and tower > 0
    from PIL import Image

    prompt = processor.apply_chat_template(two_turns()["messages"][:1], add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.open(picture(0)).convert("RGB")], return_tensors="pt")
    assert (inputs["input_ids"] == model.config.image_token_index).sum() == 16
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()
    results = json.loads((out / "eval_results.json").read_text())
    assert set(results) == {"exact_match_before", "exact_match_after"}
    # eval.py on the exported folder, the same 4 held-out pictures: the training run's exact match, and a loss
    evaluated = dict(
        model_name_or_path=str(out), dataset_name=str(data), dataset_split="test", max_eval_samples=4, max_length=80,
        metrics=["perplexity", "exact_match"], max_new_tokens=4, output_dir=str(tmp_path / "eval"), report_to="none",
    )  # fmt: skip
    run_recipe_in_process("eval", tmp_path, "eval", evaluated)
    scores = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert scores["eval_exact_match"] == pytest.approx(results["exact_match_after"]) and scores["eval_loss"] > 0


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return llava_folder(tmp_path_factory.mktemp("llava"))


def test_lora_on_a_vision_language_model_adapts_its_language_model_only_on_packed_rows(tmp_path, llava):
    from safetensors.torch import load_file

    data = shapes_subset(tmp_path / "data")
    values = vision_values(
        data, tmp_path / "out", model_config=None, tokenizer_name_or_path=None, model_name_or_path=str(llava),
        use_peft=True, lora_r=2, packing=True, packing_row_length=160,
    )  # fmt: skip
    run_recipe_in_process("sft", tmp_path, "lora", values)  # rows of 2 examples with their pictures
    keys = list(load_file(tmp_path / "out" / "adapter_model.safetensors"))
    assert keys and all("language_model" in key for key in keys), keys[:3]
    assert (tmp_path / "out" / "processor_config.json").is_file()
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["train_rows"] < 24  # packed: several examples, with their pictures, per row


# --- bad input: one error line before any weights load --------------------------------------------------------------
def refusal(tmp_path, capsys, values) -> str:
    return recipe_error_in_process("sft", tmp_path, values, capsys)


def with_rows(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_bad_images_are_refused_naming_the_row(tmp_path, capsys):
    good = two_turns()
    cases = {
        "missing": ({**good, "images": [picture(0), "nowhere.png"]}, "the image 'nowhere.png' does not exist"),
        "not an image": ({**good, "images": [picture(0), str(LLAVA)]}, "is not an image PIL can read"),
        "more parts": ({**good, "images": [picture(0)]}, "it has 2 image part(s) in its turns but 1 image(s)"),
    }
    for name, (row, expected) in cases.items():
        data = with_rows(tmp_path / name.replace(" ", "_"), [good] * 8 + [row])
        line = refusal(tmp_path, capsys, vision_values(data, tmp_path / "out"))
        assert "example 8 of the train split" in line and expected in line, (name, line)
    data = with_rows(tmp_path / "long", [good] * 9)
    line = refusal(tmp_path, capsys, vision_values(data, tmp_path / "out", max_length=30))
    assert "past max_length=30" in line and "each image is 16 tokens" in line


def test_images_for_a_text_model_a_blind_template_and_freezing_a_tower_a_model_lacks_are_refused(
    tmp_path, capsys, tiny_model_config, small_chat_data
):
    data = with_rows(tmp_path / "data", [two_turns()] * 9)
    text_model = vision_values(
        data,
        tmp_path / "out",
        model_config=str(tiny_model_config),
        tokenizer_name_or_path=str(REPO / "demo" / "assets" / "tokenizer"),
    )
    assert "nothing here reads images: the model is text-only" in refusal(tmp_path, capsys, text_model)
    blind = vision_values(data, tmp_path / "out", chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert "the chat template never renders an image part" in refusal(tmp_path, capsys, blind)
    frozen = dict(text_model, dataset_name=str(small_chat_data), freeze_vision_tower=True)
    assert "freeze_vision_tower: the model (llama) is text-only" in refusal(tmp_path, capsys, frozen)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_batch_without_pictures_runs_the_tower_on_a_blank_one_and_its_losses_do_not_change(family, pictures, request):
    """Under FSDP every rank's forward must run the same modules: a micro-batch of rows without pictures (text rows
    in data that mixes both) gets a blank picture as a sequence of its own after its last row."""
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.models.vision import vision_parts
    from fsdp_recipes.train.losses import TokenLoss

    inputs, model = family_model(family, pictures, request)
    text = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"name colour {i}"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": []}
            for i in range(2)]  # fmt: skip
    built = list(rows.build_rows(tokenized(text, inputs.tokenizer, inputs), max_length=200, packing=False))
    pad = inputs.tokenizer.pad_token_id
    with_blank, plain = rows.collate_rows(built, pad, inputs), rows.collate_rows(built, pad)
    assert "pixel_values" in with_blank and with_blank["real_tokens"].tolist() == plain["real_tokens"].tolist()
    encoded = []
    hook = vision_parts(model)[0].register_forward_hook(lambda *_: encoded.append(1))
    with torch.no_grad():
        blank, alone = (TokenLoss(model).token_losses(model.eval(), batch) for batch in (with_blank, plain))
    hook.remove()
    assert len(encoded) == 1  # the tower ran for the blank picture
    width = plain["input_ids"].shape[1]
    torch.testing.assert_close(blank[:, :width], alone, rtol=1e-5, atol=1e-6)
    assert not blank[:, width:].any()  # the blank picture's tokens are never targets


@pytest.mark.parametrize("family", ["qwen2_5_vl", "mistral3"])
def test_pictures_of_different_sizes_share_a_batch(family, request, tmp_path):
    """Qwen-VL and Pixtral keep a picture's proportions, so pictures of one batch make different numbers of tokens:
    their rows, pixel values and the model's count of image tokens agree."""
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from fsdp_recipes.data import rows
    from fsdp_recipes.data.images import GridImageProcessor, ImageInputs
    from fsdp_recipes.train.losses import TokenLoss

    inputs, model = request.getfixturevalue(family)
    if family == "qwen2_5_vl":  # its fixture resizes every picture to one size: here from 28x28 to 112x112 pixels
        ranged = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14)
        inputs = ImageInputs(GridImageProcessor(ranged, inputs.tokenizer, inputs.tokenizer.chat_template))
    wide, small = tmp_path / "wide.png", tmp_path / "small.png"
    Image.new("RGB", (64, 32), "red").save(wide)
    Image.new("RGB", (32, 32), "blue").save(small)
    examples = [{**two_turns(), "images": [str(wide), str(small)]}, {**two_turns(), "images": [str(small), str(wide)]}]
    built = rows.build_rows(tokenized(examples, inputs.tokenizer, inputs), max_length=400, packing=False)
    counts = [row["input_ids"].count(inputs.image_token_id) for row in built]
    wide_tokens = len([t for t in inputs.expansion(Image.open(wide)) if t == inputs.image_token_id])
    small_tokens = len([t for t in inputs.expansion(Image.open(small)) if t == inputs.image_token_id])
    assert wide_tokens != small_tokens and counts == [wide_tokens + small_tokens] * 2
    batch = rows.collate_rows(list(built), inputs.tokenizer.pad_token_id, inputs)
    with torch.no_grad():  # the model checks its image tokens against the pictures' features
        assert torch.isfinite(TokenLoss(model).loss_sum(model.eval(), batch))


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "idefics3"])
def test_each_familys_processor_round_trips_through_the_exported_folder(family, pictures, request, tmp_path):
    """What export writes (the processor's save_pretrained) loads back as the run loads it, and makes the same
    tokens and pixel values of a picture."""
    import torch

    from fsdp_recipes.data.images import ImageInputs
    from fsdp_recipes.models import vision

    inputs = pictures if family == "llava" else request.getfixturevalue(family)[0]
    inputs.processor.save_pretrained(tmp_path)
    again = ImageInputs(
        vision.load_processor(str(tmp_path), inputs.tokenizer, revision="main", trust_remote_code=False)
    )
    assert type(again.processor) is type(inputs.processor)
    from PIL import Image

    shown = Image.open(picture(0)).convert("RGB")
    assert again.expansion(shown) == inputs.expansion(shown) and again.image_token_id == inputs.image_token_id
    ids = torch.tensor([inputs.expansion(shown)])
    for key, value in inputs.pixel_inputs(ids, [[Path(picture(0)).read_bytes()]]).items():
        torch.testing.assert_close(again.pixel_inputs(ids, [[Path(picture(0)).read_bytes()]])[key], value, msg=key)


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "idefics3"])
def test_packed_rows_with_pictures_give_each_example_the_losses_it_has_alone(family, pictures, request):
    """Two conversations with pictures packed into one row (and a third alone, padded): every token's loss is the
    one it has in a row of its own. Llava and Gemma 3 keep the examples apart by their restarting positions (Gemma 3's
    picture tokens see each other both ways, within their example); Qwen-VL's 3-D positions are each example's own."""
    import torch

    from fsdp_recipes.data import rows
    from fsdp_recipes.train.losses import IGNORE_INDEX, TokenLoss

    inputs, model = family_model(family, pictures, request)
    model.eval()
    examples = [two_turns(), two_turns(image_in_reply=True), {**two_turns(), "images": [picture(3), picture(4)]}]
    tokens = tokenized(examples, inputs.tokenizer, inputs)
    packed = rows.build_rows(tokens.select([0, 1]), max_length=400, packing=True)
    assert len(packed) == 1 and len(packed[0]["images"]) == 5
    pad = inputs.tokenizer.pad_token_id
    alone = rows.build_rows(tokens, max_length=400, packing=False)
    loss = TokenLoss(model)
    with torch.no_grad():
        together = loss.token_losses(model, rows.collate_rows([packed[0], alone[2]], pad, inputs))
        each = [loss.token_losses(model, rows.collate_rows([alone[i]], pad, inputs))[0] for i in range(3)]
    at = 0  # the packed row holds its examples longest first (best-fit decreasing): each found by its tokens
    for _ in range(2):
        index = next(
            i for i in (0, 1) if packed[0]["input_ids"][at : at + len(alone[i]["input_ids"])] == alone[i]["input_ids"]
        )
        width, targets = len(alone[index]["input_ids"]), torch.tensor(alone[index]["targets"]) != IGNORE_INDEX
        torch.testing.assert_close(together[0, at : at + width][targets], each[index][targets], rtol=1e-4, atol=1e-5)
        at += width
    third, targets = together[1, : len(alone[2]["input_ids"])], torch.tensor(alone[2]["targets"]) != IGNORE_INDEX
    torch.testing.assert_close(third[targets], each[2][targets], rtol=1e-4, atol=1e-5)


def test_the_demo_assets_rebuild_byte_for_byte(tmp_path):
    import importlib.util

    shutil.copytree(REPO / "demo" / "assets" / "tokenizer", tmp_path / "tokenizer")
    script = importlib.util.spec_from_file_location("make_shapes_assets", REPO / "demo" / "make_shapes_assets.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    module.main(["--out-dir", str(tmp_path), "--no-model-config"])  # in this process: no interpreter to start
    for split in ("train", "test"):
        assert (tmp_path / "shapes" / f"{split}.jsonl").read_bytes() == (SHAPES / f"{split}.jsonl").read_bytes()
        prompts = tmp_path / "shapes_prompts" / f"{split}.jsonl"
        assert prompts.read_bytes() == (SHAPES.parent / "shapes_prompts" / f"{split}.jsonl").read_bytes()
    assert (tmp_path / "shapes_images" / "test-0007.png").read_bytes() == Path(picture(7)).read_bytes()


# --- DPO: pairs whose prompt shows a picture -------------------------------------------------------------------------
def test_dpo_pairs_with_images_train_the_answers_alone_and_their_log_probs_see_the_pictures(tmp_path, pictures):
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForImageTextToText

    from fsdp_recipes.methods.preference import paired
    from fsdp_recipes.train.losses import IGNORE_INDEX, TokenLoss, sequence_log_probs

    data = shapes_pairs(tmp_path / "pairs", count=4)
    raw = Dataset.from_json(str(data / "train.jsonl"))
    pairs = paired.tokenize_pairs(raw, pictures.tokenizer, max_length=80, pictures=pictures)[0]
    tokenizer = pictures.tokenizer
    for pair, example in zip(pairs, raw):
        for side in ("chosen", "rejected"):
            ids, targets = pair[f"{side}_input_ids"], pair[f"{side}_targets"]
            assert ids.count(pictures.image_token_id) == 16  # the picture's tokens, in the prompt
            trained = tokenizer.decode([t for t in targets if t != IGNORE_INDEX])
            assert trained.startswith(example[side][0]["content"][0]["text"]), (side, trained)
            assert pictures.image_token_id not in [t for t in targets if t != IGNORE_INDEX]
    batch = paired.PairCollator(tokenizer.pad_token_id, pictures=pictures)(list(pairs))
    assert batch["pixel_values"].shape[0] == 2 * len(pairs)  # each row its own picture: chosen rows, then rejected
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA)).eval()
    with torch.no_grad():
        seen = sequence_log_probs(TokenLoss(model).token_losses(model, batch))
        blank = sequence_log_probs(
            TokenLoss(model).token_losses(model, {**batch, "pixel_values": 0 * batch["pixel_values"]})
        )
    assert not torch.allclose(seen, blank)  # the answers' log-probabilities depend on the pictures
    # the implicit form (whole conversations, the prompt what they share) gives the same pairs
    implicit = raw.map(lambda e: {"chosen": e["prompt"] + e["chosen"], "rejected": e["prompt"] + e["rejected"]})
    implicit = paired.tokenize_pairs(implicit.remove_columns("prompt"), tokenizer, max_length=80, pictures=pictures)[0]
    assert implicit["chosen_input_ids"] == pairs["chosen_input_ids"] and implicit["key"] == pairs["key"]
    # the same text with another picture is another pair: precomputed reference values are never mixed up
    other = raw.map(lambda example: {"images": [picture(5)]})
    others = paired.tokenize_pairs(other, tokenizer, max_length=80, pictures=pictures)[0]
    assert others[0]["chosen_input_ids"] == pairs[0]["chosen_input_ids"] and others[0]["key"] != pairs[0]["key"]
    # bad input: one line naming the pair
    from fsdp_recipes.common.errors import DataError

    for row, options, expected in (
        (
            {**raw[0], "images": []},
            {},
            "pair 0 of the train split: its prompt and chosen answer have 1 image part(s) but 0",
        ),
        (raw[0], {"max_prompt_length": 10}, "max_prompt_length=10 would cut a picture"),
        (raw[0], {"max_length": 12}, "its last image ends at token"),
    ):
        with pytest.raises(DataError, match=re.escape(expected)):
            paired.tokenize_pairs(
                Dataset.from_list([row]), tokenizer, **{"max_length": 80, **options}, pictures=pictures
            )
    with pytest.raises(DataError, match="nothing here reads images: the model is text-only"):
        paired.tokenize_pairs(raw, tokenizer, max_length=80)


def test_kto_examples_show_their_prompts_pictures_in_both_rows_and_pairs_unpair_with_them(tmp_path, pictures):
    import torch
    from datasets import Dataset

    from fsdp_recipes.methods.preference import unpaired
    from fsdp_recipes.train.losses import IGNORE_INDEX

    data = shapes_pairs(tmp_path / "pairs", count=4)  # pairs: unpaired into a good and a bad answer each
    raw = Dataset.from_json(str(data / "train.jsonl"))
    examples, stats = unpaired.tokenize_examples(raw, pictures.tokenizer, max_length=80, seed=0, pictures=pictures)
    assert stats["desirable"] == stats["undesirable"] == 4 and len(examples) == 8
    for example in examples:  # its answer and its KL row (another answer) both follow the prompt and its picture
        for side in ("completion", "kl"):
            assert example[f"{side}_input_ids"].count(pictures.image_token_id) == 16
            assert pictures.image_token_id not in [t for t in example[f"{side}_targets"] if t != IGNORE_INDEX]
    assert examples[0]["images"] == examples[4]["images"]  # pair 0's chosen and rejected answers: one picture
    batch = unpaired.collator(pictures.tokenizer.pad_token_id, pictures)(list(examples)[:3])
    assert batch["pixel_values"].shape[0] == 6 and batch["label"].tolist() == [True, True, True]
    with pytest.raises(Exception, match="nothing here reads images"):
        unpaired.tokenize_examples(raw, pictures.tokenizer, max_length=80, seed=0)
    assert torch.equal(batch["input_ids"][0, :5], batch["input_ids"][3, :5])  # the KL row: the same prompt


# --- GRPO: prompts that show a picture ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "idefics3"])
def test_grpo_scores_completions_with_their_prompts_pictures_as_the_model_does_row_by_row(family, pictures, request):
    """The policy passes run on left-padded rows of several prompts: each completion's log-probabilities equal the
    model's own unpadded forward of that prompt, picture and completion (Qwen: its 3-D positions, from the mask)."""
    import torch
    from datasets import Dataset

    from fsdp_recipes.methods.grpo import prompts as prompts_lib
    from fsdp_recipes.methods.grpo import rollouts
    from fsdp_recipes.methods.grpo.task import Task
    from fsdp_recipes.models.vision import vision_parts
    from fsdp_recipes.train import generation

    inputs, model = family_model(family, pictures, request)
    model.eval()
    tokenizer = inputs.tokenizer
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
         "images": [picture(index)]}
        for index, text in enumerate(["which?", "which shape and colour is this one?"])
    ]  # fmt: skip
    data = prompts_lib.load_prompts(
        Dataset.from_list(rows), tokenizer, max_prompt_length=200, split="train", pictures=inputs
    )
    assert len(data.prompt_ids[0]) < len(data.prompt_ids[1])  # the first row is left-padded
    assert [row[0].size for row in data.columns["images"]] == [(32, 32)] * 2  # the reward functions' PIL images
    encoded = []
    hook = vision_parts(model)[0].register_forward_hook(lambda *_: encoded.append(1))
    settings = generation.GenerationSettings(max_completion_length=3, batch_size=2, pictures=inputs)
    completions, _ = generation.generate_completions(
        model, tokenizer, data.prompt_ids, [0, 1], settings, synced_gpus=False, images=data.images
    )
    hook.remove()
    assert encoded and all(completions)  # generation saw the pictures
    # a picture's tokens are never sampled (a training forward would count them as a picture), however likely
    favour = model.lm_head.register_forward_hook(lambda _m, _a, out: out.index_add(
        -1, torch.tensor(inputs.never_generated), torch.full((*out.shape[:-1], len(inputs.never_generated)), 1e4)
    ))  # fmt: skip
    favoured, _ = generation.generate_completions(
        model, tokenizer, data.prompt_ids, [0, 1], settings, synced_gpus=False, images=data.images
    )
    favour.remove()
    assert not set(inputs.never_generated) & {token for completion in favoured for token in completion}
    task = Task(data, [], [], [], None, None, 1.0, inputs)
    batch = rollouts.rollout_batch(
        data.prompt_ids, completions, pad_token_id=tokenizer.pad_token_id,
        prompt_width=len(data.prompt_ids[1]), completion_width=max(map(len, completions)),
    )  # fmt: skip
    batch.update(task.pixel_inputs(batch["input_ids"], [0, 1]))
    with torch.no_grad():
        padded = rollouts.completion_log_probs(model, batch, 1.0)[0]
        for row, (prompt, completion) in enumerate(zip(data.prompt_ids, completions)):
            ids = torch.tensor([prompt + completion])
            alone = model(input_ids=ids, **task.pixel_inputs(ids, [row])).logits[0, len(prompt) - 1 : -1]
            expected = alone.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(padded[row, : len(completion)], expected, rtol=1e-4, atol=1e-4)
    # one grey for every picture (Idefics3 takes all-zero pictures for padding)
    blank = {key: torch.full_like(value, 0.5) if key == "pixel_values" else value for key, value in batch.items()}
    assert not torch.allclose(rollouts.completion_log_probs(model, blank, 1.0)[0], padded)


def test_grpo_prompts_with_and_without_pictures_are_refused_over_several_ranks(tmp_path, pictures):
    from fsdp_recipes.common.errors import DataError
    from fsdp_recipes.methods.grpo.task import load_task
    from helpers.recipes import load_recipe
    from helpers.vision import shapes_prompts, vision_grpo_values

    folder = shapes_prompts(tmp_path / "prompts", count=4)
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    rows[1] = {**rows[1], "images": [], "prompt": [{"role": "user", "content": "name a colour"}]}
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    values = vision_grpo_values(folder, tmp_path / "out", reward_funcs=["exact_match"])
    config = load_recipe("grpo").GRPOConfig(**values)
    assert len(load_task(config, pictures.tokenizer, device="cpu", pictures=pictures, data_parallel_size=1).data) == 4
    with pytest.raises(DataError, match="prompts 1 of the train split show no picture while others do"):
        load_task(config, pictures.tokenizer, device="cpu", pictures=pictures, data_parallel_size=2)


def test_grpo_refuses_what_cannot_take_pictures_yet(pictures):
    from types import SimpleNamespace

    from datasets import Dataset

    from fsdp_recipes.common.errors import DataError
    from fsdp_recipes.methods.grpo.prompts import load_prompts
    from fsdp_recipes.methods.grpo.task import picture_problem

    options = dict(generation_backend="generate", padding_free=False)
    assert picture_problem(SimpleNamespace(**options), []) is None
    for change, tools, expected in (
        ({"generation_backend": "vllm"}, [], "generation_backend vllm (use_vllm) does not take them here yet"),
        ({}, ["a tool"], "tool calls with pictures are not built yet"),
        ({"padding_free": True}, [], "set padding_free: false"),
    ):
        assert expected in picture_problem(SimpleNamespace(**{**options, **change}), tools)
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]}]
    for row, options, expected in (
        ({"prompt": turns, "images": []}, {}, "prompt 0 of the train split has 1 image part(s) but 0 image(s)"),
        ({"prompt": turns, "images": ["nowhere.png"]}, {}, "the image 'nowhere.png' does not exist"),
        ({"prompt": turns, "images": [picture(0)]}, {"max_prompt_length": 10}, "cutting it would cut a picture"),
        ({"prompt": turns, "images": [picture(0)]}, {"pictures": None}, "nothing here reads images"),
    ):
        with pytest.raises(DataError, match=re.escape(expected)):
            load_prompts(
                Dataset.from_list([row]),
                pictures.tokenizer,
                split="train",
                **{"max_prompt_length": 200, "pictures": pictures, **options},
            )
