"""Which engine runs the model, and whether LISA's layer switching can work under it: the one check, with one message
per case."""

from __future__ import annotations

import os
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


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def _fsdp_config(args: Any) -> dict:
    config = getattr(args, "fsdp_config", None)
    return config if isinstance(config, dict) else {}


def _engine_from_args(args: Any) -> str:
    """The engine a ``transformers.Trainer`` builds from ``args`` (``TrainingArguments``), before it wraps the model."""
    from transformers.training_args import ParallelMode

    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        return "deepspeed"
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if getattr(args, "fsdp", None) or _env_true("ACCELERATE_USE_FSDP"):
        return "fsdp1" if int(_fsdp_config(args).get("version", 2)) == 1 else "fsdp2"
    if args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size > 1:
        return "ddp"
    return "single"


def _fsdp1_use_orig_params(model: Optional[nn.Module], args: Any) -> bool:
    units = _fsdp1_modules(model) if model is not None else []
    if units:
        return all(getattr(m, "_use_orig_params", False) for m in units)
    return str(_fsdp_config(args).get("use_orig_params", "true")).lower() == "true"


def _ddp_settings(model: Optional[nn.Module], args: Any) -> tuple[bool, bool, bool]:
    """``(find_unused_parameters, static_graph, reentrant checkpointing)`` of the DDP that runs or will run ``model``.

    From the ``DistributedDataParallel`` wrapper when there is one; otherwise what the Trainer will pass to DDP from
    ``args`` (mirrors ``Trainer._build_accelerator_args``: ``ddp_find_unused_parameters=None`` means "not with
    activation checkpointing" for a ``PreTrainedModel``).
    """
    reentrant = model is not None and _reentrant_checkpointing(model)
    if model is not None and _is_ddp(model):
        return bool(model.find_unused_parameters), bool(getattr(model, "static_graph", False)), reentrant
    if args is None:
        return True, False, reentrant
    checkpointing = bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
        or getattr(model, "is_activation_checkpointing", False)
    )
    checkpointing_kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
        args, "gradient_checkpointing_kwargs", None
    )
    if checkpointing and isinstance(checkpointing_kwargs, dict) and checkpointing_kwargs.get("use_reentrant") is True:
        reentrant = True
    find_unused = args.ddp_find_unused_parameters
    if find_unused is None:
        from transformers import PreTrainedModel

        find_unused = not (checkpointing and isinstance(model, PreTrainedModel))
    return bool(find_unused), bool(args.ddp_static_graph), reentrant


# ---------------------------------------------------------------------------------------------------------------------
# The support check: one helper per engine or condition, in the order they are checked
# ---------------------------------------------------------------------------------------------------------------------
def _engine_to_check(model: Optional[nn.Module], optimizer: Any, params: list, args: Any) -> str:
    """The engine from the objects, from ZeRO-3 candidate parameters, else from what ``args`` will build."""
    engine = detect_engine(model, optimizer)
    if any(hasattr(p, "ds_id") for p in params):
        engine = "deepspeed"
    if engine == "single" and args is not None:
        engine = _engine_from_args(args)
    return engine


def _check_deepspeed(engine: str, form: str) -> None:
    """Refuse DeepSpeed ZeRO, which fixes the trainable set when it builds its partitions, unless a
    ``DeepSpeedLayerSwitcher`` rebuilds them (checked by the caller)."""
    if engine == "deepspeed":
        raise UnsupportedEngineError(
            f"{form} changes which parameters train every K steps, but DeepSpeed ZeRO fixes the trainable set "
            "when deepspeed.initialize builds its partitions (DeepSpeed #5639): blocks frozen later keep moving under "
            "Adam and blocks unfrozen later never train. In a custom loop (deepspeed.initialize), drive the schedule "
            "with hf_lisa.distributed.DeepSpeedLayerSwitcher(engine, scheduler), which rebuilds the ZeRO optimizer "
            "over the new trainable set at every switch (ZeRO-1/2/3). The Trainer (accelerate launch with a DeepSpeed "
            "config) does not run it yet: there, use FSDP2 (fully_shard per block: "
            "hf_lisa.distributed.fully_shard_blocks, TrainingArguments(fsdp='full_shard', fsdp_config={'version': 2}) "
            "or examples/accelerate_configs/fsdp2.yaml) or DDP for layer switching, or train a fixed trainable set: "
            "LoRA, or LISA adapters with lisa_activated_layers=0 (sparse-mask re-selection works)."
        )


def _check_optimizer_holds_params(optimizer: Any, params: list, form: str) -> None:
    """Refuse an optimizer built over flattened copies: it holds none of the candidate parameters."""
    if params and optimizer is not None:
        held = {id(p) for o in _optimizer_chain(optimizer) for g in getattr(o, "param_groups", []) for p in g["params"]}
        if held and not any(id(p) in held for p in params):
            raise UnsupportedEngineError(
                f"{form} freezes and unfreezes model parameters, but the optimizer holds none of them (it was "
                "built over flattened copies, as DeepSpeed ZeRO and FSDP1 without use_orig_params do), so freezing "
                "would not stop its updates. Build the optimizer over model.parameters(); for sharding use FSDP2."
            )


def _check_fsdp1(engine: str, model: Optional[nn.Module], args: Any, form: str) -> None:
    """Refuse FSDP1 without ``use_orig_params=True``."""
    if engine == "fsdp1" and not _fsdp1_use_orig_params(model, args):
        raise UnsupportedEngineError(
            f"{form} freezes parameters inside FSDP units, which FSDP1 supports only with use_orig_params=True (it "
            "got use_orig_params=False). Wrap with use_orig_params=True (TrainingArguments(fsdp_config="
            "{'use_orig_params': True})), or better use FSDP2 (fully_shard per block, fsdp_config={'version': 2}), "
            "whose per-parameter sharding is the supported engine."
        )


