"""FSDP2 (``fully_shard``) with a changing active set: per-block sharding, the unfreeze fix for torch < 2.14.1 and
sharded checkpoints."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..scheduler.state import LISA_STATE_FILE, load_schedule, save_schedule
from ..renamed import renamed_keywords
from .guards import (
    FSDP2_UNFREEZE_FIXED_IN,
    UnsupportedEngineError,
    _dist_ready,
    _fsdp2_modules,
    _param_groups_of,
    fsdp2_unfreeze_fix_needed,
)

#: the LISA schedule inside an FSDP2 checkpoint folder (written by rank 0 next to the shards)
FSDP2_SCHEDULE_FILE = LISA_STATE_FILE


def _fsdp2_fix_callback():
    from transformers import TrainerCallback

    class Fsdp2UnfreezeFixCallback(TrainerCallback):
        """Installs :func:`install_fsdp2_unfreeze_fix` on the FSDP2-wrapped model before the LISA callbacks freeze."""

        _hf_lisa_engine_callback = True

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                install_fsdp2_unfreeze_fix(model)

    return Fsdp2UnfreezeFixCallback()


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


@renamed_keywords("layers_attribute")
def fully_shard_blocks(
    model: nn.Module,
    mesh=None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    offload_policy=None,
    lisa_layers_attribute: Optional[str] = None,
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
        >>> scheduler = LayerwiseScheduler(model, lisa_activated_layers=2, lisa_interval_steps=20)  # doctest: +SKIP
        >>> scheduler.freeze_all_but_active(optimizer)  # doctest: +SKIP
        ```
    """
    from torch.distributed.fsdp import fully_shard

    from ..scheduler.active_set import BlockIndex

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for _, block in BlockIndex.of(model, lisa_layers_attribute).blocks:  # the index the LISA scheduler reads too
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    install_fsdp2_unfreeze_fix(model)
    return model


def save_fsdp2_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None
) -> None:
    """Save a sharded (DCP) checkpoint of an FSDP2 model and its optimizer, plus the LISA schedule.

    Every rank must call it. The schedule (``scheduler.state_dict()``, sampler generator included) is written by
    rank 0 next to the shards, as ``lisa_state.safetensors`` (:func:`hf_lisa.scheduler.state.save_schedule`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    if scheduler is not None and (not _dist_ready() or torch.distributed.get_rank() == 0):
        save_schedule(checkpoint_dir, scheduler.state_dict())
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if scheduler is not None:  # refuses a missing file or another format with a message naming the path
        scheduler.load_state_dict(load_schedule(checkpoint_dir), optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
