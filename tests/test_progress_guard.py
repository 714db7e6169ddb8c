"""The safety net (``TrainingProgressGuard``): a run whose first optimizer steps train nothing stops, in user code
(an exception out of ``trainer.train()``) and in ``hf-lisa train`` (exit status 1); normal runs, a warmup from lr 0
and a sparse adapter's mask calibration (its updates withheld) do not trip it."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from peft import get_peft_model
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa import cli
from hf_lisa.errors import NothingTrainedError
from hf_lisa.scheduler import MaskScheduler
from hf_lisa.trainer import LisaTrainer
from hf_lisa.tuner.schedule_guard import attach_schedule
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback, TrainingProgressGuard, progress


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
                          train_dataset=token_dataset(), callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2)],
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
        self.mask_scheduler = MaskScheduler(model, importance_steps=2, mask_update_interval=0)

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


# -- updates too small for the weights (issue 33, item 8) --------------------------------------------------------------
def _command(tmp_path, capsys, caplog, *options: str) -> tuple[int, list[str], list[str]]:
    """``hf-lisa train`` on the 2-block fixture model at a constant learning rate: (exit status, its error lines,
    the guard's warnings)."""
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        build_tiny_lm_dir(model_dir, num_layers=2)
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(16, seed=0))
    caplog.set_level(logging.WARNING, logger=progress.__name__)
    status = cli.main([
        "train", "--model_name_or_path", str(model_dir), "--train_file", train, "--validation_split_percentage", "0",
        "--output_dir", str(tmp_path / "out"), "--max_steps", "4", "--lr_scheduler_type", "constant",
        "--per_device_train_batch_size", "4", "--max_seq_length", "32", "--save_strategy", "no", "--report_to",
        "none", "--use_cpu", "true", "--disable_tqdm", "true", "--eval_generation_samples", "0", *options,
    ])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-lisa train:")]
    return status, errors, [r.getMessage() for r in caplog.records if r.name == progress.__name__]


def _measured(message: str) -> float:
    """The ||dW||/||W|| the guard's message quotes."""
    return float(re.search(r"moved by ([0-9.e+-]+) of their size", message).group(1))


def test_bf16_weights_at_a_rate_below_their_precision_stop(tmp_path, capsys, caplog):
    """bfloat16 weights at lr 1e-8: a handful of values near 0 change (so the weights did change), the rest round
    back. The run stops naming what was measured and what to do; before, it passed and exited 0."""
    status, errors, warnings = _command(tmp_path, capsys, caplog, "--method", "full", "--torch_dtype", "bfloat16",
                                 "--learning_rate", "1e-8")
    assert status == 1 and len(errors) == 1 and not warnings, errors
    error = errors[0]
    assert error.startswith("hf-lisa train: error: nothing trained in 3 optimizer step(s) at the full learning rate "
                            "(steps 1-3): expected to train ")
    assert "the updates were too small for the weights" in error and "(bfloat16) moved by" in error
    assert _measured(error) < progress.MIN_UPDATE  # 2.0e-9 (the module's table)
    assert "raise the learning rate (--learning_rate)" in error and "--torch_dtype float32" in error


def test_lora_at_1e_12_stops_although_b_leaves_zero(tmp_path, capsys, caplog):
    """LoRA's B starts at 0: any update changes it (1e-12 is representable), so 'did a weight change' passed. Measured
    against the A it multiplies, the update is 7e-12 of the weights' size."""
    status, errors, _ = _command(tmp_path, capsys, caplog, "--method", "lora", "--learning_rate", "1e-12")
    assert status == 1 and len(errors) == 1, errors
    assert "nothing trained in 3 optimizer step(s) at the full learning rate" in errors[0]
    assert ".lora_A.default.weight" in errors[0] and "(float32) moved by" in errors[0]
    assert _measured(errors[0]) < 1e-10


