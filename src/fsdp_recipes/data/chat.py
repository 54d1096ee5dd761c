"""Chat-style SFT data: the two formats TRL's SFT accepts, recognised by their columns, tokenised with loss masks.

- conversational: `messages`, a list of {"role", "content"} turns, formatted with the tokenizer's chat template;
- prompt/completion: `prompt` and `completion`, each a string or a list of turns.

Every example becomes `input_ids` plus `loss_mask` (1 where the token is a training target), ready for
`fsdp_recipes.data.rows`.
"""

from __future__ import annotations

import json
from typing import Any

from datasets import Dataset
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from fsdp_recipes.common.errors import DataError
from fsdp_recipes.data import files
from fsdp_recipes.data import images as images_lib
from fsdp_recipes.data.chat_masks import TemplatePrefixError, conversation_tokens, prepared_turns


def detect_format(column_names: list[str]) -> str:
    if "messages" in column_names:
        return "conversational"
    if "prompt" in column_names and "completion" in column_names:
        return "prompt_completion"
    raise DataError(
        f"the dataset has columns {sorted(column_names)}, but SFT needs either a 'messages' column (a list of "
        "{'role', 'content'} turns) or 'prompt' and 'completion' columns. Rename the columns (e.g. "
        "dataset.rename_column) or convert the data to one of these formats."
    )


ROLES = ("system", "user", "assistant", "tool")


def example_problem(example: dict[str, Any], data_format: str) -> str | None:
    """What makes an example unusable for its format, or None: checked before the chat template sees it, whose own
    errors (or silence) would not say which example or what is wrong with it."""
    tools = example.get("tools")
    if tools is not None:
        try:
            tools = json.loads(tools) if isinstance(tools, str) and tools.strip() else tools
        except json.JSONDecodeError as error:
            return f"'tools' is not valid JSON ({error})"
        if tools and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
            return f"'tools' is {_a(_kind(tools))}, not a list of tool schemas (JSON objects)"
    if data_format == "conversational":
        return conversation_problem(example["messages"], "messages")
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        for column, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, list):
                return f"{column!r} is {_a(_kind(value))}, but the other column is a list of turns: both must be lists"
        return conversation_problem(prompt + completion, "prompt", assistant_from=len(prompt))
    for column, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            return f"{column!r} is {_a(_kind(value))}, not a string"
    return None


def conversation_problem(messages: Any, column: str, *, assistant_from: int = 0) -> str | None:
    """Turns that are not {role, content} with a known role, a first turn (after the system prompt) that is not
    the user's, or no assistant turn at index >= assistant_from."""
    if not isinstance(messages, list):
        return f"{column!r} is {_a(_kind(messages))}, not a list of turns"
    if not messages:
        return f"the conversation is empty ({column!r} is [])"
    for index, turn in enumerate(messages):
        if not isinstance(turn, dict):
            return f"turn {index} is {_a(_kind(turn))}, not a {{'role', 'content'}} object"
        role = turn.get("role")
        if role is None:
            return f"turn {index} has no role ({_preview(turn)})"
        if role not in ROLES:
            return f"turn {index} has role {role!r} ({_preview(turn)}); the roles are {', '.join(ROLES)}"
        if turn.get("content") is None and not turn.get("tool_calls"):
            return f"turn {index} ({role}) has no content"
        calls_problem = tool_calls_problem(turn["tool_calls"]) if role == "assistant" and "tool_calls" in turn else None
        if calls_problem:
            return f"turn {index} (assistant): {calls_problem}"
    first = next((turn for turn in messages if turn["role"] != "system"), None)
    if first is not None and first["role"] != "user":
        return (
            f"the conversation starts with {_a(first['role'])} turn ({_preview(first)}); the first turn after the "
            "optional system turn must be the user's"
        )
    if not any(turn["role"] == "assistant" for turn in messages[assistant_from:]):
        where = "the completion" if assistant_from else "the conversation"
        return f"{where} has no assistant turn, so there is nothing to learn from it"
    for index, turn in enumerate(messages[assistant_from:], start=assistant_from):
        content = turn.get("content")
        if (
            turn["role"] == "assistant"
            and isinstance(content, str)
            and not content.strip()
            and not turn.get("tool_calls")
        ):
            return (
                f"turn {index} (assistant) is {'only whitespace' if content else 'empty'}: it would be trained as the "
                "end-of-turn token alone"
            )
    if assistant_from and messages[-1]["role"] != "assistant":
        return (
            f"the completion ends with {_a(messages[-1]['role'])} turn ({_preview(messages[-1])}): its last turn must "
            "be the assistant's answer"
        )
    return None


