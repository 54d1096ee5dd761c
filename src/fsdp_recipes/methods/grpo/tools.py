"""Tool calling in GRPO's rollouts (TRL's `tools` and `max_tool_calling_iterations`): the policy writes a tool call,
the tool runs, its result goes back into the conversation as a `tool` message rendered by the chat template, and
generation continues; only the policy's own tokens are trained.

- Tools are plain Python functions named like reward functions (`path/to/file.py:function`, `package.module:function`),
  described to the model by the tokenizer's chat template (`apply_chat_template(tools=...)`) from their signature and
  docstring (transformers' `get_json_schema`: type hints and an `Args:` line per parameter are required).
- A call is read from the generated text in the Hermes/Qwen format TRL's parsers read for Qwen:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several per turn allowed). Text that is not valid JSON
  there is no call, as in TRL.
- A tool that raises, is unknown, gets arguments it does not take, or runs past `tool_timeout` seconds is answered with
  the error as text (`error: ...`), never a crash; calls and failures are counted and logged. A result goes back as
  `str(result)`, as TRL sends it.
- The tokens between the policy's turn and its next one (the tool messages and the next assistant header) are what the
  template renders after a call's end-of-sequence token, appended to the generated tokens without rendering the
  policy's turn again (as TRL appends them). They count toward `max_completion_length` and carry no loss.
- Before loading, one real round is rendered (tools shown, a call read back, a result appended): a template that
  ignores tools, writes calls in another format, or drops tool messages is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.methods.grpo.user_code import load_callable
from fsdp_recipes.train import generation

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PROBE_RESULT = "fsdp-recipes-probe-result"
_RESULT_MARKER = "\u2063fsdp-recipes-result\u2063"


@dataclasses.dataclass
class Tool:
    name: str
    function: Callable
    schema: dict


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """The `tools` entries, each with the JSON schema the chat template shows; ConfigError when one cannot be imported
    or lacks what the schema needs (transformers says what)."""
    from transformers.utils import get_json_schema

    tools, problems = [], []
    for spec in specs:
        name, function = load_callable(spec, setting="tools")
        try:
            tools.append(Tool(name, function, get_json_schema(function)))
        except Exception as error:  # noqa: BLE001 - transformers' reasons: no docstring, a parameter without a type
            problems.append(
                f"tools: {spec} cannot be described to the model ({' '.join(str(error).split())}): give it type hints "
                "and a docstring with an `Args:` line per parameter"
            )
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        problems.append(f"tools: two tools share a name ({', '.join(names)}): the model calls them by name")
    if problems:
        raise ConfigError(problems)
    return tools


@dataclasses.dataclass
class Environment:
    """A class of environments for tool-using rollouts (TRL's `environment_factory`): one instance per completion;
    `reset(**row)` starts it (a returned string joins the prompt's last turn), its other public methods are the tools
    the policy calls on it, and `get_reward()`, where it has one, scores the finished rollout."""

    name: str
    factory: Callable
    tools: list[Tool]  # bound to a probe instance: their schemas, for the chat template
    rewards: bool

    def start(self, rows: list[dict], texts: list[str | None]) -> tuple[list[Any], list[dict[str, Tool]]]:
        """An instance per row, reset with it, and the tools bound to each. The prompts were tokenised once, with the
        text each reset returned when the data was read (`texts`): a reset that now returns another is a DataError."""
        instances = [self.factory() for _ in rows]
        for instance, row, text in zip(instances, rows, texts):
            if self.reset(instance, row, "a prompt of this step") != text:
                raise DataError(
                    f"{self.name}.reset returned other text for the same row than when the data was read: the prompts "
                    "are tokenised once, so reset's text must depend on the row alone (keep random state elsewhere)"
                )
        bound = [{t.name: Tool(t.name, getattr(i, t.name), t.schema) for t in self.tools} for i in instances]
        return instances, bound

    def reset(self, instance: Any, row: dict, place: str) -> Any:
        """`instance.reset(**row)`; DataError naming `place` when the user's reset raises (it runs on every prompt
        as the data is read, before the model loads, so a reset that cannot take a row stops the run there)."""
        try:
            return instance.reset(**row)
        except Exception as error:  # noqa: BLE001 - the user's class
            raise DataError(
                f"environment_factory: {self.name}.reset raised {type(error).__name__}: {error} on {place}: reset "
                f"receives each row's columns as keyword arguments ({', '.join(row)}); make it accept every row"
            ) from None

    def reward_function(self) -> Callable:
        """The reward column the environment adds (TRL's: named after the class, weight 1)."""

        def reward(prompts, completions, environments, **columns):
            return [float(environment.get_reward()) for environment in environments]

        reward.__name__ = self.name
        return reward


def load_environment(spec: str) -> Environment:
    """The `environment_factory` entry, built once to read its tools; ConfigError when it cannot be built, has no
    `reset`, or no public method the model could call, or one that cannot be described to it."""
    from transformers.utils import get_json_schema

    name, factory = load_callable(spec, setting="environment_factory")
    try:
        probe = factory()
    except Exception as error:  # noqa: BLE001 - the user's class
        raise ConfigError(f"environment_factory: {spec} could not be built: {type(error).__name__}: {error}") from None
    if not callable(getattr(probe, "reset", None)):
        raise ConfigError(
            f"environment_factory: {name} has no reset method: give it reset(self, **row) (it starts a rollout and "
            "may return text to add to the prompt)"
        )
    names = [m for m in dir(probe) if not m.startswith("_") and m not in ("reset", "get_reward")]
    names = [m for m in names if callable(getattr(probe, m))]
    if not names:
        raise ConfigError(f"environment_factory: {name} has no public method for the model to call as a tool")
    tools, problems = [], []
    for method in names:
        try:
            tools.append(Tool(method, getattr(probe, method), get_json_schema(getattr(probe, method))))
        except Exception as error:  # noqa: BLE001 - transformers' reasons
            problems.append(
                f"environment_factory: {name}.{method} cannot be described to the model "
                f"({' '.join(str(error).split())}): give it type hints and a docstring with an `Args:` line per "
                "parameter, or make it private (_name)"
            )
    if problems:
        raise ConfigError(problems)
    return Environment(name, factory, tools, callable(getattr(probe, "get_reward", None)))


def template_problem(tokenizer, tools: list[Tool]) -> str | None:
    """Why the tokenizer's chat template cannot run these tools (None: it can), found by rendering one real round:
    the tools shown to the model, a call written in the format the calls are read in, a `tool` message with its
    result, and the next generation prompt appended after the call's end-of-sequence token."""
    probe = [{"role": "user", "content": "hi"}]
    schemas = [tool.schema for tool in tools]
    call = {"name": tools[0].name, "arguments": {}}
    try:
        shown = tokenizer.apply_chat_template(probe, tools=schemas, add_generation_prompt=True, tokenize=False)
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        if shown == plain:
            return (
                "the tokenizer's chat template ignores `tools`, so the model would never see them: use a tokenizer "
                "whose template renders tools (Qwen2.5, Qwen3) or set chat_template to one that does"
            )
        calling = _calling_turn(tokenizer, [call])
        if parse_tool_calls(calling) != [call]:
            return (
                f"the tokenizer's chat template writes a tool call as {calling.strip()[:120]!r}, not in the "
                '<tool_call>{"name": ..., "arguments": ...}</tool_call> format the calls are read in, so the model '
                "would be shown calls it cannot make: use a template with Hermes-style calls (Qwen2.5, Qwen3) in "
                "chat_template"
            )
        continuation = tokenizer.decode(continuation_ids(tokenizer, [call], [_PROBE_RESULT]))
    except ConfigError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - a template that fails on tools says why
        return f"the tokenizer's chat template cannot render tools ({type(error).__name__}: {error})"
    if _PROBE_RESULT not in continuation:
        return "the tokenizer's chat template does not render `tool` messages: the tool's result would be lost"
    return None


def tool_exchange(name: str, results: list[str], calls: list[dict] | None = None) -> list[dict]:
    """The messages of one tool round: the assistant's calls, then one `tool` message per result."""
    calls = calls or [{"name": name, "arguments": {}} for _ in results]
    ids = [f"call{index:05d}" for index in range(len(calls))]  # 9 letters and digits: Mistral's templates need ids
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "id": i, "function": call} for i, call in zip(ids, calls)],
    }
    return [assistant] + [
        {"role": "tool", "name": call["name"], "tool_call_id": i, "content": r}
        for i, call, r in zip(ids, calls, results)
    ]


