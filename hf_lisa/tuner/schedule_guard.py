"""Which LISA adapters need their schedule, and the refusal to train them without it.

Some ``LisaConfig`` settings only take effect through the schedule that ``LisaAdapterCallback`` (or code driving
:mod:`hf_lisa.scheduler` itself) runs around each optimizer step: layerwise sampling (γ of N blocks), the calibration
and re-selection of sparse masks, and layer interpolation's once-per-step penalty gradient, δ projection and weight
decay exemption. A plain ``transformers.Trainer`` or TRL's ``SFTTrainer(peft_config=LisaConfig(...))`` without the
callback would train such an adapter with these settings silently ignored.

* :func:`settings_needing_schedule` is the one rule: which settings need the schedule, given what the adapter holds.
  ``LisaAdapterCallback`` uses it for its "nothing to schedule" warning, the guard below for its refusal.
* Every ``LisaModel`` installs a forward pre-hook on the model it adapts. At a *training* forward (the model in train
  mode, autograd on) of an adapter that needs the schedule, it raises unless something declared that it runs the
  schedule (:func:`attach_schedule`; the callback does so at ``on_train_begin`` and undoes it at ``on_train_end``).
  Evaluation, inference and ``torch.no_grad()`` forwards never check; neither do schedule-free adapters (γ = 0 or
  every block, no mask to calibrate or re-select, no interpolation) nor frozen ones (loaded for inference).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..blocks import find_blocks
from .config import LisaConfig
from .layer import LisaLayer

#: attribute of the guarded module: the objects that declared they run the schedule (see attach_schedule)
_OWNERS = "_lisa_schedule_owners"


class _Owners(list):
    """The declarations of one guarded model. A copy or pickle of the model starts without any: a declaration belongs
    to the running schedule (a callback, a loop), which neither follows the copy nor should be copied with it."""

    def __deepcopy__(self, memo) -> "_Owners":
        return _Owners()

    def __reduce__(self):
        return (_Owners, ())


_FIX = (
    "Add the callback that runs it: `from hf_lisa.trainer_callbacks import LisaAdapterCallback`, then "
    "`transformers.Trainer(..., callbacks=[LisaAdapterCallback()])`, or with TRL "
    "`SFTTrainer(..., peft_config=config, callbacks=[LisaAdapterCallback()])`. Or make the adapter schedule-free: "
    "lisa_activated_layers=0 (every block's adapter trains, like LoRA), sparse masks fixed at creation "
    "(mask_init='magnitude', 'random' or 'dense', and mask_update_interval=0), layer_interpolation=False. A custom "
    "training loop that runs hf_lisa.scheduler itself declares it with "
    "hf_lisa.tuner.schedule_guard.attach_schedule(model, owner)."
)


def settings_needing_schedule(
    *,
    lisa_activated_layers: int,
    num_blocks: Optional[int],
    sparse: bool,
    uncalibrated: bool,
    mask_update_interval: int,
    layer_interpolation: bool,
    lisa_interval_steps: Optional[int] = None,
) -> list[str]:
    """The settings of one LISA adapter that take effect only through its schedule; ``[]`` when it would change nothing.

    The one rule for "does this adapter need ``LisaAdapterCallback``": the callback's "nothing to schedule" warning and
    the refusal to train without the callback both ask it.

    Args:
        lisa_activated_layers: γ, blocks whose adapters train at a time (0: every block).
        num_blocks: N, the blocks that hold trainable adapter parameters (``None``: unknown, e.g. no block list found).
            γ >= N samples nothing: every block trains throughout.
        sparse: whether the adapter has sparse layers (``sparsity`` or ``sparsity_pattern`` > 0).
        uncalibrated: whether a sparse layer still waits for its first mask from ``|∂L/∂W|`` (``mask_init=
            "importance"`` on a fresh adapter, ``B = 0``).
        mask_update_interval: optimizer steps between mask re-selections (0: never).
        layer_interpolation: whether the adapter learns the per-block α/β.
        lisa_interval_steps: K, only to name it in the text.

    Returns:
        One entry per setting, ``"name=value (what the schedule does with it)"``.
    """
    reasons = []
    if lisa_activated_layers >= 1 and (num_blocks is None or lisa_activated_layers < num_blocks):
        of = f" of the {num_blocks} blocks" if num_blocks is not None else ""
        every = "lisa_interval_steps" + ("" if lisa_interval_steps is None else f"={lisa_interval_steps}")
        gamma = lisa_activated_layers
        reasons.append(
            f"lisa_activated_layers={gamma} (the adapters of {gamma}{of} train at a time, "
            f"re-drawn every {every} steps)"
        )
    if sparse and uncalibrated:
        reasons.append(
            "mask_init='importance' on a fresh adapter (its sparse masks are chosen from |dL/dW| over the first "
            "importance_steps steps)"
        )
    if sparse and mask_update_interval > 0:
        reasons.append(
            f"mask_update_interval={mask_update_interval} (its sparse masks are re-selected every "
            f"{mask_update_interval} steps)"
        )
    if layer_interpolation:
        reasons.append(
            "layer_interpolation=True (the beta penalty's gradient is applied once per optimizer step, delta is kept "
            "within its bound, and delta/beta get no weight decay)"
        )
    return reasons


# -- what an adapter holds ---------------------------------------------------------------------------------------------
def _config_may_need_schedule(config: Any) -> bool:
    """A cheap first look at the config alone: ``False`` means no setting of this adapter needs the schedule."""
    sparse = config.sparsity > 0 or any(v > 0 for v in (config.sparsity_pattern or {}).values())
    masks_move = config.mask_init == "importance" or config.mask_update_interval > 0
    return config.lisa_activated_layers >= 1 or (sparse and masks_move) or config.layer_interpolation


def _trainable_blocks(model: nn.Module, layers_attribute: Optional[str]) -> Optional[int]:
    """N as the layer schedule counts it: blocks that hold a trainable parameter (``None`` if no block list)."""
    try:
        blocks = find_blocks(model, layers_attribute)
    except ValueError:
        return None
    return sum(any(p.requires_grad for p in block.parameters()) for _, block in blocks)


def _is_zero(weight: torch.Tensor) -> bool:
    return not weight.is_meta and not bool(weight.detach().any())


def schedule_requirements(tuner: nn.Module) -> Optional[dict[str, list[str]]]:
    """``adapter -> settings that need the schedule`` for the active, trainable LISA adapters of ``tuner`` (a
    ``LisaModel``).

    An adapter counts as trainable when one of its parameters requires a gradient (an adapter loaded for inference,
    or frozen by hand, trains nothing: its settings cannot take effect, scheduled or not). The active adapters are the
    tuner layers' own (transformers' adapter API sets them on the layers, not on a tuner). ``None`` while the adapters
    are disabled (``disable_adapter()``): nothing of them runs, so nothing needs a schedule in that forward.
    """
    configs = {n: c for n, c in tuner.peft_config.items() if isinstance(c, LisaConfig) and _config_may_need_schedule(c)}
    if not configs:
        return {}
    layers = [m for m in tuner.model.modules() if isinstance(m, LisaLayer)]
    if layers and layers[0].disable_adapters:
        return None
    active = set(layers[0].active_adapters) if layers else set(tuner.active_adapters)
    needs: dict[str, list[str]] = {}
    for name, config in configs.items():
        if name not in active:
            continue
        own = [m for m in layers if name in m.lisa_A]
        interp = [d[name] for d in (tuner.lisa_interp_delta, tuner.lisa_interp_beta) if name in d]
        weights = [w for m in own for w in (m.lisa_A[name].weight, m.lisa_B[name].weight)] + interp
        if not any(w.requires_grad for w in weights):
            continue
        sparse = [m for m in own if name in m.lisa_mask]
        gamma = config.lisa_activated_layers
        reasons = settings_needing_schedule(
            lisa_activated_layers=gamma,
            num_blocks=_trainable_blocks(tuner.model, config.lisa_layers_attribute) if gamma >= 1 else None,
            sparse=bool(sparse),
            uncalibrated=config.mask_init == "importance" and any(_is_zero(m.lisa_B[name].weight) for m in sparse),
            mask_update_interval=config.mask_update_interval,
            layer_interpolation=bool(interp),
            lisa_interval_steps=config.lisa_interval_steps,
        )
        if reasons:
            needs[name] = reasons
    return needs


# -- declaring the schedule --------------------------------------------------------------------------------------------
def _guarded_modules(model: nn.Module) -> list[nn.Module]:
    # looked up in the instance's own __dict__: PeftModel and LisaModel forward unknown attributes to the model inside
    return [m for m in model.modules() if _OWNERS in m.__dict__]


def attach_schedule(model: nn.Module, owner: object) -> int:
    """Declare that ``owner`` runs the LISA schedule of ``model`` (a ``PeftModel``, a transformers model with LISA
    adapters, or a wrapper of either): its training forwards are no longer refused. Returns how many guarded models
    were marked (0: ``model`` has no LISA adapter)."""
    guarded = _guarded_modules(model)
    for module in guarded:
        owners = module.__dict__[_OWNERS]
        if not any(o is owner for o in owners):
            owners.append(owner)
    return len(guarded)


def detach_schedule(model: nn.Module, owner: object) -> None:
    """Undo :func:`attach_schedule` for ``owner`` (training without the schedule is refused again)."""
    for module in _guarded_modules(model):
        owners = module.__dict__[_OWNERS]
        owners[:] = [o for o in owners if o is not owner]


def schedule_owners(model: nn.Module) -> list:
    """The objects that declared they run the schedule of a guarded model inside ``model`` (:func:`attach_schedule`),
    each once."""
    found: list = []
    for module in _guarded_modules(model):
        found += [o for o in module.__dict__[_OWNERS] if not any(o is f for f in found)]
    return found


def schedule_attached(model: nn.Module) -> bool:
    """Whether some owner declared that it runs the schedule of every guarded model inside ``model``."""
    guarded = _guarded_modules(model)
    return bool(guarded) and all(m.__dict__[_OWNERS] for m in guarded)


class ScheduleGuard:
    """The forward pre-hook a ``LisaModel`` puts on the model it adapts (see the module docstring)."""

    def __init__(self, tuner: nn.Module) -> None:
        self.tuner = tuner
        self._passed: Optional[tuple] = None  # the key of the last training forward that needed no schedule

    def install(self, model: nn.Module) -> None:
        model.__dict__.setdefault(_OWNERS, _Owners())
        self.model = model
        self.handle = model.register_forward_pre_hook(self)

    def remove(self) -> None:
        """Take the hook off (the adapters were unloaded)."""
        self.handle.remove()
        if _OWNERS in self.model.__dict__ and not any(
            isinstance(h, ScheduleGuard) for h in self.model._forward_pre_hooks.values()
        ):
            del self.model.__dict__[_OWNERS]

    def _key(self) -> tuple:
        # what the answer depends on, short of walking the model: the adapters and their schedule settings. A passed
        # check is not repeated for the same key (it may read every B and count the blocks: GPU syncs per forward)
        return tuple(
            (name, id(c), getattr(c, "lisa_activated_layers", None), getattr(c, "mask_init", None),
             getattr(c, "mask_update_interval", None), getattr(c, "layer_interpolation", None))
            for name, c in self.tuner.peft_config.items()
        ) + (tuple(self.tuner.active_adapters),)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()) or module.__dict__.get(_OWNERS):
            return
        key = self._key()
        if key == self._passed:
            return
        needs = schedule_requirements(self.tuner)
        if needs is None:  # adapters disabled for this forward: ask again at the next one
            return
        if not needs:
            self._passed = key
            return
        listed = "; ".join(f"adapter {name!r}: {', '.join(reasons)}" for name, reasons in needs.items())
        raise RuntimeError(
            f"A LISA adapter is being trained without its schedule, which alone applies these settings - {listed}. "
            f"Without it they would be silently ignored. {_FIX}"
        )
