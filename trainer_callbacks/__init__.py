"""Trainer callbacks that schedule LISA's masks in a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (E+H+γL, no PEFT).
* :class:`LisaAdapterCallback`: layerwise sampling and sparse-mask re-selection for ``hf_lisa.LisaConfig`` adapters.

The decisions themselves live in :mod:`hf_lisa.scheduler`; see ``docs/scheduling.md``.
"""

from __future__ import annotations

if __name__ in ("trainer_callbacks",):  # the pre-0.2 top-level name: hand over to the one canonical module
    import importlib as _importlib
    import sys as _sys
    import warnings as _warnings

    _warnings.warn(
        "`import trainer_callbacks` is deprecated and will be removed in hf-lisa 0.3; use "
        "`import hf_lisa.trainer_callbacks` (the same module).",
        FutureWarning,
        stacklevel=2,
    )
    _canonical = _importlib.import_module("hf_lisa.trainer_callbacks")
    for _sub in ('lisa', 'monitoring', 'ordering'):
        _sys.modules[f"trainer_callbacks.{_sub}"] = _importlib.import_module(f"hf_lisa.trainer_callbacks.{_sub}")
    _sys.modules[__name__] = _canonical
else:
    from .lisa import LisaAdapterCallback, LisaCallback, check_lisa_training_setup

    __all__ = ["LisaAdapterCallback", "LisaCallback", "check_lisa_training_setup"]
