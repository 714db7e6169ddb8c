"""Exact match: the fraction of predicted strings equal to their references (shipped with hf-lisa; no Hub fetch)."""

import re
import string

import datasets
import evaluate

_DESCRIPTION = """
Exact match is the fraction of predictions that equal their reference string, after optional normalisation
(case, punctuation, numbers, characters matched by regexes). hf-lisa's demo scores the answer after `####`.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): predicted texts.
    references (`list` of `str`): reference texts.
    regexes_to_ignore (`list` of `str`, *optional*): regexes removed from both sides before comparing.
    ignore_case (`bool`, defaults to `False`): lowercase both sides.
    ignore_punctuation (`bool`, defaults to `False`): remove punctuation.
    ignore_numbers (`bool`, defaults to `False`): remove digits.
Returns:
    exact_match (`float`): in [0, 1].
Examples:
    >>> import hf_lisa.metrics
    >>> metric = hf_lisa.metrics.load("exact_match")
    >>> metric.compute(predictions=["12", "7"], references=["12", "8"])
    {'exact_match': 0.5}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions,
        references,
        regexes_to_ignore=None,
        ignore_case=False,
        ignore_punctuation=False,
        ignore_numbers=False,
    ):
        if len(predictions) != len(references):
            raise ValueError(f"got {len(predictions)} predictions but {len(references)} references")

        def normalise(text):
            text = "" if text is None else str(text).strip()
            for pattern in regexes_to_ignore or []:
                text = re.sub(pattern, "", text)
            if ignore_case:
                text = text.lower()
            if ignore_punctuation:
                text = text.translate(str.maketrans("", "", string.punctuation))
            if ignore_numbers:
                text = text.translate(str.maketrans("", "", string.digits))
            return text

        if not predictions:
            return {"exact_match": 0.0}
        hits = sum(normalise(p) == normalise(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}
