"""Which tokens of a chat template's rendering are the assistant's: the loss mask of a conversation.

The text trained on is always the model's own template's rendering of the whole conversation; this module says which
of it is each reply's, and tokenises each reply apart from the text before it, as the model writes it after its
generation prompt at inference (_split_at_replies). The replies are found in three ways, the first that applies
(docs/chat-templates.md):

1. rendered prefixes: the template applied to the turns before a reply (with the generation prompt) is a prefix of
   the whole rendering, and so is the template applied through the reply (Llama 3, Mistral, Gemma, ChatML);
2. `{% generation %}` markers (SmolLM3): the template says itself which tokens are the assistant's;
3. turn renderings, for templates that render a turn differently once more turns follow (Qwen3's empty think block
   on the last reply only, gpt-oss's `<|return|>` that becomes `<|end|>`, Phi's end-of-text after the last turn):
   each reply is located between the end of its generation prompt and what its own rendering, as the last turn,
   shares with the whole conversation's, then checked to hold the reply's text and tool calls.
"""

from __future__ import annotations

import bisect
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
    >= first_trained whose role is in loss_roles (every token if loss_roles is None). Each trained reply is
    tokenised apart from the text before it, as the model writes it after its generation prompt at inference
    (_split_at_replies). Without `rewriting_templates` only the rendered prefixes are trusted; what no way can
    locate is refused (TemplatePrefixError), never guessed."""
    messages = prepared_turns(messages)
    render = functools.partial(tokenizer.apply_chat_template, tools=tools) if tools else tokenizer.apply_chat_template
    if loss_roles is None:
        full = render(messages, tokenize=True)["input_ids"]
        return full, [1] * len(full)
    text = render(messages, tokenize=False)
    if rewriting_templates and has_generation_markers(tokenizer):
        spans = _spans_from_generation_markers(tokenizer, render, messages, text, first_trained)
    else:
        try:
            spans = _spans_from_prefixes(render, messages, text, loss_roles, first_trained)
        except TemplatePrefixError:
            if not rewriting_templates:
                raise
            spans = _spans_from_turn_renderings(render, messages, text, loss_roles, first_trained)
    return _split_at_replies(tokenizer, text, spans)


def _split_at_replies(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The rendering's tokens, each reply's span tokenised apart from the text around it, and the mask of the
    replies' tokens. At inference the prompt ends where the generation prompt does and the model writes the reply's
    tokens after it; a byte-level BPE that tokenises the whole rendering at once may merge the header's last
    characters with the reply's first (the newline after Qwen's `<|im_start|>assistant` and a reply's leading
    newline make one token), a token the model never writes there and no mask could give the reply alone. A span's
    boundary inside an added token of the whole tokenisation (a special token the turn renderings met in part: the
    `<|` that gpt-oss's `<|end|>` and `<|return|>` share) moves out of it, leaving it to the text around the reply.
    Where the pieces tokenised apart do not spell the rendering (a SentencePiece tokenizer puts a space before each),
    the whole rendering's tokens are kept and a reply has those lying wholly inside its span."""
    fast = getattr(tokenizer, "is_fast", False)
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    whole_ids = list(whole["input_ids"])
    if fast:
        spans = _outside_added_tokens(tokenizer, text, whole["offset_mapping"], spans)
    ids, mask, at = [], [], 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, trained in ((text[at:start], 0), (text[start:end], 1)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            mask += [trained] * len(piece_ids)
        at = end
    if ids == whole_ids or (fast and _spelled(tokenizer, ids) == _spelled(tokenizer, whole_ids)):
        return ids, mask
    if not fast:
        raise TemplatePrefixError(
            "the tokenizer tokenises a reply differently apart from its prompt than inside the whole conversation, "
            "and telling the reply's tokens apart there needs a fast tokenizer (character offsets)",
            _FIX,
        )
    offsets = whole["offset_mapping"]
    for start, end in spans:  # a token across a reply's edge would be left out of it: its text would go untrained
        if any(first < cut < last for first, last in offsets for cut in (start, end)):
            raise TemplatePrefixError(
                f"the tokenizer merges the reply {text[start:end]!r} with the text around it into shared tokens, "
                "so its first or last token cannot be trained as the reply's",
                _FIX,
            )
    return whole_ids, [int(any(start <= first and last <= end for start, end in spans)) for first, last in offsets]


def _spelled(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _outside_added_tokens(tokenizer, text, offsets, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans less any added token of the whole tokenisation they hold only in part: a start inside one moves to
    its end, an end inside one to its start."""
    starts = [first for first, _ in offsets]

    def straddled(cut: int) -> tuple[int, int] | None:
        index = bisect.bisect_left(starts, cut) - 1
        if index >= 0 and offsets[index][1] > cut and text[slice(*offsets[index])] in tokenizer.added_tokens_encoder:
            return offsets[index]
        return None

    moved = []
    for start, end in spans:
        start = (straddled(start) or (None, start))[1]
        end = max(start, (straddled(end) or (end, None))[0])
        moved.append((start, end))
    return moved


def _spans_from_prefixes(render, messages, text, loss_roles, first_trained) -> list[tuple[int, int]]:
    spans = []
    for index, message in enumerate(messages):
        if index < first_trained or message.get("role") not in loss_roles:
            continue
        head = render(messages[:index], tokenize=False, add_generation_prompt=True)
        upto = render(messages[: index + 1], tokenize=False)
        if not (text.startswith(head) and text.startswith(upto) and len(head) <= len(upto)):
            raise TemplatePrefixError(
                "the chat template renders a conversation differently from its prefixes, so the tokens of each "
                "assistant turn cannot be located for the loss mask",
                _FIX,
            )
        _refuse_if_missing(index, message, text[len(head) : len(upto)])
        spans.append((len(head), len(upto)))
    return spans


def _spans_from_generation_markers(tokenizer, render, messages, text, first_trained) -> list[tuple[int, int]]:
    """transformers' assistant mask (the tokens inside `{% generation %}` blocks), less what the generation prompt
    already holds (SmolLM3 marks the `<|im_start|>assistant` header too, which the model is given, not asked to
    write) and less the assistant turns that come before `first_trained` (a conversational prompt's own). Each
    reply must be one marked block of its own, else the template is refused."""
    rendered = render(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask = list(rendered["assistant_masks"])
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(rendered["input_ids"]) != list(encoding["input_ids"]) or len(mask) != len(encoding["input_ids"]):
        raise TemplatePrefixError("the chat template renders differently when asked for its assistant mask", _FIX)
    offsets = encoding["offset_mapping"]
    replies = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
    runs = _runs_of_ones(mask)
    if len(runs) != len(replies):  # consecutive replies: the second's marked header joins the first's block
        raise TemplatePrefixError(
            f"the chat template's {{% generation %}} blocks ({len(runs)}) do not match the assistant turns "
            f"({len(replies)}) one to one, so each turn's tokens cannot be told apart",
            _FIX,
        )
    spans = []
    for (first, last), index in zip(runs, replies):
        if index < first_trained:
            continue
        start, end = offsets[first][0], offsets[last - 1][1]
        head = render(messages[:index], tokenize=False, add_generation_prompt=True)
        start = max(start, len(head)) if text.startswith(head) else start
        _refuse_if_missing(index, messages[index], text[start:end])
        spans.append((start, end))
    return spans


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


def _spans_from_turn_renderings(render, messages, text, loss_roles, first_trained) -> list[tuple[int, int]]:
    """For templates that render a turn differently once more follow. A reply starts where the conversation before
    it, with the generation prompt, stops agreeing with the whole rendering, the two aligned at the end of the last
    earlier turn's text (so Qwen3's think block on the last reply is trained, as the model writes it, and reasoning
    the template drops from an earlier turn does not move the start). It runs as far as the reply rendered as the
    last turn agrees with the whole rendering: from its start (gpt-oss's earlier replies: their channel and content,
    not the `<|end|>` that stands where the model wrote `<|return|>`), up to its end (Qwen3's earlier replies,
    without the think block the template gives the last turn only), or through its answer, found in its own context.
    A reply must start after the one before it ends, and its text and each tool call's name must lie in what was
    found, else the template is refused with the turn that failed."""
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
    return spans


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
