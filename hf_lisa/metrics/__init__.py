"""Evaluation metrics shipped inside hf-lisa and loaded by path, so evaluation never fetches a script from the Hub.

Example:
    ```py
    >>> import hf_lisa.metrics
    >>> hf_lisa.metrics.load("exact_match").compute(predictions=["4"], references=["4"])
    {'exact_match': 1.0}
    ```
"""

from __future__ import annotations

import os
from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
AVAILABLE_METRICS = ("accuracy", "exact_match", "perplexity")


def metric_path(name: str) -> str:
    """Path of the shipped metric script ``name`` (for ``evaluate.load``)."""
    if name not in AVAILABLE_METRICS:
        raise ValueError(f"metric={name!r} is not shipped with hf-lisa; available: {AVAILABLE_METRICS}.")
    return str(METRICS_DIR / name / f"{name}.py")


def load(name: str, **kwargs):
    """``evaluate.load`` of a shipped metric, offline (``HF_EVALUATE_OFFLINE=1``)."""
    # evaluate reads the variable at import time, so set it before the first import
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)
