"""Where things are: the repo, its local tokenizer and demo data, the 2-process CPU FSDP2 config, the recipe scripts."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "demo" / "assets" / "tokenizer"
DEMO_DATA = REPO / "demo" / "assets" / "reverse"
FSDP_CPU_CONFIG = REPO / "accelerate_configs" / "fsdp_2proc_cpu.yaml"
SFT = REPO / "recipes" / "sft.py"
CLASSIFY = REPO / "recipes" / "classify.py"
EVAL = REPO / "recipes" / "eval.py"
DPO = REPO / "recipes" / "dpo.py"
KTO = REPO / "recipes" / "kto.py"
