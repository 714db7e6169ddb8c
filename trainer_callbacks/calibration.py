"""The first masks of fresh sparse adapters, calibrated before the first optimizer step through the trainer's own loss.

A fresh sparse layer (``B = 0``) needs its mask before ``B`` moves: any update before the choice would be cut by it.
Calibrating *in* the first training steps, with the layer's update withheld, spent those steps: the learning-rate
warmup passed before the adapter first moved, and a block sampled later lost part of its first period. Here the
calibration runs as extra passes at ``on_step_begin`` of a fresh schedule's first step, before anything trains:

* ``importance_steps`` calibration steps, each of ``gradient_accumulation_steps`` micro-batches of
  ``per_device_train_batch_size`` examples per rank, drawn from the training set by a generator seeded with the
  Trainer's ``data_seed`` (else ``seed``), disjoint across ranks: the data loader, its sampler and the global RNGs are
  untouched (the passes run under ``torch.random.fork_rng``), so the training that follows sees the same batches and
  dropout as without them;
* the loss is the Trainer's own ``compute_loss`` (TRL's SFT and DPO losses, a custom one) under its autocast context
  when the callback was handed its Trainer (:func:`.setup.prepare_trainer`; ``LisaTrainer`` does it), else the
  model's own loss on batches with ``labels`` (a plain Trainer's loss); without either, the masks calibrate in
  training, with a warning. On the model the callbacks receive (not the DDP wrapper: the importance is all-reduced
  by the mask schedule itself);
* the gradient is taken with ``torch.autograd.grad`` with respect to the fresh layers' factors, so no parameter's
  ``.grad`` is written and no gradient hook (DDP's reducer, DeepSpeed's, an optimizer stepping in the backward pass)
  fires; under reentrant activation checkpointing, which hides the checkpointed blocks from ``autograd.grad`` (the
  first micro-batch reaches no factor), a plain ``backward()`` runs and every parameter's ``.grad`` is put back;
* the trainer's per-step metrics that ``compute_loss`` appends to (TRL's ``_metrics``, ``_total_train_tokens``) are
  restored afterwards.
"""

from __future__ import annotations

import copy
import logging
from itertools import islice
from typing import Any, Iterator, Optional

import torch

from .setup import _to_device, probe_batch

logger = logging.getLogger(__name__)

#: trainer attributes that ``compute_loss`` adds to (TRL): restored after the calibration passes
_METRIC_ATTRIBUTES = ("_metrics", "_total_train_tokens")
_REENTRANT = "use_reentrant=True"  # in torch's refusal of autograd.grad under reentrant checkpointing


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def calibration_batches(
    dataloader, steps: int, accumulation: int, batch_size: int, seed: int, device
) -> Iterator[list]:
    """Yield ``steps`` lists of ``accumulation`` collated micro-batches for this rank, as the Trainer would batch them.

    Examples come from the data loader's dataset in an order drawn by ``torch.Generator().manual_seed(seed)`` (an
    iterable dataset: in its own order), the same on every rank; each rank takes its own slice of every step, as a
    distributed sampler would. Nothing of the data loader, its sampler or the global RNGs is used.
    """
    rank, world = _rank_and_world()
    base = getattr(dataloader, "base_dataloader", dataloader)
    dataset, collate = base.dataset, base.collate_fn
    per_step = accumulation * world * batch_size
    if isinstance(dataset, torch.utils.data.IterableDataset):
        pool = list(islice(dataset, steps * per_step))
        order = list(range(len(pool)))
    else:
        pool = dataset
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    if not order:
        raise ValueError("The training dataset is empty; the sparse-mask calibration needs training batches.")
    for step in range(steps):
        micro = []
        for m in range(accumulation):
            start = step * per_step + (m * world + rank) * batch_size
            examples = [pool[order[(start + i) % len(order)]] for i in range(batch_size)]
            micro.append(_to_device(collate(examples), device))
        yield micro


def _model_loss(model, inputs) -> torch.Tensor:
    outputs = model(**inputs)
    return outputs["loss"] if isinstance(outputs, dict) else outputs.loss


