"""DDP with a changing active set: the active-set all-reduce hook, its compressed variants (fp16/bf16, PowerSGD) and
the DDP kwargs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn

from .guards import UnsupportedEngineError, _dist_ready, _is_ddp

#: values of ``--ddp_comm_hook``; ``None``/``"none"`` is the uncompressed active-set all-reduce
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "batched_powersgd")


# ---------------------------------------------------------------------------------------------------------------------
# DDP: active-set all-reduce and gradient-byte accounting
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class GradientBytesMeter:
    """Gradient bytes all-reduced per optimizer step, against what plain DDP would all-reduce.

    ``sent`` counts the payload handed to ``all_reduce`` per rank (a ring all-reduce moves about ``2(W-1)/W`` times
    that over the wire); ``full`` counts the DDP buckets, i.e. what the default hook sends. DDP's own small
    all-reduce of the used-parameter map under ``find_unused_parameters`` (4 bytes per parameter tensor) is not
    included.
    """

    steps: list[dict[str, int]] = field(default_factory=list)
    _sent: int = 0
    _full: int = 0

    def record(self, sent: int, full: int, last_bucket: bool) -> None:
        self._sent += int(sent)
        self._full += int(full)
        if last_bucket:
            self.steps.append({"sent": self._sent, "full": self._full})
            self._sent = self._full = 0

    @property
    def last(self) -> Optional[dict[str, int]]:
        """``{"sent": bytes, "full": bytes}`` of the last synchronised step, or ``None`` before the first."""
        return self.steps[-1] if self.steps else None

    def summary(self) -> dict[str, float]:
        """Mean bytes per step (sent and full) and their ratio over every recorded step."""
        if not self.steps:
            return {"steps": 0}
        sent = sum(s["sent"] for s in self.steps) / len(self.steps)
        full = sum(s["full"] for s in self.steps) / len(self.steps)
        return {"steps": len(self.steps), "sent_bytes_per_step": sent, "full_bytes_per_step": full,
                "sent_fraction": sent / full if full else 0.0}


class ActiveSetCommState:
    """State of :func:`lisa_allreduce_hook`.

    Args:
        process_group: the group to all-reduce over; the default group when ``None``.
        compress_dtype: ``torch.float16``/``torch.bfloat16`` to compress the packed gradients, or ``None``.
        active_only: ``False`` all-reduces whole buckets (plain DDP, still counted): the baseline for measurements.
    """

    def __init__(self, process_group=None, compress_dtype: Optional[torch.dtype] = None, active_only: bool = True):
        if compress_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"compress_dtype={compress_dtype!r} is invalid; allowed: None, torch.float16, torch.bfloat16."
            )
        self.process_group = process_group
        self.compress_dtype = compress_dtype
        self.active_only = active_only
        self.meter = GradientBytesMeter()

    def __setstate__(self, state):  # DDP may pickle hook state; keep it plain
        self.__dict__.update(state)


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def lisa_allreduce_hook(state: ActiveSetCommState, bucket: "torch.distributed.GradBucket") -> torch.futures.Future:
    """DDP communication hook: average only the gradients of parameters that require grad (LISA's active set).

    Register it with ``ddp_model.register_comm_hook(ActiveSetCommState(), lisa_allreduce_hook)`` or
    :func:`register_lisa_comm_hook`. Buckets whose parameters are all frozen skip communication entirely.
    """
    import torch.distributed as dist

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    full_bytes = buffer.numel() * buffer.element_size()
    if state.active_only:
        views = [g for p, g in zip(bucket.parameters(), bucket.gradients()) if p.requires_grad]
    else:
        views = None
    if views is not None and not views:
        state.meter.record(0, full_bytes, bucket.is_last())
        return _done(buffer)
    whole = views is None or len(views) == len(bucket.gradients())
    packed = buffer if whole else torch.cat([v.reshape(-1) for v in views])
    if state.compress_dtype is not None:
        packed = packed.to(state.compress_dtype)
    packed.div_(world)  # divide first, as torch's hooks do, so fp16 cannot overflow in the sum
    state.meter.record(packed.numel() * packed.element_size(), full_bytes, bucket.is_last())

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if whole:
            if reduced is not buffer:
                buffer.copy_(reduced)
            return buffer
        offset = 0
        for view in views:
            n = view.numel()
            view.copy_(reduced[offset : offset + n].view_as(view))
            offset += n
        return buffer

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(unpack)


if torch.distributed.is_available():
    # DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
    lisa_allreduce_hook.__annotations__ = {
        "state": ActiveSetCommState,
        "bucket": torch.distributed.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }


def register_lisa_comm_hook(
    ddp_model: nn.Module, compress_dtype: Optional[torch.dtype] = None, active_only: bool = True, process_group=None
) -> ActiveSetCommState:
    """Register :func:`lisa_allreduce_hook` on a ``DistributedDataParallel`` model; returns its state (and meter).

    Example:
        ```py
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # doctest: +SKIP
        >>> comm = register_lisa_comm_hook(ddp)  # doctest: +SKIP
        >>> train(ddp)  # doctest: +SKIP
        >>> comm.meter.summary()["sent_fraction"]  # doctest: +SKIP
        0.26
        ```
    """
    if not _is_ddp(ddp_model):
        raise TypeError(
            f"register_lisa_comm_hook expects a DistributedDataParallel model, got {type(ddp_model).__name__}."
        )
    if not ddp_model.find_unused_parameters:
        raise UnsupportedEngineError(
            "LISA's active-set all-reduce needs DDP built with find_unused_parameters=True: frozen parameters produce "
            "no gradient and DDP must mark them ready itself."
        )
    state = ActiveSetCommState(process_group=process_group, compress_dtype=compress_dtype, active_only=active_only)
    ddp_model.register_comm_hook(state, lisa_allreduce_hook)
    return state


def _normalise_comm_hook(comm_hook: Optional[str]) -> str:
    name = "none" if comm_hook is None else str(comm_hook).lower().replace("-", "_")
    name = {"power_sgd": "powersgd", "no": "none", "batched_power_sgd": "batched_powersgd"}.get(name, name)
    if name not in COMM_HOOKS:
        allowed = [h for h in COMM_HOOKS if h != "batched_powersgd"]
        raise ValueError(f"ddp_comm_hook={comm_hook!r} is invalid; allowed: {allowed}.")
    return name


def _backend() -> Optional[str]:
    return torch.distributed.get_backend() if _dist_ready() else None


def _check_comm_hook(name: str, active_set_sync: bool, backend: Optional[str]) -> None:
    if name == "batched_powersgd":
        raise ValueError(
            "ddp_comm_hook='batched_powersgd' is refused: torch's batched_powerSGD_hook fails on every device once "
            "compression starts (its Q matrix cannot be orthogonalised). Use 'powersgd', which compresses each "
            "gradient matrix separately."
        )
    if name == "bf16" and not active_set_sync and backend == "gloo":
        raise ValueError(
            f"ddp_comm_hook='bf16' with active_set_sync=False uses torch's bf16_compress_hook, which requires NCCL or "
            f"XCCL and fails on the gloo backend (torch {torch.__version__}). Use 'fp16', or keep active_set_sync=True "
            "(hf-lisa's hook compresses to bf16 itself and works on gloo)."
        )


@dataclass
class LisaDDPKwargs(DistributedDataParallelKwargs):
    """accelerate's ``DistributedDataParallelKwargs`` for LISA: unused-parameter detection on, and the active-set
    all-reduce (optionally fp16/bf16-compressed) as the communication hook.

    accelerate maps kwargs handlers by exact class, so install it with ``accelerator.ddp_handler = handler`` (what
    :func:`configure_trainer_for_lisa` does) rather than through ``Accelerator(kwargs_handlers=...)``.

    Args:
        active_set_sync (`bool`, defaults to `True`): all-reduce only the parameters that require grad
            (:func:`lisa_allreduce_hook`). With ``comm_hook=POWER_SGD``, PyTorch's PowerSGD hook runs on whole
            buckets instead.
        comm_hook / comm_state_option: as in accelerate; ``FP16``/``BF16`` compress the packed active set.

    After the wrap, ``comm_state.meter`` (a :class:`GradientBytesMeter`) holds the bytes all-reduced per step.
    """

    find_unused_parameters: bool = True
    active_set_sync: bool = True
    comm_state: Optional[ActiveSetCommState] = field(default=None, repr=False, compare=False)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option", "active_set_sync", "comm_state")):
        return super().to_dict(ignore_keys=ignore_keys)

    def to_kwargs(self):
        # accelerate passes only values that differ from the class defaults, and ours differs from DDP's
        kwargs = super().to_kwargs()
        kwargs["find_unused_parameters"] = self.find_unused_parameters
        return kwargs

    def register_comm_hook(self, model):
        name = _HOOK_NAMES[DDPCommunicationHookType(self.comm_hook)]
        _check_comm_hook(name, self.active_set_sync, _backend())
        if self.active_set_sync and name in ("none", "fp16", "bf16"):
            dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
            self.comm_state = register_lisa_comm_hook(model, compress_dtype=dtype)
            return
        if name == "powersgd" and _backend() == "gloo":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
            model.register_comm_hook(state, _completed_before_return(powerSGD_hook.powerSGD_hook))
            return
        super().register_comm_hook(model)


def _completed_before_return(hook):
    """Wrap a multi-stage communication hook so that all its collectives finish inside the hook call.

    PowerSGD issues its second and third all-reduce from future callbacks. On gloo those run in a communication
    thread, racing with the all-reduce of the used-parameter map that DDP issues from the autograd thread under
    ``find_unused_parameters=True`` (which LISA needs): the ranks can issue the collectives in different orders and
    gloo aborts ("Received data size doesn't match expected size"). Waiting here orders them; on CPU nothing
    overlapped anyway.
    """

    @functools.wraps(hook)
    def sequential(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return sequential


_HOOK_NAMES = {
    DDPCommunicationHookType.NO: "none",
    DDPCommunicationHookType.FP16: "fp16",
    DDPCommunicationHookType.BF16: "bf16",
    DDPCommunicationHookType.POWER_SGD: "powersgd",
    DDPCommunicationHookType.BATCHED_POWER_SGD: "batched_powersgd",
}


def ddp_kwargs_for_lisa(
    comm_hook: Optional[str] = None,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    active_set_sync: bool = True,
    **ddp_kwargs: Any,
):
    """Build the ``DistributedDataParallelKwargs`` of a LISA run (``--ddp_comm_hook`` and friends).

    Args:
        comm_hook: ``None``/``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``.
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: plain all-reduce before it; must be ``>= 2``.
        active_set_sync: all-reduce only the active set (ignored by PowerSGD).
        ddp_kwargs: other ``DistributedDataParallelKwargs`` fields (``bucket_cap_mb``, ``broadcast_buffers``...).

    Example:
        >>> kwargs = ddp_kwargs_for_lisa("powersgd", powersgd_rank=4, powersgd_start_iter=100)
        >>> kwargs.comm_state_option["matrix_approximation_rank"], kwargs.comm_state_option["start_powerSGD_iter"]
        (4, 100)
    """
    name = _normalise_comm_hook(comm_hook)
    _check_comm_hook(name, active_set_sync, _backend())
    state_option: dict[str, Any] = {}
    if name == "powersgd":
        if not isinstance(powersgd_rank, int) or powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={powersgd_rank!r} is invalid; allowed: an integer >= 1.")
        if not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter={powersgd_start_iter!r} is invalid; allowed: an integer >= 2 (PowerSGD's error "
                "feedback needs DDP's first two iterations uncompressed)."
            )
        # LISA's frozen blocks hand PowerSGD all-zero gradient matrices: Gram-Schmidt divides by their norm (NaN
        # without an epsilon), and a warm-started Q would carry that NaN, or a zero Q that never recovers, into the
        # block's next active period. A fresh Q each step and an epsilon keep reactivated blocks training.
        state_option = {
            "matrix_approximation_rank": powersgd_rank,
            "start_powerSGD_iter": powersgd_start_iter,
            "warm_start": False,
            "orthogonalization_epsilon": 1e-8,
        }
    hook_type = {v: k for k, v in _HOOK_NAMES.items()}[name]
    ddp_kwargs.setdefault("find_unused_parameters", True)
    return LisaDDPKwargs(
        comm_hook=hook_type, comm_state_option=state_option, active_set_sync=active_set_sync, **ddp_kwargs
    )


def ddp_training_arguments(activation_checkpointing: bool = False) -> dict[str, Any]:
    """``TrainingArguments`` overrides that LISA needs under DDP; merge them in before building the Trainer.

    Example:
        >>> ddp_training_arguments(activation_checkpointing=True)
        {'ddp_find_unused_parameters': True, 'gradient_checkpointing_kwargs': {'use_reentrant': False}}
    """
    overrides: dict[str, Any] = {"ddp_find_unused_parameters": True}
    if activation_checkpointing:
        overrides["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return overrides


def gradient_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients of ``params`` (one gradient per distinct parameter, in the parameter's dtype)."""
    unique = {id(p): p for p in params}.values()
    return sum(p.numel() * p.element_size() for p in unique)
