"""Supervised data (TRL's SFTConfig names): chat or prompt/completion examples made into token rows with loss on the
assistant / completion tokens, packed or not, and the held-out exact-match check of greedy completions. The settings
are a base a recipe's config class puts before `TrainingConfig` (SFT and distillation train on the same data)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_recipes.common import checks
from fsdp_recipes.common.arguments import setting
from fsdp_recipes.data import chat, files, rows
from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train import evaluation


@dataclasses.dataclass
class SupervisedFields:
    packing: bool = setting(
        True, "pack several examples per row: less padding; examples never attend to each other", resume="sensitive"
    )
    packing_row_length: int | None = setting(
        None,
        "tokens per packed row (null: max_length). Shorter rows cost less attention per token with "
        "sdpa/eager, which compute the whole row; longer examples still get a row of their own, uncut",
        resume="sensitive",
        check=checks.at_least(1, or_null=True),
    )
    packing_strategy: str = setting(
        "bfd",
        "how examples share rows: bfd (best-fit decreasing, TRL's default); ffd (older TRL) is read as "
        "bfd. TRL's wrapped is refused: it cuts examples across rows, which SFT here never does",
        resume="free",
        check=checks.one_of(("bfd", "ffd"), note=": SFT packs whole examples, never cut"),
    )
    assistant_only_loss: bool = setting(True, "conversational data: loss only on assistant turns", resume="sensitive")
    completion_only_loss: bool = setting(
        True, "prompt/completion data: loss only on the completion", resume="sensitive"
    )
    exact_match_eval_samples: int = setting(
        0,
        "held-out examples whose greedy completion is compared with the reference, before and after "
        "training (0: none); costs one generation per sample each time",
        resume="free",
        check=checks.at_least(0),
    )
    max_new_tokens: int = setting(
        64,
        "generation budget (tokens per completion): the exact_match_eval_samples check's, and distillation's "
        "sampled completions (lmbda, seq_kd)",
        resume="free",
        check=checks.at_least(1),
    )

    def row_length(self) -> int:
        return (self.packing_row_length or self.max_length) if self.packing else self.max_length

    def packs_examples(self) -> bool:
        return self.packing


@dataclasses.dataclass
class SupervisedData:
    train_rows: list
    eval_rows: list | None
    eval_raw: Any  # the held-out examples as read (the exact-match check generates from their prompts)
    train_stats: dict
    pictures: Any = None  # a vision-language model's processor (data.images.ImageInputs), for the exact-match check
    image_roots: tuple = ()  # where the data's relative image paths are looked up


def prepare(config: SupervisedFields, tokenizer, pictures=None) -> SupervisedData:
    """The config's data read, split (held-out rows carved only when something evaluates), tokenized with loss masks
    and made into rows: training rows packed as asked, held-out rows one example each. `pictures`: a vision-language
    model's processor (data.images.ImageInputs), for data with images (paths relative to the data's folder)."""
    raw = files.load_raw_dataset(config.dataset_name, config.dataset_config, mixture=config.dataset_mixture)
    train_raw, eval_raw = files.split_train_eval(
        raw, config.dataset_train_split, config.dataset_test_split, config.held_out_split_size(), config.seed
    )
    options = dict(
        assistant_only_loss=config.assistant_only_loss,
        completion_only_loss=config.completion_only_loss,
        max_length=config.max_length,
        num_proc=config.dataset_num_proc,
        pictures=pictures,
        image_roots=files.data_folders(config.dataset_name),
    )
    train_tokens, train_stats = chat.tokenize_dataset(train_raw, tokenizer, name="train", **options)
    train_rows = rows.build_rows(
        train_tokens, max_length=config.packing_row_length or config.max_length, packing=config.packing
    )
    eval_rows = None
    if eval_raw is not None:
        eval_tokens = chat.tokenize_dataset(eval_raw, tokenizer, name="eval", **options)[0]
        eval_rows = rows.build_rows(eval_tokens, max_length=config.max_length, packing=False)
    return SupervisedData(train_rows, eval_rows, eval_raw, train_stats, pictures, options["image_roots"])


def exact_match_wanted(config: SupervisedFields, data: SupervisedData) -> bool:
    return bool(config.exact_match_eval_samples) and data.eval_raw is not None


def exact_match(
    accelerator, model, tokenizer, data: SupervisedData, config: SupervisedFields, *, parallel: ParallelDims
) -> dict:
    """Collective. The held-out exact match of greedy completions (`evaluation.exact_match_accuracy`) of the first
    `exact_match_eval_samples` held-out examples, split over the data-parallel ranks of `parallel` (the run's)."""
    return evaluation.exact_match_accuracy(
        accelerator,
        model,
        tokenizer,
        chat.generation_examples(
            data.eval_raw, tokenizer, config.exact_match_eval_samples, pictures=data.pictures,
            image_roots=data.image_roots,
        ),
        parallel=parallel,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.per_device_eval_batch_size,
        pictures=data.pictures,
    )  # fmt: skip
