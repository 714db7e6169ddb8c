"""The ``Trainer`` every method runs on: transformers' own, with optional layer-wise learning-rate decay, checkpoints
that exist only once complete, no Hub token in what it saves, and a whole-run ``train_loss`` after a resume."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from dataclasses import fields
from typing import Any, Optional

from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy, rotate_checkpoints

from ..optim.in_backward import StepsInBackward, check_in_backward_arguments, steps_in_backward
from ..renamed import REMOVED_IN, RenamedAttribute, renamed_keywords
from ..trainer_callbacks.progress import TrainingProgressGuard
from ..trainer_callbacks.setup import prepare_trainer
from ..trainer_callbacks.state import ScheduleCheckpoint
from ..optim.chunked_loss import install_chunked_loss
from ..optim.memory import (
    apply_cpu_allocator,
    configure_embedding_state,
    heap_trim,
    sliced_8bit_optimizer,
    step_in_backward_optimizer,
)
from .atomic import STAGING_PREFIX, fsync_tree
from .training_args import TRAINER_OPTIONS, LisaTrainingArguments, check_trainer_options

logger = logging.getLogger("hf_lisa.train")

#: the private ``transformers.Trainer`` methods ``LisaTrainer`` overrides, each with the reason no public hook
#: (``create_optimizer``, ``compute_loss``, ``log``, callbacks) does the job. ``tests/test_private_trainer_api.py``
#: fails when transformers renames or drops one: the override would silently stop taking effect.
PRIVATE_OVERRIDES = {
    "_get_grad_norm": "the optimizer stepped in the backward pass freed the gradients: report the norm its hooks "
    "measured, never a norm over nothing",
    "_get_output_dir": "a checkpoint is written into a staging folder first (the Trainer writes where this points)",
    "_save_checkpoint": "the staged checkpoint, with the LISA schedule inside, is renamed into place only once "
    "complete; no callback event sees the folder before the Trainer rotates checkpoints",
    "_push_from_checkpoint": "a staged checkpoint is pushed from its final place, not from the staging folder",
    "_save": "the pickled training_args.bin is written without the Hub token",
}


class _WholeRunLoss(TrainerCallback):
    """Keeps ``train_loss`` a mean over every step of the run when training resumes from a checkpoint.

    transformers averages ``train_loss`` over the steps of one ``train()`` call only. This callback has the loss logged
    whenever a checkpoint is saved, so that a checkpoint's log history holds the loss of every step before it; on
    resume it sums them (:attr:`earlier`), and :meth:`LisaTrainer.log` folds that sum into the final ``train_loss``.
    """

    def __init__(self) -> None:
        self.resumed_at = 0
        #: ``(steps, summed loss)`` of the steps before this ``train()`` call, from the log history; ``None`` when fresh
        self.earlier: Optional[tuple[int, float]] = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.resumed_at, self.earlier = state.global_step, None
        if not state.global_step:
            return
        steps, total = 0, 0.0
        for entry in state.log_history:  # each "loss" is the mean over the steps since the previous one
            if "loss" in entry and steps < entry.get("step", 0) <= state.global_step:
                total += entry["loss"] * (entry["step"] - steps)
                steps = entry["step"]
        if steps < state.global_step:
            logger.warning(
                "The resumed checkpoint logs the training loss up to step %d of %d: train_loss leaves steps %d-%d out "
                "(checkpoints that hf-lisa's LisaTrainer writes log the loss at every save).",
                steps, state.global_step, steps + 1, state.global_step,
            )
        self.earlier = (steps, total)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and args.logging_strategy != IntervalStrategy.NO:
            control.should_log = True  # drain the loss of the steps since the last log into the checkpoint's history

    on_epoch_end = on_step_end

    def whole_run(self, session_loss: float, global_step: int, session_total: Optional[float] = None) -> float:
        """The mean loss over the earlier steps and this call's, from this call's summed loss ``session_total`` (or,
        where the Trainer does not expose it, its mean ``session_loss``)."""
        steps, total = self.earlier
        session = global_step - self.resumed_at
        if session_total is None:
            session_total = session_loss * session
        return (total + session_total) / max(steps + session, 1)


def _trainer_options(args: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``LisaTrainer``'s settings: the fields of a :class:`LisaTrainingArguments` ``args``, else the defaults, with
    the deprecated keywords ``given`` (checked, with a ``FutureWarning``; refused beside a ``LisaTrainingArguments``)."""
    if given and isinstance(args, LisaTrainingArguments):
        raise TypeError(
            f"LisaTrainer got {', '.join(f'{k}={v!r}' for k, v in given.items())} as keyword(s) and args="
            f"{type(args).__name__}, which holds these settings: set them there only (one place per setting)."
        )
    if given:
        check_trainer_options(given, prefix="LisaTrainer: ")
        warnings.warn(
            f"LisaTrainer({', '.join(f'{k}=...' for k in given)}): settings as keywords are deprecated; pass them as "
            f"fields of hf_lisa.trainer.LisaTrainingArguments (the keywords work until hf-lisa {REMOVED_IN}).",
            FutureWarning, stacklevel=4,
        )
    base = ({name: getattr(args, name) for name in TRAINER_OPTIONS} if isinstance(args, LisaTrainingArguments)
            else dict(TRAINER_OPTIONS))
    return {**base, **given}


