"""Precision, the share of predictions of a class that are right (scikit-learn's precision_score).

`average` defaults to "macro", the unweighted mean over classes, the usual figure for several classes (the
Hub's `precision` defaults to "binary"); `average=None` gives one value per class, in the order of `labels` (default:
the sorted ids that occur)."""

import datasets
import evaluate
from sklearn.metrics import precision_score


class Precision(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Precision, the share of predictions of a class that are right, per class or averaged over classes.",
            citation="",
            inputs_description="predictions, references: class ids (int); average: macro, micro, weighted, binary or "
            "None; labels: the class ids to report; zero_division: value when a class is never predicted or present",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro", labels=None, zero_division=0.0):
        value = precision_score(references, predictions, average=average, labels=labels, zero_division=zero_division)
        return {"precision": float(value) if average is not None else [float(v) for v in value]}
