"""What the two LISA callbacks share: logging, the Trainer that runs them and the step's guard rails.

Checkpoint and resume come from :class:`~hf_lisa.trainer_callbacks.state.ScheduleCheckpoint`; finding and preparing
the Trainer from :mod:`hf_lisa.trainer_callbacks.setup`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from transformers import TrainerCallback

from hf_lisa.scheduler import LayerwiseScheduler, MaskScheduler
from hf_lisa.renamed import RenamedAttribute
from hf_lisa.optim.state import optimizer_state_bytes
from hf_lisa.optim.in_backward import steps_in_backward

from .gradients import PenaltyGradient, WithheldGradients
from .progress import TrainingProgressGuard, add_progress_guard
from .setup import WANTS_TRAINER, configure_trainer, launched_world_size
from .state import ScheduleCheckpoint

logger = logging.getLogger(__name__)


class _LisaCallbackBase(ScheduleCheckpoint, TrainerCallback):
    """Logging, Trainer preparation and guard rails shared by the two LISA callbacks (checkpoints: :mod:`.state`)."""

    activated_layers = RenamedAttribute("lisa_activated_layers")  # the names before 0.3 (hf_lisa.renamed)
    interval_steps = RenamedAttribute("lisa_interval_steps")
    sampling = RenamedAttribute("lisa_sampling")
    optimizer_state_policy = RenamedAttribute("lisa_optimizer_state_policy")

    def __init__(self) -> None:
        self.layer_scheduler: Optional[LayerwiseScheduler] = None
        self.mask_scheduler: Optional[MaskScheduler] = None
        self.resume_state: Optional[dict] = None  # set by the Trainer when it restores the callback
        self._global_step = 0
        self._pending_logs: dict[str, Any] = {}
        self._warned_stray = False
        self._gradients_completed = False  # complete_lisa_gradients() ran in this optimizer step
        self._withheld_gradients: Optional[WithheldGradients] = None
        self._penalty_gradient: Optional[PenaltyGradient] = None
        self._trainer = None  # handed over by set_trainer (hf_lisa.trainer_callbacks.prepare_trainer)
        self._guard: Optional[TrainingProgressGuard] = None  # run by this callback when no Trainer was handed over
        setattr(self, WANTS_TRAINER, True)

    # -- logging -------------------------------------------------------------------------------------------------------
    def _log_values(self, optimizer) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if self.layer_scheduler is not None:
            counts = self.layer_scheduler.param_counts()
            values["lisa/active_blocks"] = ",".join(str(b) for b in self.layer_scheduler.active)
            values["lisa/always_trainable_params"] = counts["always_trainable"]
            values["lisa/active_block_params"] = counts["active_blocks"]
            values["lisa/trainable_params"] = counts["trainable"]
        if optimizer is not None:
            values["lisa/optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
        if self.mask_scheduler is not None:
            values["lisa/mask_updates"] = self.mask_scheduler.num_updates
        values.update(self._pending_logs)
        return values

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None:
            return
        values = self._log_values(optimizer)
        logs.update(values)
        # Trainer.log appended a copy of `logs` to log_history just before this event: keep the two in step
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
        self._pending_logs = {}

    def on_step_end(self, args, state, control, **kwargs):
        self._global_step = state.global_step

    # -- the Trainer that runs us --------------------------------------------------------------------------------------
    def set_trainer(self, trainer) -> None:
        """Hand this callback (and the other LISA callbacks of ``trainer``) the Trainer that runs it, and prepare it
        (:func:`.setup.configure_trainer`, a :class:`~.progress.TrainingProgressGuard`); idempotent, and called again
        when the Trainer's callbacks change (the readers of the logs stay behind the LISA callbacks). Called by
        :func:`hf_lisa.trainer_callbacks.prepare_trainer`, ``LisaTrainer`` and
        :func:`hf_lisa.distributed.configure_trainer_for_lisa`; transformers' events never pass the Trainer."""
        ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, _LisaCallbackBase)]
        for callback in ours:
            callback._trainer = trainer
        configure_trainer(trainer, ours)
        add_progress_guard(trainer)  # a run that trains nothing stops (a guard the user added stands)

    def _check_trainer(self, args, model) -> None:
        """At ``on_train_begin``: without the Trainer (``set_trainer`` not called, or called by another Trainer),
        refuse several processes (the DDP wrap could not be prepared), say that the reporting integrations do not
        receive the ``lisa/*`` values, and run the progress guard from this callback."""
        trainer = self._trainer
        if trainer is not None and trainer.model is model:
            return
        self._trainer = None
        if launched_world_size() > 1 or args.world_size > 1:
            raise RuntimeError(
                f"{type(self).__name__} was not handed its Trainer, so it could not prepare the Trainer's DDP wrap "
                "for LISA before train() (unused-parameter detection, the active-set all-reduce). Call "
                "hf_lisa.trainer_callbacks.prepare_trainer(trainer) (or "
                "hf_lisa.distributed.configure_trainer_for_lisa(trainer)) before trainer.train(), or use "
                "hf_lisa.trainer.LisaTrainer."
            )
        from transformers.integrations import get_reporting_integration_callbacks

        integrations = get_reporting_integration_callbacks(args.report_to)
        if integrations:
            logger.warning(
                "LISA: %s was not handed its Trainer, so the reporting integrations (%s) run before it and do not "
                "receive its lisa/* values (trainer.state.log_history does). Call "
                "hf_lisa.trainer_callbacks.prepare_trainer(trainer) before trainer.train() to report them.",
                type(self).__name__, ", ".join(c.__name__ for c in integrations),
            )
        if self._guard is None:
            self._guard = TrainingProgressGuard(run_by=self)

    def _relay(self, event: str, args, state, control, **kwargs) -> None:
        """Run the progress guard's ``event`` when this callback runs the guard itself (no Trainer handed over)."""
        if self._guard is not None and self._trainer is None:
            getattr(self._guard, event)(args, state, control, **kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        self._relay("on_evaluate", args, state, control, **kwargs)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._relay("on_optimizer_step", args, state, control, **kwargs)

    def _check_gradients_reachable(self, optimizer, readers: list[str]) -> None:
        """Refuse an optimizer that applies and frees each gradient inside the backward pass (``AdamWInBackward``,
        ``--optim_step_in_backward``) when this schedule reads or adds gradients after it (``readers``)."""
        readers = [r for r in readers if r]
        if readers and steps_in_backward(optimizer) is not None:
            raise ValueError(
                f"{type(self).__name__}: {' and '.join(readers)} read(s) or add(s) gradients after the backward pass, "
                "but the optimizer (AdamWInBackward, optim_step_in_backward=True) applies and frees each gradient "
                "inside it. Use a plain AdamW, or drop what needs the gradients (e.g. sampling='uniform')."
            )

    # -- the step ------------------------------------------------------------------------------------------------------
    def _install_gradient_hooks(self, optimizer, penalty_terms=()) -> None:
        """Call at the end of ``on_train_begin``: the tensor hooks that make the step's gradient edits inside the
        backward pass (:mod:`.gradients`), on every candidate of the schedules and every ``β`` of the penalty."""
        self._remove_gradient_hooks()
        params = []
        if self.layer_scheduler is not None:
            params += self.layer_scheduler.candidates
        if self.mask_scheduler is not None:
            params += self.mask_scheduler.factors()
        self._withheld_gradients = WithheldGradients(params)
        self._penalty_gradient = PenaltyGradient(penalty_terms, optimizer) if penalty_terms else None

    def _remove_gradient_hooks(self) -> None:
        for hooks in (self._withheld_gradients, self._penalty_gradient):
            if hooks is not None:
                hooks.remove()
        self._withheld_gradients = self._penalty_gradient = None

    def _begin_step(self) -> None:
        """Call first in ``on_step_begin``: the step's gradients are not complete yet."""
        self._gradients_completed = False

    def _arm_gradient_hooks(self) -> None:
        """Call last in ``on_step_begin``, once the schedule has decided what trains in this step (calibration passes
        before it are not edited): the backward passes of the step's micro-batches make the step's edits."""
        if self._withheld_gradients is not None:
            withheld = [] if self.layer_scheduler is None else self.layer_scheduler.frozen_candidates()
            if self.mask_scheduler is not None:
                withheld += self.mask_scheduler.factors(withheld=True)
            self._withheld_gradients.arm(withheld)
        if self._penalty_gradient is not None:
            self._penalty_gradient.arm()

    def complete_lisa_gradients(self, optimizer) -> None:
        """What the schedule does to a step's gradients once they are complete, before the optimizer applies them.

        The backward passes already zeroed the gradients the step withholds and added the interpolation penalty's
        (:mod:`.gradients`), so the Trainer's clip and its logged ``grad_norm`` saw exactly what is applied. Here,
        once per optimizer step (``on_pre_optimizer_step``): the withheld gradients become ``None`` (the optimizer
        skips them: no momentum, no weight decay), the step's mask importance is folded, and what no backward pass
        reached is done now (the penalty of a ``β`` outside this step's graph; parameters whose gradient bypasses
        autograd's accumulation, e.g. FSDP2's shards).
        """
        if self._gradients_completed:
            return
        self._gradients_completed = True
        if self._withheld_gradients is not None:
            self._withheld_gradients.disarm()
        added = frozenset(self._penalty_gradient.disarm()) if self._penalty_gradient is not None else frozenset()
        if self.layer_scheduler is not None:
            stray = self.layer_scheduler.drop_stray_gradients()
            if stray and not self._warned_stray:
                self._warned_stray = True
                logger.warning(
                    "LISA: %d frozen parameter(s) received gradients at step %d: something re-enabled requires_grad "
                    "behind the schedule (a library or user code). Their gradients were dropped, so they did not "
                    "move; the compute was wasted.", len(stray), self._global_step,
                )
        if self.mask_scheduler is not None:
            self.mask_scheduler.end_step()
        self._apply_penalty(optimizer, added)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.complete_lisa_gradients(optimizer)
        self._relay("on_pre_optimizer_step", args, state, control, optimizer=optimizer, **kwargs)
        self._gradients_completed = False
        if self.layer_scheduler is not None and self.layer_scheduler.lisa_sampling == "importance":
            # the sampler's running norm reads the gradients as the optimizer gets them (unscaled, clipped)
            self.layer_scheduler.observe_gradients()

    def _apply_penalty(self, optimizer, added: frozenset) -> None:
        """Hook for the adapter form's interpolation penalty (nothing to do for full-parameter LISA); ``added``: the
        ``id`` of each ``β`` whose term the backward passes added already."""

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_gradient_hooks()
        self._relay("on_train_end", args, state, control, **kwargs)
        # leave the model as it was handed over (every candidate trainable), e.g. for a second trainer.train()
        if self.layer_scheduler is not None:
            self.layer_scheduler.restore_trainable()
        if self.mask_scheduler is not None:
            self.mask_scheduler.set_tracking(False)
            self.mask_scheduler.reset_importance()
