"""AdamW stepped in the backward pass (``--optim_step_in_backward``): the same run as plain AdamW, gradients freed in
the backward pass, checkpoints that resume (either way), and every combination it cannot run with refused."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from hf_lisa import cli
from hf_lisa.errors import UsageError
from hf_lisa.optim.state import optimizer_state_bytes
from hf_lisa.optim.in_backward import AdamWInBackward, steps_in_backward
from hf_lisa.train import parse_args
from hf_lisa.trainer import LisaTrainer
from hf_lisa.optim.memory import check_step_in_backward
from hf_lisa.trainer_callbacks import LisaCallback
from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback


def _train(tiny_llama, token_dataset, training_args, fused, steps=4, resume=None, model=None, callbacks=(), **args):
    model = tiny_llama(seed=0, tie=True) if model is None else model  # tied E/H: one gradient from two places
    args = training_args(max_steps=steps, max_grad_norm=0.0, weight_decay=0.1, **args)
    trainer = LisaTrainer(
        model=model, args=args, train_dataset=token_dataset(),
        callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=3), *callbacks],
        optim_step_in_backward=fused,
    )
    monitor = TrainingMonitorCallback().attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, monitor


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "loss" in h]


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_same_run_as_plain_adamw_under_lisa(tiny_llama, token_dataset, training_args, schedule):
    """Bit for bit on CPU: the same parameters, optimizer state, learning rates, losses, and (to rounding) the logged
    gradient norms and update ratios, with LISA switching blocks every 2 steps and dropping their state."""
    plain, plain_model, _ = _train(tiny_llama, token_dataset, training_args, fused=False,
                                               lr_scheduler_type=schedule, warmup_steps=2)
    fused, fused_model, fused_monitor = _train(tiny_llama, token_dataset, training_args, fused=True,
                                               lr_scheduler_type=schedule, warmup_steps=2)
    assert isinstance(steps_in_backward(fused.optimizer), AdamWInBackward)
    assert steps_in_backward(plain.optimizer) is None
    for (name, a), (_, b) in zip(plain_model.named_parameters(), fused_model.named_parameters()):
        assert torch.equal(a, b), name
    assert optimizer_state_bytes(fused.optimizer) == optimizer_state_bytes(plain.optimizer) > 0
    assert _logged(fused, "loss") == _logged(plain, "loss")
    assert _logged(fused, "learning_rate") == _logged(plain, "learning_rate")
    assert (len(set(_logged(fused, "learning_rate"))) == 1) == (schedule == "constant")
    for key in ("grad_norm", "monitor/grad_norm", "monitor/update_ratio/blocks_00-00"):
        expected, got = _logged(plain, key), _logged(fused, key)
        assert len(got) == len(expected) == 4, key
        assert got == pytest.approx(expected, rel=1e-5), key
        assert all(v > 0 for v in got) or key.startswith("monitor/update_ratio"), key
    assert fused_monitor.plateau_count == 0


class _GradientsAtStep(TrainerCallback):
    """Before the optimizer step: which trainable parameters still hold a gradient, and which have already moved."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.seen: list[tuple[int, int, int]] = []  # (trainable, holding a gradient, moved)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        holding = sum(p.grad is not None for _, p in trainable)
        moved = sum(not torch.equal(p, self.before[n]) for n, p in trainable)
        self.seen.append((len(trainable), holding, moved))


