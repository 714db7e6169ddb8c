"""The evaluation metrics are plain NumPy functions; on hand-computed examples they give what the ``evaluate`` scripts
they replaced (``hf_lisa/metrics/{accuracy,perplexity,exact_match}``, hf-lisa 0.1) gave."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from hf_lisa.evaluation import accuracy, compute_metrics, exact_match, perplexity


def test_compute_metrics_on_a_hand_computed_example():
    # compute_metrics shifts the labels by one (token t predicts t+1); predictions and NLL come already shifted
    label_ids = np.array([[-100, 5, -100, -100], [-100, 7, 8, 9]])  # scored: row 0 one token, row 1 three
    predictions = np.array([[5, 1, 1], [7, 0, 9]])  # hits: 5=5 | 7=7, 0≠8, 9=9 -> 3 of 4
    nll = np.array([[2.0, 9.9, 9.9], [1.0, 0.5, 0.5]], dtype=np.float32)  # 9.9 sits on unscored positions
    metrics = compute_metrics(SimpleNamespace(predictions=(predictions, nll), label_ids=label_ids))
    assert metrics.keys() == {"token_accuracy", "perplexity"}
    assert metrics["token_accuracy"] == 0.75
    # token-weighted, as the old script's sum(nll_sum) / sum(num_tokens) = (2.0 + 2.0) / (1 + 3) = 1.0;
    # a mean of per-row means would give (2.0 + 2/3) / 2 instead
    assert metrics["perplexity"] == pytest.approx(math.e, rel=1e-12)


def test_accuracy():
    assert accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == 0.75  # the old script's docstring example
    assert accuracy(np.array([3, 4]), np.array([3, 4])) == 1.0
    assert accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="predictions but"):
        accuracy([1, 2], [1])


def test_perplexity():
    assert perplexity([math.log(4), math.log(4)]) == pytest.approx(4.0, rel=1e-12)  # the old docstring example
    assert perplexity([0.0, 2.0]) == pytest.approx(math.e, rel=1e-12)
    assert perplexity([1000.0]) == math.exp(700.0)  # capped below float64 overflow, as before
    with pytest.raises(ValueError, match="at least one scored token"):
        perplexity([])


def test_exact_match():
    assert exact_match(["12", "7"], ["12", "8"]) == 0.5  # the old script's docstring example
    assert exact_match([" 4\n", "-3"], ["4", "-3 "]) == 1.0  # surrounding whitespace is ignored
    assert exact_match(["Four"], ["four"]) == 0.0  # case is not
    assert exact_match([], []) == 0.0
    with pytest.raises(ValueError, match="predictions but"):
        exact_match(["1"], [])


def test_generation_rows_skip_what_training_would_skip():
    from hf_lisa.evaluation import generation_rows

    chat = [
        {"messages": "hi"},  # not a list of turns
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ""}]},  # empty answer
        {"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "4"}]},  # non-string
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    rows = generation_rows(chat, "messages", limit=10)
    assert rows == [{"messages": [{"role": "user", "content": "2+2?"}], "reference": "4"}]
    pc = [{"prompt": "1+1=", "completion": 42}, {"prompt": "", "completion": "2"}, {"prompt": "1+1=", "completion": "2"}]
    assert generation_rows(pc, "prompt_completion", limit=10) == [{"prompt": "1+1=", "reference": "2"}]


def test_generation_rows_read_the_columns_the_rows_use():
    """``columns`` names a dataset's own columns (``hf-lisa train --prompt_column question ...``): without it those rows
    have no prompt, with it they are prompted and scored."""
    from hf_lisa.data import Columns
    from hf_lisa.evaluation import generation_rows
    from hf_lisa.train import DataArguments

    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    renamed = Columns(prompt="question", completion="answer")
    assert generation_rows(rows, "prompt_completion", limit=10, columns=renamed) == [
        {"prompt": "1+1=", "reference": "2"}, {"prompt": "2+2=", "reference": "4"}]
    assert generation_rows(rows, "prompt_completion", limit=1, columns=renamed) == [{"prompt": "1+1=", "reference": "2"}]
    assert generation_rows(rows, "prompt_completion", limit=10) == []  # the default columns are not there
    # the command's options give the same columns
    args = DataArguments(prompt_column="question", completion_column="answer")
    assert generation_rows(rows, "prompt_completion", limit=10, columns=args.columns()) == generation_rows(
        rows, "prompt_completion", limit=10, columns=renamed)
