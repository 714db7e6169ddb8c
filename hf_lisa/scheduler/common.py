"""What the layerwise and mask schedules share: the state format version and the adapter config lookup."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

#: format of the saved schedule state; 3 keeps its tensors in ``lisa_state.safetensors`` (:mod:`.state`)
SCHEDULER_STATE_VERSION = 3


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def lisa_config_of(model: nn.Module, adapter_name: Optional[str] = None):
    """The ``LisaConfig`` of ``adapter_name`` (default: the active adapter) of a PEFT-wrapped model."""
    from ..tuner.config import LisaConfig

    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        raise ValueError(
            f"Expected a PeftModel with a LisaConfig adapter, got {type(model).__name__} without `peft_config`. For a "
            "plain transformers model use full-parameter LISA (trainer_callbacks.LisaCallback)."
        )
    if adapter_name is None:
        adapter_name = getattr(model, "active_adapter", None)
        if not isinstance(adapter_name, str):
            adapter_name = next(iter(peft_config))
    if adapter_name not in peft_config:
        raise ValueError(f"adapter_name={adapter_name!r} is not an adapter of this model; it has {list(peft_config)}.")
    config = peft_config[adapter_name]
    if not isinstance(config, LisaConfig):
        raise ValueError(
            f"Adapter {adapter_name!r} has a {type(config).__name__}, not a LisaConfig; LISA adapter scheduling needs "
            "an adapter created with hf_lisa.LisaConfig (or use trainer_callbacks.LisaCallback without PEFT)."
        )
    return config


def _active_adapter_name(model: nn.Module, adapter_name: Optional[str]) -> str:
    if adapter_name is not None:
        return adapter_name
    name = getattr(model, "active_adapter", None)
    return name if isinstance(name, str) else next(iter(model.peft_config))
