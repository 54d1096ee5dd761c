"""Reward functions of online RL, with TRL's interface: `f(prompts, completions, completion_ids, **columns)` returns
one float (or None: "no reward for this completion", left out of the weighted sum) per completion. `prompts` are the
dataset's prompts (text, or chat turns), `completions` the generated text (for chat prompts, a list holding one
assistant turn, as TRL gives them), `columns` every other dataset column by name (e.g. `answer`; a prompt's
pictures as PIL images, under `images` or `image`).

`reward_funcs` entries name one each:
- a built-in (`BUILT_INS`): exact_match, partial_match, numeric_answer (against the `reward_answer_column` column),
  format (`reward_format_pattern` matched by the whole completion), length_penalty;
- `package.module:function` (importable from the working directory or the environment);
- `path/to/file.py:function`;
- a folder holding a sequence classifier with one label (the reward-model recipe's export): its score of prompt +
  completion is the reward. It is loaded whole on every rank (a seam: a large reward model would be sharded).

Loading happens before the policy's weights (`load_reward_functions`): one that cannot be found is a ConfigError.
`score` checks what each returns: raising, the wrong number of values, NaN or inf is a DataError naming the function and
the prompt (its index in the training data).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.data import chat
from fsdp_recipes.methods.grpo.user_code import load_callable

RewardFunction = Callable[..., list]


def completion_text(completion: Any) -> str:
    """The generated text of a completion, whether plain text or a list of chat turns (the last one's content)."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _answers(name: str, column: str, columns: dict[str, list], count: int) -> list:
    if column not in columns:
        raise DataError(
            f"the {name} reward compares with the {column!r} column, which the data lacks (it has: "
            f"{', '.join(sorted(columns)) or 'no other column'}): set reward_answer_column"
        )
    return columns[column]


def exact_match(column: str) -> RewardFunction:
    """1.0 when the completion (stripped) equals the answer column's value (stripped), else 0.0."""

    def exact_match(prompts, completions, **columns) -> list[float]:
        answers = _answers("exact_match", column, columns, len(completions))
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]

    return exact_match


def partial_match(column: str) -> RewardFunction:
    """Partial credit: the share of positions where the completion has the answer's character, over the longer of
    the two (1.0 only for an exact match; an extra or missing character costs its share)."""

    def partial_match(prompts, completions, **columns) -> list[float]:
        answers = _answers("partial_match", column, columns, len(completions))
        scores = []
        for completion, answer in zip(completions, answers):
            text, answer = completion_text(completion).strip(), str(answer).strip()
            longest = max(len(text), len(answer))
            scores.append(sum(a == b for a, b in zip(text, answer)) / longest if longest else 1.0)
        return scores

    return partial_match


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_answer(column: str) -> RewardFunction:
    """1.0 when the last number of the completion equals the last number of the answer (GSM8K answers end with
    `#### 42`), else 0.0; None when the answer holds no number (not applicable)."""

    def numeric_answer(prompts, completions, **columns) -> list[float | None]:
        answers = _answers("numeric_answer", column, columns, len(completions))
        scores = []
        for completion, answer in zip(completions, answers):
            expected, got = _last_number(str(answer)), _last_number(completion_text(completion))
            scores.append(None if expected is None else float(got is not None and abs(got - expected) < 1e-6))
        return scores

    return numeric_answer


