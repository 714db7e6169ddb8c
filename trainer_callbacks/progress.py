"""The safety net: a run whose first optimizer steps train nothing stops, with exit status 1 under ``hf-lisa train``.

A run can do every step, log a loss and exit 0 while no weight moves: a bitsandbytes 4-bit base repacked into its
inference-only layout by an evaluation before training (no backward: every gradient zero), a loss that does not
depend on what trains, a learning rate too small for the weights' precision, parameters frozen by a library after the
optimizer was built. :class:`TrainingProgressGuard` checks the first ``check_steps`` optimizer steps (and again the
first ``check_steps`` after each evaluation, which is what repacks a 4-bit base) and raises
:class:`~hf_lisa.errors.NothingTrainedError` out of ``trainer.train()`` when none of them trained.

What counts:

* A step **trained** when some trainable parameter changed across the optimizer step *and* its gradient was nonzero
  (weight decay alone moves weights whose gradients are zero). With an optimizer that steps in the backward pass the
  gradients are gone by then: its hooks' gradient norm stands for them. Under DeepSpeed (gradients in its own
  buffers) a changed weight is enough.
* Only **checked** steps count: the learning rate is above 0 (a warmup that starts at 0 is skipped), the step was not
  skipped (an fp16 loss scaler's inf/NaN step), and not everything trainable was deliberately withheld (a fresh sparse
  adapter's mask calibration, :class:`~hf_lisa.scheduler.MaskScheduler`: the check waits until calibration ends).
* A change is seen in a fingerprint per parameter, taken before and after the step: a float64 sum, computed a slice
  at a time (8 MiB of temporaries at most), and ``sample_size`` evenly spaced values. Nothing the size of the model is
  copied; the cost is a read of the trainable weights twice per checked step, and nothing once a step has trained.
  Under FSDP2 each rank fingerprints its own shards and the ranks agree on the verdict (one all-reduce per checked
  step). Under DeepSpeed ZeRO-3 (parameters partitioned away) the guard is off, with a warning.

``hf-lisa train`` and ``LisaTrainer`` run one with ``check_steps=3``; the LISA callbacks add one to a plain
``transformers.Trainer`` (:func:`add_progress_guard`). To change or turn it off, pass your own:
``Trainer(callbacks=[LisaCallback(...), TrainingProgressGuard(check_steps=0)])``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from hf_lisa.errors import NothingTrainedError
from hf_lisa.optim.in_backward import check_in_backward_arguments, steps_in_backward

logger = logging.getLogger(__name__)

__all__ = ["TrainingProgressGuard", "add_progress_guard"]

#: values per slice of the float64 checksum (8 MiB of float64 temporaries)
_SLICE = 1 << 20
#: causes named in the message, most likely first
LIKELY_CAUSES = (
    "a quantized base in an inference-only layout (bitsandbytes 4-bit after model.eval(): an evaluation or a "
    "generation before training; such a base has no backward)",
    "a loss that does not depend on the trainable parameters (every gradient zero)",
    "a learning rate too small to change the weights at their precision (e.g. bf16 weights)",
    "parameters frozen by a library (requires_grad=False) after the optimizer was built",
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (an FSDP2 ``DTensor``'s local shard; no collective)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Fingerprint:
    """A float64 sum of a tensor (computed a slice at a time) and ``k`` evenly spaced values of it (this rank's
    shard of it; an empty shard never differs)."""

    __slots__ = ("total", "sample")

    def __init__(self, tensor: torch.Tensor, k: int) -> None:
        flat = _local(tensor.detach()).reshape(-1)
        total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for part in flat.split(_SLICE):
            total += part.sum(dtype=torch.float64)
        # integer positions: a float32 linspace rounds numel - 1 up past the end for large tensors (28311551 of a
        # 49152 x 576 embedding became 28311552)
        n = flat.numel()
        index = (torch.arange(min(k, n), device=flat.device, dtype=torch.int64) * (n - 1)) // max(min(k, n) - 1, 1)
        self.total, self.sample = total, flat[index].clone()

    def differs(self, other: "_Fingerprint") -> bool:
        return bool(self.total != other.total) or not torch.equal(self.sample, other.sample)


class TrainingProgressGuard(TrainerCallback):
    """Stop a run whose first optimizer steps train nothing (see the module docstring).

    Args:
        check_steps (`int`, defaults to `3`): stop after this many checked steps (learning rate above 0, updates not
            all withheld) in which nothing trained; checked again for this many steps after each evaluation. `0`
            turns the guard off.
        sample_size (`int`, defaults to `16`): values per parameter compared besides its float64 sum.

    Attributes:
        passed_at (`int` or `None`): the optimizer step (1-based) at which a step last trained and the check ended.
        checked (`int`): checked steps without training since the check was (re)armed.

    Raises:
        hf_lisa.errors.NothingTrainedError: out of ``trainer.train()``, naming what was expected to train, what was
            seen (no gradient, zero gradients, unchanged weights) and the likely causes.
    """

    def __init__(self, check_steps: int = 3, sample_size: int = 16) -> None:
        if not isinstance(check_steps, int) or isinstance(check_steps, bool) or check_steps < 0:
            raise ValueError(f"check_steps={check_steps!r} is invalid; allowed: an integer >= 0 (0 turns it off).")
        if not isinstance(sample_size, int) or isinstance(sample_size, bool) or sample_size < 1:
            raise ValueError(f"sample_size={sample_size!r} is invalid; allowed: an integer >= 1.")
        self.check_steps = check_steps
        self.sample_size = sample_size
        self.passed_at: Optional[int] = None
        self.checked = 0
        self._armed = False
        self._first_checked: Optional[int] = None
        self._callbacks: list = []  # the Trainer's callbacks: the LISA callbacks say which updates they withhold
        self._grads_visible = True  # False under DeepSpeed (gradients in its own buffers)
        self._snapshot: Optional[dict[int, tuple[str, torch.nn.Parameter, _Fingerprint]]] = None
        self._hooks_norm: Optional[float] = None
        self._seen: dict[str, Any] = {}

    # -- arming --------------------------------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._armed, self.checked, self._first_checked, self._snapshot = self.check_steps > 0, 0, None, None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from .setup import calling_trainer

        if steps_in_backward(optimizer) is not None:  # a plain Trainer given such an optimizer: the command's rules
            check_in_backward_arguments(args, check_optim=False)
        trainer = calling_trainer()
        self._callbacks = list(trainer.callback_handler.callbacks) if trainer is not None else []
        deepspeed = getattr(trainer, "is_deepspeed_enabled", False) if trainer is not None else bool(args.deepspeed)
        self._grads_visible = not deepspeed
        self._arm()
        if self._armed and model is not None and any(hasattr(p, "ds_tensor") for p in model.parameters()):
            self._armed = False
            logger.warning("TrainingProgressGuard is off for this run: DeepSpeed ZeRO-3 partitions the parameters, "
                           "so their values cannot be compared across a step here.")

    def on_evaluate(self, args, state, control, **kwargs):
        # model.eval() can change what trains (a 4-bit base repacked for inference): check the next steps again
        if self.check_steps and self.passed_at is not None:
            self._arm()

    def on_train_end(self, args, state, control, **kwargs):
        if self._armed and self.checked == 0 and self.passed_at is None and state.global_step:
            logger.info("TrainingProgressGuard: no step of this run could be checked (learning rate 0, or every "
                        "update withheld, at every step), so nothing was verified to train.")
        self._armed, self._snapshot = False, None

    # -- per step ------------------------------------------------------------------------------------------------------
    def _candidates(self, model, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
        """Parameters that train or may train this step: those that require a gradient, and the optimizer's."""
        held = set()
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad or id(p) in held]

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self._armed or model is None:
            return
        self._hooks_norm = None
        candidates = self._candidates(model, optimizer)
        self._snapshot = {id(p): (n, p, _Fingerprint(p, self.sample_size)) for n, p in candidates}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        stepping = steps_in_backward(optimizer)
        if self._snapshot is not None and stepping is not None:  # its hooks applied (and freed) the gradients
            self._hooks_norm = stepping.grad_norm()

    def _withheld(self) -> set[int]:
        ids = set()
        for callback in self._callbacks:
            scheduler = getattr(callback, "mask_scheduler", None)
            ids.update(id(p) for p in getattr(scheduler, "withheld", None) or ())
        return ids

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        snapshot, self._snapshot = self._snapshot, None
        if not self._armed or snapshot is None or getattr(optimizer, "step_was_skipped", False):
            return
        withheld = self._withheld()
        trainable = [(n, p) for n, p, _ in snapshot.values() if p.requires_grad and id(p) not in withheld]
        if withheld and not trainable:  # every update deliberately withheld (mask calibration): wait
            return
        ids = {id(p) for _, p in trainable}
        # the groups of what trains (all of them where the optimizer holds copies: DeepSpeed's flat partitions)
        all_groups = optimizer.param_groups if optimizer is not None else []
        groups = [g for g in all_groups if any(id(p) in ids for p in g["params"])] or all_groups
        if groups and not any(float(g["lr"]) > 0 for g in groups):  # e.g. a warmup's first step at lr 0
            return
        step = state.global_step + 1  # global_step counts this step after on_optimizer_step
        changed = {id(p) for _, p in trainable if snapshot[id(p)][2].differs(_Fingerprint(p, self.sample_size))}
        grads = {id(p): _local(p.grad) for _, p in trainable if p.grad is not None}
        nonzero = {i for i, g in grads.items() if bool(g.any())}
        if self._hooks_norm is not None:  # stepped in the backward pass: the hooks measured the gradients
            trained = bool(changed) and self._hooks_norm > 0
        elif self._grads_visible:
            trained = bool(changed & nonzero)
        else:
            trained = bool(changed)
        if _any_rank(trained, args.device):
            self._armed, self.passed_at = False, step
            logger.debug("TrainingProgressGuard: step %d trained; the check ends.", step)
            return
        self.checked += 1
        self._first_checked = self._first_checked or step
        self._seen = {"step": step, "candidates": [n for n, _, _ in snapshot.values()], "trainable": trainable,
                      "grads": len(grads), "nonzero": len(nonzero), "changed": len(changed),
                      "hooks_norm": self._hooks_norm}
        if self.checked >= self.check_steps:
            raise NothingTrainedError(self._message())

    # -- the message ---------------------------------------------------------------------------------------------------
    def _evidence(self) -> str:
        seen = self._seen
        if not seen["trainable"]:
            return (f"none of the {len(seen['candidates'])} parameter tensors the optimizer holds requires a gradient "
                    "any more")
        if seen["hooks_norm"] is not None:
            if seen["hooks_norm"] == 0:
                return "the gradient norm the in-backward optimizer's hooks measured was 0"
            return "their gradients were nonzero but no weight changed"
        if not self._grads_visible:
            return "no weight changed"
        if not seen["grads"]:
            return "no gradient reached any of them (all absent)"
        if not seen["nonzero"]:
            what = "; weights moved by weight decay alone" if seen["changed"] else ""
            return f"every gradient was zero ({seen['grads']} tensors){what}"
        return f"{seen['nonzero']} had nonzero gradients but no weight changed"

    def _message(self) -> str:
        seen = self._seen
        names = [n for n, _ in seen["trainable"]] or seen["candidates"]
        values = sum(p.numel() for _, p in seen["trainable"])
        what = f"{len(names)} parameter tensor(s)" + (f" ({values:,} values)" if values else "")
        where = _where(names)
        steps = f"step {seen['step']}" if self._first_checked == seen["step"] else \
            f"steps {self._first_checked}-{seen['step']}"
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (
            f"nothing trained in {self.checked} optimizer step(s) with a learning rate above 0 ({steps}): expected to "
            f"train {what}{where}, e.g. {shown}; {self._evidence()}. Likely causes: {'; '.join(LIKELY_CAUSES)}. "
            f"The run was stopped by TrainingProgressGuard(check_steps={self.check_steps}); "
            "TrainingProgressGuard(check_steps=0) turns the check off."
        )


def _where(names: list[str]) -> str:
    """`` in blocks 0, 2 and outside the blocks`` from parameter names (``.layers.N.``/``.h.N.`` and the like)."""
    import re

    blocks, outside = set(), False
    for name in names:
        found = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", name)
        if found:
            blocks.add(int(found.group(1)))
        else:
            outside = True
    parts = []
    if blocks:
        parts.append("block" + ("s " if len(blocks) > 1 else " ") + ", ".join(str(b) for b in sorted(blocks)))
    if outside:
        parts.append("outside the blocks")
    return f" in {' and '.join(parts)}" if parts else ""


def _any_rank(flag: bool, device: Any) -> bool:
    """``flag`` on any rank (one all-reduce when several processes run), so that every rank reaches one verdict."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def add_progress_guard(trainer, check_steps: int = 3) -> TrainingProgressGuard:
    """The Trainer's :class:`TrainingProgressGuard`: the one it holds (a user's choice stands), else a new one with
    ``check_steps``, added to its callbacks."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TrainingProgressGuard):
            return callback
    guard = TrainingProgressGuard(check_steps=check_steps)
    trainer.callback_handler.add_callback(guard)
    return guard
