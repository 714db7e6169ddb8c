"""AdamW with the optimizer step fused into the backward pass: each parameter is updated the moment its gradient is
complete, and its gradient is freed at once.

This is PyTorch's "optimizer step in backward" recipe (a ``register_post_accumulate_grad_hook`` per parameter) in the
shape of an ordinary ``torch.optim.AdamW``: its ``param_groups`` and ``state`` are AdamW's own, so an LR scheduler,
LISA's state dropping for deactivated blocks (:mod:`hf_lisa.optim.state`) and checkpoints of
``optimizer.state_dict()`` (loadable by plain ``AdamW`` and back) work unchanged. The update of each parameter is
AdamW's (torch's functional ``adamw`` with the group's hyperparameters), so a run with it follows a run with plain
``AdamW`` exactly: the order of the updates differs, not their values.

What it saves: the gradients of all trainable parameters never live at once, and there is no optimizer step with its
own temporaries after the backward pass. For full-parameter LISA that is the active blocks' gradients and the step's
temporaries; a tied embedding/LM-head weight still holds its gradient through the whole backward pass, because its
two halves arrive at the start and at the end.

What it cannot do, because every gradient is consumed as it arrives:

* **gradient accumulation** (each micro-batch would be a step of its own);
* **global-norm clipping** (the norm is known only once every gradient exists; per-parameter clipping is not the
  same thing);
* **a gradient scaler** (fp16 ``GradScaler`` unscales and checks for infs after the backward pass);
* **data-parallel engines** (DDP, FSDP, DeepSpeed reduce gradients across ranks after local accumulation; a hook
  would step on the rank's own gradient);
* **reading gradients after ``backward()``** (gradient-based importance sampling, gradient-norm monitoring from
  ``.grad``): they are ``None``. The global gradient norm is measured by the hooks instead (:meth:`grad_norm`).

Example:
    ```py
    >>> import torch
    >>> from hf_lisa.optim.in_backward import AdamWInBackward
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = AdamWInBackward(model.parameters(), lr=1e-2)
    >>> model(torch.ones(3, 4)).sum().backward()  # the update happens here
    >>> model.weight.grad is None
    True
    >>> opt.step()  # nothing left to do (it applies gradients that did not pass a hook, if any)
    ```
"""

from __future__ import annotations

import collections
import functools
import math
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim.adamw import adamw as _adamw_functional
from torch.utils.hooks import RemovableHandle

from ..errors import UsageError

__all__ = ["AdamWInBackward", "StepsInBackward", "check_in_backward_arguments", "steps_in_backward"]

#: ``optim`` values (``TrainingArguments.optim``) whose update an optimizer stepping in backward reproduces
IN_BACKWARD_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit")


def _run_hook(optimizer_ref: "weakref.ref[AdamWInBackward]", p: torch.Tensor) -> None:
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._hook(p)


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype of AdamW's ``step`` counter (float32, or float64 under a float64 default dtype when not fused)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32


