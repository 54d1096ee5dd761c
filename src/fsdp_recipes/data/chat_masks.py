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

import functools
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from fsdp_recipes.common.errors import DataError


class TemplatePrefixError(DataError):
    """The chat template renders a conversation's start differently once more turns follow it, so the tokens of a
    turn cannot be told apart: a class of its own so that other recipes can name their own fix (`reason`: the
    message without SFT's fix)."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(f"{reason}. {fix}." if fix else reason)
        self.reason = reason


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
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokens of a whole conversation, as the model's own chat template renders it (with `tools`, the schemas the
    template shows the model, as TRL passes a dataset's `tools` column), and a mask over those of messages at index
    >= first_trained whose role is in loss_roles (every token if loss_roles is None). Without `rewriting_templates`
    only the rendered prefixes are trusted; what no way can locate is refused (TemplatePrefixError), never guessed."""
    messages = prepared_turns(messages)
    render = functools.partial(tokenizer.apply_chat_template, tools=tools) if tools else tokenizer.apply_chat_template
    full = render(messages, tokenize=True)["input_ids"]
    if loss_roles is None:
        return full, [1] * len(full)
    if rewriting_templates and has_generation_markers(tokenizer):
        return full, _mask_from_generation_markers(tokenizer, render, messages, full, first_trained)
    try:
        return full, _mask_from_prefixes(tokenizer, render, messages, full, loss_roles, first_trained)
    except TemplatePrefixError:
        if not rewriting_templates:
            raise
        return full, _mask_from_turn_renderings(tokenizer, render, messages, full, loss_roles, first_trained)


def _mask_from_prefixes(tokenizer, render, messages, full, loss_roles, first_trained) -> list[int]:
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = render(messages[:index], tokenize=True, add_generation_prompt=True)["input_ids"]
        upto = render(messages[: index + 1], tokenize=True)["input_ids"]
        if full[: len(head)] != head or full[: len(upto)] != upto:
            raise TemplatePrefixError(
                "the chat template renders a conversation differently from its prefixes, so the tokens of each "
                "assistant turn cannot be located for the loss mask",
                _FIX,
            )
        _refuse_if_missing(index, message, tokenizer.decode(full[len(head) : len(upto)]))
        for position in range(len(head), len(upto)):
            mask[position] = 1
    return mask


