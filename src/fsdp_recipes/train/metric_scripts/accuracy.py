"""Accuracy: the share of predictions equal to their reference (scikit-learn's accuracy_score)."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Share of predicted class ids equal to the reference class ids.",
            citation="",
            inputs_description="predictions, references: class ids (int); sample_weight: optional weights",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, sample_weight=sample_weight))}
