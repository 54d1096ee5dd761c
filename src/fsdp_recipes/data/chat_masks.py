"""Which tokens of a chat template's rendering are the assistant's: the loss mask of a conversation.

The tokens trained on are always the model's own template's rendering of the whole conversation; this module only
says which of them are a reply's. Three ways, the first that applies (docs/chat-templates.md):

1. rendered prefixes: the template applied to the turns before a reply (with the generation prompt) is a prefix of
   the whole rendering, and so is the template applied through the reply (Llama 3, Mistral, Gemma, ChatML);
2. `{% generation %}` markers (SmolLM3): the template says itself which tokens are the assistant's;
3. turn renderings, for templates that render a turn differently once more turns follow (Qwen3's empty think block
   on the last reply only, gpt-oss's `<|return|>` that becomes `<|end|>`, Phi's end-of-text after the last turn):
   each reply is located between the end of its generation prompt and what its own rendering, as the last turn,
   shares with the whole conversation's, then checked to hold the reply's text and tool calls.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from fsdp_recipes.common.errors import DataError


class TemplatePrefixError(DataError):
    """The chat template renders a conversation's start differently once more turns follow it, so the tokens of a
    turn cannot be told apart: a class of its own so that other recipes can name their own fix."""


_FIX = (
    "Set chat_template to a template that renders each turn as written (or marks the assistant's tokens with "
    "{% generation %}), or set assistant_only_loss: false to train on every token"
)
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK_END = "</think>"


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template marks the assistant's tokens itself (`{% generation %}`, as SmolLM3's does)."""
    return bool(_GENERATION_MARKER.search(str(tokenizer.chat_template or "")))


def prepared_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as templates expect it: an assistant turn that only calls tools (`content: null`, as
    OpenAI-style data writes it) gets an empty content. transformers drops keys whose value is None, and templates
    such as Qwen3's then fail on the missing content, while "" renders as no text (tests/test_real_chat_templates.py)."""
    return [
        {**turn, "content": ""}
        if isinstance(turn, dict) and turn.get("content") is None and turn.get("tool_calls")
        else turn
        for turn in messages
    ]


def conversation_tokens(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    loss_roles: set[str] | None,
    first_trained: int,
    *,
    rewriting_templates: bool = False,
) -> tuple[list[int], list[int]]:
    """Tokens of a whole conversation, as the model's own chat template renders it, and a mask over those of messages
    at index >= first_trained whose role is in loss_roles (every token if loss_roles is None). Without
    `rewriting_templates` only the rendered prefixes are trusted (DPO's prompt must be a shared prefix of both
    answers); what no way can locate is refused (TemplatePrefixError), never guessed at."""
    messages = prepared_turns(messages)
    full = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    if loss_roles is None:
        return full, [1] * len(full)
    if rewriting_templates and has_generation_markers(tokenizer):
        return full, _mask_from_generation_markers(tokenizer, messages, full, first_trained)
    try:
        return full, _mask_from_prefixes(tokenizer, messages, full, loss_roles, first_trained)
    except TemplatePrefixError:
        if not rewriting_templates:
            raise
        return full, _mask_from_turn_renderings(tokenizer, messages, full, loss_roles, first_trained)


def _mask_from_prefixes(tokenizer, messages, full, loss_roles, first_trained) -> list[int]:
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = tokenizer.apply_chat_template(messages[:index], tokenize=True, add_generation_prompt=True)["input_ids"]
        upto = tokenizer.apply_chat_template(messages[: index + 1], tokenize=True)["input_ids"]
        if full[: len(head)] != head or full[: len(upto)] != upto:
            raise TemplatePrefixError(
                "the chat template renders a conversation differently from its prefixes, so the tokens of each "
                "assistant turn cannot be located for the loss mask. Use a template that only appends text turn "
                "by turn (set chat_template), or set assistant_only_loss: false to train on every token."
            )
        _refuse_if_missing(index, message, tokenizer.decode(full[len(head) : len(upto)]))
        for position in range(len(head), len(upto)):
            mask[position] = 1
    return mask


def _mask_from_generation_markers(tokenizer, messages, full, first_trained) -> list[int]:
    """transformers' assistant mask (the tokens inside `{% generation %}` blocks), less what the generation prompt
    already holds (SmolLM3 marks the `<|im_start|>assistant` header too, which the model is given, not asked to
    write) and less the assistant turns that come before `first_trained` (a conversational prompt's own)."""
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    mask = list(rendered["assistant_masks"])
    if list(rendered["input_ids"]) != list(full) or len(mask) != len(full):
        raise TemplatePrefixError("the chat template renders differently when asked for its assistant mask")
    runs, position = [], 0  # each assistant turn is one run of ones
    while position < len(mask):
        if mask[position]:
            start = position
            while position < len(mask) and mask[position]:
                position += 1
            runs.append((start, position))
        position += 1
    replies = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
    for (start, end), index in zip(runs, replies):
        head = tokenizer.apply_chat_template(messages[:index], tokenize=True, add_generation_prompt=True)["input_ids"]
        given = len(head) if full[: len(head)] == head else start
        for position in range(start, end if index < first_trained else min(given, end)):
            mask[position] = 0
        if index >= first_trained:
            _refuse_if_missing(index, messages[index], tokenizer.decode(full[max(start, given) : end]))
    return mask


