"""Files the tests make: JSON lines and the tiny Llama's config."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_tiny_model_config(path: Path, tokenizer, **overrides) -> Path:
    """A Llama of about 0.1M parameters: big enough to have every real part, small enough for 2 CPU cores."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    LlamaConfig(**settings).to_json_file(path)
    return path


def encode_chat(tokenizer, example: dict, *, max_length: int = 1 << 20, **options) -> dict:
    """An SFT example's tokens and loss mask (assistant / completion tokens only), as recipes/sft.py makes them."""
    from fsdp_recipes.data.chat import tokenize_example

    data_format = "conversational" if "messages" in example else "prompt_completion"
    return tokenize_example(
        example, tokenizer, data_format, assistant_only_loss=True, completion_only_loss=True, max_length=max_length,
        **options,
    )  # fmt: skip


def trained_text(tokenizer, encoded: dict) -> str:
    """The text of the tokens an encoded example trains on."""
    return tokenizer.decode([t for t, keep in zip(encoded["input_ids"], encoded["loss_mask"]) if keep])