def test_gradients_are_applied_and_freed_inside_backward(tiny_llama, token_dataset, training_args):
    probe = _GradientsAtStep()
    _, model, _ = _train(tiny_llama, token_dataset, training_args, fused=True, steps=3, callbacks=[probe])
    # after backward, before optimizer.step(): every trainable parameter has moved and none holds a gradient
    assert probe.seen and all(holding == 0 and moved == trainable > 0 for trainable, holding, moved in probe.seen)
    # with plain AdamW the same probe sees every gradient and nothing moved yet
    plain_probe = _GradientsAtStep()
    _train(tiny_llama, token_dataset, training_args, fused=False, steps=3, callbacks=[plain_probe])
    assert all(holding == trainable and moved == 0 for trainable, holding, moved in plain_probe.seen)
    # outside train() the hooks are disarmed: a backward pass accumulates gradients and moves nothing
    before = [p.detach().clone() for p in model.parameters()]
    batch = token_dataset()[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    assert any(p.grad is not None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("resume_fused", [True, False], ids=["resume-in-backward", "resume-plain-adamw"])
def test_checkpoint_resumes_like_the_uninterrupted_run(tiny_llama, token_dataset, training_args, resume_fused):
    """``checkpoint-1`` (mid LISA interval, a switch still ahead) holds ordinary AdamW state: resuming with either
    optimizer follows the uninterrupted run exactly."""
    _, uninterrupted, _ = _train(tiny_llama, token_dataset, training_args, fused=True,
                                 save_strategy="steps", save_steps=1)
    checkpoint = os.path.join(training_args().output_dir, "checkpoint-1")
    assert os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))
    resumed_model = tiny_llama(seed=1, tie=True)  # different init: everything comes from the checkpoint
    _train(tiny_llama, token_dataset, training_args, fused=resume_fused, model=resumed_model, resume=checkpoint,
           save_strategy="steps", save_steps=1)
    for (name, a), (_, b) in zip(uninterrupted.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_gradient_arriving_twice_before_step_is_refused():
    layer = torch.nn.Linear(4, 2)
    optimizer = AdamWInBackward(layer.parameters(), lr=1e-2)
    layer(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="arrived twice"):
        layer(torch.ones(1, 4)).sum().backward()  # a second micro-batch: gradient accumulation
    optimizer.step()
    layer(torch.ones(1, 4)).sum().backward()  # a new step: fine again
    assert layer.weight.grad is None


def _args(*extra):
    base = ["--output_dir", "unused", "--report_to", "none", "--optim_step_in_backward"]
    return [*base, *extra]


@pytest.mark.parametrize(
    "extra, match",
    [
        ([], r"--max_grad_norm=1\.0 .*allowed with it: --max_grad_norm 0"),
        (["--max_grad_norm", "0", "--gradient_accumulation_steps", "2"], r"--gradient_accumulation_steps=2.*: 1"),
        (["--max_grad_norm", "0", "--optim", "adafactor"], r"--optim='adafactor'.*allowed: adamw_torch"),
        (["--max_grad_norm", "0", "--lisa_sampling", "importance"], r"--lisa_sampling=importance.*uniform, cyclic"),
        (["--max_grad_norm", "0", "--method", "lora"], r"--method lora does not use --optim_step_in_backward"),
    ],
    ids=["clipping", "accumulation", "optim", "importance", "method"],
)
def test_refused_combinations_name_the_option_and_what_is_allowed(extra, match):
    with pytest.raises(ValueError, match=match):
        parse_args(_args(*extra))


def test_parses_and_reaches_the_trainer_when_compatible():
    *_, lisa_args, training_args = parse_args(_args("--max_grad_norm", "0", "--optim", "adamw_torch_fused"))
    assert training_args.optim_step_in_backward is True and training_args.max_grad_norm == 0


@pytest.mark.parametrize(
    "changes, match",
    [({"fp16": True}, "--fp16"), ({"world_size": 2}, "2 processes"), ({"deepspeed": "ds.json"}, "--deepspeed"),
     ({"fsdp": ["full_shard"]}, "--fsdp")],
    ids=["fp16", "ddp", "deepspeed", "fsdp"],
)
def test_refused_engines_and_scaler(changes, match):
    args = dict(gradient_accumulation_steps=1, max_grad_norm=0.0, fp16=False, optim="adamw_torch", world_size=1,
                deepspeed=None, fsdp=[], optim_step_in_backward=True)  # a LisaTrainingArguments field
    lisa_args = SimpleNamespace(method="lisa", lisa_sampling="uniform")
    with pytest.raises(UsageError, match=match):
        check_step_in_backward(lisa_args, SimpleNamespace(**{**args, **changes}))


def test_command_exits_2_with_one_message(capsys, tmp_path):
    status = cli.main(["train", "--output_dir", str(tmp_path / "out"), "--optim_step_in_backward",
                       "--gradient_accumulation_steps", "4", "--max_grad_norm", "0"])
    assert status == 2
    assert "--gradient_accumulation_steps=4" in capsys.readouterr().err


def test_python_api_refusals(tiny_llama, token_dataset, training_args):
    model = tiny_llama(seed=0)
    args = training_args(max_steps=1, max_grad_norm=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizers=\(AdamW"):
        LisaTrainer(model=model, args=args, train_dataset=token_dataset(), optimizers=(optimizer, None),
                    optim_step_in_backward=True)
    trainer = LisaTrainer(model=model, args=args, train_dataset=token_dataset(), optim_step_in_backward=True,
                          callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, lisa_sampling="importance")])
    with pytest.raises(ValueError, match="importance sampling"):
        trainer.train()
    sgd = training_args(max_steps=1, max_grad_norm=0.0, optim="sgd")
    with pytest.raises(ValueError, match="optim='sgd'"):  # as the Trainer is built (test_lisa_trainer_refuses_...)
        LisaTrainer(model=tiny_llama(seed=0), args=sgd, train_dataset=token_dataset(), optim_step_in_backward=True)


def test_grad_norm_counts_the_gradients_applied_and_pending():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    optimizer = AdamWInBackward([a], lr=0.1)
    optimizer.add_param_group({"params": [b], "lr": 0.1})
    (2 * a.sum()).backward()  # hook: applied, gradient 2 per element
    b.grad = torch.full((4,), 3.0)  # set by hand: waits for step()
    assert optimizer.grad_norm() == pytest.approx(math.sqrt(3 * 4 + 4 * 9))
    optimizer.step()
    assert b.grad is None and optimizer.grad_norm() == 0.0
    assert optimizer.state[b]["step"] == 1 and optimizer.state[a]["step"] == 1


@pytest.mark.parametrize(
    "overrides, match",
    [({}, r"optim_step_in_backward=True .*max_grad_norm=1\.0 \(TrainingArguments' default\).*"
          r"TrainingArguments\(max_grad_norm=0\)"),
     ({"max_grad_norm": 0.0, "gradient_accumulation_steps": 2},
      r"gradient_accumulation_steps=2 .*TrainingArguments\(gradient_accumulation_steps=1\)"),
     ({"max_grad_norm": 0.0, "optim": "sgd"}, r"optim='sgd' .*allowed: adamw_torch")],
    ids=["clipping-by-default", "accumulation", "optim"],
)
def test_lisa_trainer_refuses_what_the_command_refuses(tiny_llama, token_dataset, training_args, overrides, match):
    """The Python API runs the command's rules as the Trainer is built, naming the setting to change (the default
    max_grad_norm=1.0 included): before, clipping was dropped in silence and the logged grad_norm was 0.0."""
    with pytest.raises(UsageError, match=match):
        LisaTrainer(model=tiny_llama(seed=0), args=training_args(max_steps=2, **overrides),
                    train_dataset=token_dataset(), optim_step_in_backward=True)


def test_arguments_changed_after_construction_are_refused_at_train(tiny_llama, token_dataset, training_args):
    model = tiny_llama(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = LisaTrainer(model=model, args=training_args(max_steps=2, max_grad_norm=0.0),
                          train_dataset=token_dataset(), optim_step_in_backward=True)
    trainer.args.max_grad_norm = 0.5
    with pytest.raises(UsageError, match=r"max_grad_norm=0\.5 "):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any step


def test_plain_trainer_given_an_in_backward_optimizer(tiny_llama, token_dataset, training_args):
    """A plain ``transformers.Trainer`` handed ``AdamWInBackward``: with clipping it is refused by the callbacks
    before any step; without, the logged ``grad_norm`` (and the monitor's) is the norm the hooks measured, not the
    0.0 the Trainer computes over gradients that are gone."""
    from transformers import Trainer

    def build(max_grad_norm, fused):
        model = tiny_llama(seed=0, tie=True)
        args = training_args(max_steps=3, max_grad_norm=max_grad_norm)
        optimizer = (AdamWInBackward if fused else torch.optim.AdamW)(model.parameters(), lr=args.learning_rate)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), optimizers=(optimizer, None),
                          callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=3)])
        return trainer, TrainingMonitorCallback().attach(trainer), model

    trainer, _, model = build(1.0, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UsageError, match=r"max_grad_norm=1\.0 .*TrainingArguments\(max_grad_norm=0\)"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fused, _, _ = build(0.0, fused=True)
    fused.train()
    plain, _, _ = build(0.0, fused=False)
    plain.train()
    for key in ("grad_norm", "monitor/grad_norm"):
        got, expected = _logged(fused, key), _logged(plain, key)
        assert len(got) == 3 and all(v > 0 for v in got), (key, got)
        assert got == pytest.approx(expected, rel=1e-5), key
