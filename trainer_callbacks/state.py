"""Checkpoint and resume of the LISA callbacks' schedule.

The callbacks are ``ExportableState``: ``Trainer._save_checkpoint`` stores their :meth:`ScheduleCheckpoint.state` in
``checkpoint-N/trainer_state.json``. It holds the constructor arguments and the schedule's small values (format
version, step, γ, K, strategy, seed, counters, the active set), with each tensor replaced by a reference. The tensors
(the sampler's generator state, the mask bookkeeping, importance accumulators) go to
``checkpoint-N/lisa_state.safetensors``, written atomically from ``on_save``, which runs after the Trainer has written
the checkpoint folder, by the process that saves (rank 0 under DDP). See :mod:`hf_lisa.scheduler.state` for the format.

Resuming from ``checkpoint-N`` restores the schedule *with or without*
``TrainingArguments(restore_callback_states_from_checkpoint=True)``: with the flag the Trainer rebuilds the callback
from its stored state; without it, the callback reads the same values from the resumed ``TrainerState``. The tensors
come from the checkpoint folder being resumed.
"""

from __future__ import annotations

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
        # Trainer._save_checkpoint wrote checkpoint-N (trainer_state.json included, via state()) before this event
        tensors, self._unsaved_tensors = self._unsaved_tensors, None
        if tensors is not None:
            directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            write_state_file(directory, tensors, global_step=str(state.global_step))

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
