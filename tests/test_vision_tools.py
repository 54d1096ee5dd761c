"""The tools on vision-language models (docs/vision.md): `fsdp-recipes estimate` counts a picture's tokens as the
processors do and the vision tower's memory as the run trains it (frozen or not, LoRA on the language model only),
`ls` marks the configs that train on pictures, and `rehearse` shrinks both towers consistently, writes the real
processor beside the stand-in and the data's pictures beside its rows. In-process and cheap: the stand-ins' forwards
take a picture each; no launch."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from fsdp_recipes.common.errors import ConfigError
from fsdp_recipes.distributed.accelerate_config import LaunchLayout
from fsdp_recipes.tools.estimator import MODEL_SHAPES
from fsdp_recipes.tools.estimator.formulas import estimate, estimate_for_recipe
from fsdp_recipes.tools.estimator.recipe import recipe_config
from fsdp_recipes.tools.estimator.report import estimate_report, render_report
from fsdp_recipes.tools.estimator.shapes import load_model_info
from fsdp_recipes.tools.estimator.workload import Adapters, Workload
from helpers.paths import FSDP_CPU_CONFIG, REPO
from helpers.vision import LLAVA, PROCESSOR, SHAPES

QWEN2_5_VL = MODEL_SHAPES / "Qwen" / "Qwen2.5-VL-7B-Instruct" / "config.json"
QWEN3_VL = MODEL_SHAPES / "Qwen" / "Qwen3-VL-8B-Instruct" / "config.json"
GEMMA3 = MODEL_SHAPES / "google" / "gemma-3-12b-pt" / "config.json"
ONE_PROCESS = LaunchLayout.from_mapping({"distributed_type": "NO", "num_processes": 1, "mixed_precision": "no"})


# --- estimate ----------------------------------------------------------------------------------------------------------
def test_tokens_per_picture_are_the_processors_own():
    """Qwen's count for a 640x480 photo is what its image processor's grid gives (with the published limits); Llava's
    what the demo's processor writes for a picture; Gemma 3's its config's 256, from its tower's 4,096 patches."""
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLImageProcessorPil

    from fsdp_recipes.data.images import ImageInputs

    photo = Image.new("RGB", (640, 480))
    qwen = load_model_info(str(QWEN2_5_VL)).vision.pictures
    grid = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)(images=[photo])["image_grid_thw"][0]
    assert qwen.kind == "grid" and qwen.example_tokens == int(grid.prod()) // 4 == 391
    assert (qwen.min_tokens, qwen.tokens, qwen.patches_per_token) == (4, 16384, 4)
    assert load_model_info(str(QWEN3_VL)).vision.pictures.example_tokens == 300  # 32-pixel merged patches
    llava = load_model_info(str(LLAVA)).vision.pictures
    expansion = ImageInputs(AutoProcessor.from_pretrained(PROCESSOR)).expansion(Image.new("RGB", (32, 32)))
    assert llava.tokens == len(expansion) == 16
    gemma = load_model_info(str(GEMMA3)).vision.pictures
    assert (gemma.tokens, gemma.patches_per_token) == (256, 16) and "mm_tokens_per_image" in gemma.source


def test_a_frozen_tower_has_no_gradients_or_optimizer_state_as_the_run_freezes_it():
    """One process, fp32: the estimator's gradient bytes are 4 per parameter the run leaves trainable after
    models.vision.freeze (Qwen's merger is inside its tower and freezes with it), on weightless copies."""
    from transformers import AutoConfig

    from fsdp_recipes.models.modeling import meta_model
    from fsdp_recipes.models.vision import freeze

    for path, tower, projector in ((LLAVA, True, False), (LLAVA, True, True), (QWEN2_5_VL, True, False)):
        model = meta_model(AutoConfig.from_pretrained(path))
        freeze(model, tower=tower, projector=projector)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        info = load_model_info(str(path))
        est = estimate(info, ONE_PROCESS, Workload(64, 1), freeze=(tower, projector))
        assert est.state["gradients"] == 4 * trainable < 4 * info.num_params
        assert not est.vision.trained_tower and est.vision.trained_projector == (not projector and path == LLAVA)


def test_the_tower_s_activations_count_unless_it_is_frozen_and_pictures_must_fit_the_row(tmp_path, capsys):
    info = load_model_info(str(QWEN2_5_VL))
    layout = LaunchLayout.from_file(FSDP_CPU_CONFIG)
    trained = estimate(info, layout, Workload(2048, 2))
    frozen = estimate(info, layout, Workload(2048, 2), freeze=(True, False))
    text = estimate(info, layout, Workload(2048, 2), images_per_row=0)
    assert trained.vision.patches == 2 * 2048 * 4  # a picture as large as the row holds, 4 patches per token
    assert trained.vision.stored_without_checkpointing > 0 == frozen.vision.stored_without_checkpointing
    assert trained.activations_used > frozen.activations_used >= text.activations_used
    two = estimate(info, layout, Workload(2048, 2), images_per_row=2)
    assert two.vision.tokens_per_picture == 1024 and two.vision.patches == trained.vision.patches
    report = render_report(estimate_report(frozen, info, recipe_config({})))
    assert "a 640x480 picture is 391" in report and "frozen: nothing kept for backward" in report
    # packed rows hold no pictures; LoRA leaves the image side alone (peft's own count on the tiny Llava)
    packed = recipe_config({"packing": True}, script=REPO / "recipes" / "sft.py")
    assert estimate_for_recipe(info, layout, packed).vision.pictures_per_row == 0
    llava = load_model_info(str(LLAVA))
    assert estimate(llava, layout, Workload(80, 1), images_per_row=5).vision.patches == 5 * 17  # and CLIP's class token
    with pytest.raises(ConfigError, match=r"--images-per-row 6: pictures of 16 tokens each .* at most 5 fit"):
        estimate(llava, layout, Workload(80, 1), images_per_row=6)
    args = Namespace(
        model=str(REPO / "tests" / "data" / "llama-3-8b-like_config.json"), accelerate_config=str(FSDP_CPU_CONFIG),
        recipe_config=None, max_length=None, batch_size=None, num_processes=None, gpu_memory="80GB", reserve="10%",
        trust_remote_code=False, json=True, images_per_row=1,
    )  # fmt: skip
    from fsdp_recipes.tools.estimator.command import run_estimate

    with pytest.raises(ConfigError, match="--images-per-row: .* is a text-only model"):
        run_estimate(args)


def test_lora_adapters_are_counted_on_the_language_model_alone_as_peft_makes_them():
    from peft import get_peft_model
    from transformers import AutoConfig

    from fsdp_recipes.models.adapters import lora_config
    from fsdp_recipes.models.modeling import meta_model

    config = recipe_config({"use_peft": True, "lora_r": 4})
    adapted = get_peft_model(
        meta_model(AutoConfig.from_pretrained(LLAVA)), lora_config(config, "causal-lm", vision_language=True)
    )
    made = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert sum(p.numel for p in Adapters(rank=4).adapter_params(load_model_info(str(LLAVA)))) == made


# --- ls ------------------------------------------------------------------------------------------------------------------
def test_ls_marks_the_configs_that_train_on_pictures():
    from fsdp_recipes.tools.catalog import Catalog
    from fsdp_recipes.tools.listing import listing

    lines = listing(Catalog(REPO), "gemma-3-12b")
    rows = {line.split()[0]: line for line in lines if line.startswith("  sft/")}
    assert "full + images" in rows["sft/gemma-3-12b_llava-instruct_images"]
    assert "+ images" not in rows["sft/gemma-3-12b_ultrachat"]  # the same model on packed text rows
    assert any(line.startswith("Fine-tuning on pictures") and "sft/gemma-3-12b_llava-instruct_images" in line
               for line in lines)  # fmt: skip


# --- rehearse ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("real", [QWEN2_5_VL, QWEN3_VL])
def test_a_qwen_vl_stand_in_reads_a_picture_with_both_towers_shrunk(real):
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    from fsdp_recipes.tools.rehearsal import stand_ins

    small = stand_ins.shrunk_config(AutoConfig.from_pretrained(real))
    text, vision = small.text_config, small.vision_config
    assert text.num_hidden_layers == vision.depth == 2 and vision.out_hidden_size == text.hidden_size == 64
    assert (
        sum(text.rope_parameters["mrope_section"]) == 8
        and vision.patch_size == AutoConfig.from_pretrained(real).vision_config.patch_size
    )  # what the processor reads is kept
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(small).eval()
    side = 4 * vision.patch_size
    pictures = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, min_pixels=side**2, max_pixels=side**2)(
        images=[Image.new("RGB", (side, side), "red")], return_tensors="pt"
    )
    count = int(pictures["image_grid_thw"].prod()) // vision.spatial_merge_size**2
    ids = torch.tensor(
        [[5, small.vision_start_token_id, *[small.image_token_id] * count, small.vision_end_token_id, 7]]
    )
    inputs = dict(input_ids=ids, image_grid_thw=pictures["image_grid_thw"], mm_token_type_ids=(ids == small.image_token_id).long())  # fmt: skip
    with torch.no_grad():
        seen = model(**inputs, pixel_values=pictures["pixel_values"]).logits
        blank = model(**inputs, pixel_values=torch.zeros_like(pictures["pixel_values"])).logits
    assert seen.shape == (1, count + 4, small.text_config.vocab_size) and not torch.allclose(seen, blank)