def _mask_from_turn_renderings(tokenizer, messages, full, loss_roles, first_trained) -> list[int]:
    """For templates that render a turn differently once more follow. A reply starts where the conversation before
    it, with the generation prompt, stops agreeing with the whole rendering (so Qwen3's think block on the last
    reply is trained, as the model generates it). It runs as far as the reply rendered as the last turn agrees with
    the whole rendering: from its start (gpt-oss's earlier replies: their content, not the `<|end|>` that stands
    where the model wrote `<|return|>`), or up to its end (Qwen3's earlier replies: without the think block the
    template gives the last turn only). The reply's text and each tool call's name must lie in what was found, else
    the template is refused with the turn that failed. Needs a fast tokenizer (its offsets map characters to
    tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplatePrefixError(
            "the chat template renders earlier turns differently once more follow, and locating the assistant's "
            "tokens in such a rendering needs a fast tokenizer (character offsets). Use a fast tokenizer, a template "
            "with {% generation %} markers in chat_template, or set assistant_only_loss: false."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        alone = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        start, start_alone = _shared_length(text, head), _shared_length(alone, head)
        if not _holds_the_prompt(text[:start], messages[:index]):
            raise TemplatePrefixError(
                f"the chat template renders the turns before turn {index} (assistant) differently once that turn "
                f"follows them, so the reply's tokens cannot be told from its prompt's. {_FIX}"
            )
        turn, turn_alone = text[start:], alone[start_alone:]
        length = max(
            _shared_length(turn, turn_alone),
            _shared_tail_length(turn, turn_alone),
            _through_answer_length(turn, turn_alone, _answer(message)),
        )
        _refuse_if_missing(index, message, turn[:length])
        spans.append((start, start + length))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != list(full):
        raise TemplatePrefixError(
            "the chat template's text does not tokenize to its own token ids (apply_chat_template with tokenize=True "
            "and False disagree), so the assistant's tokens cannot be located. Set assistant_only_loss: false."
        )
    # Whole tokens only: a reply's end found character by character may lie inside the next turn's first token.
    return [
        int(any(start <= first and last <= end for start, end in spans)) for first, last in encoding["offset_mapping"]
    ]


def _answer(message: dict[str, Any]) -> str:
    """The reply's answer: its content after any inline reasoning, which templates move or drop."""
    content = message.get("content")
    return content.split(_THINK_END)[-1].strip() if isinstance(content, str) else ""


def _refuse_if_missing(index: int, message: dict[str, Any], found: str) -> None:
    """Refuse a reply whose tokens found for the loss lack its answer or a tool call's name: the template dropped or
    rewrote them (a template that does not render `tool_calls` would train such a turn as its end token alone)."""
    squeezed = "".join(found.split())  # decoding may change spaces, never the text
    missing = None
    if _answer(message) and "".join(_answer(message).split()) not in squeezed:
        missing = "its content"
    for call in message.get("tool_calls") or []:
        name = (call.get("function") or call).get("name") if isinstance(call, dict) else None
        if missing is None and isinstance(name, str) and name not in squeezed:
            missing = f"its call of {name!r}"
    if missing is None and not squeezed:
        missing = "any text"
    if missing:
        raise TemplatePrefixError(
            f"turn {index} (assistant): the tokens the chat template renders for it do not hold {missing}, so that "
            "turn cannot be trained as written (a template that does not render `tool_calls`, or that rewrites the "
            f"reply). {_FIX}, or remove such turns from the data."
        )


def _holds_the_prompt(prompt: str, messages: list[dict[str, Any]]) -> bool:
    """Whether the text before a reply holds the last earlier turn's text (a template that moves text into the
    reply's place would have the reply's tokens start inside the prompt)."""
    last = next((m["content"] for m in reversed(messages) if isinstance(m.get("content"), str) and m["content"]), "")
    return "".join(last.split()) in "".join(prompt.split())


def _shared_length(left: str, right: str) -> int:
    """The length of the longest common prefix."""
    length, most = 0, min(len(left), len(right))
    while length < most and left[length] == right[length]:
        length += 1
    return length


def _shared_tail_length(text: str, turn: str) -> int:
    """The length of the longest end of `turn` that `text` starts with."""
    for cut in range(len(turn)):
        if text.startswith(turn[cut:]):
            return len(turn) - cut
    return 0


def _through_answer_length(text: str, turn: str, answer: str) -> int:
    """How far `text` holds the reply through its answer and what closes it in `turn` (the reply as the last turn):
    for templates that change both what comes before the answer and what closes it (gpt-oss drops the analysis
    channel of earlier replies and ends them with `<|end|>`, not `<|return|>`)."""
    at, at_alone = text.find(answer), turn.find(answer)
    if not answer or at < 0 or at_alone < 0:
        return 0
    end = at + len(answer)
    return end + _shared_length(text[end:], turn[at_alone + len(answer) :])
