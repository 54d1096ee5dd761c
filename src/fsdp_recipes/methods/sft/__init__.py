"""Supervised fine-tuning (recipes/sft.py; distill.py trains on the same data): chat or prompt/completion rows with
loss on the answers, packed, and the exact-match generation check."""
