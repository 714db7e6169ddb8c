"""``configure_trainer_for_lisa``: wire a ``transformers.Trainer`` for LISA under the engine it runs on."""

from __future__ import annotations

import os
import warnings
from typing import Optional

from .ddp import _normalise_comm_hook, ddp_kwargs_for_lisa
from .fsdp2 import _fsdp2_fix_callback
from .guards import _is_ddp


# ---------------------------------------------------------------------------------------------------------------------
# Trainer integration
# ---------------------------------------------------------------------------------------------------------------------
def _ddp_callback(handler, trainer):
    from transformers import TrainerCallback

    class LisaDDPCallback(TrainerCallback):
        """Keeps the Trainer's DDP wrap honest and logs ``ddp/grad_bytes_per_step`` / ``ddp/grad_bytes_full``."""

        _hf_lisa_engine_callback = True

        def unmark_evaluation_prepare(self) -> None:
            # accelerate (1.15) flags a model prepared for evaluation -- which is not wrapped in DDP -- as prepared,
            # and train() then skips the DDP wrap: trainer.evaluate() before trainer.train() would leave the ranks
            # training unsynchronised copies
            model = trainer.model
            if trainer.model_wrapped is model and getattr(model, "_is_accelerate_prepared", False):
                model._is_accelerate_prepared = False

        def on_evaluate(self, args, state, control, **kwargs):
            self.unmark_evaluation_prepare()

        def on_predict(self, args, state, control, metrics=None, **kwargs):
            self.unmark_evaluation_prepare()

        def on_train_begin(self, args, state, control, **kwargs):
            if not _is_ddp(trainer.model_wrapped):
                raise RuntimeError(
                    f"The Trainer runs {trainer.accelerator.num_processes} processes but did not wrap the model in "
                    f"DistributedDataParallel (got {type(trainer.model_wrapped).__name__}), so the ranks would train "
                    "unsynchronised copies. This happens when accelerate prepared the model earlier without DDP."
                )

        def on_log(self, args, state, control, logs=None, **kwargs):
            comm = getattr(handler, "comm_state", None)
            if logs is None or comm is None or comm.meter.last is None:
                return
            last = comm.meter.last
            values = {"ddp/grad_bytes_per_step": last["sent"], "ddp/grad_bytes_full": last["full"]}
            logs.update(values)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(values)

    return LisaDDPCallback()


def configure_trainer_for_lisa(
    trainer,
    comm_hook: Optional[str] = None,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    active_set_sync: bool = True,
):
    """Make a ``transformers.Trainer`` safe and efficient for LISA on its engine. Call it before ``trainer.train()``.

    * **DDP**: ``ddp_find_unused_parameters=True`` (also with activation checkpointing, which must be
      non-reentrant), the active-set all-reduce (:func:`lisa_allreduce_hook`) or the ``comm_hook`` compression, and
      ``ddp/grad_bytes_per_step`` / ``ddp/grad_bytes_full`` in the logs. ``trainer.evaluate()`` before
      ``trainer.train()`` no longer stops the DDP wrap (accelerate 1.15 marks the evaluation-prepared model as
      prepared), and training refuses to start on an unwrapped model.
    * **FSDP2**: the mixed-precision unfreeze fix on torch < 2.14.1 (see :func:`install_fsdp2_unfreeze_fix`).
    * **DeepSpeed / FSDP1**: nothing to set; the LISA callbacks refuse layer switching where it cannot work.

    Returns:
        The ``LisaDDPKwargs`` installed on the accelerator under DDP (its ``comm_state.meter`` holds the measured
        bytes), else ``None``.

    Example:
        ```py
        >>> from hf_lisa.trainer_callbacks import LisaCallback
        >>> callbacks = [LisaCallback(lisa_activated_layers=2)]
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)  # doctest: +SKIP
        >>> configure_trainer_for_lisa(trainer, comm_hook="fp16")  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        ```
    """
    # a second call (hf-lisa train after LisaTrainer's own, or user code) replaces the first
    for callback in list(trainer.callback_handler.callbacks):
        if getattr(callback, "_hf_lisa_engine_callback", False):
            trainer.callback_handler.remove_callback(callback)
    handler = _configure_trainer_for_lisa(trainer, comm_hook, powersgd_rank, powersgd_start_iter, active_set_sync)
    trainer._hf_lisa_configured = True
    # the LISA callbacks are handed the Trainer (hf_lisa.trainer_callbacks.prepare_trainer: they order the logs'
    # readers after themselves and the engine's callbacks); marked, since this layer does not import them
    for callback in list(trainer.callback_handler.callbacks):
        if getattr(callback, "_hf_lisa_wants_trainer", False):
            callback.set_trainer(trainer)
    return handler


def _add_first(trainer, callback) -> None:
    """Add ``callback`` to ``trainer`` first in line, ahead of the LISA callbacks and of whatever reads the logs (the
    others move behind it in their order, through the callback handler's public ``pop_callback`` / ``add_callback``)."""
    handler = trainer.callback_handler  # its methods, not the Trainer's (a subclass may extend add_callback)
    others = list(handler.callbacks)
    handler.add_callback(callback)
    for other in others:
        handler.pop_callback(other)
        handler.add_callback(other)


def _configure_trainer_for_lisa(trainer, comm_hook, powersgd_rank, powersgd_start_iter, active_set_sync):
    from accelerate.utils import DistributedType

    args = trainer.args
    accelerator = trainer.accelerator
    name = _normalise_comm_hook(comm_hook)
    distributed_type = accelerator.distributed_type
    if getattr(trainer, "is_fsdp_enabled", False):
        _add_first(trainer, _fsdp2_fix_callback())  # before the LISA callbacks freeze
        if name != "none":
            warnings.warn(f"ddp_comm_hook={comm_hook!r} is ignored under FSDP (DDP communication hooks only).")
        return None
    if getattr(trainer, "is_deepspeed_enabled", False) or distributed_type == DistributedType.DEEPSPEED:
        if name != "none":
            warnings.warn(f"ddp_comm_hook={comm_hook!r} is ignored under DeepSpeed (DDP communication hooks only).")
        return None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"The launcher started {launched} processes (WORLD_SIZE={launched}) but the Trainer runs each as "
            "a separate single-process job, so they would train unsynchronised copies. On CPU, launch with "
            "ACCELERATE_USE_CPU=1 (`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ...` or "
            "torchrun), see "
            "examples/accelerate_configs/cpu_2proc.yaml."
        )
    if accelerator.num_processes <= 1 or distributed_type == DistributedType.NO:
        if name != "none":
            warnings.warn(f"ddp_comm_hook={comm_hook!r} has no effect: the run has a single process, no DDP.")
        return None
    # the LISA callbacks check the wrap as training begins (check_layer_switching_supported): static_graph and
    # reentrant activation checkpointing are refused there
    args.ddp_find_unused_parameters = True
    previous = accelerator.ddp_handler
    carried = {}
    if previous is not None:
        for key in ("dim", "broadcast_buffers", "bucket_cap_mb", "check_reduction", "gradient_as_bucket_view"):
            carried[key] = getattr(previous, key)
    handler = ddp_kwargs_for_lisa(
        name, powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter, active_set_sync=active_set_sync,
        **carried,
    )
    accelerator.ddp_handler = handler
    # first in line, so that every printer and reporting integration sees the values it adds to the logs
    callback = _ddp_callback(handler, trainer)
    _add_first(trainer, callback)
    callback.unmark_evaluation_prepare()  # an evaluate() already run before this call
    return handler
