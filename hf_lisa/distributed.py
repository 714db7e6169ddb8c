"""LISA on more than one device: DDP, FSDP2 and DeepSpeed ZeRO, with gradient compression.

LISA changes which parameters train every K steps. Each engine fixes something about the trainable set when it wraps
the model, so each needs its own treatment. This module holds all of it; the schedulers in :mod:`hf_lisa.scheduler`
stay engine-agnostic.

**DDP** (the mechanism, and why):

* Every candidate parameter must have ``requires_grad=True`` when DDP wraps the model. DDP registers its gradient
  hooks only for the parameters that require grad at wrap time; a parameter frozen then and unfrozen later is
  *silently never synchronised*. The Trainer wraps before ``on_train_begin``, where the LISA callbacks freeze, so
  this holds by construction.
* Freezing after the wrap needs ``find_unused_parameters=True``; without it DDP waits forever for the frozen
  parameters' gradients ("Expected to have finished reduction", axolotl #1474). The Trainer turns it off with gradient
  checkpointing; :func:`configure_trainer_for_lisa` turns it back on. Non-reentrant checkpointing (transformers'
  default since 5.0) works with it; reentrant checkpointing cannot ("Expected to mark a variable ready only once")
  and is refused.
* **Gradients of the active set only.** DDP all-reduces whole buckets, frozen parameters included (as zeros), so
  plain DDP communicates the whole model's gradients every step. :func:`lisa_allreduce_hook` is a DDP communication
  hook that packs the gradients of the parameters that currently require grad, all-reduces only those, and leaves the
  rest of the bucket alone (DDP does not write gradients of globally unused parameters back, so frozen parameters keep
  ``grad=None``). Every rank freezes the same parameters (the sampler's seeded generator), so every rank packs the
  same slices. The bytes per step drop from the whole model to E+H+γ blocks; :class:`GradientBytesMeter` counts them.
* Compression (``fp16``/``bf16``) is applied to the packed active set; PowerSGD runs through PyTorch's own hook on
  whole buckets, with a fresh Q each step (warm-started Qs go stale or NaN while a block is frozen) and, on gloo, its
  stages completed inside the hook (they otherwise race with DDP's unused-parameter all-reduce). Batched PowerSGD
  fails on every device (a non-orthogonalisable Q) and is refused; torch's ``bf16_compress_hook`` requires
  NCCL/XCCL and is refused on gloo when the active-set hook is off.

**FSDP2** (``fully_shard`` per transformer block, :func:`fully_shard_blocks`): sharding is per parameter, so freezing
inside a block is fine and frozen blocks do no reduce-scatter at all: the communicated gradient bytes follow the
active set without help. Two things need care:

* torch < 2.14.1 computes a parameter group's mixed-precision dtypes only over the parameters trainable at lazy init
  (pytorch#186998). A block frozen at the first forward and unfrozen later then reduce-scatters bf16 gradients into
  fp32 parameters and fails ("attempting to assign a gradient with dtype 'BFloat16' to a tensor with grad_dtype
  'Float'"). :func:`install_fsdp2_unfreeze_fix` recomputes them whenever the trainable set changes; without it,
  :func:`check_layer_switching_supported` refuses low-precision ``MixedPrecisionPolicy`` with switching.
* Optimizer checkpoints load strictly and torch initialises optimizer state only for parameters that require grad, so
  the saved active set must be re-applied *before* the optimizer state is loaded: :func:`load_fsdp2_checkpoint`.

**FSDP1** mixes trainable and frozen parameters inside one flat parameter only with ``use_orig_params=True``; without
it, it is refused.

**DeepSpeed ZeRO** builds its fp32 partitions and optimizer over the parameters trainable at ``deepspeed.initialize``
(DeepSpeed #5639): blocks frozen later keep moving under Adam and blocks unfrozen later never train. Fixed trainable
sets (LoRA, LISA adapters with ``lisa_activated_layers=0``, sparse-mask re-selection, which changes no
``requires_grad``) train normally. Layer switching is refused with an error that names FSDP2.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn

__all__ = [
    "COMM_HOOKS",
    "ENGINES",
    "ActiveSetCommState",
    "GradientBytesMeter",
    "LisaDDPKwargs",
    "UnsupportedEngineError",
    "check_layer_switching_supported",
    "configure_trainer_for_lisa",
    "ddp_kwargs_for_lisa",
    "ddp_training_arguments",
    "detect_engine",
    "fsdp2_unfreeze_fix_needed",
    "fully_shard_blocks",
    "gradient_bytes",
    "install_fsdp2_unfreeze_fix",
    "lisa_allreduce_hook",
    "load_fsdp2_checkpoint",
    "register_lisa_comm_hook",
    "save_fsdp2_checkpoint",
]

ENGINES = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")
#: values of ``--ddp_comm_hook``; ``None``/``"none"`` is the uncompressed active-set all-reduce
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "batched_powersgd")
#: first torch release with the FSDP2 fix for parameters unfrozen after lazy init under mixed precision
FSDP2_UNFREEZE_FIXED_IN = "2.14.1"
FSDP2_SCHEDULE_FILE = "lisa_schedule.json"


class UnsupportedEngineError(ValueError):
    """A distributed engine / setting combination in which LISA would train silently wrong."""


def _torch_version_below(version: str) -> bool:
    from packaging.version import Version

    return Version(Version(torch.__version__).base_version) < Version(version)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------------------------------
# Engine detection
# ---------------------------------------------------------------------------------------------------------------------
def _optimizer_chain(optimizer: Any) -> list[Any]:
    chain, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def _from_deepspeed(obj: Any) -> bool:
    return type(obj).__module__.startswith("deepspeed.")


def _is_ddp(module: nn.Module) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel)


def _fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def detect_engine(model: Optional[nn.Module] = None, optimizer: Any = None) -> str:
    """Which engine trains ``model``: one of :data:`ENGINES`.

    Looks at the objects themselves (not at launcher flags): a ``DeepSpeedEngine`` or an optimizer chain through a
    DeepSpeed optimizer, ZeRO-3 partitioned parameters (``ds_id``), FSDP1 ``FullyShardedDataParallel`` units, FSDP2
    ``fully_shard`` modules, a ``DistributedDataParallel`` wrapper. An unwrapped model with no optimizer clue is
    ``"single"``, even inside a distributed run: pass the wrapped model when you have it.

    Example:
        >>> import torch
        >>> detect_engine(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
        'single'
    """
    if any(_from_deepspeed(o) for o in _optimizer_chain(optimizer)):
        return "deepspeed"
    if model is not None:
        if _from_deepspeed(model) or any(hasattr(p, "ds_id") for p in model.parameters()):
            return "deepspeed"
        if _fsdp1_modules(model):
            return "fsdp1"
        if _fsdp2_modules(model):
            return "fsdp2"
        if _is_ddp(model):
            return "ddp"
    return "single"


def _reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether any module runs torch's *reentrant* activation checkpointing (transformers' ``use_reentrant=True``)."""
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        keywords = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None)
        if keywords is None:  # not a functools.partial of torch's checkpoint: nothing to tell
            continue
        # torch.utils.checkpoint is reentrant when use_reentrant is not given
        if keywords.get("use_reentrant", True):
            return True
    return False


