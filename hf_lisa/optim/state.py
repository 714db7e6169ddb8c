"""Optimizer-state bookkeeping for layerwise training: find the real optimizer, measure and drop per-parameter state.

LISA trains a few blocks at a time. Optimizers keep their per-parameter state (Adam's two moments, Adafactor's
factored second moment, SGD's momentum buffer) in ``optimizer.state[param]`` even after ``param`` stops receiving
gradients, so without help a LISA run ends up holding the state of every block it ever trained: the memory of full
fine-tuning (LMFlow #768, ms-swift #4522). These helpers are what the scheduler uses to keep that in check.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..tuner.config import OPTIMIZER_STATE_POLICIES  # noqa: F401  (re-exported: hf_lisa.scheduler)



def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Return the ``torch.optim.Optimizer`` that holds the state, looking through wrappers.

    accelerate's ``AcceleratedOptimizer`` (what ``Trainer.optimizer`` is after ``accelerator.prepare``) and similar
    wrappers keep the real optimizer in ``.optimizer``; its ``state`` is the one that matters.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> unwrap_optimizer(opt) is opt
        True
    """
    seen = set()
    # AcceleratedOptimizer subclasses torch.optim.Optimizer itself, so follow `.optimizer` whatever the type
    while hasattr(getattr(optimizer, "optimizer", None), "param_groups") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not hasattr(optimizer, "state") or not hasattr(optimizer, "param_groups"):
        raise TypeError(
            "Expected a torch.optim.Optimizer (or a wrapper exposing it as `.optimizer`), got "
            f"{type(optimizer).__name__}."
        )
    return optimizer


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes held by the tensors of the optimizer's per-parameter state (moments, step counters, buffers).

    For ``torch.optim.AdamW`` this is ``Σ (2 · numel · element_size + 4)`` over the parameters with state: two
    moments and a float32 ``step`` tensor each.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(10))
        >>> opt = torch.optim.AdamW([p]); p.grad = torch.ones(10); opt.step()
        >>> optimizer_state_bytes(opt)
        84
    """
    return sum(_tensor_bytes(state) for state in unwrap_optimizer(optimizer).state.values())


def params_with_state(optimizer: Any) -> list[torch.Tensor]:
    """Parameters that currently hold optimizer state."""
    return [p for p, s in unwrap_optimizer(optimizer).state.items() if s]


def drop_optimizer_state(optimizer: Any, params: Iterable[torch.Tensor]) -> int:
    """Remove the optimizer state of ``params``; returns the number of bytes freed.

    A parameter re-activated later starts a fresh sequence (Adam ``step`` 1, zero moments), as in the paper's runs,
    which restarted the optimizer every sampling period.
    """
    opt = unwrap_optimizer(optimizer)
    freed = 0
    for p in params:
        state = opt.state.pop(p, None)
        if state:
            freed += _tensor_bytes(state)
    return freed


def optimizer_params(optimizer: Any) -> set[int]:
    """``id`` of every parameter the optimizer updates."""
    return {id(p) for group in unwrap_optimizer(optimizer).param_groups for p in group["params"]}


def exclude_from_weight_decay(optimizer: Any, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Move ``params`` out of weight-decaying parameter groups into a group without weight decay.

    The Trainer builds two groups (decay, no decay) from parameter *names*, so parameters like LISA's interpolation
    scalars δ and β land in the decaying group. They go to an existing group with ``weight_decay == 0`` whose other
    hyperparameters are identical (the Trainer's no-decay group). Returns the parameters that could not be moved
    because no such group exists; the caller should say so.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.AdamW([{"params": [a, b], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}])
        >>> exclude_from_weight_decay(opt, [b])
        []
        >>> [len(g["params"]) for g in opt.param_groups]
        [1, 1]
    """
    optimizer = unwrap_optimizer(optimizer)
    wanted = {id(p) for p in params}
    stuck: list[torch.Tensor] = []

    def same_but_decay(g: dict, h: dict) -> bool:
        keys = (set(g) | set(h)) - {"params", "weight_decay", "initial_lr"}
        return all(g.get(k) == h.get(k) for k in keys)

    for group in optimizer.param_groups:
        if not group.get("weight_decay"):
            continue
        moving = [p for p in group["params"] if id(p) in wanted]
        if not moving:
            continue
        target = next(
            (h for h in optimizer.param_groups if not h.get("weight_decay") and same_but_decay(group, h)), None
        )
        if target is None:
            stuck.extend(moving)
            continue
        group["params"] = [p for p in group["params"] if id(p) not in wanted]
        target["params"].extend(moving)
    return stuck
