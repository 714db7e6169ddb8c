"""What ``hf-lisa train`` prints: one compact line per logging step and per evaluation, instead of the Trainer's
dictionaries of 20 keys (third-party chatter is kept out by :func:`hf_lisa.cli.quiet_third_parties`). Everything
logged still reaches ``--report_to`` (TensorBoard, W&B, ...) and ``trainer_state.json`` whole; only the console is
short.

Lines::

    [hf-lisa] step 20/60: loss 1.2345, grad_norm 0.5321, lr 1.8e-04, epoch 0.27
    [hf-lisa] eval at step 20: eval_loss 1.1023, eval_perplexity 3.011, eval_token_accuracy 0.7125
    [hf-lisa] trained 60 steps in 95 s (0.63 steps/s), train_loss 1.4021
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .outputs import SUMMARY_PREFIX

#: the console's keys of a training step's log, in order, with their format
STEP_KEYS = (("loss", "{:.4f}"), ("grad_norm", "{:.4g}"), ("learning_rate", "{:.2g}"), ("epoch", "{:.2f}"),
             ("ddp/grad_bytes_per_step", "{:.0f}"))  # the last under DDP only: what the active-set all-reduce sent
#: the short names the console uses
SHORT = {"learning_rate": "lr"}
#: the evaluation metrics the console shows (the rest: runtime, samples/s, ... go to --report_to only)
EVAL_KEYS = ("eval_loss", "eval_perplexity", "eval_token_accuracy", "eval_exact_match", "eval_rewards/accuracies",
             "eval_rewards/margins")  # the last two: --stage dpo


def _number(value: Any, fmt: str) -> Optional[str]:
    try:
        return fmt.format(float(value))
    except (TypeError, ValueError):
        return None


def format_log(logs: dict, state) -> Optional[str]:
    """The console line of one ``on_log`` event, or ``None`` when it has nothing for the console."""
    step = state.global_step
    if "loss" in logs:
        parts = [f"{SHORT.get(k, k)} {v}" for k, fmt in STEP_KEYS if k in logs and (v := _number(logs[k], fmt))]
        total = f"/{state.max_steps}" if state.max_steps and state.max_steps > 0 else ""
        return f"[{SUMMARY_PREFIX}] step {step}{total}: " + ", ".join(parts)
    if any(k in logs for k in EVAL_KEYS):
        parts = [f"{k} {v}" for k in EVAL_KEYS if k in logs and (v := _number(logs[k], "{:.4g}"))]
        return f"[{SUMMARY_PREFIX}] eval at step {step}: " + ", ".join(parts)
    if "train_runtime" in logs:
        runtime = float(logs["train_runtime"])
        rate = f" ({step / runtime:.2f} steps/s)" if runtime > 0 else ""
        loss = _number(logs.get("train_loss"), "{:.4f}")
        return f"[{SUMMARY_PREFIX}] trained {step} steps in {runtime:.0f} s{rate}" + (f", train_loss {loss}" if loss
                                                                                     else "")
    return None


class _DuringTraining:
    """Prints only the log events of ``train()``: the evaluations before and after it have their own
    ``before training`` / ``after training`` lines."""

    training = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True
        return super().on_train_begin(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        result = super().on_train_end(args, state, control, **kwargs)
        self.training = False
        return result

    def _line(self, state, logs) -> Optional[str]:
        if not (self.training and state.is_world_process_zero and logs):
            return None
        return format_log(logs, state)


class CompactProgressCallback(_DuringTraining, ProgressCallback):
    """transformers' progress bars, with one compact line per log event written above them."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = self._line(state, logs)
        if line and self.training_bar is not None:
            self.training_bar.write(line)
        elif line:
            print(line, flush=True)


class CompactPrinterCallback(_DuringTraining, TrainerCallback):
    """``--disable_tqdm``'s printer: one compact line per log event."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = self._line(state, logs)
        if line:
            print(line, flush=True)


def use_compact_console(trainer) -> None:
    """Replace the Trainer's log printers (the progress bar's or ``--disable_tqdm``'s) with the compact ones."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(CompactProgressCallback)
    if trainer.pop_callback(PrinterCallback) is not None:
        trainer.add_callback(CompactPrinterCallback)


def metrics_line(metrics: dict, suffix: str) -> str:
    """The evaluation's headline figures (exact match, eval loss, perplexity, token accuracy; DPO's reward accuracy
    and margin), of the keys ending in ``suffix`` (``_before`` for the evaluation before training), on one line."""
    names = [("eval_exact_match", "exact match"), ("eval_loss", "eval loss"), ("eval_perplexity", "perplexity"),
             ("eval_token_accuracy", "token accuracy"), ("eval_rewards/accuracies", "reward accuracy"),
             ("eval_rewards/margins", "reward margin")]
    parts = [f"{label} {metrics[key + suffix]:.4f}" for key, label in names if key + suffix in metrics]
    return ", ".join(parts)
