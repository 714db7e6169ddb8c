"""bitsandbytes' 8-bit AdamW a slice at a time on CPU (``SlicedAdamW8bit``) and stepped in the backward pass
(``--optim adamw_bnb_8bit --optim_step_in_backward``): bit for bit bitsandbytes' own update, the Trainer's 32-bit rule
for embeddings kept unless ``--optim_8bit_embeddings``, and the option refused without an 8-bit optimizer."""

from __future__ import annotations

import os

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from hf_lisa.errors import UsageError  # noqa: E402
from hf_lisa.optim.in_backward import steps_in_backward  # noqa: E402
from hf_lisa.optim.adamw_8bit import AdamW8bitInBackward, SlicedAdamW8bit  # noqa: E402
from hf_lisa.train import parse_args  # noqa: E402
from hf_lisa.trainer import LisaTrainer  # noqa: E402
from hf_lisa.trainer_callbacks import LisaCallback  # noqa: E402

VOCAB = 256  # a 256 x 32 embedding: 8192 values, over bitsandbytes' min_8bit_size (4096), so its state can be 8-bit


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(1000, 70)  # 70000 values: 273.4 quantization blocks, the last one partial
        self.head = torch.nn.Linear(70, 30)  # 2100 + 30 values: under min_8bit_size, 32-bit state

    def loss(self, step: int) -> torch.Tensor:
        ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(step))
        return (self.head(self.embed(ids)) ** 2).mean()


