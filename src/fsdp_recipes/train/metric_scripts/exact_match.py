"""Exact match: the share of generated texts equal to their reference once surrounding whitespace is stripped."""

import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Share of predictions equal to their reference after stripping surrounding whitespace.",
            citation="",
            inputs_description="predictions, references: strings; ignore_case: compare lower-cased text",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, ignore_case=False):
        def normal(text):
            return text.strip().lower() if ignore_case else text.strip()

        hits = sum(normal(p) == normal(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / max(len(predictions), 1)}
