"""ROUGE F-measures (rouge-score), the mean over examples of each example's score against its reference."""

import datasets
import evaluate
from rouge_score import rouge_scorer

TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures, averaged over examples.",
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004.",
            inputs_description="predictions, references: strings (one reference each); use_stemmer: Porter stemming",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, use_stemmer=False):
        scorer = rouge_scorer.RougeScorer(list(TYPES), use_stemmer=use_stemmer)
        totals = dict.fromkeys(TYPES, 0.0)
        for prediction, reference in zip(predictions, references):
            scores = scorer.score(reference, prediction)
            for name in TYPES:
                totals[name] += scores[name].fmeasure
        return {name: total / max(len(predictions), 1) for name, total in totals.items()}
