"""The safety net (``TrainingProgressGuard``): a run whose first optimizer steps train nothing stops, in user code
(an exception out of ``trainer.train()``) and in ``hf-lisa train`` (exit status 1); normal runs, a warmup from lr 0
and a sparse adapter's mask calibration (its updates withheld) do not trip it."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa import cli
from hf_lisa.errors import NothingTrainedError
from hf_lisa.scheduler import MaskScheduler
from hf_lisa.train import LisaTrainer
from hf_lisa.tuner.schedule_guard import attach_schedule
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback, TrainingProgressGuard


class _ZeroLoss:
    """A loss that does not depend on the parameters' values: every gradient is exactly zero (as under a 4-bit base
    in its inference layout), while the loop, the optimizer and weight decay run as usual. ``zero_after_eval``: only
    once an evaluation has run."""

    zero_after_eval = False
    evaluated = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if model.training and not return_outputs and (not self.zero_after_eval or self.evaluated):
            result = result * 0
        return result

    def evaluate(self, *args, **kwargs):
        self.evaluated = True
        return super().evaluate(*args, **kwargs)


class ZeroLossTrainer(_ZeroLoss, Trainer):
    pass


class ZeroLossLisaTrainer(_ZeroLoss, LisaTrainer):
    pass


def _guard(trainer) -> TrainingProgressGuard:
    guards = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TrainingProgressGuard)]
    assert len(guards) == 1
    return guards[0]


def _adapter_model(tiny_llama, **config):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], lisa_activated_layers=1,
                                lisa_interval_steps=5, **config)
    return get_peft_model(tiny_llama(num_layers=2), config)


def test_zero_gradients_stop_a_plain_trainer_with_the_lisa_callback(tiny_llama, token_dataset, training_args):
    """User code: a plain Trainer with ``LisaAdapterCallback`` gets the guard; weight decay moves the weights, but
    with every gradient zero nothing trained: ``train()`` raises after 3 checked steps, naming what should train."""
    model = _adapter_model(tiny_llama)
    trainer = ZeroLossTrainer(model=model, args=training_args(max_steps=8, weight_decay=0.1),
                              train_dataset=token_dataset(), callbacks=[LisaAdapterCallback(seed=0)])
    with pytest.raises(NothingTrainedError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "\n" not in message
    assert "nothing trained in 3 optimizer step(s) with a learning rate above 0 (steps 1-3)" in message
    assert "expected to train 4 parameter tensor(s) (448 values) in block 0, " in message  # the active block's q/v A, B
    assert ".lisa_A.default.weight" in message and "every gradient was zero (4 tensors)" in message
    assert "weights moved by weight decay alone" in message
    assert "inference-only layout" in message and "TrainingProgressGuard(check_steps=0) turns the check off" in message
    assert trainer.state.global_step == 2  # stopped inside step 3


def test_a_guard_given_by_the_user_stands(tiny_llama, token_dataset, training_args):
    trainer = ZeroLossTrainer(model=_adapter_model(tiny_llama), args=training_args(max_steps=4),
                              train_dataset=token_dataset(),
                              callbacks=[LisaAdapterCallback(seed=0), TrainingProgressGuard(check_steps=0)])
    trainer.train()  # turned off: the run ends as before, having trained nothing
    assert _guard(trainer).check_steps == 0 and trainer.state.global_step == 4
    with pytest.raises(ValueError, match=r"check_steps=-1 is invalid; allowed: an integer >= 0"):
        TrainingProgressGuard(check_steps=-1)


def test_step_in_backward_with_zero_gradients(tiny_llama, token_dataset, training_args):
    """AdamW stepped in the backward pass: gradients are gone by the optimizer step, so the hooks' norm (0) stands
    for them; the weights did move (weight decay)."""
    model = tiny_llama(seed=0)
    trainer = ZeroLossLisaTrainer(model=model, args=training_args(max_steps=6, max_grad_norm=0.0, weight_decay=0.1),
                                  train_dataset=token_dataset(), optim_step_in_backward=True, progress_check_steps=2)
    before = model.lm_head.weight.detach().clone()
    with pytest.raises(NothingTrainedError, match=r"\(steps 1-2\).*hooks measured was 0"):
        trainer.train()
    assert not torch.equal(before, model.lm_head.weight)


class _FreezeEverything(TrainerCallback):
    """A library freezing every parameter after the optimizer was built (the input still requires a gradient, so the
    backward pass runs and reaches no parameter)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.enable_input_require_grads()
        for p in model.parameters():
            p.requires_grad_(False)


def test_parameters_frozen_after_the_optimizer_was_built(tiny_llama, token_dataset, training_args):
    model = tiny_llama(seed=0, num_layers=2)
    trainer = LisaTrainer(model=model, args=training_args(max_steps=5), train_dataset=token_dataset(),
                          callbacks=[_FreezeEverything()])
    with pytest.raises(NothingTrainedError, match=r"none of the 21 parameter tensors the optimizer holds requires a "
                                                  r"gradient any more"):
        trainer.train()