def _mask_from_generation_markers(tokenizer, render, messages, full, first_trained) -> list[int]:
    """transformers' assistant mask (the tokens inside `{% generation %}` blocks), less what the generation prompt
    already holds (SmolLM3 marks the `<|im_start|>assistant` header too, which the model is given, not asked to
    write) and less the assistant turns that come before `first_trained` (a conversational prompt's own). Each
    reply must be one marked block of its own, else the template is refused."""
    rendered = render(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask = list(rendered["assistant_masks"])
    if list(rendered["input_ids"]) != list(full) or len(mask) != len(full):
        raise TemplatePrefixError("the chat template renders differently when asked for its assistant mask", _FIX)
    replies = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
    runs = [(start, end) for start, end in _runs_of_ones(mask)]
    if len(runs) != len(replies):  # consecutive replies: the second's marked header joins the first's block
        raise TemplatePrefixError(
            f"the chat template's {{% generation %}} blocks ({len(runs)}) do not match the assistant turns "
            f"({len(replies)}) one to one, so each turn's tokens cannot be told apart",
            _FIX,
        )
    for (start, end), index in zip(runs, replies):
        head = render(messages[:index], tokenize=True, add_generation_prompt=True)["input_ids"]
        given = len(head) if full[: len(head)] == head else start
        for position in range(start, end if index < first_trained else min(given, end)):
            mask[position] = 0
        if index >= first_trained:
            _refuse_if_missing(index, messages[index], tokenizer.decode(full[max(start, given) : end]))
    return mask


def _runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, position = [], 0
    while position < len(mask):
        if mask[position]:
            start = position
            while position < len(mask) and mask[position]:
                position += 1
            runs.append((start, position))
        position += 1
    return runs


def _mask_from_turn_renderings(tokenizer, render, messages, full, loss_roles, first_trained) -> list[int]:
    """For templates that render a turn differently once more follow. A reply starts where the conversation before
    it, with the generation prompt, stops agreeing with the whole rendering, the two aligned at the end of the last
    earlier turn's text (so Qwen3's think block on the last reply is trained, as the model writes it, and reasoning
    the template drops from an earlier turn does not move the start). It runs as far as the reply rendered as the
    last turn agrees with the whole rendering: from its start (gpt-oss's earlier replies: their channel and content,
    not the `<|end|>` that stands where the model wrote `<|return|>`), up to its end (Qwen3's earlier replies,
    without the think block the template gives the last turn only), or through its answer, found in its own context.
    A reply must start after the one before it ends, and its text and each tool call's name must lie in what was
    found, else the template is refused with the turn that failed. Needs a fast tokenizer (its offsets map
    characters to tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplatePrefixError(
            "the chat template renders earlier turns differently once more follow, and locating the assistant's "
            "tokens in such a rendering needs a fast tokenizer (character offsets)",
            _FIX,
        )
    text = render(messages, tokenize=False)
    spans, previous_end = [], 0
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = render(messages[:index], tokenize=False, add_generation_prompt=True)
        alone = render(messages[: index + 1], tokenize=False)
        start = _reply_start(text, head, messages[:index], previous_end)
        if start is None:
            raise TemplatePrefixError(
                f"the chat template renders the turns before turn {index} (assistant) differently once that turn "
                "follows them (it drops or moves their text), so the reply's tokens cannot be told from its prompt's",
                _FIX,
            )
        turn, turn_alone = text[start:], alone[_shared_length(alone, head) :]
        length = max(
            _shared_length(turn, turn_alone),
            _shared_tail_length(turn, turn_alone),
            _through_answer_length(turn, turn_alone, _answer(message)),
        )
        _refuse_if_missing(index, message, turn[:length])
        spans.append((start, start + length))
        previous_end = start + length
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != list(full):
        raise TemplatePrefixError(
            "the chat template's text does not tokenize to its own token ids (apply_chat_template with tokenize=True "
            "and False disagree), so the assistant's tokens cannot be located",
            "Set assistant_only_loss: false",
        )
    # Whole tokens only: a reply's end found character by character may lie inside the next turn's first token.
    return [
        int(any(start <= first and last <= end for start, end in spans)) for first, last in encoding["offset_mapping"]
    ]


def _reply_start(text: str, head: str, before: list[dict[str, Any]], previous_end: int) -> int | None:
    """Where the reply after `before` starts in the whole rendering `text`. `head` is those turns with the generation
    prompt: where the text starts with it, the reply starts at its end. Else the two are aligned at the end of the
    last earlier turn's text (found after the previous reply, `previous_end`), and the reply starts after what they
    share from there: the generation prompt, or the part of it the template keeps in history (DeepSeek-R1's drops
    its `<think>`). None when that turn's text is not there, or when the rest of the generation prompt follows a
    little later (the template put text of its own between the prompt and the reply: the reply's tokens would
    start inside the prompt)."""
    if text.startswith(head) and len(head) >= previous_end:
        return len(head)
    last = next((_visible(m) for m in reversed(before) if _visible(m)), "")
    if not last:
        return None
    in_text = text.rfind(last, previous_end, _shared_length(text, head) + len(last))  # the copy the head agrees to
    in_text = in_text if in_text >= 0 else text.find(last, previous_end)
    in_head = head.rfind(last)
    if in_text < 0 or in_head < 0:
        return None
    in_text, in_head = in_text + len(last), in_head + len(last)
    shared = _shared_length(text[in_text:], head[in_head:])
    rest, start = head[in_head + shared :], in_text + shared
    if rest.strip() and rest.strip() in text[start : start + len(rest) + 64]:
        return None
    return start


def _visible(message: dict[str, Any]) -> str:
    """A turn's text as templates keep it in history: its content after any inline reasoning, stripped."""
    content = message.get("content")
    return content.split(_THINK_END)[-1].strip() if isinstance(content, str) else ""


def _answer(message: dict[str, Any]) -> str:
    """The reply's answer: its content after any inline reasoning, which templates move or drop."""
    return _visible(message)


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
            "reply)",
            f"{_FIX}, or remove such turns from the data",
        )


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
    channel of earlier replies and ends them with `<|end|>`, not `<|return|>`). The answer is looked for with the
    text that leads to it in `turn` (as much as `text` shares), within the length of `turn`: a reply is never longer
    in history than as the last turn, and a short answer ("a") is not taken for a letter of the template's own."""
    at_alone = turn.rfind(answer)
    if not answer or at_alone < 0:
        return 0
    bound = len(turn)
    for lead in range(min(at_alone, 64), -1, -1):
        at = text.find(turn[at_alone - lead : at_alone + len(answer)], 0, bound)
        if at >= 0:
            end = at + lead + len(answer)
            return end + _shared_length(text[end:], turn[at_alone + len(answer) :])
    return 0