def _run(optimizer_cls, steps=5, **kwargs):
    model = _Model()
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    for step in range(steps):
        model.loss(step).backward()
        if isinstance(optimizer, AdamW8bitInBackward):  # the update happened in backward: no gradient is left
            assert all(p.grad is None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("optimizer_cls", [SlicedAdamW8bit, AdamW8bitInBackward])
def test_bit_for_bit_bitsandbytes_8bit_adamw(optimizer_cls):
    """Slices of 768 values (rounded down from 1000 to whole quantization blocks), so the embedding's update runs in
    92 slices: parameters and both quantized states with their block maxima equal bitsandbytes' whole-tensor
    update exactly."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()  # what earlier optimizers of this process left behind would change the reference's config
    reference, ref_opt = _run(bnb.optim.AdamW, optim_bits=8)
    # entries an optimizer of another model leaves in bitsandbytes' global manager, keyed by position and id()
    manager.index2config[(0, 0)] = {"optim_bits": 32}
    manager.pid2config.update({id(p): {"optim_bits": 32} for p in _Model().parameters()})
    model, opt = _run(optimizer_cls, slice_elements=1000)
    assert opt.slice_elements == 768
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
        expected, got = ref_opt.state[a], opt.state[b]
        assert got["step"] == expected["step"] == 5
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if key in expected:
                assert torch.equal(got[key], expected[key]), (name, key)
    assert opt.state[model.embed.weight]["state1"].dtype == torch.uint8
    assert opt.state[model.head.weight]["state1"].dtype == torch.float32
    moved = _Model()
    assert not torch.equal(moved.embed.weight, model.embed.weight)


def _train(tiny_llama, token_dataset, training_args, fused, eight_bit_embeddings=False, steps=4, model=None,
           resume=None, **extra):
    model = tiny_llama(seed=0, tie=True, vocab=VOCAB) if model is None else model
    args = training_args(max_steps=steps, max_grad_norm=0.0, weight_decay=0.1, optim="adamw_bnb_8bit",
                         learning_rate=1e-2, **extra)
    trainer = LisaTrainer(
        model=model, args=args, train_dataset=token_dataset(vocab=VOCAB),
        callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=3)],
        optim_step_in_backward=fused, optim_8bit_embeddings=eight_bit_embeddings,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def test_lisa_trainer_steps_8bit_adamw_in_backward_as_without(tiny_llama, token_dataset, training_args):
    """LISA switching blocks every 2 steps (their state dropped): the same weights and losses with the 8-bit update
    in the backward pass as after it; the tied embedding's state stays 32-bit, as transformers' Trainer keeps it."""
    plain, plain_model = _train(tiny_llama, token_dataset, training_args, fused=False)
    fused, fused_model = _train(tiny_llama, token_dataset, training_args, fused=True)
    assert type(plain.optimizer.optimizer) is SlicedAdamW8bit and steps_in_backward(plain.optimizer) is None
    assert isinstance(steps_in_backward(fused.optimizer), AdamW8bitInBackward)
    for (name, a), (_, b) in zip(plain_model.named_parameters(), fused_model.named_parameters()):
        assert torch.equal(a, b), name
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, fused)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    for trainer, model in ((plain, plain_model), (fused, fused_model)):
        state = trainer.optimizer.optimizer.state[model.get_input_embeddings().weight]
        assert state["state1"].dtype == torch.float32


@pytest.mark.parametrize("resume_fused", [True, False], ids=["resume-in-backward", "resume-after-backward"])
def test_a_checkpoint_of_the_8bit_step_in_backward_resumes_like_the_uninterrupted_run(
        tiny_llama, token_dataset, training_args, resume_fused):
    """``checkpoint-1`` (mid LISA interval) holds bitsandbytes' own 8-bit state, E/H included: resuming with either
    form follows the uninterrupted run exactly."""
    _, uninterrupted = _train(tiny_llama, token_dataset, training_args, fused=True, eight_bit_embeddings=True,
                              save_strategy="steps", save_steps=1)
    checkpoint = os.path.join(training_args().output_dir, "checkpoint-1")
    resumed = tiny_llama(seed=1, tie=True, vocab=VOCAB)  # different init: everything comes from the checkpoint
    trainer, _ = _train(tiny_llama, token_dataset, training_args, fused=resume_fused, eight_bit_embeddings=True,
                        model=resumed, resume=checkpoint, save_strategy="steps", save_steps=1)
    assert trainer.optimizer.optimizer.state[resumed.get_input_embeddings().weight]["state1"].dtype == torch.uint8
    for (name, a), (_, b) in zip(uninterrupted.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_optim_8bit_embeddings_keeps_the_tied_embedding_state_in_8_bits(tiny_llama, token_dataset, training_args):
    trainer, model = _train(tiny_llama, token_dataset, training_args, fused=True, eight_bit_embeddings=True,
                            steps=2)
    state = trainer.optimizer.optimizer.state[model.get_input_embeddings().weight]
    assert state["state1"].dtype == torch.uint8 and state["absmax1"].numel() == VOCAB * 32 // 256
    thirty_two, _ = _train(tiny_llama, token_dataset, training_args, fused=True, steps=2)
    bytes_of = lambda t: sum(v.numel() * v.element_size() for s in t.optimizer.optimizer.state.values()  # noqa: E731
                             for v in s.values() if torch.is_tensor(v))
    assert bytes_of(trainer) < bytes_of(thirty_two)


def test_8bit_embeddings_need_an_8bit_optimizer(tmp_path, tiny_llama, token_dataset, training_args):
    refusal = r"--optim_8bit_embeddings=True keeps .* --optim='adamw_torch(_fused)?' is not one\. Allowed with it: "
    with pytest.raises(UsageError, match=refusal + "--optim adamw_bnb_8bit"):
        parse_args(["--output_dir", str(tmp_path), "--method", "lisa", "--optim_8bit_embeddings", "true"])
    *_, parsed = parse_args(["--output_dir", str(tmp_path), "--method", "lisa", "--optim", "adamw_bnb_8bit",
                             "--optim_8bit_embeddings", "true", "--optim_step_in_backward", "true",
                             "--max_grad_norm", "0"])
    assert parsed.optim_8bit_embeddings and parsed.optim_step_in_backward
    trainer = LisaTrainer(model=tiny_llama(seed=0), args=training_args(max_steps=1), train_dataset=token_dataset(),
                          optim_8bit_embeddings=True)
    with pytest.raises(ValueError, match=r"optim_8bit_embeddings=True needs a bitsandbytes 8-bit optimizer; this "
                                         r"Trainer's is AdamW"):
        trainer.create_optimizer()


def test_paged_8bit_adamw_is_refused_in_backward(tmp_path):
    with pytest.raises(UsageError, match=r"--optim='paged_adamw_8bit' cannot be used with it; allowed: adamw_torch, "
                                         r"adamw_torch_fused, adamw_bnb_8bit"):
        parse_args(["--output_dir", str(tmp_path), "--method", "lisa", "--optim", "paged_adamw_8bit",
                    "--optim_step_in_backward", "true", "--max_grad_norm", "0"])
