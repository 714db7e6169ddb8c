"""Which engine runs the model, and whether LISA's layer switching can work under it (one check, with one message per case)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

ENGINES = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")


#: first torch release with the FSDP2 fix for parameters unfrozen after lazy init under mixed precision
FSDP2_UNFREEZE_FIXED_IN = "2.14.1"


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