def parse_tool_calls(text: str) -> list[dict]:
    """The calls in one generated turn: [{"name", "arguments"}], in order; a block that is not a JSON object with a
    string `name` is not a call."""
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments") or {}
            calls.append({"name": call["name"], "arguments": arguments if isinstance(arguments, dict) else {}})
    return calls


def run_call(tools: dict[str, Tool], call: dict, timeout: float) -> tuple[str, bool]:
    """(the text that goes back to the model, whether the call failed)."""
    tool = tools.get(call["name"])
    if tool is None:
        return f"error: no tool named {call['name']!r} (tools: {', '.join(sorted(tools))})", True
    # A daemon thread of its own: a tool that never returns is abandoned at the timeout and cannot keep the process
    # from exiting at the end of the run (a ThreadPoolExecutor's workers are joined at exit: the run would hang).
    outcome: dict[str, Any] = {}

    def call_tool() -> None:
        try:
            outcome["result"] = tool.function(**call["arguments"])
        except SystemExit as exiting:  # sys.exit in a tool would end this rank alone: the others would wait forever
            outcome["error"] = f"error: {tool.name} called sys.exit({exiting.code!r}); a tool must return its answer"
        except Exception as error:  # noqa: BLE001 - the tool's own failure goes back to the model as text
            outcome["error"] = f"error: {type(error).__name__}: {error}"

    worker = threading.Thread(target=call_tool, name=f"tool {tool.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"error: {tool.name} did not return within {timeout:g} s", True
    if "error" in outcome:
        return outcome["error"], True
    return str(outcome["result"]), False


def continuation_ids(tokenizer, calls: list[dict], results: list[str]) -> list[int]:
    """The tokens the template puts after the policy's calling turn (generation stopped at its end-of-sequence token)
    and before its next one: the `tool` messages and the next generation prompt. Read from the template's rendering
    of a call round: what follows the calling turn's end-of-sequence token. The calling turn is never rendered again
    from its parsed calls: Qwen3's template writes it with an empty think block while it is the last turn and
    without one once a tool message follows, so rendering the conversation twice would not line up (TRL appends the
    same way)."""
    head, exchange = _rendered_round(tokenizer, calls, results)
    # The calling turn ends at the last end-of-sequence token before the first result (a call's arguments may spell
    # the token out too): found where a marker result stands, the rendering before it being the same.
    _, marked = _rendered_round(tokenizer, calls, [_RESULT_MARKER] * len(results))
    before_results = marked.find(_RESULT_MARKER, len(head))
    before_results = before_results if before_results >= 0 else len(marked)  # a template that drops tool messages
    end = marked.rfind(tokenizer.eos_token, len(head), before_results) if tokenizer.eos_token else -1
    if end >= 0 and not exchange.startswith(marked[: end + len(tokenizer.eos_token)]):
        end = -1
    if end < 0:
        raise ConfigError(
            f"the tokenizer's chat template does not end an assistant turn that calls tools with the end-of-sequence "
            f"token ({tokenizer.eos_token!r}) that generation stops at, so the tool results cannot be appended where "
            "the policy stopped: set the tokenizer's eos_token to the template's end-of-turn token"
        )
    return tokenizer(exchange[end + len(tokenizer.eos_token) :], add_special_tokens=False)["input_ids"]


def _rendered_round(tokenizer, calls: list[dict], results: list[str]) -> tuple[str, str]:
    """(the generation prompt of a one-turn conversation, that conversation followed by one call round and the
    next generation prompt); ConfigError when the round does not start with the prompt."""
    probe = [{"role": "user", "content": "hi"}]
    head = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    exchange = tokenizer.apply_chat_template(
        probe + tool_exchange("", results, calls), add_generation_prompt=True, tokenize=False
    )
    if not exchange.startswith(head):
        raise ConfigError(
            "the tokenizer's chat template renders the conversation before a tool call differently once the call "
            "follows, so the tool results cannot be appended to the generated tokens: use a template that keeps "
            "earlier turns as they are"
        )
    return head, exchange


def _calling_turn(tokenizer, calls: list[dict]) -> str:
    """The text of an assistant turn that makes `calls` as the template renders it (as the last turn: its end is
    where generation would stop)."""
    probe = [{"role": "user", "content": "hi"}]
    head = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    turn = tokenizer.apply_chat_template(probe + tool_exchange("", [], calls)[:1], tokenize=False)
    return turn[len(head) :] if turn.startswith(head) else turn


@dataclasses.dataclass
class Rollout:
    """Generated completions: the token ids and whether each hit the length limit; with tools also which tokens the
    policy wrote (1) and which the template added (0: the tool messages between its turns), the conversation each
    is to the reward functions, and the (calls, failed calls) each made. Without tools those three are None.
    `sampling_log_probs`: each token's log-probability as the engine sampled it (vLLM; 0.0 on tool messages), None
    where the engine reports none."""

    completion_ids: list[list[int]]
    truncated: list[bool]
    policy_masks: list[list[int]] | None = None
    conversations: list[list[dict]] | None = None
    tool_calls: list[tuple[int, int]] | None = None
    environments: list | None = None  # an environment: each completion's instance, for the reward functions
    sampling_log_probs: list[list[float]] | None = None


def generate_with_tools(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    keys: list[int],
    settings: generation.GenerationSettings,
    tools: list[Tool],
    *,
    max_iterations: int | None,
    timeout: float,
    synced_gpus: bool,
    most_pending: Callable[[int], int] = lambda count: count,
    row_tools: list[dict[str, Tool]] | None = None,
    images: list[list[bytes]] | None = None,
) -> Rollout:
    """Collective under FSDP/TP (`synced_gpus`, `most_pending`: the largest of the ranks' counts). Each completion is
    generated; with `tools`, its tool calls are run and answered, and generation resumed after the answers, until a
    turn calls no tool, `max_iterations` rounds of calls were answered, or `max_completion_length` tokens (tool
    messages included) are reached. Every rank runs the same number of generation passes, padded with throw-away
    rows, so ranks stay in step; a row's tokens depend only on its prompt, its key and the tools. `row_tools`: each
    row's own tools (bound to its environment) instead of `tools`. `images`: each prompt's pictures (no tools then)."""
    generated = generation.generate_completions(
        model, tokenizer, prompt_ids, keys, settings, synced_gpus=synced_gpus, images=images
    )
    first, truncated = generated
    sampled = generated.sampling_log_probs
    if not tools and not row_tools:
        return Rollout(first, truncated, sampling_log_probs=sampled)
    ids, masks = [list(c) for c in first], [[1] * len(c) for c in first]
    sampled = None if sampled is None else [list(values) for values in sampled]
    turns = [[{"role": "assistant", "content": tokenizer.decode(c, skip_special_tokens=True)}] for c in first]
    calls, failures = [0] * len(ids), [0] * len(ids)
    by_name = {tool.name: tool for tool in tools}
    pending = list(range(len(ids)))
    iteration = 0
    while max_iterations is None or iteration < max_iterations:
        iteration += 1
        resumed = []
        for row in pending:
            asked = [] if truncated[row] else parse_tool_calls(turns[row][-1]["content"])
            if not asked:
                continue
            answers = []
            for call in asked:
                text, failed = run_call(row_tools[row] if row_tools else by_name, call, timeout)
                answers.append(text)
                calls[row] += 1
                failures[row] += int(failed)
            turns[row][-1]["tool_calls"] = [{"type": "function", "function": call} for call in asked]
            suffix = continuation_ids(tokenizer, asked, answers)
            room = settings.max_completion_length - len(ids[row]) - len(suffix)
            if room < 1:  # no room to answer: the call stays unanswered, as TRL leaves it
                truncated[row] = True
                continue
            turns[row] += [{"role": "tool", "name": c["name"], "content": a} for c, a in zip(asked, answers)]
            ids[row] += suffix
            masks[row] += [0] * len(suffix)
            if sampled is not None:
                sampled[row] += [0.0] * len(suffix)
            resumed.append((row, room))
        width = most_pending(len(resumed))
        if width == 0:
            break
        padded = resumed + [resumed[0] if resumed else (0, 1)] * (width - len(resumed))  # thrown away after
        more = dataclasses.replace(settings, max_completion_length=max(room for _, room in padded))
        more_generated = generation.generate_completions(
            model,
            tokenizer,
            [prompt_ids[row] + ids[row] for row, _ in padded],
            [(keys[row] * 1_000_003 + iteration) % 2**61 for row, _ in padded],
            more,
            synced_gpus=synced_gpus,
        )
        continued, stopped_short = more_generated
        for index, ((row, room), tokens, short) in enumerate(zip(resumed, continued, stopped_short)):
            kept = tokens[:room]
            ids[row] += kept
            masks[row] += [1] * len(kept)
            if sampled is not None:
                sampled[row] += list(more_generated.sampling_log_probs[index][:room])
            truncated[row] = short or len(tokens) > room
            turns[row].append({"role": "assistant", "content": tokenizer.decode(kept, skip_special_tokens=True)})
        pending = [row for row, _ in resumed]
    return Rollout(ids, truncated, masks, turns, list(zip(calls, failures)), sampling_log_probs=sampled)