def check_layer_switching_supported(
    model: Optional[nn.Module] = None,
    optimizer: Any = None,
    form: str = "LISA layer switching",
    params: Optional[Iterable[torch.Tensor]] = None,
) -> str:
    """Refuse engine setups in which changing ``requires_grad`` during training would train silently wrong.

    Call it with the *wrapped* model (DDP, FSDP, DeepSpeed engine) and the optimizer before the first switch. The
    LISA schedulers call it from ``freeze_all_but_active`` with the optimizer and their candidate ``params``: a
    DeepSpeed optimizer, ZeRO-3 parameters, or an optimizer that holds none of the candidates (the flat partitions
    of ZeRO-1/2 or FSDP1 without ``use_orig_params``) are refused there too.

    Returns:
        The detected engine (see :func:`detect_engine`).

    Raises:
        UnsupportedEngineError: DeepSpeed ZeRO (any stage); FSDP1 without ``use_orig_params=True``; DDP without
            ``find_unused_parameters=True``, with ``static_graph=True`` or with reentrant activation checkpointing;
            FSDP2 with a low-precision ``MixedPrecisionPolicy`` on torch < 2.14.1 without
            :func:`install_fsdp2_unfreeze_fix`.

    Example:
        >>> import torch
        >>> check_layer_switching_supported(torch.nn.Linear(2, 2))
        'single'
    """
    engine = detect_engine(model, optimizer)
    params = list(params) if params is not None else []
    if any(hasattr(p, "ds_id") for p in params):
        engine = "deepspeed"
    if engine == "deepspeed":
        raise UnsupportedEngineError(
            f"{form} changes which parameters train every K steps, but DeepSpeed ZeRO fixes the trainable set "
            "when deepspeed.initialize builds its partitions (DeepSpeed #5639): blocks frozen later keep moving under "
            "Adam and blocks unfrozen later never train. Use FSDP2 (torch.distributed.fsdp.fully_shard per block, "
            "hf_lisa.distributed.fully_shard_blocks, or examples/accelerate_configs/fsdp2.yaml) or DDP for layer "
            "switching. Under DeepSpeed, train a fixed trainable set: LoRA, or LISA adapters with "
            "lisa_activated_layers=0 (sparse-mask re-selection works)."
        )
    if params and optimizer is not None and engine != "deepspeed":
        held = {id(p) for o in _optimizer_chain(optimizer) for g in getattr(o, "param_groups", []) for p in g["params"]}
        if held and not any(id(p) in held for p in params):
            raise UnsupportedEngineError(
                f"{form} freezes and unfreezes model parameters, but the optimizer holds none of them (it was "
                "built over flattened copies, as DeepSpeed ZeRO and FSDP1 without use_orig_params do), so freezing "
                "would not stop its updates. Build the optimizer over model.parameters(); for sharding use FSDP2."
            )
    if engine == "fsdp1":
        bad = [m for m in _fsdp1_modules(model) if not getattr(m, "_use_orig_params", False)]
        if bad:
            raise UnsupportedEngineError(
                f"{form} freezes parameters inside FSDP units, which FSDP1 supports only with "
                "use_orig_params=True (it got use_orig_params=False). Wrap with use_orig_params=True, or better use "
                "FSDP2 (fully_shard per block), whose per-parameter sharding is the supported engine."
            )
    if engine == "ddp":
        if not getattr(model, "find_unused_parameters", False):
            raise UnsupportedEngineError(
                f"{form} freezes blocks after DDP wrapped the model, so DDP must look for unused parameters, but "
                "it was built with find_unused_parameters=False; it would fail with 'Expected to have finished "
                "reduction' (axolotl #1474). Build DDP with find_unused_parameters=True "
                "(TrainingArguments(ddp_find_unused_parameters=True), or "
                "hf_lisa.distributed.configure_trainer_for_lisa)."
            )
        if getattr(model, "static_graph", False):
            raise UnsupportedEngineError(
                f"{form} changes the set of parameters with gradients every K steps, which DDP's "
                "static_graph=True forbids. Build DDP with static_graph=False."
            )
    if engine in ("ddp", "single") and model is not None and _dist_world_size() > 1 and _reentrant_checkpointing(model):
        raise UnsupportedEngineError(
            f"{form} under DDP needs find_unused_parameters=True, which reentrant activation checkpointing "
            "breaks ('Expected to mark a variable ready only once'). Use non-reentrant checkpointing: "
            "TrainingArguments(gradient_checkpointing_kwargs={'use_reentrant': False}) (transformers' default)."
        )
    if engine == "fsdp2" and fsdp2_unfreeze_fix_needed(model) and not getattr(model, "_lisa_unfreeze_fix", False):
        raise UnsupportedEngineError(
            f"{form} with FSDP2 and a low-precision MixedPrecisionPolicy fails on torch {torch.__version__} when "
            f"a block frozen at the first forward is unfrozen later (pytorch#186998, fixed in "
            f"{FSDP2_UNFREEZE_FIXED_IN}). Call hf_lisa.distributed.install_fsdp2_unfreeze_fix(model) after "
            "fully_shard (fully_shard_blocks does it), upgrade torch, or drop param_dtype from the policy."
        )
    return engine


