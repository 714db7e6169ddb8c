"""Accuracy: the fraction of predictions equal to their references (shipped with hf-lisa; no Hub fetch)."""

import datasets
import evaluate

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions: (TP + TN) / (TP + TN + FP + FN).
hf-lisa uses it for sequence classification and for next-token accuracy on the label tokens of causal LMs.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`, defaults to `True`): return the fraction instead of the count of correct predictions.
    sample_weight (`list` of `float`, *optional*): per-sample weights.
Returns:
    accuracy (`float`): in [0, 1] when normalize is True.
Examples:
    >>> import evaluate, hf_lisa.metrics
    >>> metric = hf_lisa.metrics.load("accuracy")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        if len(predictions) != len(references):
            raise ValueError(f"got {len(predictions)} predictions but {len(references)} references")
        if sample_weight is None:
            sample_weight = [1.0] * len(predictions)
        correct = sum(w for p, r, w in zip(predictions, references, sample_weight) if p == r)
        total = sum(sample_weight)
        if not normalize:
            return {"accuracy": float(correct)}
        return {"accuracy": float(correct / total) if total else 0.0}
