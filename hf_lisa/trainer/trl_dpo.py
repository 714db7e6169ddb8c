"""LISA in TRL's ``DPOTrainer``: :class:`LisaDPOTrainer` and :class:`LisaDPOConfig` (also importable from
:mod:`hf_lisa.trainer.trl`). A module of its own because importing TRL's DPO trainer needs more than its SFT trainer
on some TRL releases (``mergekit``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn
from trl import DPOConfig, DPOTrainer

from .lisa_trainer import LisaTrainer
from .training_args import LisaTrainingArguments

__all__ = ["LisaDPOConfig", "LisaDPOTrainer", "TRL_REFERENCE_ADAPTER"]


@dataclasses.dataclass
class LisaDPOConfig(DPOConfig, LisaTrainingArguments):
    """TRL's ``DPOConfig`` with :class:`~hf_lisa.trainer.LisaTrainingArguments`' fields. ``chunked_loss`` has nothing
    to do under DPO: TRL's fused LM head computes the log-probabilities a tile of positions at a time."""


#: the adapter TRL 1.16 copies a given ``PeftModel``'s adapter into, as the reference of a re-trained adapter
TRL_REFERENCE_ADAPTER = "ref"


class LisaDPOTrainer(LisaTrainer, DPOTrainer):
    """TRL's ``DPOTrainer`` with ``LisaTrainer``'s additions (its settings from a :class:`LisaDPOConfig`), for a model
    whose adapter (if any) is already in place.

    * A ``PeftModel`` with a fresh adapter (``fresh_adapter=True``, the default: as ``apply_method`` builds it) gets the
      base model as reference (the adapters disabled), as ``DPOTrainer(..., peft_config=...)`` gives: TRL 1.16 copies a
      given ``PeftModel``'s adapter into a frozen ``"ref"`` adapter, meant for re-training a trained one; a fresh
      adapter starts as the identity (``B = 0``), so the copy computes the base model's function at the cost of a
      second adapter, and is dropped. Pass ``fresh_adapter=False`` for a trained adapter: TRL's copy stays its
      reference.
    * The trainable parameters keep the dtype ``apply_method`` gave them: TRL casts a quantized model's trainable
      parameters to bf16 (its QLoRA recipe), which the SFT path does not do.
    * No model card at each checkpoint: hf-lisa writes its own with the final model (:mod:`hf_lisa.hub.card`), and
      TRL's would land in ``output_dir`` outside the run's manifest.
    """

    def __init__(self, model: nn.Module, ref_model: Optional[nn.Module] = None, *args, fresh_adapter: bool = True,
                 **kwargs):
        adapters = getattr(model, "peft_config", None)
        fresh_adapter = fresh_adapter and adapters is not None and TRL_REFERENCE_ADAPTER not in adapters
        dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
        super().__init__(model, ref_model, *args, **kwargs)
        if fresh_adapter and TRL_REFERENCE_ADAPTER in self.model.peft_config:
            self.model.delete_adapter(TRL_REFERENCE_ADAPTER)
        for name, param in self.model.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])

    def create_model_card(self, *args, **kwargs) -> None:
        return None