def test_a_rate_in_the_grey_zone_warns_and_trains_on(tmp_path, capsys, caplog):
    """fp32 weights at lr 1e-8 do move (1.2e-7 of their size): above what the guard stops, below what runs at the
    rates people train at measure. The run goes on with one warning that says what was measured and what to do."""
    status, errors, warnings = _command(tmp_path, capsys, caplog, "--method", "full", "--learning_rate", "1e-8")
    assert status == 0 and not errors
    assert len(warnings) == 1, warnings
    assert "the updates were too small for the weights in steps 1-3 at learning rate 1e-08" in warnings[0]
    assert progress.MIN_UPDATE <= _measured(warnings[0]) < progress.WARN_UPDATE
    assert "the run goes on" in warnings[0] and "raise the learning rate" in warnings[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_normal_rate_passes_at_its_first_step_and_records_its_update(tiny_llama, token_dataset, training_args,
                                                                       dtype, caplog):
    """lr 1e-5, the lowest rate the methods train at: fp32 weights move by a few lr / 0.02 (their std) diluted by
    the norm weights (1.0); bf16 weights lose the updates of their larger values. Both pass at their first step, 10x
    or more above WARN_UPDATE, with no warning."""
    model = tiny_llama(seed=0, num_layers=2).to(dtype)
    trainer = LisaTrainer(model=model, args=training_args(max_steps=2, learning_rate=1e-5),
                          train_dataset=token_dataset())
    with caplog.at_level(logging.WARNING, logger=progress.__name__):
        trainer.train()
    guard = _guard(trainer)
    assert (guard.passed_at, guard.checked) == (1, 0) and not caplog.records
    assert 10 * progress.WARN_UPDATE <= guard.update_size < 1e-3


def test_a_warmup_is_judged_at_the_full_rate(tiny_llama, token_dataset, training_args):
    """bf16 weights under a linear warmup to lr 1e-8: steps 2-3 (lr 0.25e-8, 0.5e-8 ... ) are not counted however
    little they move; from the full rate on the updates are judged, and the run stops at steps 3-5."""
    model = tiny_llama(seed=0, num_layers=2).to(torch.bfloat16)
    trainer = LisaTrainer(model=model, args=training_args(max_steps=10, learning_rate=1e-8, warmup_steps=4),
                          train_dataset=token_dataset())
    with pytest.raises(NothingTrainedError, match=r"at the full learning rate \(steps 3-5\).*too small for the "
                                                  r"weights in steps 3-5 at learning rate"):
        trainer.train()


def test_a_long_warmup_of_bf16_weights_does_not_trip(tiny_llama, token_dataset, training_args):
    """A warmup's first steps move bf16 weights by less than their precision, legitimately (lr 1e-4 over 1000 warmup
    steps starts at 1e-7): the updates' size waits for the full rate, which these 6 steps never reach."""
    model = tiny_llama(seed=0, num_layers=2).to(torch.bfloat16)
    trainer = LisaTrainer(model=model, args=training_args(max_steps=6, learning_rate=1e-4, warmup_steps=1000),
                          train_dataset=token_dataset(), progress_check_steps=1)
    trainer.train()
    guard = _guard(trainer)
    assert (guard.passed_at, guard.checked, guard.update_size) == (None, 0, None)


def test_the_update_size_measures_a_zero_tensor_against_the_others():
    """||dW||/||W|| pooled over tensors: B (all zeros, as LoRA starts) counts at the mean size of the others, so that
    B moving by 1e-3 next to an A of std 0.1 (same size) measures 1e-3 / 0.1 / sqrt(2); all zeros has no size."""
    from hf_lisa.trainer_callbacks.progress import _Fingerprint, _update_size

    a = torch.full((64,), 0.1)
    b, b_after = torch.zeros(64), torch.full((64,), 1e-3)
    pairs = [(_Fingerprint(a, 1024), _Fingerprint(a, 1024)), (_Fingerprint(b, 1024), _Fingerprint(b_after, 1024))]
    size, changed = _update_size(pairs, "cpu")
    assert size == pytest.approx(1e-3 / 0.1 / 2 ** 0.5) and changed == 0.5
    assert _update_size([(_Fingerprint(b, 16), _Fingerprint(b_after, 16))], "cpu") is None
