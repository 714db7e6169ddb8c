"""Evaluation: token accuracy and perplexity from the eval loop, exact match of greedy generations.

The three metrics are plain NumPy functions (:func:`accuracy`, :func:`perplexity`, :func:`exact_match`): nothing is
fetched from the Hub. A ``Trainer`` takes :func:`compute_metrics` with :func:`preprocess_logits_for_metrics` (as
``hf-lisa train`` passes them); :func:`generation_rows` turns validation rows of any supported format into prompts and
references, and :func:`generation_exact_match` greedy-decodes them and scores the answers::

    from hf_lisa.evaluation import generation_exact_match, generation_rows

    rows = generation_rows(validation_split, "prompt_completion", limit=32)
    score, samples = generation_exact_match(model, tokenizer, rows, chat=True, answer_pattern=r"(-?\d+)")
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from .data.validation import Columns

__all__ = ["accuracy", "compute_metrics", "exact_match", "extract_answer", "generation_exact_match", "generation_rows",
           "perplexity", "preprocess_logits_for_metrics"]


def preprocess_logits_for_metrics(logits: torch.Tensor, labels: torch.Tensor):
    """Reduce ``(batch, seq, vocab)`` logits to next-token predictions and per-token NLL before they are gathered."""
    if isinstance(logits, tuple):
        logits = logits[0]
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    predictions = shift_logits.argmax(-1)
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1).clamp_min(0), reduction="none"
    ).view_as(shift_labels)
    return predictions, nll


def accuracy(predictions: Sequence, references: Sequence) -> float:
    """The fraction of predictions equal to their references; 0.0 when there are none.

    Example:
        ```py
        >>> from hf_lisa.evaluation import accuracy
        >>> accuracy([0, 1, 1, 0], [0, 1, 0, 0])
        0.75
        ```
    """
    predictions, references = np.asarray(predictions), np.asarray(references)
    if predictions.shape != references.shape:
        raise ValueError(f"got {predictions.shape} predictions but {references.shape} references; they must match.")
    return float(np.mean(predictions == references)) if predictions.size else 0.0


def perplexity(token_nll: Sequence[float]) -> float:
    """``exp`` of the mean negative log-likelihood (natural log) of the scored tokens: every token weighs the same.

    Example:
        ```py
        >>> import math
        >>> from hf_lisa.evaluation import perplexity
        >>> round(perplexity([math.log(4), math.log(4)]), 6)
        4.0
        ```
    """
    token_nll = np.asarray(token_nll, dtype=np.float64)
    if not token_nll.size:
        raise ValueError("perplexity needs at least one scored token; got none (every label is -100).")
    return math.exp(min(float(token_nll.mean()), 700.0))  # exp(700) is near the float64 limit


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The fraction of predicted strings equal to their reference, ignoring surrounding whitespace; 0.0 for none.

    Example:
        ```py
        >>> from hf_lisa.evaluation import exact_match
        >>> exact_match(["12", " 7"], ["12", "8"])
        0.5
        ```
    """
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions but {len(references)} references; they must match.")
    if not predictions:
        return 0.0
    return sum(_answer_text(p) == _answer_text(r) for p, r in zip(predictions, references)) / len(predictions)


def _answer_text(text: Optional[str]) -> str:
    return "" if text is None else str(text).strip()


def compute_metrics(eval_pred) -> dict[str, float]:
    """Next-token accuracy on the label tokens and token-weighted perplexity, from the reduced eval-loop outputs."""
    predictions, nll = eval_pred.predictions
    labels = eval_pred.label_ids[:, 1:]
    width = min(labels.shape[1], predictions.shape[1])
    labels, predictions, nll = labels[:, :width], predictions[:, :width], nll[:, :width]
    mask = labels != -100
    return {"token_accuracy": accuracy(predictions[mask], labels[mask]), "perplexity": perplexity(nll[mask])}


