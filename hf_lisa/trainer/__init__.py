"""The library face: the Trainer classes hf-lisa adds to transformers, for users of the Trainer API.

* :class:`LisaTrainer` (:mod:`.lisa_trainer`): ``transformers.Trainer`` with layer-wise learning-rate decay,
  checkpoints that appear only once complete (:mod:`.atomic`), no Hub token in its saves, a progress guard, and the
  LISA callbacks handed their Trainer (:func:`hf_lisa.trainer_callbacks.prepare_trainer`);
* :class:`LisaTrainingArguments` (:mod:`.training_args`): its settings as typed ``TrainingArguments`` fields, checked
  once in ``__post_init__``;
* :mod:`.trl`: the same over TRL's ``SFTTrainer`` and ``DPOTrainer`` (``LisaSFTTrainer`` / ``LisaSFTConfig``,
  ``LisaDPOTrainer`` / ``LisaDPOConfig``); imported on its own, since it imports TRL;
* :func:`.methods.setup_method`: a model set up for any method of the registry (``lisa``, ``lisa-adapter``, ``lora``,
  ``dora``, ``full``) with the callbacks it needs, as ``hf-lisa train`` builds it.

The LISA schedule itself is the callbacks' (:mod:`hf_lisa.trainer_callbacks`): they work in any Trainer, this one
included. ``hf-lisa train`` (:mod:`hf_lisa.train`, the application) runs on this class and builds its methods with
:func:`.methods.setup_method`.

Example:
    ```py
    >>> from hf_lisa.trainer import LisaTrainer, LisaTrainingArguments
    >>> from hf_lisa.trainer_callbacks import LisaCallback
    >>> args = LisaTrainingArguments("out", layerwise_lr_decay=0.9, report_to="none")
    >>> trainer = LisaTrainer(model=model, args=args, train_dataset=ds,
    ...                       callbacks=[LisaCallback(lisa_activated_layers=2)])  # doctest: +SKIP
    ```
"""

from __future__ import annotations

from .lisa_trainer import PRIVATE_OVERRIDES, LisaTrainer
from .training_args import LisaTrainingArguments

__all__ = ["LisaTrainer", "LisaTrainingArguments", "PRIVATE_OVERRIDES"]
