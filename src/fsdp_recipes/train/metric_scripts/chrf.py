"""Corpus chrF as sacrebleu computes it (0-100), one reference per prediction."""

import datasets
import evaluate
import sacrebleu


class Chrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus-level character n-gram F-score (chrF, sacrebleu defaults), 0-100.",
            citation="Popovic, chrF: character n-gram F-score for automatic MT evaluation, 2015.",
            inputs_description="predictions, references: strings (one reference each); word_order: 2 gives chrF++",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, word_order=0):
        return {"chrf": sacrebleu.corpus_chrf(list(predictions), [list(references)], word_order=word_order).score}
