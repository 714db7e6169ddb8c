"""Perplexity from token-level negative log-likelihoods (shipped with hf-lisa; no Hub fetch, no model download).

The Hub's `perplexity` metric loads a model by id and scores raw texts. During training the model has already
computed the loss, so this module takes what the evaluation loop has: the summed negative log-likelihood of each
sequence and its number of scored tokens. Perplexity is exp(total NLL / total tokens), i.e. weighted by tokens.
"""

import math

import datasets
import evaluate

_DESCRIPTION = """
Perplexity = exp(sum of token negative log-likelihoods / number of scored tokens), computed from per-sequence sums so
that sequences of different lengths are weighted by their number of tokens.
"""

_KWARGS_DESCRIPTION = """
Args:
    nll_sum (`list` of `float`): summed negative log-likelihood (natural log) of the scored tokens of each sequence.
    num_tokens (`list` of `int`): number of scored tokens of each sequence.
Returns:
    perplexity (`float`), mean_nll (`float`).
Examples:
    >>> import math, hf_lisa.metrics
    >>> metric = hf_lisa.metrics.load("perplexity")
    >>> round(metric.compute(nll_sum=[2 * math.log(4)], num_tokens=[2])["perplexity"], 6)
    4.0
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "num_tokens": datasets.Value("int64")}),
        )

    def _compute(self, nll_sum, num_tokens):
        total_tokens = sum(num_tokens)
        if total_tokens <= 0:
            raise ValueError("perplexity needs at least one scored token (num_tokens sums to 0)")
        mean_nll = sum(nll_sum) / total_tokens
        return {"perplexity": math.exp(min(mean_nll, 700.0)), "mean_nll": mean_nll}