# ----------------------------------------------------------------------------------------------------------------------
# Generation-based exact match
# ----------------------------------------------------------------------------------------------------------------------
def generation_rows(raw_validation, data_format: str, limit: int, chat: bool = True,
                    columns: Optional[Columns] = None) -> list[dict]:
    """``[{"messages": [...] or "prompt": str, "reference": str}]`` for up to ``limit`` validation rows.

    ``data_format`` is a format of :data:`hf_lisa.data.DATA_FORMATS` other than ``auto`` (what
    :func:`hf_lisa.data.detect_format` or :func:`hf_lisa.data.tokenize_datasets` found); ``columns`` names columns
    other than the format's own (``hf-lisa train``'s ``--prompt_column`` and the like).

    Rows that training would skip (see :func:`hf_lisa.data.formats.check_row`) are skipped here too, so a
    malformed validation row never reaches generation. Alpaca and ShareGPT rows are prompted as training renders them
    (:func:`hf_lisa.data.formats.canonical_row`; ``chat``: whether a chat template is used): the last assistant turn
    (Alpaca's output) is the reference.
    """
    from .data.formats import CONVERTED_FORMATS, canonical_row, check_row

    given = columns or Columns()
    rows = []
    for row in raw_validation:
        if len(rows) >= limit:
            break
        if check_row(row, data_format, given) is not None:
            continue
        fmt, columns = data_format, given
        if fmt in CONVERTED_FORMATS:
            (row, fmt), columns = canonical_row(row, fmt, chat), Columns()
        if fmt == "prompt_completion":
            rows.append({"prompt": row[columns.prompt], "reference": row[columns.completion]})
        elif fmt == "messages":
            messages = row[columns.messages]
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
            if last is not None:
                rows.append({"messages": messages[:last], "reference": messages[last]["content"]})
    return rows


def extract_answer(text: str, pattern: Optional[str], lenient: bool) -> str:
    """The answer in ``text``: the first group of ``pattern`` (or the whole stripped text when there is none)."""
    if not pattern:
        return text.strip()
    match = re.search(pattern, text)
    if match:
        return (match.group(1) if match.groups() else match.group(0)).strip()
    if lenient:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
        return numbers[-1] if numbers else ""
    return ""


@torch.no_grad()
def generation_exact_match(
    model: nn.Module,
    tokenizer,
    rows: list[dict],
    chat: bool,
    max_new_tokens: int = 32,
    batch_size: int = 16,
    answer_pattern: Optional[str] = None,
    lenient: bool = True,
    progress: bool = False,
) -> tuple[float, list[dict]]:
    """Greedy-decode every prompt and score the extracted answers with :func:`exact_match`; ``progress`` shows a
    progress bar over the batches (generation is the slow part of an evaluation on CPU).

    Returns:
        ``(exact match in [0, 1], [{"prompt", "generation", "prediction", "reference"}, ...])``.
    """
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right end
    device = next(model.parameters()).device
    samples = []
    from tqdm.auto import tqdm

    starts = range(0, len(rows), batch_size)
    try:
        for start in tqdm(starts, desc="Generating answers", unit="batch", disable=not progress, leave=False):
            batch = rows[start : start + batch_size]
            if chat:
                texts = [
                    tokenizer.apply_chat_template(
                        r.get("messages") or [{"role": "user", "content": r["prompt"]}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                    for r in batch
                ]
                encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            else:
                encoded = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True)
            encoded = {k: v.to(device) for k, v in encoded.items()}
            output = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            for row, tokens in zip(batch, new_tokens):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                samples.append(
                    {
                        "prompt": row.get("prompt") or row["messages"][-1]["content"],
                        "generation": text,
                        "prediction": extract_answer(text, answer_pattern, lenient),
                        "reference": extract_answer(row["reference"], answer_pattern, lenient=False),
                    }
                )
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    score = exact_match([s["prediction"] for s in samples], [s["reference"] for s in samples])
    return score, samples