def calibrate_fresh_masks(trainer, mask_scheduler, model, args, train_dataloader, global_step: int,
                          optimizer=None) -> Optional[dict]:
    """Run :meth:`MaskScheduler.calibrate` on passes of ``trainer``'s own loss (``None``: the model's own loss);
    returns its record (or ``None``).

    Call at ``on_step_begin`` of the first step of a fresh schedule, after the layer switch. See the module docstring.
    """
    device = next(model.parameters()).device
    seed = args.data_seed if args.data_seed is not None else args.seed
    batches = calibration_batches(train_dataloader, mask_scheduler.importance_steps, args.gradient_accumulation_steps,
                                  args.per_device_train_batch_size, seed, device)
    scaler = getattr(trainer.accelerator if trainer is not None else optimizer, "scaler", None)
    saved = {name: copy.deepcopy(getattr(trainer, name)) for name in _METRIC_ATTRIBUTES if hasattr(trainer, name)}
    stashed: Optional[dict] = None  # every parameter's .grad before the first plain backward(), if one is needed
    mode: Optional[str] = None  # "grad" (autograd.grad) or "backward", decided on the first micro-batch

    def loss_of(inputs) -> torch.Tensor:
        if trainer is None:
            loss = _model_loss(model, inputs)
        else:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, inputs)
        if scaler is not None and scaler.is_enabled():  # a constant factor (the selection is scale-free): no underflow
            loss = scaler.scale(loss)
        return loss

    def run_step(factors: list) -> None:
        nonlocal mode, stashed
        for inputs in next(batches):
            loss = loss_of(inputs)
            if mode != "backward":
                try:  # (a factor frozen since the forward, by code outside the schedule, is left out)
                    grads = torch.autograd.grad(loss, [f for f in factors if f.requires_grad], allow_unused=True)
                except RuntimeError as err:
                    if mode == "grad" or _REENTRANT not in str(err):
                        raise
                    grads = (None,)
                if mode == "grad" or any(g is not None for g in grads):
                    mode = "grad"
                    continue
                # the very first micro-batch reached no factor: reentrant activation checkpointing hides the blocks
                # from autograd.grad (or refuses it). Drop what it summed and run it again with backward()
                mask_scheduler.discard_gradient_sums()
                logger.info("LISA: autograd.grad does not reach the adapters (reentrant activation checkpointing); "
                            "the mask calibration runs backward() and restores every parameter's gradient after.")
                mode, stashed = "backward", {p: p.grad for p in model.parameters()}
                loss = loss_of(inputs)
            loss.backward()
            for p in model.parameters():
                p.grad = None

    was_training = model.training
    if device.type == "cpu":
        fork: dict[str, Any] = {"devices": []}
    else:
        index = device.index if device.index is not None else getattr(torch, device.type).current_device()
        fork = {"devices": [index], "device_type": device.type}
    logger.info("LISA: calibrating the first masks of %d fresh sparse layer(s) before step %d: %d step(s) of %d "
                "micro-batch(es), nothing trained.", sum(mask_scheduler.fresh.values()), global_step,
                mask_scheduler.importance_steps, args.gradient_accumulation_steps)
    try:
        with torch.random.fork_rng(**fork):
            model.train()
            return mask_scheduler.calibrate(run_step, global_step)
    finally:
        model.train(was_training)
        if stashed is not None:
            for p, grad in stashed.items():
                p.grad = grad
        for name, value in saved.items():
            setattr(trainer, name, value)


def calibrate_due_masks(callback, args, state, train_dataloader, optimizer=None) -> list[dict]:
    """The adapter callback's calibration at ``on_step_begin``: the first masks of a fresh schedule, before its first
    optimizer step (:func:`calibrate_fresh_masks`); nothing otherwise. Returns the records (zero or one)."""
    masks = callback.mask_scheduler
    if not masks.calibration_due:
        return []
    trainer, model = callback._trainer, callback._model
    why = None
    if train_dataloader is None:
        why = "no training data loader reached the callback"
    elif trainer is None:
        first = probe_batch(train_dataloader, 1, next(model.parameters()).device)
        if not (hasattr(first, "keys") and "labels" in first.keys()):
            why = ("the callback was not handed its Trainer (hf_lisa.trainer_callbacks.prepare_trainer), whose loss "
                   "it would use, and the batches carry no labels for the model's own")
    if why is not None:
        masks.calibration_due = False
        logger.warning("LISA: %s, so the sparse masks calibrate in training: each fresh layer's first "
                       "importance_steps trainable steps, with its update withheld.", why)
        return []
    if trainer is None:
        logger.warning("LISA: the first sparse masks are calibrated on the model's own loss, since the callback was "
                       "not handed its Trainer; a Trainer whose compute_loss differs trains another loss. "
                       "hf_lisa.trainer_callbacks.prepare_trainer(trainer) calibrates on the Trainer's own.")
    record = calibrate_fresh_masks(trainer, masks, model, args, train_dataloader, state.global_step, optimizer)
    return [] if record is None else [record]
