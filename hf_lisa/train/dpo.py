"""``hf-lisa train --stage dpo``: TRL's ``DPOTrainer`` with everything :class:`~hf_lisa.trainer.LisaTrainer`
adds, its ``DPOConfig`` built from the run's ``TrainingArguments``, and the reference model each method needs.

* **The trainer** (:class:`LisaDPOTrainer`): ``LisaTrainer``'s behaviour composed over ``DPOTrainer`` by inheritance
  (``LisaTrainer`` only extends ``Trainer`` methods through ``super()``): layer-wise LR decay, the optimizer stepped in
  the backward pass, the embeddings' 8-bit state, the CPU heap trim, atomic checkpoints with the LISA schedule inside,
  no Hub token in its pickles, the whole-run ``train_loss`` and the progress guard. ``--chunked_loss`` has nothing to
  do: TRL's fused LM head computes the log-probabilities a tile of positions at a time.
* **The configuration** (:func:`dpo_config`): every ``TrainingArguments`` field carried over as it is (a value that
  TRL's ``DPOConfig`` would change is refused, never dropped), with ``beta=--dpo_beta``, ``max_length=--max_seq_length``
  and ``dataset_num_proc=--preprocessing_num_workers``.
* **The reference model** (:func:`reference_model`): for adapter methods (LISA adapters, LoRA, DoRA) none, since the
  base model with the adapters disabled is the reference (no memory); for the methods that train the weights
  (full-parameter LISA, full fine-tuning), a frozen copy of the model as loaded, before any step: one more copy of
  the weights in their dtype (no gradients, no optimizer state).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Optional

from torch import nn

from ..errors import UsageError
from ..methods import get_method
from ..trainer.trl_dpo import LisaDPOConfig, LisaDPOTrainer
from .run_folder.output_dir import RunTrainingArguments
from ..data.preference import apply_length_policy, hold_out_after_skipping
from ..data.validation import LINE_COLUMN

logger = logging.getLogger("hf_lisa.train")

# ----------------------------------------------------------------------------------------------------------------------
# DPOConfig from the parsed TrainingArguments
# ----------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunDPOConfig(LisaDPOConfig, RunTrainingArguments):
    """The library's :class:`~hf_lisa.trainer.trl.LisaDPOConfig` with the fields ``hf-lisa train`` adds
    (``--keep_checkpoints``, ...), so that the arguments of a ``--stage dpo`` run are one object, as for SFT."""


#: DPOConfig settings the run sets itself: ``{field: (value, why)}``
DPO_SETTINGS = {
    "chunked_loss": (False, "TRL's fused LM head already computes the log-probabilities a tile of positions at a "
                            "time"),
    "prediction_loss_only": (True, "the DPO metrics come from the loss computation; logits would cost a second "
                                   "forward pass per evaluation batch, and no metric reads them"),
}


def dpo_config(training_args, *, beta: float, max_seq_length: int, num_proc: Optional[int]) -> RunDPOConfig:
    """A :class:`RunDPOConfig` holding every field of ``training_args`` as it is, with ``beta``,
    ``max_length=max_seq_length``, ``dataset_num_proc=num_proc`` and :data:`DPO_SETTINGS`.

    Raises:
        UsageError: naming the fields of ``training_args`` that ``LisaDPOConfig`` lacks, or whose value it would not
            keep (nothing is dropped silently).
    """
    names = [f.name for f in dataclasses.fields(training_args) if f.init]
    own = {f.name for f in dataclasses.fields(RunDPOConfig)}
    missing = [name for name in names if name not in own]
    if missing:
        raise UsageError(f"--stage dpo cannot carry {', '.join('--' + n for n in missing)} over into TRL's "
                         f"DPOConfig ({type(training_args).__name__} has fields it lacks).")
    settings = {name: value for name, (value, _) in DPO_SETTINGS.items()}
    config = RunDPOConfig(**{name: getattr(training_args, name) for name in names if name not in settings},
                           **settings, beta=beta, max_length=max_seq_length, dataset_num_proc=num_proc)
    lost = [f"--{name}={getattr(training_args, name)!r} (DPOConfig: {getattr(config, name)!r})" for name in names
            if name not in settings and getattr(config, name) != getattr(training_args, name)]
    if lost:
        raise UsageError(f"--stage dpo cannot carry {', '.join(lost)} over into TRL's DPOConfig; change or remove "
                         "the option(s).")
    return config


# ----------------------------------------------------------------------------------------------------------------------
# The reference model, and the trainer of a run
# ----------------------------------------------------------------------------------------------------------------------
def reference_model(model: nn.Module, method: str) -> Optional[nn.Module]:
    """The model DPO measures the policy against: ``None`` for adapter methods (the base model, adapters disabled),
    else a frozen copy of ``model``, made before ``apply_method`` and training touch it."""
    if get_method(method).is_adapter:
        return None
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


@contextlib.contextmanager
def _datasets_cache(enabled: bool):
    """``datasets``' cache off inside (``--overwrite_cache``: TRL's tokenisation is recomputed)."""
    import datasets

    was = datasets.is_caching_enabled()
    if not enabled:
        datasets.disable_caching()
    try:
        yield
    finally:
        if was and not enabled:
            datasets.enable_caching()


def dpo_trainer(model, ref_model, training_args, data_args, lisa_args, rows, tokenizer, report, callbacks,
                held_out: int = 0, **trainer_kwargs) -> LisaDPOTrainer:
    """The run's :class:`LisaDPOTrainer` on the preference ``rows`` (:func:`~.preference.preference_datasets`):
    TRL tokenises them, then ``--overlength`` applies (:func:`~.preference.apply_length_policy`, counted in
    ``report``). ``held_out > 0``: the validation rows were held out of the training rows, and are drawn again after
    skipping (:func:`~.preference.hold_out_after_skipping`). ``trainer_kwargs``: ``LisaTrainer``'s options."""
    config = dpo_config(training_args, beta=lisa_args.dpo_beta, max_seq_length=data_args.max_seq_length,
                        num_proc=data_args.preprocessing_num_workers)
    validation = rows.get("validation")
    emptied = validation is not None and len(validation) == 0  # every held-out pair was a bad row
    with _datasets_cache(not data_args.overwrite_cache):
        trainer = LisaDPOTrainer(
            model=model, ref_model=ref_model, args=config, train_dataset=rows["train"],
            # TRL cannot prepare an empty dataset: one training pair stands in until the held-out pairs are drawn
            eval_dataset=rows["train"].select(range(1)) if emptied else validation,
            processing_class=tokenizer, callbacks=callbacks,
            **trainer_kwargs,
        )
    trainer.train_dataset = apply_length_policy(
        trainer.train_dataset, rows["train"][LINE_COLUMN], rows["train"], "train", data_args.max_seq_length,
        data_args.overlength, report,
    )
    if validation is None:
        return trainer
    kept = None if emptied else apply_length_policy(
        trainer.eval_dataset, validation[LINE_COLUMN], validation, "validation", data_args.max_seq_length,
        data_args.overlength, report, required=not held_out,
    )
    if held_out:
        trainer.train_dataset, kept = hold_out_after_skipping(
            trainer.train_dataset, kept, rows, config.seed, report, data_args.validation_split_percentage)
    trainer.eval_dataset = kept
    return trainer
