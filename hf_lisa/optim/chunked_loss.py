"""The causal-LM loss without the vocabulary-sized temporaries: ``--chunked_loss``.

transformers' ``ForCausalLMLoss`` is ``cross_entropy(logits.float(), labels)``: a log-softmax over the whole
vocabulary, kept for the backward pass, then in the backward pass its gradient and the logits' gradient, each a
tokens × vocabulary fp32 tensor (on SmolLM2-135M with 4 rows of 128 tokens, 66 MiB each, beside a 49152-word
vocabulary's 108 MiB embedding gradient). :func:`chunked_causal_lm_loss` computes the same function a few hundred rows
at a time: the forward pass keeps only each row's log-sum-exp (4 bytes a token), and the backward pass writes
``softmax − one-hot`` chunk by chunk into the logits' gradient, so the only vocabulary-sized tensors are the logits
the model already made and their gradient.

It is the model's own loss, with the same signature and reductions (a sum over ``num_items_in_batch`` when the Trainer
passes it, else a mean over the tokens that count; ``ignore_index``; ``shift_labels``), so the Trainer's gradient
accumulation and token averaging are untouched. It agrees with ``ForCausalLMLoss`` to float rounding (a log-sum-exp
instead of a log-softmax): ``tests/test_chunked_loss.py`` checks losses and gradients.
:func:`install_chunked_loss` puts it on a model whose loss is transformers' causal-LM loss and leaves any other loss
alone.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..blocks import unwrap_model

logger = logging.getLogger("hf_lisa.train")

#: values per chunk of the loss's fp32 temporaries (16 MiB): ``max(1, CHUNK_VALUES // vocabulary)`` rows at a time
CHUNK_VALUES = 2**22


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """``Σ_t [t counts] (logsumexp(z_t) − z_t[y_t])`` over rows ``z_t`` of ``logits``, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        counts = targets != ignore_index
        safe = torch.where(counts, targets, torch.zeros_like(targets)).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            chunk = logits[start:start + rows].float()
            lse[start:start + rows] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, safe[start:start + rows]).squeeze(1)
            # where(), not a product: a row that does not count adds 0 even if its logits are not finite
            total += torch.where(counts[start:start + rows], lse[start:start + rows] - picked, 0.0).sum()
        ctx.save_for_backward(logits, safe, counts, lse)
        ctx.rows = rows
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        logits, safe, counts, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        weight = counts.to(torch.float32) * grad_total.to(torch.float32)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            probs = (logits[start:end].float() - lse[start:end, None]).exp_()  # softmax
            probs.scatter_add_(1, safe[start:end], -torch.ones_like(probs[:, :1]))  # − one-hot
            grad[start:end] = probs.mul_(weight[start:end, None]).masked_fill_(~counts[start:end, None], 0.0)
        return grad, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None,
                          ignore_index: int = -100, chunk_values: int = CHUNK_VALUES) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=...)`` over ``(tokens, vocabulary)`` logits, with
    transformers' reductions: the sum over ``num_items_in_batch`` if given, else the mean over the counted tokens
    (NaN when none counts, as ``F.cross_entropy``)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits of shape (tokens, vocabulary) and targets of shape (tokens,) are required; got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}.")
    rows = max(1, chunk_values // max(1, logits.shape[1]))
    total = _ChunkedCrossEntropySum.apply(logits, targets, ignore_index, rows)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def chunked_causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                           num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same value), computed by :func:`chunked_cross_entropy`."""
    if type(logits) is not torch.Tensor:  # a DTensor (tensor parallelism) or another subclass: transformers' own loss
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n
        shift_labels = labels[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    return chunked_cross_entropy(logits.reshape(-1, vocab_size), targets, num_items_in_batch, ignore_index)


def install_chunked_loss(model: nn.Module) -> bool:
    """Give ``model`` :func:`chunked_causal_lm_loss` as its ``loss_function`` when its loss is transformers' own
    causal-LM loss (``ForCausalLMLoss``); returns whether it did. A model with another loss (a custom
    ``loss_function``, another ``loss_type``) keeps it, with a log line."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING

    target = unwrap_model(model)  # PeftModel, PEFT tuners, DDP: down to the transformers model
    if not isinstance(target, PreTrainedModel):
        logger.info("--chunked_loss: %s is not a transformers model; its loss is unchanged.", type(model).__name__)
        return False
    current = target.loss_function
    if current is chunked_causal_lm_loss:
        return True
    if current is not LOSS_MAPPING["ForCausalLM"]:
        logger.info("--chunked_loss: %s computes its own loss (%s); it is unchanged.", type(target).__name__,
                    getattr(current, "__name__", current))
        return False
    target.loss_function = chunked_causal_lm_loss
    return True
