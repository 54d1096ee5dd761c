"""The model keeps its chat template (fsdp_recipes.data.chat): assistant-only loss with templates that do not render a
conversation's prefixes as its beginning, and the exported tokenizer carries the template the model came with.

The two templates are written here, modelled on real ones with the demo tokenizer's tokens: QWEN3_LIKE adds an empty
think block to the assistant turns after the last user turn only (as Qwen3's does), MARKED wraps the assistant's
tokens in `{% generation %}` markers (as SmolLM3's does)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fsdp_recipes.data.chat import tokenize_dataset
from fsdp_recipes.data.chat_masks import TemplatePrefixError, has_generation_markers
from helpers.data import encode_chat, trained_text, write_jsonl
from helpers.paths import TOKENIZER
from helpers.recipes import base_recipe_values, run_recipe_in_process

QWEN3_LIKE = (
    "{{ bos_token }}{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<|assistant|><think>\\n\\n</think>\\n\\n' + m.content + '<|end|>' }}"
    "{%- else %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)
MARKED = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|assistant|>' }}{% generation %}{{ m.content + '<|end|>' }}{% endgeneration %}"
    "{%- else %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)
PHI_LIKE = (  # an end-of-text token after the last turn only, as Phi-3's template does
    "{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ '<|pad|>' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "reverse: xy"},
    {"role": "assistant", "content": "yx"},
]


def with_template(tokenizer, template: str):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


def encode(tokenizer, example, **options):
    return encode_chat(tokenizer, example, max_length=512, **options)


def test_a_qwen3_like_template_trains_each_reply_as_the_model_renders_it(tokenizer):
    qwen = with_template(tokenizer, QWEN3_LIKE)
    with pytest.raises(TemplatePrefixError):  # prefixes do not render as the conversation's beginning
        encode(qwen, {"messages": CONVERSATION})
    encoded = encode(qwen, {"messages": CONVERSATION}, rewriting_templates=True)
    # The tokens are the model's own rendering: the earlier reply without the think block, the last one with it.
    assert encoded["input_ids"] == qwen.apply_chat_template(CONVERSATION)["input_ids"]
    assert trained_text(qwen, encoded) == "cba<|end|><think>\n\n</think>\n\nyx<|end|>"


def test_a_phi_like_template_trains_the_end_of_text_after_the_last_reply(tokenizer):
    phi = with_template(tokenizer, PHI_LIKE)
    with pytest.raises(TemplatePrefixError):
        encode(phi, {"messages": CONVERSATION})
    encoded = encode(phi, {"messages": CONVERSATION}, rewriting_templates=True)
    assert trained_text(phi, encoded) == "cba<|end|>yx<|end|><|pad|>"


def test_generation_markers_say_which_tokens_are_trained(tokenizer):
    marked = with_template(tokenizer, MARKED)
    assert has_generation_markers(marked) and not has_generation_markers(tokenizer)
    encoded = encode(marked, {"messages": CONVERSATION}, rewriting_templates=True)
    assert trained_text(marked, encoded) == "cba<|end|>yx<|end|>"
    # A conversational prompt's own assistant turn is context, not target.
    split = encode(marked, {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}, rewriting_templates=True)
    assert trained_text(marked, split) == "yx<|end|>"
    assert split["input_ids"] == encoded["input_ids"]


def test_a_template_that_rewrites_the_replies_is_still_refused(tokenizer):
    """Nothing is guessed: a template that changes the assistant's text cannot be located, and says so."""
    upper = with_template(tokenizer, QWEN3_LIKE.replace("+ m.content +", "+ m.content | upper +"))
    data = Dataset.from_list([{"messages": CONVERSATION}])
    with pytest.raises(TemplatePrefixError, match="generation"):
        tokenize_dataset(data, upper, assistant_only_loss=True, completion_only_loss=True, max_length=64)


