"""Tiny mixtures of experts, one per family transformers ships (tests/test_moe.py and the launches that train one)."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
    "qwen2_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "deepseek_v3": dict(
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
        num_key_value_heads=4,  # multi-head latent attention: one key/value head per query head
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}  # fmt: skip
FUSED_ON_DISK = {"gpt_oss"}


def tiny_moe(family: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
    return AutoModelForCausalLM.from_config(config)
