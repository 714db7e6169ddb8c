"""Evaluation: token accuracy and perplexity from the eval loop, exact match of greedy generations."""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch
from torch import nn

from .arguments import DataArguments

logger = logging.getLogger("hf_lisa.train")


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


def compute_metrics(eval_pred) -> dict[str, float]:
    """Next-token accuracy on the label tokens and token-weighted perplexity, through the shipped metric modules."""
    import numpy as np

    from .. import metrics as shipped

    predictions, nll = eval_pred.predictions
    labels = eval_pred.label_ids[:, 1:]
    width = min(labels.shape[1], predictions.shape[1])
    labels, predictions, nll = labels[:, :width], predictions[:, :width], nll[:, :width]
    mask = labels != -100
    accuracy = shipped.load("accuracy").compute(
        predictions=predictions[mask].astype(np.int64).tolist(), references=labels[mask].astype(np.int64).tolist()
    )["accuracy"]
    per_row_nll = np.where(mask, nll, 0.0).sum(axis=1)
    per_row_tokens = mask.sum(axis=1)
    keep = per_row_tokens > 0
    ppl = shipped.load("perplexity").compute(
        nll_sum=per_row_nll[keep].astype(float).tolist(), num_tokens=per_row_tokens[keep].astype(int).tolist()
    )
    return {"token_accuracy": float(accuracy), "perplexity": float(ppl["perplexity"])}


# ----------------------------------------------------------------------------------------------------------------------
# Generation-based exact match
# ----------------------------------------------------------------------------------------------------------------------
def generation_rows(raw_validation, data_format: str, data_args: DataArguments, limit: int) -> list[dict]:
    """``[{"messages": [...] or "prompt": str, "reference": str}]`` for up to ``limit`` validation rows."""
    rows = []
    for row in raw_validation:
        if len(rows) >= limit:
            break
        if data_format == "prompt_completion":
            prompt, completion = row.get(data_args.prompt_column), row.get(data_args.completion_column)
            if isinstance(prompt, str) and isinstance(completion, str) and prompt.strip():
                rows.append({"prompt": prompt, "reference": completion})
        elif data_format == "messages":
            messages = row.get(data_args.messages_column) or []
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
) -> tuple[float, list[dict]]:
    """Greedy-decode every prompt and score the extracted answers with the shipped ``exact_match`` metric.

    Returns:
        ``(exact match in [0, 1], [{"prompt", "generation", "prediction", "reference"}, ...])``.
    """
    from .. import metrics as shipped

    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right end
    device = next(model.parameters()).device
    samples = []
    try:
        for start in range(0, len(rows), batch_size):
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
    score = shipped.load("exact_match").compute(
        predictions=[s["prediction"] for s in samples], references=[s["reference"] for s in samples]
    )["exact_match"]
    return float(score), samples


def _metrics_line(metrics: dict, suffix: str) -> str:
    names = [("eval_exact_match", "exact match"), ("eval_loss", "eval loss"), ("eval_perplexity", "perplexity"),
             ("eval_token_accuracy", "token accuracy")]
    parts = [f"{label} {metrics[key + suffix]:.4f}" for key, label in names if key + suffix in metrics]
    return ", ".join(parts)