class StepsInBackward:
    """What every optimizer that steps in the backward pass shares: one post-accumulate-grad hook per trainable
    parameter, armed or not, each gradient applied once per step and then freed, and the global gradient norm measured
    on the way. A subclass mixes this into a ``torch.optim.Optimizer`` and gives ``_update(group, params)``, the
    optimizer's own update of ``params`` (all in ``group``, each with ``.grad`` set), which sets their ``.grad`` to
    ``None``. Call :meth:`_start_in_backward` at the end of ``__init__``.
    """

    _handles: dict

    def _start_in_backward(self) -> None:
        self.armed = True
        self._handles = {}
        self._group_of: Optional[dict[int, dict]] = None  # parameter -> its group, rebuilt once per step
        self._stepped: set[int] = set()  # parameters updated since the last step()
        self._grad_sq: list[torch.Tensor] = []  # squared norms of the gradients applied since the last step()
        self._update_pre_hooks: dict[int, Callable[[torch.Tensor], None]] = collections.OrderedDict()
        self._register_hooks()

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    # -- hooks ---------------------------------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        """Hook every parameter that requires a gradient and has no hook yet (through a weak reference: a
        discarded optimizer neither stays alive through its parameters nor updates them)."""
        ref = weakref.ref(self)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._handles:
                    self._handles[id(p)] = p.register_post_accumulate_grad_hook(functools.partial(_run_hook, ref))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_handles"):  # torch.optim.Optimizer.__init__ calls this before our attributes exist
            self._group_of = None
            self._register_hooks()

    def remove_hooks(self) -> None:
        """Detach the optimizer from the parameters for good (it then behaves as its plain base optimizer)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.armed = False

    def register_update_pre_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Call ``hook(param)`` just before each parameter's update (e.g. to copy its value, as the training monitor
        does for update/weight ratios); ``remove()`` on the returned handle unregisters it."""
        handle = RemovableHandle(self._update_pre_hooks)
        self._update_pre_hooks[handle.id] = hook
        return handle

    def _hook(self, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None:
            return
        if id(p) in self._stepped:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient arrived twice before optimizer.step() (gradient "
                "accumulation, or a weight used in two reentrant activation-checkpointing segments). The step in "
                "backward applies each gradient as it arrives, so this would update on partial gradients. Use "
                "gradient_accumulation_steps=1 and non-reentrant checkpointing, or the plain optimizer."
            )
        if self._group_of is None:  # groups may have been edited since the last step (a parameter moved)
            self._group_of = {id(q): group for group in self.param_groups for q in group["params"]}
        self._stepped.add(id(p))
        self._update(self._group_of[id(p)], [p])

    def _before_update(self, p: torch.Tensor) -> None:
        """Record ``p``'s gradient norm and run the update pre-hooks (each ``_update`` calls this per parameter)."""
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
        self._grad_sq.append(torch.linalg.vector_norm(p.grad, dtype=torch.float32).square())
        for hook in self._update_pre_hooks.values():
            hook(p)

    # -- the Trainer's calls -------------------------------------------------------------------------------------------
    def grad_norm(self) -> float:
        """The global L2 norm of the gradients applied since the last :meth:`step` (by the hooks) plus those still
        waiting in ``.grad``: what ``clip_grad_norm_`` would have measured before a plain optimizer step."""
        squares = list(self._grad_sq)
        for group in self.param_groups:
            squares += [torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
                        for p in group["params"] if p.grad is not None]
        return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[Any]:
        """Apply the gradients that did not pass a hook (there are none in the usual case), then start a new step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pending = [p for p in group["params"] if p.grad is not None]
            if pending:
                self._update(group, pending)
        self._stepped.clear()
        self._grad_sq.clear()
        self._group_of = None
        self._register_hooks()  # parameters that became trainable since: their updates move into backward from now
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # builds new param_groups dicts: the hooks look their group up afresh
        self._group_of = None


class AdamWInBackward(StepsInBackward, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update of each parameter runs in the backward pass, as soon as that parameter's
    gradient is accumulated; the gradient is then set to ``None``.

    Takes ``torch.optim.AdamW``'s arguments. Hooks are registered on the parameters that require a gradient when the
    optimizer is built (the Trainer builds it before LISA freezes anything); a parameter frozen later simply gets no
    gradient, so its hook does not fire. :meth:`step` applies any gradient that did not pass a hook (a gradient set by
    hand, a parameter that became trainable after construction, which it then hooks for the next steps), so nothing
    is ever left unapplied.

    While :attr:`armed` is ``False`` the hooks do nothing and the optimizer is plain AdamW: gradients accumulate and
    :meth:`step` applies them. ``LisaTrainer`` arms it for ``train()`` only, so a backward pass outside training
    (a probe, user code) never moves the weights.

    Raises:
        RuntimeError: when a parameter's gradient arrives twice between two :meth:`step` calls (gradient
            accumulation, or a weight shared across reentrant activation-checkpointing segments): stepping on a part
            of the gradient would be silently wrong.
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        if self.defaults.get("differentiable"):
            raise ValueError("AdamWInBackward(differentiable=True) is not supported: the update runs inside backward.")
        self._start_in_backward()

    # -- the update: AdamW's, for the given parameters of one group ----------------------------------------------------
    @torch.no_grad()
    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], []
        fused = bool(group.get("fused"))
        for p in params:
            self._before_update(p)
            grad = p.grad
            state = self.state[p]
            if not state:  # AdamW's lazy initialisation, the same tensors and dtypes
                on_device = group.get("capturable") or fused
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group.get("foreach"), capturable=group.get("capturable", False), differentiable=False,
            fused=group.get("fused"), has_complex=any(torch.is_complex(p) for p in params), amsgrad=group["amsgrad"],
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group.get("maximize", False),
        )
        for p in params:
            p.grad = None


def steps_in_backward(optimizer: Any) -> Optional[StepsInBackward]:
    """The optimizer that steps in backward (:class:`AdamWInBackward`, or
    :class:`~hf_lisa.optim.adamw_8bit.AdamW8bitInBackward`) behind ``optimizer`` (through
    accelerate's wrapper), or ``None``."""
    from .state import unwrap_optimizer

    if optimizer is None:
        return None
    inner = unwrap_optimizer(optimizer)
    return inner if isinstance(inner, StepsInBackward) else None


def check_in_backward_arguments(args: Any, cli: bool = False, check_optim: bool = True) -> None:
    """The one set of rules for a Trainer whose optimizer steps in the backward pass, on its ``TrainingArguments``:
    ``hf-lisa train --optim_step_in_backward`` (``cli=True``: messages name the command's flags), ``LisaTrainer`` and
    the callbacks (messages name the ``TrainingArguments`` field to set) all run this.

    Args:
        args: ``TrainingArguments`` (or anything with its fields).
        cli: word the messages for the command line.
        check_optim: check ``optim`` (off when the Trainer was given its optimizer class or instance).

    Raises:
        UsageError: gradient accumulation (each micro-batch would step), ``max_grad_norm`` > 0 (global-norm clipping
            needs every gradient first; TrainingArguments' default is 1.0), ``fp16`` (its gradient scaler unscales
            and checks after the backward pass), an ``optim`` other than AdamW, more than one process or
            DeepSpeed/FSDP (gradients are reduced across ranks after the local backward).
    """
    flag = "--optim_step_in_backward" if cli else "optim_step_in_backward=True"

    def name(field: str) -> str:
        return f"--{field}" if cli else field

    def setting(field: str, value: Any) -> str:
        return f"--{field} {value}" if cli else f"TrainingArguments({field}={value!r})"

    accumulation = args.gradient_accumulation_steps
    if accumulation != 1:
        raise UsageError(
            f"{flag} applies each gradient as soon as it is complete, so {name('gradient_accumulation_steps')}="
            f"{accumulation} cannot accumulate; allowed with it: 1 ({setting('gradient_accumulation_steps', 1)}; "
            "use a larger per-device batch instead)."
        )
    norm = args.max_grad_norm
    if norm is not None and norm > 0:
        default = " (TrainingArguments' default)" if not cli and norm == 1.0 else ""
        raise UsageError(
            f"{flag} updates each parameter before the global gradient norm is known, so {name('max_grad_norm')}="
            f"{norm!r}{default} (global-norm clipping) cannot take effect; allowed with it: "
            f"{setting('max_grad_norm', 0)} (no clipping)."
        )
    if args.fp16:
        raise UsageError(
            f"{flag} cannot run with {'--fp16' if cli else 'fp16=True'}: its gradient scaler unscales and checks the "
            "gradients after the backward pass, when they are already applied; use "
            f"{'--bf16' if cli else 'bf16=True'} (no scaler) or drop {flag}."
        )
    optim = getattr(args, "optim", "adamw_torch")
    optim = getattr(optim, "value", optim)
    if check_optim and optim not in IN_BACKWARD_OPTIMS:
        raise UsageError(
            f"{flag} reproduces AdamW's update (torch's or bitsandbytes' 8-bit), so {name('optim')}={optim!r} cannot "
            f"be used with it; allowed: {', '.join(IN_BACKWARD_OPTIMS)}."
        )
    distributed = [name(field) for field in ("deepspeed", "fsdp") if getattr(args, field, None)]
    world_size = getattr(args, "world_size", 1)
    if world_size > 1 or distributed:
        what = " and ".join(distributed) or f"{world_size} processes"
        raise UsageError(
            f"{flag} runs one process only: with {what}, gradients are reduced across ranks after the local "
            "backward pass, and the hooks would step on each rank's own gradient. Drop it for distributed training."
        )