def _dist_world_size() -> int:
    return torch.distributed.get_world_size() if _dist_ready() else 1


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


# ---------------------------------------------------------------------------------------------------------------------
# Trainer integration
# ---------------------------------------------------------------------------------------------------------------------
def _ddp_callback(handler, trainer):
    from transformers import TrainerCallback

    class LisaDDPCallback(TrainerCallback):
        """Keeps the Trainer's DDP wrap honest and logs ``ddp/grad_bytes_per_step`` / ``ddp/grad_bytes_full``."""

        _hf_lisa_engine_callback = True

        def _unmark_evaluation_prepare(self) -> None:
            # accelerate (1.15) flags a model prepared for evaluation -- which is not wrapped in DDP -- as prepared,
            # and train() then skips the DDP wrap: trainer.evaluate() before trainer.train() would leave the ranks
            # training unsynchronised copies
            model = trainer.model
            if trainer.model_wrapped is model and getattr(model, "_is_accelerate_prepared", False):
                model._is_accelerate_prepared = False

        def on_evaluate(self, args, state, control, **kwargs):
            self._unmark_evaluation_prepare()

        def on_predict(self, args, state, control, metrics=None, **kwargs):
            self._unmark_evaluation_prepare()

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


def _fsdp2_fix_callback():
    from transformers import TrainerCallback

    class Fsdp2UnfreezeFixCallback(TrainerCallback):
        """Installs :func:`install_fsdp2_unfreeze_fix` on the FSDP2-wrapped model before the LISA callbacks freeze."""

        _hf_lisa_engine_callback = True

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                install_fsdp2_unfreeze_fix(model)

    return Fsdp2UnfreezeFixCallback()


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
        >>> callbacks = [LisaCallback(activated_layers=2)]
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)  # doctest: +SKIP
        >>> configure_trainer_for_lisa(trainer, comm_hook="fp16")  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        ```
    """
    # a second call (hf-lisa train after the callbacks' own call from on_init_end, or user code) replaces the first
    trainer.callback_handler.callbacks[:] = [
        cb for cb in trainer.callback_handler.callbacks if not getattr(cb, "_hf_lisa_engine_callback", False)
    ]
    handler = _configure_trainer_for_lisa(trainer, comm_hook, powersgd_rank, powersgd_start_iter, active_set_sync)
    trainer._hf_lisa_configured = True
    return handler


def _configure_trainer_for_lisa(trainer, comm_hook, powersgd_rank, powersgd_start_iter, active_set_sync):
    from accelerate.utils import DistributedType

    args = trainer.args
    accelerator = trainer.accelerator
    name = _normalise_comm_hook(comm_hook)
    distributed_type = accelerator.distributed_type
    if getattr(trainer, "is_fsdp_enabled", False):
        trainer.callback_handler.callbacks.insert(0, _fsdp2_fix_callback())  # before the LISA callbacks freeze
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
    if args.ddp_static_graph:
        raise UnsupportedEngineError(
            "LISA changes the set of parameters with gradients every K steps, which DDP's static_graph=True forbids; "
            "set TrainingArguments(ddp_static_graph=False)."
        )
    gc_kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
        args, "gradient_checkpointing_kwargs", None
    )
    checkpointing = bool(
        getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    )
    reentrant = checkpointing and isinstance(gc_kwargs, dict) and gc_kwargs.get("use_reentrant") is True
    if reentrant or _reentrant_checkpointing(trainer.model):
        raise UnsupportedEngineError(
            "LISA under DDP needs find_unused_parameters=True, which reentrant activation checkpointing breaks "
            "('Expected to mark a variable ready only once'). Use "
            "gradient_checkpointing_kwargs={'use_reentrant': False}."
        )
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
    # first in line, so that the printer and the reporting integrations see the values it adds to the logs
    trainer.callback_handler.callbacks.insert(0, _ddp_callback(handler, trainer))
    return handler


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------------------------------
def _param_groups_of(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10: a single group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp2_unfreeze_fix_needed(model: nn.Module) -> bool:
    """Whether ``model`` has FSDP2 groups with a low-precision ``param_dtype`` on a torch with pytorch#186998."""
    if not _torch_version_below(FSDP2_UNFREEZE_FIXED_IN):
        return False
    for module in _fsdp2_modules(model):
        for group in _param_groups_of(module):
            policy = getattr(group, "mp_policy", None)
            if policy is not None and policy.param_dtype is not None and policy.param_dtype != torch.float32:
                return True
    return False


def install_fsdp2_unfreeze_fix(model: nn.Module) -> bool:
    """Work around pytorch#186998 on torch < 2.14.1: recompute FSDP2's mixed-precision dtypes when the trainable set
    changes.

    FSDP2 derives a group's original and reduce dtypes from the parameters that require grad at lazy init. A block
    frozen then has none; unfrozen later, its bf16 gradients are not cast back to fp32 and assigning them fails. A
    forward pre-hook on every FSDP2 module re-runs that derivation (``FSDPParamGroup._init_mp_dtypes``, a private
    method of the affected releases) whenever the group's ``requires_grad`` pattern changed since the last forward.

    Returns:
        ``True`` if the fix was installed, ``False`` if it is not needed (no low-precision policy, or a fixed torch).
    """
    if not fsdp2_unfreeze_fix_needed(model):
        return False
    if getattr(model, "_lisa_unfreeze_fix", False):
        return True
    modules = _fsdp2_modules(model)
    for module in modules:
        if not all(hasattr(g, "_init_mp_dtypes") for g in _param_groups_of(module)):
            raise UnsupportedEngineError(
                f"Cannot install the FSDP2 unfreeze fix on torch {torch.__version__} (FSDPParamGroup._init_mp_dtypes "
                f"is missing). Upgrade torch to >= {FSDP2_UNFREEZE_FIXED_IN} or drop param_dtype from the "
                "MixedPrecisionPolicy."
            )

    def make_hook(module: nn.Module):
        last: dict[int, tuple[bool, ...]] = {}

        def refresh(mod, args, kwargs=None):
            for group in _param_groups_of(module):
                pattern = tuple(p.sharded_param.requires_grad for p in group.fsdp_params)
                if last.get(id(group)) != pattern:
                    group._init_mp_dtypes()
                    last[id(group)] = pattern

        return refresh

    for module in modules:
        # runs after FSDP's own pre-forward (registered at fully_shard time), so lazy init has happened
        module.register_forward_pre_hook(make_hook(module))
    model._lisa_unfreeze_fix = True
    return True


def fully_shard_blocks(
    model: nn.Module,
    mesh=None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    offload_policy=None,
    layers_attribute: Optional[str] = None,
) -> nn.Module:
    """Apply FSDP2's ``fully_shard`` to every transformer block, then to the root; ready for LISA switching.

    Per-block units make a frozen block skip its reduce-scatter, so the gradient traffic follows the active set. On
    torch < 2.14.1 with a low-precision ``mp_policy`` the unfreeze fix is installed
    (:func:`install_fsdp2_unfreeze_fix`).
    Build the optimizer *after* this call, over every candidate parameter, then freeze.

    Example:
        ```py
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy
        >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        >>> model = fully_shard_blocks(model, mp_policy=policy)  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # doctest: +SKIP
        >>> scheduler = LayerwiseScheduler(model, num_active=2, interval_steps=20)  # doctest: +SKIP
        >>> scheduler.freeze_all_but_active(optimizer)  # doctest: +SKIP
        ```
    """
    from torch.distributed.fsdp import fully_shard

    from .blocks import find_blocks

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for _, block in find_blocks(model, layers_attribute):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    install_fsdp2_unfreeze_fix(model)
    return model


def save_fsdp2_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None
) -> None:
    """Save a sharded (DCP) checkpoint of an FSDP2 model and its optimizer, plus the LISA schedule.

    Every rank must call it. The schedule (``scheduler.state_dict()``, sampler generator included) is written by
    rank 0 as exact JSON next to the shards.
    """
    import json
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .json_state import encode_state

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    if scheduler is not None and (not _dist_ready() or torch.distributed.get_rank() == 0):
        with open(os.path.join(checkpoint_dir, FSDP2_SCHEDULE_FILE), "w") as f:
            json.dump(encode_state(scheduler.state_dict()), f)
    if _dist_ready():
        torch.distributed.barrier()


def load_fsdp2_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None
) -> None:
    """Load :func:`save_fsdp2_checkpoint` output into a freshly built FSDP2 model, optimizer and LISA scheduler.

    The saved active set is applied *before* the optimizer state is loaded: torch initialises optimizer state only for
    parameters that require grad and FSDP2/DCP loads strictly, so loading with every candidate trainable would expect
    state for blocks that had none (their state was dropped on the switch).
    """
    import json
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .json_state import decode_state

    if scheduler is not None:
        path = os.path.join(checkpoint_dir, FSDP2_SCHEDULE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved without the LISA schedule.")
        with open(path) as f:
            scheduler.load_state_dict(decode_state(json.load(f)), optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
