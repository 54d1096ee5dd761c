"""What a GRPO run samples and scores, read before any weights load (`load_task`): the prompts, the reward functions
and their weights (an environment's `get_reward` among them, weight 1), the tools the chat template shows the model and
the environment they act on; and a round's two halves on it: `generate` (the policy's completions, its tool calls
answered) and `score` (every reward function, then every rank's scored completions gathered)."""

from __future__ import annotations

import dataclasses
import functools

from fsdp_recipes.common.errors import ConfigError, DataError
from fsdp_recipes.data import files, images
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.methods.grpo import groups, prompts, rewards
from fsdp_recipes.methods.grpo import tools as tools_lib
from fsdp_recipes.methods.grpo.rollouts import sampling_key
from fsdp_recipes.train.generation import GenerationSettings


@dataclasses.dataclass
class Task:
    data: prompts.Prompts
    functions: list[tuple[str, rewards.RewardFunction]]
    weights: list[float]
    tools: list[tools_lib.Tool]
    environment: tools_lib.Environment | None
    max_tool_calling_iterations: int | None
    tool_timeout: float
    pictures: images.ImageInputs | None = None  # a vision-language model's processor, for prompts with pictures

    def generate(
        self, model, tokenizer, slots, round_index: int, attempt: int, settings: GenerationSettings, **collective
    ) -> tools_lib.Rollout:
        """The completions of `slots` ((prompt index, generation index) pairs), each seeded by its own key;
        `collective`: `synced_gpus` and `most_pending` (fsdp_recipes.methods.grpo.tools.generate_with_tools)."""
        environments, row_tools = None, None
        if self.environment is not None:  # one per completion, reset with its row
            rows = [self.data.row(p) for p, _ in slots]
            environments, row_tools = self.environment.start(rows, [self.data.reset_texts[p] for p, _ in slots])
        shown = None if self.data.images is None else [self.data.images[p] for p, _ in slots]
        rolled = tools_lib.generate_with_tools(
            model, tokenizer, [self.data.prompt_ids[p] for p, _ in slots],
            [sampling_key(round_index, p, g, attempt) for p, g in slots], settings, self.tools,
            max_iterations=self.max_tool_calling_iterations, timeout=self.tool_timeout, row_tools=row_tools,
            images=shown, **collective,
        )  # fmt: skip
        rolled.environments = environments
        return rolled

    def pixel_inputs(self, input_ids, prompt_indices: list[int]) -> dict:
        """The vision inputs of rows that show these prompts (their pictures' pixel values); {} without pictures."""
        if self.data.images is None:
            return {}
        return self.pictures.pixel_inputs(input_ids, [self.data.images[p] for p in prompt_indices])

    def score(
        self, accelerator, tokenizer, slots, rolled: tools_lib.Rollout, on_every_rank, *, parallel: ParallelDims
    ) -> groups.ScoredSlots:
        """Collective: `rolled` scored by every reward function (on every rank together: one failing stops all), then
        every data-parallel rank's scored completions gathered (`parallel`: the run's layout), in slot order."""
        texts = tokenizer.batch_decode(rolled.completion_ids, skip_special_tokens=True)
        indices = [p for p, _ in slots]
        scores = on_every_rank(
            functools.partial(
                rewards.score_completions, self.functions, self.weights, self.data, indices, rolled.completion_ids,
                texts, rolled.conversations, rolled.environments,
            )
        )  # fmt: skip
        return groups.gather_scored(
            accelerator, indices, rolled.completion_ids, rolled.truncated, *scores, rolled.policy_masks,
            rolled.tool_calls, rolled.sampling_log_probs, parallel=parallel,
        )  # fmt: skip


def load_task(
    config, tokenizer, *, device, pictures: images.ImageInputs | None = None, data_parallel_size: int = 1
) -> Task:
    """The run's task, from its config (the GRPO settings groups and the data fields); ConfigError or DataError when a reward
    function, a tool, the environment, the chat template or the data cannot serve. `pictures`: a vision-language
    model's processor (the run's), for prompts with images."""
    functions = rewards.load_reward_functions(config.reward_funcs, config.reward_options(), device=device)
    environment = tools_lib.load_environment(config.environment_factory) if config.environment_factory else None
    tools = tools_lib.load_tools(config.tools) + (environment.tools if environment else [])  # shown to the model
    problem = tools and tools_lib.template_problem(tokenizer, tools)
    if problem:
        raise ConfigError(f"tools: {problem}")
    if environment and environment.rewards:  # the environment's get_reward, weight 1 (TRL's)
        functions.append((environment.name, environment.reward_function()))
    raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
    split = config.dataset_train_split
    if split not in raw:
        raise DataError(f"the data has no {split!r} split (it has: {', '.join(raw)})")
    data = prompts.load_prompts(
        raw[split], tokenizer, max_prompt_length=config.max_length - config.max_completion_length, split=split,
        column=config.dataset_prompt_column, tools=[tool.schema for tool in tools],
        reset=environment and (lambda row, place: environment.reset(environment.factory(), row, place)),
        pictures=pictures, image_roots=files.data_folders(config.dataset_name),
    )  # fmt: skip
    if data.images is not None and (problem := picture_problem(config, tools)):
        raise ConfigError(f"the prompts show pictures, and {problem}")
    without = [index for index, shown in enumerate(data.images or []) if not shown]
    if without and len(without) < len(data) and data_parallel_size > 1:
        raise DataError(
            f"prompts {', '.join(map(str, without[:5]))}{'...' if len(without) > 5 else ''} of the {split} split show "
            f"no picture while others do: with {data_parallel_size} data-parallel ranks a rank whose micro-batch has "
            "no picture would skip the vision tower the others run, and FSDP's collectives would not match (not "
            "built yet for GRPO). Give every prompt a picture, train the two kinds in separate runs, or use one rank"
        )
    weights = config.weights() + [1.0] * (len(functions) - len(config.reward_funcs))
    return Task(
        data, functions, weights, tools, environment, config.max_tool_calling_iterations, config.tool_timeout, pictures
    )


def picture_problem(config, tools) -> str | None:
    """What of the config cannot take prompts with pictures yet (docs/vision.md), or None."""
    if config.generation_backend != "generate":
        return (
            f"generation_backend {config.generation_backend} (use_vllm) does not take them here yet: the policy "
            "generates with them through transformers' generate. Set generation_backend: generate (use_vllm: false)"
        )
    if tools:
        return "tool calls with pictures are not built yet: remove tools and environment_factory"
    if config.padding_free:
        return (
            "padding_free packs rows, which a vision-language model's positions do not allow: set padding_free: false"
        )
    return None
