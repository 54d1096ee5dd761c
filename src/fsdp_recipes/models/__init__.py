"""Layer 3: tokenizer and model loading, the checks that need only a model config, LoRA/QLoRA adapters."""
