"""LISA as a PEFT tuner, in PEFT's own config / layer / model split (compare ``peft/tuners/lora/``).

* :mod:`.peft_type`: the ``PeftType.LISA`` member (a leaf module);
* :mod:`.config`: [`LisaConfig`], the single source of the method's settings and their validation;
* :mod:`.masks`: the structured-sparse mask patterns (unstructured, N:M, block, row, column) and their selection;
* :mod:`.layer`: [`LisaLayer`], the adapter on a ``Linear``/``Conv1D`` base: ``W + s·M⊙(BA)``;
* :mod:`.model`: [`LisaModel`], the ``BaseTuner`` that injects layers and owns layer interpolation.

Importing this package registers LISA with PEFT (``register_peft_method``), next to LoRA.
"""

from __future__ import annotations

from .config import LisaConfig
from .layer import LisaLayer, Linear
from .model import LisaModel
from .peft_type import PEFT_TYPE_LISA


def register() -> None:
    """Register LISA with PEFT. Idempotent: importing ``hf_lisa`` twice (or reloading it) does not raise."""
    from peft.mapping import (
        PEFT_TYPE_TO_CONFIG_MAPPING,
        PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
        PEFT_TYPE_TO_PREFIX_MAPPING,
        PEFT_TYPE_TO_TUNER_MAPPING,
    )
    from peft.utils import register_peft_method

    if PEFT_TYPE_TO_CONFIG_MAPPING.get(PEFT_TYPE_LISA) is LisaConfig and PEFT_TYPE_TO_TUNER_MAPPING.get(
        PEFT_TYPE_LISA
    ) is LisaModel:
        return
    # a reload of hf_lisa defines new classes: replace the stale registration instead of failing on the duplicate
    for mapping in (
        PEFT_TYPE_TO_CONFIG_MAPPING,
        PEFT_TYPE_TO_TUNER_MAPPING,
        PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
        PEFT_TYPE_TO_PREFIX_MAPPING,
    ):
        mapping.pop(PEFT_TYPE_LISA, None)
    register_peft_method(name="lisa", config_cls=LisaConfig, model_cls=LisaModel, prefix="lisa_")


register()

__all__ = ["LisaConfig", "LisaLayer", "LisaModel", "Linear", "PEFT_TYPE_LISA", "register"]
