"""Checkpoint and resume of the LISA callbacks' schedule.

The callbacks are ``ExportableState``: ``Trainer._save_checkpoint`` stores their :meth:`ScheduleCheckpoint.state` in
``checkpoint-N/trainer_state.json``. It holds the constructor arguments and the schedule's small values (format
version, step, γ, K, strategy, seed, counters, the active set), with each tensor replaced by a reference. The tensors
(the sampler's generator state, the mask bookkeeping, importance accumulators) go to
``checkpoint-N/lisa_state.safetensors``, written atomically by the process that saves (rank 0 under DDP): by
``on_save``, after ``transformers.Trainer`` has written the checkpoint folder, or, under
:class:`hf_lisa.trainer.LisaTrainer` (which renames a checkpoint into place only once complete), before that rename
(:meth:`ScheduleCheckpoint.save_pending_state`). See :mod:`hf_lisa.scheduler.state` for the format;
:func:`stored_schedule_settings` reads the settings a checkpoint's schedule was written with.

Resuming from ``checkpoint-N`` restores the schedule *with or without*
``TrainingArguments(restore_callback_states_from_checkpoint=True)``: with the flag the Trainer rebuilds the callback
from its stored state; without it, the callback reads the same values from the resumed ``TrainerState``. The tensors
come from the checkpoint folder being resumed, recognised by the save id stored in both files: ``output_dir/
checkpoint-N``, or the folder named by ``TrainingArguments(resume_from_checkpoint=...)`` (:func:`resume_candidates`;
no callback event carries the argument of ``trainer.train(resume_from_checkpoint=...)``).
"""

from __future__ import annotations

import json
import os
import uuid
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


def resume_candidates(args, state) -> list[str]:
    """Where the checkpoint being resumed can be, in order: ``TrainingArguments.resume_from_checkpoint``, then
    ``output_dir/checkpoint-N`` (``N`` the resumed step; ``train(resume_from_checkpoint=True)`` resolves there).

    ``trainer.train(resume_from_checkpoint=path)`` is an argument of ``train()`` that no callback event carries: the
    schedule's tensor file is recognised by the ``save_id`` that ``trainer_state.json`` (which the Trainer does hand
    over) stores with it, so a folder outside ``output_dir`` is found when ``args.resume_from_checkpoint`` names it,
    and is refused clearly otherwise (never a same-step file of another run).
    """
    found = []
    path = getattr(args, "resume_from_checkpoint", None)
    if isinstance(path, str):
        found.append(path)
    found.append(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
    return list(dict.fromkeys(found))


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
    _unsaved_id: Optional[str] = None

    def _ctor_args(self) -> dict[str, Any]:
        raise NotImplementedError

    def state(self) -> dict:
        """The ``ExportableState`` entry: constructor arguments and the schedule's small values (tensors by reference).

        The Trainer calls it while it writes a checkpoint, on the process that saves; the tensors wait for ``on_save``.
        """
        tree = None
        self._unsaved_tensors = self._unsaved_id = None
        if self.layer_scheduler is not None or self.mask_scheduler is not None:
            self._unsaved_id = uuid.uuid4().hex  # names the tensor file that belongs to this trainer_state.json
            tree, self._unsaved_tensors = split_tensors(
                {
                    "version": SCHEDULER_STATE_VERSION,
                    "global_step": self._global_step,
                    "save_id": self._unsaved_id,
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
            write_state_file(directory, tensors, global_step=str(global_step), save_id=self._unsaved_id or "")

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
        return join_tensors(stored, self._stored_tensors(args, state, stored.get("save_id")))

    def _stored_tensors(self, args, state, save_id: Optional[str]) -> dict[str, torch.Tensor]:
        """The tensors saved with the resumed ``trainer_state.json``: the file of :func:`resume_candidates` whose
        ``save_id`` matches (the first candidate for a checkpoint written before save ids)."""
        candidates = resume_candidates(args, state)
        existing = [d for d in candidates if os.path.isfile(os.path.join(d, LISA_STATE_FILE))]
        if not existing:
            raise FileNotFoundError(
                f"{' and '.join(os.path.join(d, LISA_STATE_FILE) for d in candidates)}: {LISA_STATE_FILE} is missing. "
                "The LISA schedule keeps its tensors there, next to the checkpoint it was saved with. The callbacks "
                "are not told which folder trainer.train(resume_from_checkpoint=...) resumes: when it is not "
                "output_dir/checkpoint-N, name it in TrainingArguments(resume_from_checkpoint=...) as well."
            )
        for directory in existing:
            tensors, metadata = read_state_file(directory)
            if metadata.get("global_step") != str(state.global_step):
                continue
            if not save_id or metadata.get("save_id") == save_id:
                return tensors
        directory = existing[0]
        _, metadata = read_state_file(directory)
        if metadata.get("global_step") != str(state.global_step):
            raise RuntimeError(
                f"{os.path.join(directory, LISA_STATE_FILE)} was written at step {metadata.get('global_step')} but "
                f"training resumes at step {state.global_step} from {directory}: the tensors of the LISA "
                "schedule belong to another checkpoint. Resume from the checkpoint folder the Trainer wrote."
            )
        raise RuntimeError(
            f"The LISA schedule resumed at step {state.global_step} was saved with a tensor file of save id {save_id}, "
            f"and none of {', '.join(os.path.join(d, LISA_STATE_FILE) for d in existing)} is that file: they belong "
            "to another run. "
            "The callbacks are not told which folder trainer.train(resume_from_checkpoint=...) resumes; when it is "
            "not output_dir/checkpoint-N, name it in TrainingArguments(resume_from_checkpoint=...) as well."
        )