def tool_calls_problem(calls: Any) -> str | None:
    """What makes an assistant turn's tool calls uncallable, or None: each call (`{"type": "function", "function":
    {"name", "arguments"}}`, or the flat `{"name", "arguments"}` that transformers' templates read too) needs a
    function name, and arguments that are a JSON object, given as a mapping or as its JSON text (templates render a
    mapping with tojson and text as written). Trained as written, a call with text that is not JSON, or with no
    name, teaches the model to write calls that cannot be made."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"'tool_calls' is {_a(_kind(calls))}, not a list of calls"
    for number, call in enumerate(calls):
        function = (call.get("function") or call) if isinstance(call, dict) else call
        if not isinstance(function, dict):
            what = f"tool call {number}" + ("'s function" if function is not call else "")
            return (
                f"{what} is {_a(_kind(function))}, not a call ({{'type': 'function', 'function': {{'name', "
                "'arguments'}})"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            return f"tool call {number} has no function name ({_shortened(json.dumps(call, default=str))})"
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                written = _shortened(function["arguments"])
                return f"the arguments of its call of {name!r} are not valid JSON ({error}): {written}"
        if arguments is None:
            return f"its call of {name!r} has no arguments (a call that takes none has {{}})"
        if not isinstance(arguments, dict):
            return (
                f"the arguments of its call of {name!r} are {_a(_kind(arguments))}, not a JSON object of named "
                "arguments"
            )
    return None


def _shortened(text: str) -> str:
    return repr(text[:60]) + ("..." if len(text) > 60 else "")


def _kind(value: Any) -> str:
    return {str: "string", list: "list", dict: "mapping", type(None): "null"}.get(type(value), type(value).__name__)


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeio" else f"a {word}"  # a user, a list; an assistant, an integer


def _preview(turn: dict[str, Any]) -> str:
    """Enough of a turn to find the example in the data: indices count the split after the eval examples left it."""
    return f"content {_shortened(' '.join(str(turn.get('content')).split()))}"


def example_tools(example: dict[str, Any]) -> list[dict] | None:
    """The tool schemas of an example's `tools` column (a list of JSON schemas, or its JSON text, as TRL's SFT
    reads it), for the chat template to show the model; None without one."""
    tools = example.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    return tools or None


def tokenize_example(
    example: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    data_format: str,
    *,
    assistant_only_loss: bool,
    completion_only_loss: bool,
    max_length: int,
    rewriting_templates: bool = False,
    keep_whole: bool = False,
) -> dict[str, Any]:
    """`rewriting_templates`: also locate the assistant's tokens with templates that mark them or that rewrite
    earlier turns (see chat_masks.conversation_tokens); off, such templates are refused (TemplatePrefixError).
    `keep_whole`: also the tokens before truncation (`full_ids`, `full_mask`), for images to be expanded into."""
    tools = example_tools(example)
    if data_format == "conversational":
        loss_roles = {"assistant"} if assistant_only_loss else None
        ids, mask = conversation_tokens(
            tokenizer, example["messages"], loss_roles, 0, rewriting_templates=rewriting_templates, tools=tools
        )
    elif isinstance(example["prompt"], list):  # conversational prompt/completion
        messages = list(example["prompt"]) + list(example["completion"])
        loss_roles = {"assistant"} if completion_only_loss else None
        ids, mask = conversation_tokens(
            tokenizer,
            messages,
            loss_roles,
            len(example["prompt"]),
            rewriting_templates=rewriting_templates,
            tools=tools,
        )
    else:
        prompt = tokenizer(example["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion = completion + [tokenizer.eos_token_id]
        ids = prompt + completion
        mask = ([0] * len(prompt) if completion_only_loss else [1] * len(prompt)) + [1] * len(completion)
    truncated = len(ids) > max_length
    whole = {"full_ids": ids, "full_mask": mask} if keep_whole else {}
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "truncated": truncated, **whole}


def _with_images(
    example: dict[str, Any], tokenized: dict[str, Any], pictures: images_lib.ImageInputs, column: str, roots, max_length
) -> dict[str, Any]:
    """A conversation's tokens with each image placeholder replaced by its picture's tokens (never trained), and
    the pictures' bytes for the collator. ValueError says what is wrong with the row's images."""
    given = images_lib.images_of(example, column)
    messages = example.get("messages") or list(example.get("prompt") or []) + list(example.get("completion") or [])
    parts = images_lib.image_parts(messages)
    if parts != len(given):
        raise ValueError(f"it has {parts} image part(s) in its turns but {len(given)} image(s) in {column!r}")
    data = [images_lib.image_bytes(value, roots) for value in given]
    ids, mask = pictures.expand(
        tokenized["full_ids"], tokenized["full_mask"], [images_lib.open_image(one) for one in data]
    )
    last_image = pictures.last_image_token(ids)
    if last_image >= max_length:
        raise ValueError(
            f"its text and images take {len(ids)} tokens and its last image ends at token {last_image + 1}, past "
            f"max_length={max_length} (each image is {len(pictures.expansion(images_lib.open_image(data[0])))} "
            "tokens after the processor's resize): raise max_length, or shrink the images' resolution in the "
            "processor"
        )
    return {
        "input_ids": ids[:max_length],
        "loss_mask": mask[:max_length],
        "truncated": len(ids) > max_length,
        "images": data,
    }


def _checked_tokenize_example(
    example: dict[str, Any],
    index: int,
    tokenizer: PreTrainedTokenizerBase,
    data_format: str,
    *,
    name: str,
    carving: files.Carving | None = None,
    pictures: images_lib.ImageInputs | None = None,
    image_column: str | None = None,
    image_roots: tuple = (),
    **options,
) -> dict[str, Any]:
    problem = example_problem(example, data_format)
    fix = "Fix or remove that example"
    if problem is None:
        try:
            if image_column is None:
                return tokenize_example(example, tokenizer, data_format, **options)
            tokenized = tokenize_example(example, tokenizer, data_format, keep_whole=True, **options)
            try:
                return _with_images(example, tokenized, pictures, image_column, image_roots, options["max_length"])
            except ValueError as error:  # what is wrong with the row's images
                problem = str(error)
        except TemplateError as error:
            problem = f"the chat template refused it: {error}"
            fix += ", or set chat_template to a template that accepts it"
        except TemplatePrefixError as error:  # the template's reason, with the example that showed it
            raise TemplatePrefixError(f"example {files.row_place(carving, index, name)}: {error}") from None
    raise DataError(f"example {files.row_place(carving, index, name)}: {problem}. {fix}.")


def tokenize_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    assistant_only_loss: bool,
    completion_only_loss: bool,
    max_length: int,
    num_proc: int | None = None,
    name: str = "train",
    pictures: images_lib.ImageInputs | None = None,
    image_roots: tuple = (),
) -> tuple[Dataset, dict[str, int]]:
    """Tokenised examples that carry at least one loss token, and counts of what was truncated or dropped. With an
    `images` (or `image`) column, `pictures` (the model's processor) expands each image part into its tokens and the
    rows keep the pictures' bytes (`images`); image paths are looked up in `image_roots`, then the working
    directory."""
    if len(dataset) == 0:
        raise DataError(f"the {name} split is empty: there is nothing to train or evaluate on")
    data_format = detect_format(dataset.column_names)
    image_column = images_lib.image_column(dataset.column_names)
    images_lib.require_reader(image_column, pictures, name)
    uses_chat_template = data_format == "conversational" or isinstance(dataset[0]["prompt"], list)
    if uses_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so conversations cannot be formatted. Set "
            "chat_template in the recipe config to a Jinja template (a path to a .jinja file or the text itself), "
            "or use a tokenizer that ships one."
        )
    tokenized = dataset.map(
        _checked_tokenize_example,
        with_indices=True,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            data_format=data_format,
            name=name,
            carving=files.carving_of(dataset),
            assistant_only_loss=assistant_only_loss,
            completion_only_loss=completion_only_loss,
            max_length=max_length,
            rewriting_templates=True,
            pictures=pictures,
            image_column=image_column,
            image_roots=tuple(image_roots),
        ),
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {name}",
    )
    with_loss = tokenized.filter(lambda mask: sum(mask[1:]) > 0, input_columns="loss_mask", num_proc=num_proc)
    stats = {
        "examples": len(dataset),
        "truncated": int(sum(tokenized["truncated"])),
        "dropped_without_loss_tokens": len(tokenized) - len(with_loss),
    }
    if len(with_loss) == 0:
        raise DataError(
            f"no {name} example has a token to learn from (all {len(dataset)} have an empty assistant/completion part "
            f"after truncation to max_length={max_length}). Raise max_length or check the data."
        )
    return with_loss.remove_columns("truncated"), stats


def generation_examples(
    dataset, tokenizer, limit: int, *, pictures=None, image_roots: tuple = ()
) -> list[dict[str, Any]]:
    """Prompts (everything before the last assistant turn, or the prompt) and references from held-out raw data;
    with `pictures` (a vision-language model's processor) and an images column, the prompt's image placeholders
    expanded and its pictures' bytes (`images`)."""
    column = images_lib.image_column(dataset.column_names) if pictures is not None else None
    examples = []
    for record in dataset.select(range(min(limit, len(dataset)))):
        if "messages" in record:
            messages = record["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt_ids = tokenizer.apply_chat_template(prepared_turns(messages[:last]), add_generation_prompt=True)[
                "input_ids"
            ]
            reference = _text_of(messages[last]["content"])
        elif isinstance(record["prompt"], list):
            prompt_ids = tokenizer.apply_chat_template(prepared_turns(record["prompt"]), add_generation_prompt=True)[
                "input_ids"
            ]
            reference = _text_of(record["completion"][-1]["content"])
        else:
            prompt_ids = tokenizer(record["prompt"])["input_ids"]
            reference = record["completion"]
        example = {"prompt_ids": prompt_ids, "reference": reference}
        if column is not None:  # the prompt's own pictures, in order
            shown = sum(1 for token in prompt_ids if token == pictures.placeholder_id)
            data = [images_lib.image_bytes(v, image_roots) for v in images_lib.images_of(record, column)[:shown]]
            prompt_ids, _ = pictures.expand(
                prompt_ids, [0] * len(prompt_ids), [images_lib.open_image(one) for one in data]
            )
            example.update(prompt_ids=prompt_ids, images=data)
        examples.append(example)
    return examples


def _text_of(content: Any) -> str:
    """A turn's text: its content, or its text parts joined (a turn with images)."""
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return content