def _check_ddp(engine: str, model: Optional[nn.Module], args: Any, form: str) -> None:
    """Refuse DDP without unused-parameter detection, with a static graph, or with reentrant checkpointing."""
    if not (engine == "ddp" or (engine == "single" and _dist_world_size() > 1)):
        return
    find_unused, static_graph, reentrant = _ddp_settings(model, args)
    if engine == "ddp" and not find_unused:
        raise UnsupportedEngineError(
            f"{form} freezes blocks after DDP wrapped the model, so DDP must look for unused parameters, but it "
            "runs with find_unused_parameters=False and would fail with 'Expected to have finished reduction' "
            "(axolotl #1474). Set TrainingArguments(ddp_find_unused_parameters=True) (the Trainer turns it off "
            "with gradient checkpointing) or call hf_lisa.distributed.configure_trainer_for_lisa(trainer); in a "
            "custom loop, build DDP with find_unused_parameters=True."
        )
    if engine == "ddp" and static_graph:
        raise UnsupportedEngineError(
            f"{form} changes the set of parameters with gradients every K steps, which DDP's static_graph=True "
            "forbids. Set TrainingArguments(ddp_static_graph=False), or build DDP with static_graph=False."
        )
    if reentrant:
        raise UnsupportedEngineError(
            f"{form} under DDP needs find_unused_parameters=True, which reentrant activation checkpointing "
            "breaks ('Expected to mark a variable ready only once'). Use non-reentrant checkpointing: "
            "TrainingArguments(gradient_checkpointing_kwargs={'use_reentrant': False}) (transformers' default)."
        )


def _check_fsdp2(engine: str, model: Optional[nn.Module], form: str) -> None:
    """Refuse FSDP2 with a low-precision policy on a torch with pytorch#186998, unless the fix is installed."""
    unfixed_fsdp2 = engine == "fsdp2" and model is not None and not getattr(model, "_lisa_unfreeze_fix", False)
    if unfixed_fsdp2 and fsdp2_unfreeze_fix_needed(model):
        raise UnsupportedEngineError(
            f"{form} with FSDP2 and a low-precision MixedPrecisionPolicy fails on torch {torch.__version__} when "
            f"a block frozen at the first forward is unfrozen later (pytorch#186998, fixed in "
            f"{FSDP2_UNFREEZE_FIXED_IN}). Call hf_lisa.distributed.install_fsdp2_unfreeze_fix(model) after "
            "fully_shard (fully_shard_blocks does it), upgrade torch, or drop param_dtype from the policy."
        )


def check_layer_switching_supported(
    model: Optional[nn.Module] = None,
    optimizer: Any = None,
    form: str = "LISA layer switching",
    params: Optional[Iterable[torch.Tensor]] = None,
    args: Any = None,
    freezes: bool = True,
) -> str:
    """The one rule for which engine supports LISA's layer switching: refuse setups that would train silently wrong.

    Changing ``requires_grad`` during training (LISA's switch every K steps) works only where the engine keeps
    following the model's parameters. Every setup is judged here, with one message per case; the LISA callbacks call
    it once per training run, as training begins (``on_train_begin``), with the wrapped model, the optimizer, the
    Trainer's arguments and their candidate parameters. In a custom loop, call it with the *wrapped* model (DDP,
    FSDP, DeepSpeed engine) and the optimizer before the first switch.

    The engine comes from the objects when they tell (a ``DeepSpeedEngine``, a DeepSpeed optimizer or ZeRO-3
    parameters, FSDP1 or FSDP2 units, a ``DistributedDataParallel`` wrapper), otherwise from ``args`` (what the Trainer
    is about to build).

    Args:
        model: the model, wrapped by its engine when it is.
        optimizer: the optimizer the schedule freezes under (any wrapper chain through ``.optimizer``).
        form: what switches, for the messages (e.g. ``"full-parameter LISA"``).
        params: the candidate parameters of the schedule; refused when the optimizer holds none of them (the flat
            partitions of ZeRO-1/2 or FSDP1 without ``use_orig_params``).
        args: the Trainer's ``TrainingArguments``, for a Trainer that has not wrapped the model yet.
        freezes: whether the schedule freezes anything the optimizer was built over (γ < N, or parameters outside
            the always-trainable set). Setups that only re-select masks change no ``requires_grad`` and are never
            refused.

    Returns:
        The detected engine, one of :data:`ENGINES`.

    Raises:
        UnsupportedEngineError: DeepSpeed ZeRO (any stage) unless ``model`` is an engine driven by a
            :class:`~hf_lisa.distributed.DeepSpeedLayerSwitcher`; an optimizer that holds none of ``params``;
            FSDP1 without ``use_orig_params=True``; DDP without ``find_unused_parameters=True``, with ``static_graph=True`` or with
            reentrant activation checkpointing; FSDP2 with a low-precision ``MixedPrecisionPolicy`` on torch < 2.14.1
            without :func:`install_fsdp2_unfreeze_fix`.

    Example:
        >>> import torch
        >>> check_layer_switching_supported(torch.nn.Linear(2, 2))
        'single'
    """
    params = list(params) if params is not None else []
    engine = _engine_to_check(model, optimizer, params, args)
    if not freezes:
        return engine
    if engine == "deepspeed" and getattr(model, "_hf_lisa_layer_switcher", None) is not None:
        return engine  # a DeepSpeedLayerSwitcher rebuilds the ZeRO optimizer at every switch
    _check_deepspeed(engine, form)
    _check_optimizer_holds_params(optimizer, params, form)
    _check_fsdp1(engine, model, args, form)
    _check_ddp(engine, model, args, form)
    _check_fsdp2(engine, model, form)
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
