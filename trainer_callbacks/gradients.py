"""The schedule's gradient edits, made inside the backward pass through torch's public tensor hooks.

What the schedule removes from or adds to a step's gradient must be in the gradient before anything reads it: the
Trainer's clipping scales every applied gradient by a norm, and its logged ``grad_norm`` should be the norm of the
update. No callback event comes between the last backward and the clipping, so the edits happen where the gradient is
made, with ``Tensor.register_hook`` (a hook on a leaf runs before its gradient is accumulated into ``.grad``, and so
before DDP's reducer and before any clip):

* :class:`WithheldGradients`: the gradient of a parameter the schedule does not update in this step (a frozen
  candidate that something re-enabled behind the schedule; the factors of a sparse layer calibrating in training) is
  replaced by zeros, so it counts for nothing in the clip or the norm; at ``on_pre_optimizer_step`` the schedule sets
  those ``.grad`` to ``None`` (:meth:`hf_lisa.scheduler.LayerwiseScheduler.drop_stray_gradients`,
  :meth:`hf_lisa.scheduler.MaskScheduler.end_step`), so the optimizer skips them (no momentum, no weight decay).
* :class:`PenaltyGradient`: the interpolation penalty's gradient ``2λβ`` joins ``β``'s gradient in the first backward
  of each optimizer step that reaches ``β``, scaled like the loss (a loss scaler's current scale): once per step
  whatever the loss function, gradient accumulation or world size (every rank adds the same term, DDP averages it).

Both are armed by the LISA callbacks at the end of ``on_step_begin`` (after the layer switch, the mask re-selection
and any calibration passes, which must not be edited) and disarmed at ``on_pre_optimizer_step``; the hooks are
removed at ``on_train_end``. Parameters whose gradient is not accumulated through autograd (FSDP2's sharded
parameters) do not run them: there the same edits happen at ``on_pre_optimizer_step``, after the clip.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn


def _register(param: nn.Parameter, hook) -> torch.utils.hooks.RemovableHandle:
    """``param.register_hook(hook)``, also for a parameter frozen right now (torch refuses a hook on a tensor that
    does not require grad, but keeps it once registered)."""
    if param.requires_grad:
        return param.register_hook(hook)
    param.requires_grad_(True)
    try:
        return param.register_hook(hook)
    finally:
        param.requires_grad_(False)


class WithheldGradients:
    """Zeros, in the backward pass, the gradients of the parameters the current step withholds (see the module)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._withheld: set[int] = set()
        self._handles = []
        seen: set[int] = set()
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                self._handles.append(_register(p, self._hook_for(p)))

    def _hook_for(self, param: nn.Parameter):
        key = id(param)

        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            return torch.zeros_like(grad) if key in self._withheld else None

        return hook

    def arm(self, withheld: Iterable[nn.Parameter]) -> None:
        """From now until :meth:`disarm`, the gradients of ``withheld`` are zeros."""
        self._withheld = {id(p) for p in withheld}

    def disarm(self) -> None:
        self._withheld = set()

    def remove(self) -> None:
        self.disarm()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def loss_scale(optimizer) -> float:
    """The factor by which the backward pass's gradients are scaled: a loss scaler's current scale (accelerate's
    ``AcceleratedOptimizer.scaler``, a ``torch.amp.GradScaler``), else 1."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


class PenaltyGradient:
    """Adds ``2λβ`` to ``β``'s gradient once per optimizer step, in the backward pass (see the module).

    ``terms`` are ``(β, λ)`` pairs (:meth:`hf_lisa.tuner.LisaModel.interpolation_penalty_terms`); ``optimizer`` is
    the Trainer's, whose loss scaler (if any) scales the added term like the loss.
    """

    def __init__(self, terms: Iterable[tuple[nn.Parameter, float]], optimizer=None) -> None:
        self.optimizer = optimizer
        self.armed = False
        self.added: set[int] = set()  # the β that got their term in this step
        self._handles = [
            _register(beta, self._hook_for(beta, lam)) for beta, lam in terms if lam != 0
        ]

    def _hook_for(self, beta: nn.Parameter, lam: float):
        key = id(beta)

        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            if not self.armed or key in self.added:
                return None
            self.added.add(key)
            return grad + ((2 * lam * loss_scale(self.optimizer)) * beta.detach()).to(grad.dtype)

        return hook

    def arm(self) -> None:
        self.armed, self.added = True, set()

    def disarm(self) -> set[int]:
        """Stop adding; returns the ``id`` of every ``β`` that got its term in this step."""
        added, self.armed, self.added = self.added, False, set()
        return added

    def remove(self) -> None:
        self.disarm()
        for handle in self._handles:
            handle.remove()
        self._handles = []