def test_gemma3_and_llava_stand_ins_keep_their_picture_geometry_and_their_projectors_follow():
    from transformers import AutoConfig, LlavaConfig

    from fsdp_recipes.models.modeling import meta_model
    from fsdp_recipes.tools.rehearsal import stand_ins

    gemma = stand_ins.shrunk_config(AutoConfig.from_pretrained(GEMMA3))
    assert (gemma.vision_config.image_size, gemma.vision_config.patch_size, gemma.mm_tokens_per_image) == (896, 14, 256)
    assert gemma.vision_config.num_hidden_layers == 2 and gemma.text_config.head_dim == 16
    projector = meta_model(gemma).model.multi_modal_projector.mm_input_projection_weight
    assert tuple(projector.shape) == (gemma.vision_config.hidden_size, gemma.text_config.hidden_size)
    llava = stand_ins.shrunk_config(LlavaConfig(text_config={"vocab_size": 32064}))
    linear = meta_model(llava).model.multi_modal_projector.linear_1
    assert (linear.in_features, linear.out_features) == (llava.vision_config.hidden_size, llava.text_config.hidden_size)
    assert llava.vision_config.image_size == 336 and llava.vision_config.num_hidden_layers == 2


def test_a_shipped_vision_config_s_launch_line_keeps_its_wrap_classes(monkeypatch):
    from fsdp_recipes.tools.config_comments import opening_comment
    from fsdp_recipes.tools.rehearsal import launch_line

    monkeypatch.chdir(REPO)
    comment = opening_comment((REPO / "recipes/configs/sft/qwen2.5-vl-7b_llava-instruct.yaml").read_text())
    words = " ".join(line.strip().removesuffix("\\") for line in comment[1:4]).split()
    launch = launch_line.parse_launch(words)
    wrap = launch.fsdp_options["fsdp_transformer_layer_cls_to_wrap"]
    assert wrap == "Qwen2_5_VLDecoderLayer,Qwen2_5_VLVisionBlock" and launch.recipe.name == "sft.py"


def test_the_stand_in_folder_holds_the_real_processor_and_the_rows_their_pictures(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from fsdp_recipes.tools.rehearsal import stand_ins

    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(LLAVA.read_text())
    folder, _, small = stand_ins.write_model(
        str(real), str(PROCESSOR), tmp_path / "model", tp=1, ep=1, locals_={}
    )  # fmt: skip
    assert type(AutoProcessor.from_pretrained(folder)).__name__ == "LlavaProcessor"
    assert AutoModelForImageTextToText.from_pretrained(folder).config.vision_config.hidden_size == 64
    splits = {"dataset_train_split": "train", "dataset_test_split": "test"}
    renamed = stand_ins.write_data(str(SHAPES), None, None, splits, tmp_path / "data", rows=3, locals_={})
    assert renamed == splits
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    pictures = [path for row in rows for path in row["images"]]
    assert len(pictures) == 3 and all(path.startswith(str(tmp_path / "data_images")) for path in pictures)
    original = json.loads((SHAPES / "train.jsonl").read_text().splitlines()[0])["images"][0]
    assert open(pictures[0], "rb").read() == (SHAPES / original).read_bytes()
