"""Trainer callbacks that schedule LISA's masks in a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (E+H+γL, no PEFT).
* :class:`LisaAdapterCallback`: layerwise sampling and sparse-mask re-selection for ``hf_lisa.LisaConfig`` adapters.

The decisions themselves live in :mod:`hf_lisa.scheduler`; see ``docs/scheduling.md``. Modules: :mod:`.lisa` (the two
callbacks), :mod:`.base` (what they share), :mod:`.setup` (:func:`prepare_trainer`, which hands them their Trainer,
and the run's engine check), :mod:`.gradients` (the step's gradient edits in the backward pass), :mod:`.state`
(checkpoint and resume of the schedule), :mod:`.monitoring` (``TrainingMonitorCallback``), :mod:`.ordering` (callback
order), :mod:`.progress` (``TrainingProgressGuard``: a run that trains nothing stops).
:func:`check_lisa_training_setup` is a public alias of :func:`hf_lisa.distributed.check_layer_switching_supported`.
"""

from __future__ import annotations

from .lisa import LisaAdapterCallback, LisaCallback
from .progress import TrainingProgressGuard
from .setup import check_lisa_training_setup, prepare_trainer

__all__ = ["LisaAdapterCallback", "LisaCallback", "TrainingProgressGuard", "check_lisa_training_setup",
           "prepare_trainer"]
