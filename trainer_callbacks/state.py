"""Checkpoint and resume of the LISA callbacks' schedule.

The callbacks are ``ExportableState``: ``Trainer._save_checkpoint`` stores their :meth:`ScheduleCheckpoint.state` in
``checkpoint-N/trainer_state.json``. It holds the constructor arguments and the schedule's small values (format
version, step, γ, K, strategy, seed, counters, the active set), with each tensor replaced by a reference. The tensors
(the sampler's generator state, the mask bookkeeping, importance accumulators) go to
``checkpoint-N/lisa_state.safetensors``, written atomically by the process that saves (rank 0 under DDP): by
``on_save``, after ``transformers.Trainer`` has written the checkpoint folder, or, under
:class:`hf_lisa.train.LisaTrainer` (which renames a checkpoint into place only once complete), before that rename
(:meth:`ScheduleCheckpoint.save_pending_state`). See :mod:`hf_lisa.scheduler.state` for the format;
:func:`stored_schedule_settings` reads the settings a checkpoint's schedule was written with.

Resuming from ``checkpoint-N`` restores the schedule *with or without*
``TrainingArguments(restore_callback_states_from_checkpoint=True)``: with the flag the Trainer rebuilds the callback
from its stored state; without it, the callback reads the same values from the resumed ``TrainerState``. The tensors
come from the checkpoint folder being resumed.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

import torch
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_lisa.scheduler.common import SCHEDULER_STATE_VERSION
from hf_lisa.scheduler.state import (
    LISA_STATE_FILE,
    check_state_version,
    join_tensors,
    read_state_file,
    split_tensors,
    write_state_file,
)

from .setup import trainer_frame


def resumed_checkpoint(args, state) -> str:
    """The checkpoint folder being resumed.

    ``trainer.train(resume_from_checkpoint=...)`` (a local of the Trainer's training loop, ``True`` already resolved to
    the last checkpoint), else ``TrainingArguments.resume_from_checkpoint``, else ``output_dir/checkpoint-N``.
    """
    frame = trainer_frame()
    path = None if frame is None else frame.f_locals.get("resume_from_checkpoint")
    if not isinstance(path, str):
        path = getattr(args, "resume_from_checkpoint", None)
    if isinstance(path, str):
        return path
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


#: the settings a resumed schedule must keep, by ``hf-lisa train`` option: where the stored schedule holds each
RESUMED_SETTINGS = {
    "lisa_activated_layers": ("layers", "sampler", "num_active"),
    "lisa_sampling": ("layers", "sampler", "strategy"),
    "lisa_interval_steps": ("layers", "interval_steps"),
    "mask_update_interval": ("masks", "update_interval"),
    "importance_steps": ("masks", "importance_steps"),
}


def stored_schedule_settings(checkpoint: str) -> dict[str, dict[str, Any]]:
    """The settings of the LISA schedules stored in ``checkpoint/trainer_state.json``, by callback name, e.g.
    ``{"LisaCallback": {"lisa_activated_layers": 2, "lisa_sampling": "uniform", "lisa_interval_steps": 20}}``.

    Keys are those of :data:`RESUMED_SETTINGS`; a schedule without a layer part (an adapter with γ = 0) has
    ``lisa_activated_layers=0``, one without sparse masks no mask settings. Empty for a checkpoint without a schedule.
    Raises ``ValueError`` when the file is not JSON.
    """
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        callbacks = json.load(f).get("stateful_callbacks") or {}
    found: dict[str, dict[str, Any]] = {}
    for name, entry in callbacks.items():
        stored = ((entry.get("attributes") or {}).get("resume_state")) if isinstance(entry, dict) else None
        if not isinstance(stored, dict) or not {"layers", "masks"} & set(stored):
            continue
        settings: dict[str, Any] = {}
        for option, keys in RESUMED_SETTINGS.items():
            value: Any = stored
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                settings[option] = value
        if stored.get("layers") is None:
            settings["lisa_activated_layers"] = 0
        found[name] = settings
    return found


class ScheduleCheckpoint(ExportableState):
    """Save and restore of a LISA callback's schedule (``layer_scheduler``, ``mask_scheduler``).

    A mixin for the LISA callbacks, listed before ``TrainerCallback`` so that its ``on_save`` runs.
    """

    layer_scheduler: Any = None
    mask_scheduler: Any = None
    #: the stored schedule: set by the Trainer when it rebuilds the callback from a checkpoint
    resume_state: Optional[dict] = None
    _global_step: int = 0
    _unsaved_tensors: Optional[dict[str, torch.Tensor]] = None

    def _ctor_args(self) -> dict[str, Any]:
        raise NotImplementedError

    def state(self) -> dict:
        """The ``ExportableState`` entry: constructor arguments and the schedule's small values (tensors by reference).

        The Trainer calls it while it writes a checkpoint, on the process that saves; the tensors wait for ``on_save``.
        """
        tree = None
        self._unsaved_tensors = None
        if self.layer_scheduler is not None or self.mask_scheduler is not None:
            tree, self._unsaved_tensors = split_tensors(
                {
                    "version": SCHEDULER_STATE_VERSION,
                    "global_step": self._global_step,
                    "layers": None if self.layer_scheduler is None else self.layer_scheduler.state_dict(),
                    "masks": None if self.mask_scheduler is None else self.mask_scheduler.state_dict(),
                }
            )
        return {"args": self._ctor_args(), "attributes": {"resume_state": tree}}

    def on_save(self, args, state, control, **kwargs):
        # Trainer._save_checkpoint wrote checkpoint-N (trainer_state.json included, via state()) before this event;
        # under LisaTrainer the tensors are in it already (save_pending_state before the rename)
        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.save_pending_state(directory, state.global_step)

    def save_pending_state(self, directory: str, global_step: int) -> None:
        """Write the tensors of the schedule that the last :meth:`state` call stored to ``directory`` (as
        ``lisa_state.safetensors``); nothing when they are written already.

        A Trainer that renames a checkpoint into place only once it is complete calls it before the rename, so that
        no checkpoint exists without the file; otherwise ``on_save`` calls it.
        """
        tensors, self._unsaved_tensors = self._unsaved_tensors, None
        if tensors is not None:
            write_state_file(directory, tensors, global_step=str(global_step))

    def _stored_state(self, args, state) -> Optional[dict]:
        """The schedule saved with the checkpoint being resumed, tensors included; ``None`` for a fresh run."""
        if state.global_step == 0:
            return None
        name = type(self).__name__
        stored = self.resume_state
        if stored is None:
            # without restore_callback_states_from_checkpoint the resumed TrainerState still carries our state
            entry = (state.stateful_callbacks or {}).get(name)
            if isinstance(entry, list):
                raise ValueError(f"Only one {name} per Trainer is supported; found {len(entry)} states.")
            stored = ((entry or {}).get("attributes") or {}).get("resume_state")
        if stored is None:
            warnings.warn(
                f"Resuming at global step {state.global_step} from a checkpoint without {name} state: a new LISA "
                "schedule starts here, so the run will not follow the original run's path."
            )
            return None
        # version 2 had no top-level version; its parts carry it
        parts = [part for part in (stored.get("layers"), stored.get("masks")) if isinstance(part, dict)]
        check_state_version(stored.get("version", parts[0].get("version") if parts else None), f"the {name} schedule")
        if stored["global_step"] != state.global_step:
            raise RuntimeError(
                f"The LISA schedule stored in the checkpoint was saved at step {stored['global_step']} but training "
                f"resumes at step {state.global_step}; resume from a checkpoint written by the Trainer."
            )
        directory = resumed_checkpoint(args, state)
        tensors, metadata = read_state_file(directory)
        if metadata.get("global_step") != str(state.global_step):
            raise RuntimeError(
                f"{os.path.join(directory, LISA_STATE_FILE)} was written at step {metadata.get('global_step')} but "
                f"training resumes at step {state.global_step} from {directory}: the tensors of the LISA "
                "schedule belong to another checkpoint. Resume from the checkpoint folder the Trainer wrote."
            )
        return join_tensors(stored, tensors)
