"""``--chunked_loss``: the causal-LM loss computed chunk by chunk equals transformers' ``ForCausalLMLoss`` (value and
gradient), through the model's ``loss_function`` and through a training run."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_lisa.optim.chunked_loss import chunked_causal_lm_loss, chunked_cross_entropy, install_chunked_loss


def _logits_and_labels(batch=3, seq=11, vocab=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, seq, vocab, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :4] = -100  # a masked prompt
    labels[2, -3:] = -100  # padding
    return logits, labels


@pytest.mark.parametrize("num_items", [None, 21, "tensor"])
@pytest.mark.parametrize("chunk_values", [50, 7 * 50, 1 << 22])  # one row, 7 rows (uneven last chunk), everything
def test_equals_transformers_loss_and_gradient(num_items, chunk_values):
    logits, labels = _logits_and_labels()
    if num_items == "tensor":
        num_items = torch.tensor(21)
    expected = ForCausalLMLoss(logits, labels, 50, num_items_in_batch=num_items)
    (expected_grad,) = torch.autograd.grad(expected * 1.7, logits)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    loss = chunked_cross_entropy(logits.reshape(-1, 50), shifted, num_items, chunk_values=chunk_values)
    (grad,) = torch.autograd.grad(loss * 1.7, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert not torch.equal(grad, torch.zeros_like(grad))


def test_shift_labels_and_bf16_logits():
    logits, labels = _logits_and_labels(dtype=torch.bfloat16)
    shift = labels.roll(-1, dims=1)
    expected = ForCausalLMLoss(logits, None, 50, shift_labels=shift)
    loss = chunked_causal_lm_loss(logits, None, 50, shift_labels=shift)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16  # fp32 loss, the logits' dtype back
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), expected_grad.float(), rtol=1e-2, atol=1e-6)


def test_nothing_counts_gives_nan_as_transformers():
    logits, labels = _logits_and_labels()
    labels.fill_(-100)
    assert math.isnan(ForCausalLMLoss(logits, labels, 50).item())
    assert math.isnan(chunked_causal_lm_loss(logits, labels, 50).item())
    assert chunked_causal_lm_loss(logits, labels, 50, num_items_in_batch=4).item() == 0.0


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"shape \(tokens, vocabulary\).*got \(2, 3, 4\)"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_installed_on_the_model_and_under_peft(tiny_llama):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(num_layers=2)
    batch = {"input_ids": torch.randint(0, 64, (2, 9)), "labels": torch.randint(0, 64, (2, 9))}
    expected = model(**batch).loss
    assert install_chunked_loss(model) and model.loss_function is chunked_causal_lm_loss
    torch.testing.assert_close(model(**batch).loss, expected, rtol=1e-6, atol=1e-6)
    peft_model = get_peft_model(tiny_llama(num_layers=2), LoraConfig(r=4, target_modules=["q_proj"]))
    assert install_chunked_loss(peft_model)
    assert peft_model.base_model.model.loss_function is chunked_causal_lm_loss


def test_a_model_with_its_own_loss_keeps_it(tiny_llama):
    model = tiny_llama(num_layers=1)

    def custom(logits, labels, vocab_size, **kwargs):
        return logits.sum()

    model.loss_function = custom
    assert not install_chunked_loss(model)
    assert model.loss_function is custom
    assert not install_chunked_loss(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_training_follows_the_unchunked_run(tiny_llama, token_dataset, training_args, accumulation):
    from hf_lisa.trainer import LisaTrainer

    weights, losses = {}, {}
    for chunked in (False, True):  # SGD: a gradient of the wrong scale would move the weights differently
        model = tiny_llama(num_layers=2, tie=True)
        args = training_args(max_steps=4, gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5)
        trainer = LisaTrainer(model=model, args=args, train_dataset=token_dataset(num_examples=32),
                              chunked_loss=chunked)
        assert trainer.chunked_loss is chunked
        assert (model.loss_function is chunked_causal_lm_loss) is chunked
        trainer.train()
        weights[chunked] = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses[chunked] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
    start = tiny_llama(num_layers=2, tie=True).state_dict()
    for name, value in weights[True].items():
        torch.testing.assert_close(value, weights[False][name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(weights[True][n], start[n]) for n in weights[True])  # it trained


def test_rows_that_do_not_count_cannot_poison_the_loss():
    logits, labels = _logits_and_labels()
    with torch.no_grad():
        logits[2, -3:] = float("nan")  # e.g. padded positions; their labels are -100
    loss = chunked_causal_lm_loss(logits, labels, 50)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad[:2]).all()
    assert torch.equal(grad[2, -3:], torch.zeros_like(grad[2, -3:]))