class LisaTrainer(Trainer):
    """``transformers.Trainer`` with optional layer-wise learning-rate decay (see [`hf_lisa.scheduler.param_groups`]),
    and safe saving:

    * **Checkpoints appear only when complete.** ``checkpoint-N`` is written as ``.partial-checkpoint-N/checkpoint-N``
      (model, optimizer, RNG and trainer state, and the LISA schedule's ``lisa_state.safetensors``) and renamed to
      ``checkpoint-N`` once every process has written its part, so ``transformers.trainer_utils.get_last_checkpoint``
      and ``--resume_from_checkpoint latest`` never pick up a save that a kill or a full disk interrupted. Files that
      ``on_save`` callbacks add afterwards are outside that guarantee.
    * **No Hub token in its saves.** The pickled ``training_args.bin`` of each checkpoint and ``save_model()`` is
      written with ``hub_token`` unset; resuming never reads it. (transformers' own push, ``push_to_hub=True``, which
      ``hf-lisa train`` never turns on, still pickles the arguments with the token into ``output_dir``.)
    * **A run that trains nothing stops.** Its first optimizer steps are checked (``progress_check_steps``): when
      none changed a trainable parameter with a nonzero gradient, ``train()`` raises
      :class:`~hf_lisa.errors.NothingTrainedError` (``hf-lisa train``: exit status 1).
    * **``train_loss`` over the whole run.** The loss is logged at every checkpoint, and a resumed ``train()`` reports
      the mean over all steps since step 0, not only the resumed ones.

    The optimizer is built, as the Trainer's own, over every parameter that requires a gradient when training
    starts, i.e. before the LISA callbacks freeze anything: every candidate block has its parameter group. With
    ``layerwise_lr_decay=1.0`` (the default) it builds exactly ``transformers.Trainer``'s optimizer.

    With ``optim_step_in_backward=True`` the optimizer is [`~hf_lisa.optim.in_backward.AdamWInBackward`]:
    AdamW updates each parameter inside the backward pass and frees its gradient (see :mod:`hf_lisa.optim.memory`
    for what that excludes); its hooks are armed during ``train()`` only, and the logged ``grad_norm`` is the norm
    the hooks measured.

    Two memory options (see :mod:`hf_lisa.optim.memory`): ``chunked_loss=True`` (the default) gives a causal LM
    whose loss is transformers' own :func:`~hf_lisa.optim.chunked_loss.chunked_causal_lm_loss` as its ``loss_function`` (the
    same value without the vocabulary-sized temporaries), and ``cpu_allocator="trim"`` returns the heap's free pages
    to the system at the two points of each CPU backward pass where the peak forms (``"lean"`` applies
    [`~hf_lisa.optim.memory.apply_cpu_allocator`]).

    Its settings are the fields of :class:`~hf_lisa.trainer.LisaTrainingArguments` (``layerwise_lr_decay``,
    ``optim_step_in_backward``, ``optim_8bit_embeddings``, ``chunked_loss``, ``cpu_allocator``,
    ``progress_check_steps``: the :class:`~hf_lisa.trainer_callbacks.progress.TrainingProgressGuard` it runs; a guard
    in ``callbacks`` stands); with a plain ``TrainingArguments`` they keep their defaults. As keywords of this class
    they work until 0.4, with a ``FutureWarning``, and not beside a ``LisaTrainingArguments`` (one place per setting).

    Args:
        lisa_layers_attribute: dotted path of the block list for the learning-rate decay groups, when
            auto-detection cannot find it (``layers_attribute`` before 0.3, until 0.4 with a ``FutureWarning``).
    """

    layers_attribute = RenamedAttribute("lisa_layers_attribute")

    @renamed_keywords("layers_attribute")
    def __init__(self, *args, lisa_layers_attribute: Optional[str] = None, **kwargs):
        given = {name: kwargs.pop(name) for name in TRAINER_OPTIONS if name in kwargs}
        callbacks = list(kwargs.pop("callbacks", None) or [])
        guarded = any(isinstance(cb, TrainingProgressGuard) or cb is TrainingProgressGuard for cb in callbacks)
        super().__init__(*args, callbacks=callbacks, **kwargs)
        options = _trainer_options(self.args, given)  # the arguments the Trainer resolved, whatever the subclass
        optim_step_in_backward, cpu_allocator = options["optim_step_in_backward"], options["cpu_allocator"]
        if not guarded:  # a guard given in callbacks stands
            self.add_callback(TrainingProgressGuard(check_steps=options["progress_check_steps"]))
        prepare_trainer(self)  # the LISA callbacks are handed this Trainer (transformers' events do not pass it)
        self._lisa_prepared = True
        self.chunked_loss = options["chunked_loss"] and install_chunked_loss(self.model)
        on_cpu = self.args.device.type == "cpu"
        applied = apply_cpu_allocator(cpu_allocator, on_cpu=on_cpu)  # "lean"; hf-lisa train applied it already
        if applied:
            logger.debug(applied)
        self.heap_trim = heap_trim(cpu_allocator, on_cpu=on_cpu)
        if self.heap_trim is not None:
            self.heap_trim.attach(self.model)
        self.layerwise_lr_decay = options["layerwise_lr_decay"]
        self.lisa_layers_attribute = lisa_layers_attribute
        self.optim_step_in_backward = optim_step_in_backward
        self.optim_8bit_embeddings = options["optim_8bit_embeddings"]
        if optim_step_in_backward and self.optimizer is not None and steps_in_backward(self.optimizer) is None:
            raise ValueError(
                "optim_step_in_backward=True builds its own optimizer (AdamWInBackward), but the Trainer was given "
                f"optimizers=({type(self.optimizer).__name__}, ...); pass one or the other."
            )
        self._check_in_backward()
        self._staging: Optional[str] = None  # the staging folder of the checkpoint being written
        self._whole_run_loss = _WholeRunLoss()
        self.add_callback(self._whole_run_loss)

    def add_callback(self, callback) -> None:
        """``Trainer.add_callback``; a LISA callback added later is handed this Trainer too (``prepare_trainer``)."""
        super().add_callback(callback)
        if getattr(self, "_lisa_prepared", False):  # Trainer.__init__ adds its printer before the callbacks are ready
            prepare_trainer(self)

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            if self.optim_step_in_backward:  # the Trainer's AdamW (torch's or 8-bit), stepping in backward
                self.optimizer_cls_and_kwargs = step_in_backward_optimizer(self, opt_model)
            else:  # bitsandbytes' 8-bit AdamW, its CPU update a slice at a time (bit for bit the same)
                self.optimizer_cls_and_kwargs = sliced_8bit_optimizer(self, opt_model) or self.optimizer_cls_and_kwargs
        given = self.optimizer is not None
        optimizer = self._optimizer_with_llrd(model)
        if not given or self.optim_8bit_embeddings:  # a given optimizer is left as it is, unless asked for 8 bits
            configured = configure_embedding_state(optimizer, opt_model, self.optim_8bit_embeddings)
            if configured:
                logger.info(configured)
        return optimizer

    def _optimizer_with_llrd(self, model=None):
        """The Trainer's optimizer, with one parameter group per block when layer-wise LR decay is on."""
        if self.layerwise_lr_decay >= 1.0 or self.optimizer is not None:
            return super().create_optimizer(model)
        from ..scheduler.param_groups import layerwise_lr_decay_param_groups

        opt_model = self.model if model is None else model
        groups = layerwise_lr_decay_param_groups(
            opt_model,
            lr=self.args.learning_rate,
            decay=self.layerwise_lr_decay,
            weight_decay=self.args.weight_decay,
            no_decay_names=set(n for n, _ in opt_model.named_parameters())
            - set(self.get_decay_parameter_names(opt_model)),
            lisa_layers_attribute=self.lisa_layers_attribute,
        )
        if self.optimizer_cls_and_kwargs is not None:  # the step in backward's, the sliced 8-bit AdamW, or given
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs = dict(optimizer_kwargs)
        optimizer_kwargs.pop("lr", None)  # each group carries its own rate
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self.heap_trim is not None and model.training:
            self.heap_trim.trim_before_backward_of(result[0] if return_outputs else result)
        return result

    def _check_in_backward(self) -> None:
        """The command's rules for an optimizer that steps in backward (``optim_step_in_backward=True``, or such an
        optimizer given): no clipping, accumulation, fp16, other optimizers or several processes. Raises
        ``UsageError`` naming the ``TrainingArguments`` field to set."""
        given = self.optimizer_cls_and_kwargs
        given_cls = given is not None and isinstance(given[0], type) and issubclass(given[0], StepsInBackward)
        if self.optim_step_in_backward or given_cls or steps_in_backward(self.optimizer) is not None:
            check_in_backward_arguments(self.args, check_optim=self.optimizer is None and given is None)

    def _get_grad_norm(self, model, grad_norm=None):
        stepping = steps_in_backward(self.optimizer)
        if stepping is not None:  # the gradients are gone: the norm the hooks measured (never a norm over nothing)
            return stepping.grad_norm()
        return super()._get_grad_norm(model, grad_norm)

    # -- training loss over the whole run (and the step in backward armed for train() only) ----------------------------
    def train(self, *args, **kwargs):
        self._check_in_backward()  # the arguments may have changed since __init__
        stepping = steps_in_backward(self.optimizer)
        if stepping is not None:  # a second train(): the Trainer reuses its optimizer
            stepping.armed = True
        try:
            output = super().train(*args, **kwargs)
        finally:  # outside train(), a backward pass (a probe, user code) must not move the weights
            stepping = steps_in_backward(self.optimizer)
            if stepping is not None:
                stepping.armed = False
        # log() turned the final "train_loss" into the whole-run mean; the returned value follows it
        return output._replace(training_loss=output.metrics.get("train_loss", output.training_loss))

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "train_loss" in logs and self._whole_run_loss.earlier is not None:
            # the sum itself: transformers 5.16 divides it by every step of the run, 5.23 by this call's steps only
            session_total = getattr(self, "_total_loss_scalar", None)
            logs["train_loss"] = self._whole_run_loss.whole_run(logs["train_loss"], self.state.global_step,
                                                                session_total)
        super().log(logs, start_time)

    # -- saving --------------------------------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return run_dir if self._staging is None else os.path.join(run_dir, self._staging)

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` inside ``.partial-checkpoint-N/`` and rename it into place once complete."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = self._get_output_dir(trial)
        staging_root = os.path.join(run_dir, STAGING_PREFIX + name)
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        self._staging = STAGING_PREFIX + name  # the Trainer writes run_dir/<staging>/checkpoint-N
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                for callback in self.callback_handler.callbacks:
                    if isinstance(callback, ScheduleCheckpoint):
                        callback.save_pending_state(staged, self.state.global_step)
            if self.state.best_model_checkpoint == staged:  # the Trainer recorded the folder it was writing
                self.state.best_model_checkpoint = final
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
            self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, shards)
            if self.args.should_save and os.path.isdir(staged):
                fsync_tree(staged)
                if os.path.isdir(final):  # the same step saved again (a resumed run): the old folder goes aside
                    os.replace(final, os.path.join(staging_root, "replaced"))
                os.replace(staged, final)
        finally:
            self._staging = None
            if self.args.should_save:
                shutil.rmtree(staging_root, ignore_errors=True)
        if self.args.push_to_hub:  # the Trainer's push of the checkpoint uploads in the background: from its place
            super()._push_from_checkpoint(final)
        if self.args.should_save:  # the Trainer rotated the staging folder; rotate the real ones
            rotate_checkpoints(run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staging is None:  # while a checkpoint is staged, its push waits until it is in place
            super()._push_from_checkpoint(checkpoint_folder)

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        # transformers pickles the arguments beside the weights (training_args.bin): without the Hub token
        tokens = {f.name: getattr(self.args, f.name) for f in fields(self.args) if f.name.endswith("_token")}
        for name in tokens:
            setattr(self.args, name, None)
        try:
            super()._save(output_dir, state_dict)
        finally:
            for name, value in tokens.items():
                setattr(self.args, name, value)