def sentencepiece_like_tokenizer():
    """Letters and SentencePiece's prefix space: a piece tokenised on its own starts with `▁` (a space) that the
    whole rendering does not have there, unlike byte-level BPE."""
    vocab = {piece: id_ for id_, piece in enumerate("▁abcdefghijklmnopqrstuvwxyz:")}
    backend = Tokenizer(models.BPE({**vocab, "▁c": len(vocab)}, [("▁", "c")]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<s>", "[INST]", "[/INST]", "</s>"]})
    tokenizer.chat_template = (  # Mistral v0.1's shape: the reply right after [/INST]
        "<s>{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + '[/INST]' }}"
        "{% else %}{{ m.content + '</s>' }}{% endif %}{% endfor %}"
    )
    return tokenizer


def test_a_tokenizer_that_spells_a_reply_differently_on_its_own_keeps_the_whole_renderings_tokens():
    """A reply is tokenised apart from its prompt only where the pieces spell the rendering (byte-level BPE); else
    the whole rendering's tokens are kept, the reply's those inside it."""
    sentencepiece = sentencepiece_like_tokenizer()
    assert sentencepiece.convert_ids_to_tokens(sentencepiece("cba")["input_ids"])[0] == "▁c"
    encoded = encode(sentencepiece, {"messages": CONVERSATION})
    assert encoded["input_ids"] == sentencepiece.apply_chat_template(CONVERSATION)["input_ids"]
    assert trained_text(sentencepiece, encoded) == "cba</s>yx</s>"
    # a reply after a space: SentencePiece's `▁c` holds the prompt's space and the reply's first letter, which no
    # mask can give the reply alone: refused, rather than trained without its first letter
    sentencepiece.chat_template = sentencepiece.chat_template.replace("'[/INST]'", "'[/INST] '")
    with pytest.raises(TemplatePrefixError, match="merges the reply 'cba</s>' with the text around it"):
        encode(sentencepiece, {"messages": CONVERSATION})


@pytest.fixture(scope="module")
def qwen_like_tokenizer(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen_like_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.save_pretrained(folder)
    return folder


def multi_turn_data(folder: Path) -> Path:
    pairs = [("reverse: abc", "cba"), ("reverse: de", "ed"), ("reverse: fgh", "hgf"), ("reverse: ij", "ji")]
    records = []
    for first in range(len(pairs)):
        turns = []
        for user, reply in (pairs[first], pairs[(first + 1) % len(pairs)]):
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        records.append({"messages": turns})
    write_jsonl(folder / "train.jsonl", records * 4)
    return folder


@pytest.mark.parametrize("how", ["own", "chat_template_path"])
def test_sft_trains_with_the_models_template_and_exports_it_unchanged(
    tmp_path, tiny_model_config, qwen_like_tokenizer, how
):
    """In-process SFT: assistant-only loss on the Qwen3-like template (the tokenizer's own, or set on purpose with
    chat_template_path from a .jinja file); the exported tokenizer's template is that one, byte for byte."""
    values = base_recipe_values(
        tiny_model_config, multi_turn_data(tmp_path), tmp_path / "out", max_steps=2, eval_split_size=0.0
    )
    if how == "own":
        values["tokenizer_name_or_path"] = str(qwen_like_tokenizer)
    else:
        (tmp_path / "template.jinja").write_text(MARKED)
        values["chat_template_path"] = str(tmp_path / "template.jinja")
    run_recipe_in_process("sft", tmp_path, "run", values)
    exported = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported.chat_template == (QWEN3_LIKE if how == "own" else MARKED)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["data"]["dropped_without_loss_tokens"] == 0


def test_chat_template_path_takes_a_tokenizers_template(qwen_like_tokenizer):
    from fsdp_recipes.models.modeling import load_tokenizer

    loaded = load_tokenizer(str(TOKENIZER), chat_template_path=str(qwen_like_tokenizer))
    assert loaded.chat_template == QWEN3_LIKE


def test_chat_template_and_chat_template_path_together_is_one_error(tmp_path, tiny_model_config, capsys):
    from helpers.recipes import recipe_error_in_process

    values = base_recipe_values(
        tiny_model_config, multi_turn_data(tmp_path), tmp_path / "out", chat_template="x", chat_template_path="y"
    )
    error = recipe_error_in_process("sft", tmp_path, values, capsys)
    assert "set one of chat_template and chat_template_path" in error


# the alignment-handbook's zephyr recipes write the template itself in the YAML, as a multi-line string
HANDBOOK_YAML = """\
model_name_or_path: some/model
dataset_name: some/data
chat_template: "{% for message in messages %}\\n{% if message['role'] == 'user' %}\\n{{ '<|user|>\\n' + message['content'] + eos_token }}\\n{% elif message['role'] == 'assistant' %}\\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\\n{% endif %}\\n{% if loop.last and add_generation_prompt %}\\n{{ '<|assistant|>' }}\\n{% endif %}\\n{% endfor %}"
"""  # noqa: E501


def test_an_inline_template_as_the_handbook_writes_it_is_the_template(tmp_path):
    from fsdp_recipes.common.arguments import parse_config
    from fsdp_recipes.models.modeling import load_tokenizer
    from helpers.recipes import load_recipe

    (tmp_path / "zephyr.yaml").write_text(HANDBOOK_YAML)
    config = parse_config(load_recipe("sft").SFTConfig, ["--config", str(tmp_path / "zephyr.yaml")])
    assert config.chat_template.count("\n") >= 8
    tokenizer = load_tokenizer(str(TOKENIZER), chat_template=config.chat_template)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.startswith("<|user|>\nhi")


def test_a_template_path_that_does_not_exist_is_not_taken_for_a_template_or_a_hub_id(tmp_path):
    from fsdp_recipes.common.errors import InputError
    from fsdp_recipes.models.modeling import load_tokenizer

    with pytest.raises(InputError, match=r"chat_template: there is no such file .*templates/chatml\.jinja"):
        load_tokenizer(str(TOKENIZER), chat_template="templates/chatml.jinja")
    with pytest.raises(InputError, match=r"chat_template_path: there is no such local file .*chatml\.jinja"):
        load_tokenizer(str(TOKENIZER), chat_template_path="templates/chatml.jinja")
