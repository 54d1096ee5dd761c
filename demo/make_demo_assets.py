#!/usr/bin/env python
"""Generate the tiny, fully local assets used by the SFT demo.

Writes (deterministically, no network access needed):

* ``reverse/train.jsonl`` / ``reverse/test.jsonl`` -- chat-format examples of a
  string-reversal task: ``{"messages": [{"role": "user", "content":
  "reverse: abcde"}, {"role": "assistant", "content": "edcba"}]}``.
  Test strings never occur in the training set.
* ``tokenizer/`` -- a character-level ``PreTrainedTokenizerFast`` with chat
  special tokens and a Jinja chat template, saved with ``save_pretrained``.

Usage::

    python demo/make_demo_assets.py [--out-dir demo/assets]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

PROMPT_PREFIX = "reverse: "
ALPHABET = string.ascii_lowercase

# Special tokens; their ids are their positions in this list.
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
END_TOKEN = "<|end|>"  # closes every turn; used as eos so generation stops
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, END_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, UNK_TOKEN]

# Plain characters: printable ASCII without the \t\r\x0b\x0c whitespace, plus "\n".
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

# Prefix-consistent template: rendering messages[:i] with add_generation_prompt
# is a prefix of rendering the full conversation, and each turn ends with
# <|end|> (the eos token), so generation stops after the assistant answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

DEFAULT_SEED = 1234
DEFAULT_NUM_TRAIN = 4000
DEFAULT_NUM_TEST = 200
DEFAULT_MIN_LEN = 3
DEFAULT_MAX_LEN = 8


def make_example(s: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT_PREFIX + s}, {"role": "assistant", "content": s[::-1]}]}


def sample_strings(rng: random.Random, n: int, min_len: int, max_len: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        length = rng.randint(min_len, max_len)
        s = "".join(rng.choice(ALPHABET) for _ in range(length))
        if s in seen:
            continue
        seen.add(s)
        out.append(s)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def write_dataset(out_dir: Path, seed: int, num_train: int, num_test: int, min_len: int, max_len: int) -> None:
    rng = random.Random(seed)
    test = sample_strings(rng, num_test, min_len, max_len, exclude=set())
    train = sample_strings(rng, num_train, min_len, max_len, exclude=set(test))
    assert not set(train) & set(test)
    write_jsonl(out_dir / "reverse" / "train.jsonl", [make_example(s) for s in train])
    write_jsonl(out_dir / "reverse" / "test.jsonl", [make_example(s) for s in test])


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One token per character (special tokens are matched before pre-tokenization).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without inserting spaces
    tok.add_special_tokens(SPECIAL_TOKENS)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        padding_side="right",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def check_tokenizer(tok) -> None:
    msgs = make_example("hello")["messages"]
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert full == "<|bos|><|user|>reverse: hello<|end|><|assistant|>olleh<|end|>", full
    ids_full = tok(full, add_special_tokens=False)["input_ids"]
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    ids_prompt = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids_full[: len(ids_prompt)] == ids_prompt
    assert ids_full[-1] == tok.eos_token_id
    assert tok.decode(ids_full[len(ids_prompt) :], skip_special_tokens=True) == "olleh"
    assert tok.unk_token_id not in ids_full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "assets")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN)
    parser.add_argument("--num-test", type=int, default=DEFAULT_NUM_TEST)
    parser.add_argument("--min-len", type=int, default=DEFAULT_MIN_LEN)
    parser.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN)
    args = parser.parse_args()

    out_dir: Path = args.out_dir
    write_dataset(out_dir, args.seed, args.num_train, args.num_test, args.min_len, args.max_len)
    tok = build_tokenizer()
    check_tokenizer(tok)
    tok.save_pretrained(str(out_dir / "tokenizer"))
    print(f"wrote assets to {out_dir} (vocab size {len(tok)})")


if __name__ == "__main__":
    main()
