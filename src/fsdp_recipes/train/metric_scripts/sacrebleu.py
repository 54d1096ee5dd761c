"""Corpus BLEU as sacrebleu computes it (0-100), one reference per prediction."""

import datasets
import evaluate
import sacrebleu as scorer


class SacreBleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus-level BLEU (sacrebleu defaults: 13a tokenisation, exponential smoothing), 0-100.",
            citation="Post, A Call for Clarity in Reporting BLEU Scores, 2018.",
            inputs_description="predictions, references: strings (one reference each); tokenize: sacrebleu tokeniser",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, tokenize="13a"):
        return {"sacrebleu": scorer.corpus_bleu(list(predictions), [list(references)], tokenize=tokenize).score}
