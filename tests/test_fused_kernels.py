"""liger-kernel's fused kernels (`use_liger_kernel: true`) with the real package (requirements-gpu.txt, installed by
`make venv` into .venv/kernels): its kernels are Triton's and run on CUDA GPUs only, so here the patch itself is
checked, that LoRA and FSDP2 compose with the patched model, and what is refused before loading. A recipe run with
it on CPU is refused with its one line (tests/test_compat.py, the handbook YAML that asks for it)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from fsdp_recipes.models import fused_kernels
from helpers.kernels import kernel_packages_on_path
from helpers.launch import free_port


def tiny_llama():
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@contextlib.contextmanager
def llama_module_restored():
    """liger replaces names in transformers' llama module (its RMSNorm and MLP classes, the rotary function) for the
    whole process, as it does for a real run: put them back for the tests that follow in this process."""
    module = sys.modules[type(tiny_llama().model).__module__]
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name in set(vars(module)) - set(saved):
            delattr(module, name)
        vars(module).update(saved)


def test_the_patch_replaces_norms_rope_and_mlp_and_lora_and_fsdp2_wrap_the_result():
    kernel_packages_on_path()
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    with llama_module_restored():
        model = tiny_llama()
        description = fused_kernels.apply_liger_kernels(model)
        assert description.startswith("liger-kernel 0.8.5: RMSNorm, rotary embedding, SwiGLU")
        layer = model.model.layers[0]
        for patched in (model.model.norm, layer.input_layernorm, layer.mlp):
            assert patched.forward.__func__.__module__.startswith("liger_kernel"), patched.forward.__func__
        rotary = sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb
        assert rotary.__module__.startswith("liger_kernel")  # what the attention calls
        assert model.lm_head.forward.__func__.__module__.startswith("torch")  # the loss: loss_implementation's

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"]))
        assert type(model.base_model.model.model.layers[0].mlp.gate_proj).__name__ == "Linear"  # peft's LoRA layer
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            for decoder_layer in model.base_model.model.model.layers:
                fully_shard(decoder_layer)
            fully_shard(model)
            assert isinstance(model.base_model.model.model.layers[1], FSDPModule)
            patched_mlp = model.base_model.model.model.layers[1].mlp
            assert patched_mlp.forward.__func__.__module__.startswith("liger_kernel")  # kept under the wrapping
        finally:
            torch.distributed.destroy_process_group()


def test_what_cannot_run_is_refused_before_loading(monkeypatch):
    kernel_packages_on_path()
    llama = tiny_llama().config
    assert fused_kernels.liger_problem(llama, device_type="cuda", sharded_layers=False) is None
    assert fused_kernels.liger_problem(llama, device_type="cpu", sharded_layers=False).startswith(
        "use_liger_kernel: true needs a CUDA GPU (liger-kernel's kernels are Triton's); this run is on cpu: run it on a "
        "GPU, or set use_liger_kernel: false"
    )
    assert "train with FSDP alone" in fused_kernels.liger_problem(llama, device_type="cuda", sharded_layers=True)
    gpt2 = fused_kernels.liger_problem(GPT2Config(), device_type="cuda", sharded_layers=False)
    assert gpt2.startswith("use_liger_kernel: true: liger-kernel 0.8.5 has no kernels for model type 'gpt2' (it has ")
    assert "llama" in gpt2 and "qwen3" in gpt2
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    assert fused_kernels.liger_problem(llama, device_type="cuda", sharded_layers=False) == (
        "use_liger_kernel: true needs liger-kernel, which is not installed: pip install liger-kernel==0.8.5 "
        "(requirements-gpu.txt), or set use_liger_kernel: false (the same operations then run unfused)"
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "mistral", "qwen3_moe", "gpt_oss"])
def test_the_model_families_the_recipes_ship_configs_for_have_liger_kernels(model_type):
    kernel_packages_on_path()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    assert model_type in MODEL_TYPE_TO_APPLY_LIGER_FN
