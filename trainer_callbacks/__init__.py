"""Trainer callbacks that schedule LISA's masks in a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (E+H+γL, no PEFT).
* :class:`LisaAdapterCallback`: layerwise sampling and sparse-mask re-selection for ``hf_lisa.LisaConfig`` adapters.

The decisions themselves live in :mod:`hf_lisa.scheduler`; see ``docs/scheduling.md``.
"""

from .lisa import LisaAdapterCallback, LisaCallback, check_lisa_training_setup

__all__ = ["LisaAdapterCallback", "LisaCallback", "check_lisa_training_setup"]
