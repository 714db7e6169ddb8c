"""How the LISA callbacks find and prepare the ``transformers.Trainer`` that runs them.

* :func:`configure_trainer`: the LISA callbacks run before the reporting integrations, and under DDP the wrap gets
  unused-parameter detection and the active-set all-reduce (:func:`hf_lisa.distributed.configure_trainer_for_lisa`).
* :func:`check_engine`: the run's one engine check (:func:`hf_lisa.distributed.check_layer_switching_supported`), as
  training begins; :func:`check_lisa_training_setup` is its public alias for a Trainer's arguments.
* The Trainer itself, found on the call stack (:func:`calling_trainer`), the fixed batch on which the adapter callback
  measures the loss around a mask re-selection (:func:`probe_batch`), and the adapter's tuner and loss scale.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Optional, Sequence

import torch

CONFIGURED = "_hf_lisa_configured"  # set on the Trainer by hf_lisa.distributed.configure_trainer_for_lisa

__all__ = ["check_engine", "check_lisa_training_setup", "configure_trainer"]


def trainer_frame() -> Optional[FrameType]:
    """The frame of the ``transformers.Trainer`` method whose event is running (``None`` outside a Trainer).

    Trainer events do not receive the Trainer itself, but a LISA callback must adjust it before ``train()`` wraps the
    model, order the callbacks and know which checkpoint is resumed. The Trainer is the ``self`` of a frame a few
    levels up: ``Trainer.__init__`` for ``on_init_end``, the training loop otherwise.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame
    return None


def calling_trainer():
    """The ``transformers.Trainer`` whose event is running, found on the call stack (``None`` outside a Trainer)."""
    frame = trainer_frame()
    return None if frame is None else frame.f_locals["self"]


def launched_world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``), whether or not the Trainer sees them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def configure_trainer(trainer, lisa_callbacks: Sequence) -> None:
    """Prepare a Trainer for the LISA callbacks it holds; idempotent.

    * ``lisa_callbacks`` move ahead of the reporting integrations (TensorBoard, W&B, ...) and the printer, which
      ``Trainer`` registers before user callbacks, so the values they add in ``on_log`` reach all of them.
    * Under DDP, :func:`hf_lisa.distributed.configure_trainer_for_lisa` (unused-parameter detection, the active-set
      all-reduce, the wrap check after ``evaluate()``), unless the user already called it.
    """
    from hf_lisa.trainer_callbacks.ordering import run_before_reporting_integrations

    run_before_reporting_integrations(trainer, lisa_callbacks)
    if getattr(trainer, CONFIGURED, False):
        return
    from hf_lisa.distributed import configure_trainer_for_lisa

    configure_trainer_for_lisa(trainer)


def check_engine(args, model, optimizer, scheduler, form: str) -> str:
    """The run's one engine check, as training begins (the LISA callbacks' ``on_train_begin``).

    Calls :func:`hf_lisa.distributed.check_layer_switching_supported` with the Trainer's wrapped model (DDP, FSDP or
    DeepSpeed engine), its optimizer and arguments, and the candidates of ``scheduler`` (a ``LayerwiseScheduler``, or
    ``None`` when no layer switches: then nothing is refused).
    """
    from hf_lisa.distributed import check_layer_switching_supported

    trainer = calling_trainer()
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