def test_a_normal_run_and_a_warmup_from_lr_0_pass(tiny_llama, token_dataset, training_args):
    """The linear warmup's first step has lr 0 (nothing can move): not counted, even with check_steps=1; the first
    step with lr > 0 trains and ends the check."""
    trainer = LisaTrainer(model=tiny_llama(seed=0), args=training_args(max_steps=4, warmup_steps=2),
                          train_dataset=token_dataset(), callbacks=[LisaCallback(activated_layers=1, interval_steps=2)],
                          progress_check_steps=1)
    trainer.train()
    history = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    assert history[0] == 0.0 and history[1] > 0
    guard = _guard(trainer)
    assert (guard.passed_at, guard.checked) == (2, 0)


class _CalibrateInTraining(TrainerCallback):
    """Drives a ``MaskScheduler`` by itself: fresh sparse layers calibrate in the training steps, their updates
    withheld (``end_step``), as the LISA adapter callback does for layers its pre-training passes do not reach."""

    def __init__(self, model):
        self.mask_scheduler = MaskScheduler(model, importance_steps=2, update_interval=0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        attach_schedule(model, self)  # a loop that runs the schedule itself declares it
        self.mask_scheduler.start(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.mask_scheduler.step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.mask_scheduler.end_step()


def test_mask_calibration_withholding_every_update_waits(tiny_llama, token_dataset, training_args):
    """Fresh sparse adapters are all that trains, and their updates are withheld for the 2 calibration steps: the
    check waits (with check_steps=1 it would stop the run at step 1 otherwise); the first step after trains."""
    model = get_peft_model(tiny_llama(num_layers=2), hf_lisa.LisaConfig(
        r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance"))
    calibrate = _CalibrateInTraining(model)
    trainer = Trainer(model=model, args=training_args(max_steps=4), train_dataset=token_dataset(),
                      callbacks=[calibrate, TrainingProgressGuard(check_steps=1)])
    trainer.train()
    assert [(u["step"], u["kind"]) for u in calibrate.mask_scheduler.updates] == [(2, "calibration")]
    assert (_guard(trainer).passed_at, _guard(trainer).checked) == (3, 0)


def test_a_fresh_sparse_adapter_under_the_adapter_callback_passes(tiny_llama, token_dataset, training_args):
    """The adapter callback's own calibration (before the first step, or in the first steps with the updates
    withheld) never trips the guard, even with check_steps=1: the first step that can train does."""
    model = _adapter_model(tiny_llama, sparsity=0.5, mask_init="importance", importance_steps=4,
                           mask_update_interval=0)
    lisa = LisaAdapterCallback(seed=0)
    trainer = Trainer(model=model, args=training_args(max_steps=4), train_dataset=token_dataset(),
                      callbacks=[lisa, TrainingProgressGuard(check_steps=1)])
    trainer.train()
    calibrated_at = [u["step"] for u in lisa.mask_updates if u["kind"] == "calibration"]
    assert len(calibrated_at) == 1 and _guard(trainer).passed_at == calibrated_at[0] + 1


def test_an_evaluation_rearms_the_check(tiny_llama, token_dataset, training_args):
    """Gradients that vanish after an evaluation (what model.eval() does to a 4-bit base) are caught too."""
    args = training_args(max_steps=10, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = ZeroLossLisaTrainer(model=tiny_llama(seed=0, num_layers=2), args=args, train_dataset=token_dataset(),
                                  eval_dataset=token_dataset(8), progress_check_steps=2)
    trainer.zero_after_eval = True
    with pytest.raises(NothingTrainedError, match=r"\(steps 3-4\).*every gradient was zero"):
        trainer.train()
    assert _guard(trainer).passed_at == 1


def test_the_command_exits_1_with_one_line(tmp_path, capsys):
    """``hf-lisa train`` with a learning rate far below what fp32 weights can register: every step runs, no weight
    moves; the command stops with exit status 1 and the guard's message, no traceback hint."""
    model_dir = build_tiny_lm_dir(tmp_path / "model", num_layers=2)
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(16, seed=0))
    status = cli.main([
        "train", "--model_name_or_path", model_dir, "--train_file", train, "--validation_split_percentage", "0",
        "--output_dir", str(tmp_path / "out"), "--method", "full", "--max_steps", "6", "--learning_rate", "1e-30",
        "--per_device_train_batch_size", "4", "--max_seq_length", "32", "--save_strategy", "no", "--report_to",
        "none", "--use_cpu", "true", "--disable_tqdm", "true", "--eval_generation_samples", "0",
    ])
    assert status == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-lisa train:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("hf-lisa train: error: nothing trained in 3 optimizer step(s)")
    assert "no weight changed" in errors[0] and "--debug" not in errors[0]
    assert not (tmp_path / "out" / "training_summary.json").exists()


def test_the_fingerprint_samples_inside_a_large_tensor():
    """A float32 linspace rounded the last position of the demo's 49152 x 576 embedding (28311551) up past its end:
    ``hf-lisa demo`` stopped at step 1 with an IndexError."""
    from hf_lisa.trainer_callbacks.progress import _Fingerprint

    big = torch.zeros(49152 * 576)
    big[-1] = 1.0
    fingerprint = _Fingerprint(big, 16)
    assert fingerprint.sample.shape == (16,) and fingerprint.sample[-1].item() == 1.0  # the last value, sampled
    small = _Fingerprint(torch.arange(5, dtype=torch.float32), 16)
    assert small.sample.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert _Fingerprint(torch.zeros(0), 16).sample.numel() == 0
