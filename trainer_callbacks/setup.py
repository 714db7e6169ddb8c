"""How the LISA callbacks are handed and prepare the ``transformers.Trainer`` that runs them.

A Trainer does not pass itself to its callbacks' events, and the callbacks never look for it (no stack frames): what
they do with the objects the events hand over (model, optimizer, arguments, data loader) is complete in any Trainer.
A few things need the Trainer object itself, and it is handed over explicitly, as transformers' own
``JITCheckpointCallback.set_trainer`` is: :func:`prepare_trainer` (``LisaTrainer``, the axolotl plugin and
:func:`hf_lisa.distributed.configure_trainer_for_lisa` call it).

* :func:`prepare_trainer` / :func:`configure_trainer`: under DDP the wrap gets unused-parameter detection and the
  active-set all-reduce (:func:`hf_lisa.distributed.configure_trainer_for_lisa`), the LISA callbacks run before the
  reporting integrations, a :class:`~.progress.TrainingProgressGuard` joins, and the first sparse masks are
  calibrated through the Trainer's own ``compute_loss``.
* :func:`check_engine`: the run's one engine check (:func:`hf_lisa.distributed.check_layer_switching_supported`), as
  training begins; :func:`check_lisa_training_setup` is its public alias for a Trainer's arguments.
* The fixed batch on which the adapter callback measures the loss around a mask re-selection (:func:`probe_batch`),
  and the adapter's tuner and loss scale.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

CONFIGURED = "_hf_lisa_configured"  # set on the Trainer by hf_lisa.distributed.configure_trainer_for_lisa

__all__ = ["check_engine", "check_lisa_training_setup", "configure_trainer", "prepare_trainer"]

#: set on the LISA callbacks (and read by hf_lisa.distributed.configure_trainer_for_lisa, which cannot import them)
WANTS_TRAINER = "_hf_lisa_wants_trainer"


def prepare_trainer(trainer) -> list:
    """Hand ``trainer`` to every LISA callback it holds, which prepares it (:func:`configure_trainer`); idempotent.
    Returns those callbacks.

    Call it after building a Trainer with LISA callbacks, before ``trainer.train()``, where its features are wanted:
    a plain ``Trainer`` or TRL trainer runs the callbacks without it, except under DDP, which needs it (the callbacks
    refuse to start there otherwise). ``LisaTrainer`` calls it itself.

    Example:
        ```py
        >>> from hf_lisa.trainer_callbacks import LisaCallback, prepare_trainer
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[LisaCallback()])  # doctest: +SKIP
        >>> prepare_trainer(trainer)  # doctest: +SKIP
        ```
    """
    ours = [cb for cb in trainer.callback_handler.callbacks if getattr(cb, WANTS_TRAINER, False)]
    for callback in ours:
        callback.set_trainer(trainer)
    return ours



def launched_world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``), whether or not the Trainer sees them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def configure_trainer(trainer, lisa_callbacks: Sequence) -> None:
    """Prepare a Trainer for the LISA callbacks it holds; idempotent.

    * Under DDP, :func:`hf_lisa.distributed.configure_trainer_for_lisa` (unused-parameter detection, the active-set
      all-reduce, the wrap check after ``evaluate()``), unless the user already called it.
    * ``lisa_callbacks`` and the engine's callbacks run ahead of the reporting integrations (TensorBoard, W&B, ...)
      and the printer, which ``Trainer`` registers before user callbacks, so the values they add in ``on_log`` reach
      all of them.
    """
    from hf_lisa.trainer_callbacks.ordering import run_before_reporting_integrations

    if not getattr(trainer, CONFIGURED, False):
        from hf_lisa.distributed import configure_trainer_for_lisa

        configure_trainer_for_lisa(trainer)
    engine = [cb for cb in trainer.callback_handler.callbacks if getattr(cb, "_hf_lisa_engine_callback", False)]
    run_before_reporting_integrations(trainer, [*lisa_callbacks, *engine])


def check_engine(args, model, optimizer, scheduler, form: str, trainer=None) -> str:
    """The run's one engine check, as training begins (the LISA callbacks' ``on_train_begin``).

    Calls :func:`hf_lisa.distributed.check_layer_switching_supported` with the Trainer's wrapped model (DDP, FSDP or
    DeepSpeed engine) when the callback was handed the ``trainer``, else the model its events carry (with the
    optimizer, that identifies DeepSpeed and FSDP; a run of several processes is not started without the Trainer),
    its optimizer and arguments, and the candidates of ``scheduler`` (a ``LayerwiseScheduler``, or ``None`` when no
    layer switches: then nothing is refused).
    """
    from hf_lisa.distributed import check_layer_switching_supported

    return check_layer_switching_supported(
        trainer.model_wrapped if trainer is not None else model,
        optimizer,
        form=form,
        params=None if scheduler is None else scheduler.candidates,
        args=args,
        freezes=scheduler is not None and scheduler.freezes_candidates,
    )


def check_lisa_training_setup(args, model=None, freezes_parameters: bool = True, form: str = "full-parameter") -> str:
    """Public alias of :func:`hf_lisa.distributed.check_layer_switching_supported` for a Trainer's arguments.

    The one engine rule lives there, and the LISA callbacks call it once per run as training begins. This alias keeps
    the 0.1 signature: ``check_lisa_training_setup(args, model, freezes_parameters, form)`` is
    ``check_layer_switching_supported(model, args=args, freezes=freezes_parameters, form=f"{form} LISA")``.

    Returns:
        The engine the Trainer runs (see :func:`hf_lisa.distributed.detect_engine`).

    Raises:
        hf_lisa.distributed.UnsupportedEngineError: (a ``ValueError``) for the setups in which layer switching would
            train silently wrong, e.g. DeepSpeed ZeRO; the message names the reason and what to use instead.
    """
    from hf_lisa.distributed import check_layer_switching_supported

    return check_layer_switching_supported(model, args=args, freezes=freezes_parameters, form=f"{form} LISA")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def probe_batch(dataloader, batch_size: int, device) -> Any:
    """The first ``batch_size`` training examples, collated, without touching the training dataloader or any RNG.

    The same batch on every rank, so the loss measured around a mask re-selection is the same number everywhere.
    """
    base = getattr(dataloader, "base_dataloader", dataloader)
    dataset, collate = base.dataset, base.collate_fn
    if isinstance(dataset, torch.utils.data.IterableDataset):
        examples = [example for _, example in zip(range(batch_size), dataset)]
    else:
        examples = [dataset[i % len(dataset)] for i in range(batch_size)] if len(dataset) else []
    if not examples:
        raise ValueError("The training dataset is empty; LISA's mask schedule needs training batches.")
    return _to_device(collate(examples), device)


def tuner_of(model):
    """The ``LisaModel`` inside a (possibly wrapped) ``PeftModel``, or ``None``."""
    from hf_lisa.tuner.model import LisaModel

    while type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        model = model.module
    base = getattr(model, "base_model", None)
    return base if isinstance(base, LisaModel) else None


def unscaled_factor(optimizer) -> float:
    """The loss scale still applied to the gradients at ``on_pre_optimizer_step`` (1.0 without fp16 loss scaling).

    With fp16 loss scaling, gradients are unscaled by gradient clipping; without clipping they are still scaled when
    the optimizer step begins, and a gradient added there must be scaled alike.
    """
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return 1.0
    from torch.amp.grad_scaler import OptState

    inner = getattr(optimizer, "optimizer", optimizer)
    stage = scaler._per_optimizer_states[id(inner)]["stage"]
    return 1.0 if stage is OptState.UNSCALED else float(scaler.get_scale())
