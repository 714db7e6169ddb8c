"""LISA in TRL's trainers: :class:`LisaTrainer`'s behaviour composed over ``SFTTrainer`` and ``DPOTrainer``, with
configs that carry :class:`~hf_lisa.trainer.LisaTrainingArguments`' fields beside TRL's.

``LisaTrainer`` only extends ``Trainer`` methods through ``super()``, so it composes over TRL's trainers by
inheritance: layer-wise LR decay, the optimizer stepped in the backward pass, the embeddings' 8-bit state, the CPU
heap trim, atomic checkpoints with the LISA schedule inside, no Hub token in its pickles, the whole-run
``train_loss``, the progress guard, and the LISA callbacks handed their Trainer. The LISA schedule comes, as in any
Trainer, from the callbacks (:mod:`hf_lisa.trainer_callbacks`). Importing this module imports TRL's SFT trainer; the
DPO names import TRL's DPO trainer on first use (:mod:`.trl_dpo`: some TRL releases pinned by LLaMA-Factory need
``mergekit`` for it, which SFT users need not install).

Example:
    ```py
    >>> from hf_lisa.trainer.trl import LisaSFTConfig, LisaSFTTrainer
    >>> from hf_lisa.trainer_callbacks import LisaCallback
    >>> args = LisaSFTConfig("out", layerwise_lr_decay=0.9, report_to="none")  # doctest: +SKIP
    >>> trainer = LisaSFTTrainer(model=model, args=args, train_dataset=ds,
    ...                          callbacks=[LisaCallback(lisa_activated_layers=2)])  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trl import SFTConfig, SFTTrainer

from .lisa_trainer import LisaTrainer
from .training_args import LisaTrainingArguments

__all__ = ["LisaDPOConfig", "LisaDPOTrainer", "LisaSFTConfig", "LisaSFTTrainer", "TRL_REFERENCE_ADAPTER"]


@dataclasses.dataclass
class LisaSFTConfig(SFTConfig, LisaTrainingArguments):
    """TRL's ``SFTConfig`` with :class:`~hf_lisa.trainer.LisaTrainingArguments`' fields."""


class LisaSFTTrainer(LisaTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with ``LisaTrainer``'s additions; its settings come from a :class:`LisaSFTConfig`."""


def __getattr__(name: str) -> Any:
    if name in ("LisaDPOConfig", "LisaDPOTrainer", "TRL_REFERENCE_ADAPTER"):
        from . import trl_dpo

        return getattr(trl_dpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