def format_reward(pattern: str) -> RewardFunction:
    """1.0 when the whole completion (stripped) matches `pattern` (a Python regex; dot matches newlines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return format


def length_penalty(max_completion_length: int) -> RewardFunction:
    """-(completion tokens / max_completion_length): between -1 and 0, shorter is better."""

    def length_penalty(prompts, completions, completion_ids, **columns) -> list[float]:
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return length_penalty


BUILT_INS = ("exact_match", "partial_match", "numeric_answer", "format", "length_penalty")


@dataclasses.dataclass
class RewardOptions:
    """What the built-ins are configured with."""

    answer_column: str = "answer"
    format_pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>"
    max_completion_length: int = 256


class RewardModel:
    """A sequence classifier with one label as a reward: its score of the prompt followed by the completion (chat
    prompts through its tokenizer's chat template, the completion as the assistant's turn)."""

    def __init__(self, folder: Path, *, device: torch.device | str = "cpu", batch_size: int = 16):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        config = AutoConfig.from_pretrained(folder)
        architectures = getattr(config, "architectures", None) or []
        if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
            raise ConfigError(
                f"reward model {folder} is not a sequence classifier (its config.json names {', '.join(architectures)}):"
                " a reward model scores a completion with one label (num_labels: 1), as recipes/reward.py exports; a "
                "causal LM gives no score"
            )
        if getattr(config, "num_labels", None) != 1:
            raise ConfigError(
                f"reward model {folder} has {getattr(config, 'num_labels', None)} labels: a reward model is a "
                "sequence classifier with one label (num_labels: 1), as recipes/reward.py exports"
            )
        self.__name__ = Path(folder).name
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "right"  # as the reward recipe's rows: the model pools the last real token
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval()
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = device, batch_size

    def _ids(self, prompt: Any, completion: Any) -> list[int]:
        """The tokens recipes/reward.py trains and evaluates on for this prompt and answer (chat turns through the
        template; text as prompt + answer + the end-of-sequence token): a score read anywhere else is not the one
        the model learned (without the end token, a text answer is scored at its last letter)."""
        answer = completion_text(completion)
        if isinstance(prompt, list):  # the answer tokenised apart from its prompt, as the reward recipe's pairs are
            example = {"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]}
        else:
            example = {"prompt": str(prompt), "completion": answer}
        options = dict(
            assistant_only_loss=True, completion_only_loss=True, max_length=1 << 30, rewriting_templates=True
        )
        return chat.tokenize_example(example, self.tokenizer, "prompt_completion", **options)["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns) -> list[float]:
        rows = [self._ids(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(rows), self.batch_size):
            batch = self.tokenizer.pad({"input_ids": rows[start : start + self.batch_size]}, return_tensors="pt")
            scores += self.model(**batch.to(self.device)).logits[:, 0].float().tolist()
        return scores


def load_reward_function(spec: str, options: RewardOptions, *, device="cpu") -> tuple[str, RewardFunction]:
    """(name, callable) for one `reward_funcs` entry; ConfigError when it cannot be found."""
    builders = {
        "exact_match": lambda: exact_match(options.answer_column),
        "partial_match": lambda: partial_match(options.answer_column),
        "numeric_answer": lambda: numeric_answer(options.answer_column),
        "format": lambda: format_reward(options.format_pattern),
        "length_penalty": lambda: length_penalty(options.max_completion_length),
    }
    if spec in builders:
        return spec, builders[spec]()
    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise ConfigError(f"reward_funcs: {spec} is a folder without config.json, not a reward model folder")
        model = RewardModel(Path(spec), device=device)
        return model.__name__, model
    if ":" not in spec:
        raise ConfigError(
            f"reward_funcs: {spec!r} is not a built-in ({', '.join(BUILT_INS)}), a reward model folder, "
            "package.module:function nor path/to/file.py:function"
        )
    return load_callable(spec, setting="reward_funcs")


def load_reward_functions(
    specs: Sequence[str], options: RewardOptions, *, device="cpu"
) -> list[tuple[str, RewardFunction]]:
    return [load_reward_function(spec, options, device=device) for spec in specs]


def _call(name: str, function: RewardFunction, prompts, completions, completion_ids, columns) -> list:
    return function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)


def score(
    functions: list[tuple[str, RewardFunction]],
    weights: Sequence[float],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    prompt_indices: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted reward of each completion ([N]) and each function's values ([functions, N], NaN for None).
    DataError naming the function and the prompt when one raises, returns the wrong number of values, a value that is
    not a number, NaN or infinite."""
    count = len(completions)
    per_function = torch.full((len(functions), count), math.nan, dtype=torch.float32)
    for row, (name, function) in enumerate(functions):
        try:
            values = _call(name, function, prompts, completions, completion_ids, columns)
        except Exception as error:  # noqa: BLE001 - the user's function: find the prompt it fails on
            failing = _first_failing(name, function, prompts, completions, completion_ids, columns, prompt_indices)
            raise DataError(
                f"reward function {name} raised {type(error).__name__}: {error} (on prompt {failing} of the training "
                "data): fix the function, or return None for completions it cannot score"
            ) from None
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise DataError(
                f"reward function {name} returned {got} for {count} completions (prompts "
                f"{min(prompt_indices)}..{max(prompt_indices)} of the training data): it must return one float or "
                "None per completion"
            )
        for column, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise DataError(
                    f"reward function {name} returned {value!r} for a completion of prompt "
                    f"{prompt_indices[column]} of the training data: rewards must be finite numbers (None: no "
                    "reward; a penalty is a finite negative number, e.g. -1.0: advantages compare rewards within a "
                    "group, so its size only needs to set it apart)"
                )
            per_function[row, column] = float(value)
    weight = torch.tensor(list(weights), dtype=torch.float32).unsqueeze(1)
    return torch.nansum(per_function * weight, dim=0), per_function


def _first_failing(name, function, prompts, completions, completion_ids, columns, prompt_indices) -> str:
    for i in range(len(completions)):
        one = {key: values[i : i + 1] for key, values in columns.items()}
        try:
            _call(name, function, prompts[i : i + 1], completions[i : i + 1], completion_ids[i : i + 1], one)
        except Exception:  # noqa: BLE001
            return str(prompt_indices[i])
    return f"{min(prompt_indices)}..{max(prompt_indices)} (it fails only on the whole batch)"


def score_completions(
    functions: list[tuple[str, RewardFunction]],
    weights: Sequence[float],
    data,
    prompt_indices: list[int],
    completion_ids: list[list[int]],
    texts: list[str],
    conversations: list[list[dict]] | None = None,
    environments: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`score` for completions of prompts of `data` (fsdp_recipes.methods.grpo.prompts.Prompts), by index: as TRL calls
    reward functions, completions of chat prompts as one assistant turn (with tools, the whole exchange: assistant
    turns with their `tool_calls` and the `tool` messages), every other column by name, and with an environment
    each completion's instance as `environments`."""
    completions = [[{"role": "assistant", "content": t}] for t in texts] if data.conversational else list(texts)
    if conversations is not None:
        completions = conversations
    return score(
        functions,
        weights,
        prompts=[data.prompts[p] for p in prompt_indices],
        completions=completions,
        completion_ids=completion_ids,
        columns={name: [values[p] for p in prompt_indices] for name, values in data.columns.items()}
        | ({"environments": environments} if environments is not None else {}),
        prompt_indices=list(prompt_indices),
    )
