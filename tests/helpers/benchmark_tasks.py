"""lm-eval task YAMLs the tests write beside the shipped demo tasks (src/fsdp_recipes/train/benchmark_tasks/)."""

from __future__ import annotations

from pathlib import Path

from helpers.paths import DEMO_DATA


def rolling_task(folder: Path) -> str:
    """`reverse_rolling`: the rolling log-likelihood of each held-out demo conversation's two texts (word perplexity,
    bits per byte): a score that moves with every weight, unlike a count of right answers."""
    path = folder / "reverse_rolling.yaml"
    path.write_text(
        "task: reverse_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DEMO_DATA / 'test.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{messages[0].content}} {{messages[1].content}}'\n"
        "metric_list:\n"
        "  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n"
        "metadata:\n  version: 1.0\n"
    )
    return str(path)
