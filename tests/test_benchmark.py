"""The throughput benchmark runs end to end in its small mode and reports every variant sanely (no timing
assertions: the figures depend on the machine and on whatever else it is running)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCHMARK = REPO / "benchmarks" / "sft_throughput.py"
VARIANTS = {"bare", "recipe", "trainer", "trainer_grouped", "proposal"}


@pytest.mark.slow
def test_small_benchmark_reports_every_variant():
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--small", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    report = json.loads(result.stdout)

    results = report["results"]
    assert set(results) == VARIANTS
    for name, variant in results.items():
        assert variant["real_tokens_per_s"] > 0, name
        assert variant["wall_s"] > 0 and variant["steps"] > 0, name
        assert 0.0 <= variant["padding_fraction"] <= 1.0, name
    # One full epoch of the same examples for everyone: the same real tokens.
    assert {variant["real_tokens"] for variant in results.values()} == {report["data"]["real_tokens"]}
    assert report["same_real_tokens"] is True
    assert results["bare"]["steps"] == results["recipe"]["steps"]
    assert results["bare"]["time_per_token_vs_bare"] == pytest.approx(1.0)
