"""The one place that decides what trains: LISA's layerwise schedule and the sparse-mask re-selection.

Everything about *which* parameters train, *when* that changes and *what happens to the optimizer state* lives here,
in the spirit of BAdam's ``block_optim.py``. The Trainer callbacks in ``trainer_callbacks`` only call these classes at
the right events.

* :class:`LayerwiseScheduler` (full-parameter and adapter form): every K optimizer steps, γ blocks train; the
  always-trainable set (embeddings, LM head, final norm, or all non-block adapter parameters) trains throughout.
* :class:`MaskScheduler` (sparse LISA adapters): selects the element mask ``M`` from ``|∂L/∂W|`` accumulated over
  ``importance_steps`` batches, at train begin and every ``mask_update_interval`` steps.

Choices made here, and why:

* The optimizer must be built over **every** candidate parameter *before* freezing (LMFlow #726: an optimizer built
  after freezing never sees layers sampled later). The schedulers are constructed from the parameters that are
  trainable when training begins and only toggle ``requires_grad`` inside that set.
* A switch happens exactly when ``global_step % K == 0`` and at most once per step, so there is no double switch at
  steps 0 and 1 (axolotl, ms-swift).
* Deactivated parameters are frozen (``requires_grad=False``, ``grad=None``), never given zero gradients: a zero grad
  still moves a parameter under Adam (momentum, weight decay).
* Their optimizer state is dropped by default (LMFlow #768, ms-swift #4522; the paper restarted the optimizer every
  period). Blocks that stay active across a switch keep their state, so γ = N is exactly full fine-tuning.
* At a mask re-selection the function changes abruptly: entries dropped from ``M`` vanish at once and new entries
  start from the current ``B A``. The loss on a fixed batch just before and after is measured and logged.
"""

from __future__ import annotations

import math
import re
import warnings
import zlib
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from . import masks as M
from .blocks import _unwrap, find_blocks
from .optim_state import OPTIMIZER_STATE_POLICIES, drop_optimizer_state, optimizer_state_bytes
from .sampler import LayerSampler

__all__ = [
    "ALWAYS_TRAINABLE_KEYWORDS",
    "DEFAULT_ALWAYS_TRAINABLE",
    "LayerwiseScheduler",
    "MaskScheduler",
    "optimizer_state_bytes",
]

ALWAYS_TRAINABLE_KEYWORDS = ("embeddings", "lm_head", "norm")
DEFAULT_ALWAYS_TRAINABLE = ("embeddings", "lm_head", "norm")  # E+H(+final norm), the paper's setting

SCHEDULER_STATE_VERSION = 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _grad_norm(grad: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(grad.detach().float())
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 DTensor shards


class LayerwiseScheduler:
    """Layerwise Importance Sampling: γ of the N blocks train, re-drawn every K optimizer steps.

    The scheduler works on the *candidate* parameters: those trainable when it is built (by default). Candidates inside
    a transformer block are scheduled with their block; candidates outside every block train throughout if they
    belong to the always-trainable set, and are frozen for the whole run otherwise.

    * **Full-parameter form** (plain transformers model): every parameter is a candidate; ``always_trainable`` picks
      E+H+norm by default.
    * **Adapter form** (a ``PeftModel`` with ``LisaConfig``, see :meth:`for_adapter`): the candidates are the adapter's
      parameters; ``always_trainable=None`` keeps every non-block candidate (layer-interpolation scalars,
      ``modules_to_save``) trainable.

    Args:
        model: the model being trained (optionally wrapped by PEFT or DDP).
        num_active: γ, blocks active at a time, ``1 <= γ <= N``.
        interval_steps: K, optimizer steps per period, ``>= 1``.
        strategy: ``"uniform"``, ``"importance"`` or ``"cyclic"`` (see :class:`~hf_lisa.sampler.LayerSampler`).
        seed: seed of the sampler's private generator; identical on every rank.
        always_trainable: keywords ``"embeddings"`` (every ``nn.Embedding`` outside the blocks), ``"lm_head"`` (the
            output embeddings), ``"norm"`` (norm layers outside the blocks, e.g. the final norm) and/or module names
            or regexes (e.g. ``"score"``, ``"classifier"``); ``None`` means every candidate outside the blocks. Tied
            weights are one parameter and are counted once.
        optimizer_state_policy: ``"drop"`` (default) frees the optimizer state of deactivated parameters; ``"keep"``
            keeps it, so a re-activated block resumes its old moments.
        layers_attribute: dotted path of the block list, overriding discovery (``lisa_layers_attribute``).
        candidate_params: the parameters to schedule; by default those with ``requires_grad=True`` now.

    Example:
        ```py
        >>> from hf_lisa.scheduler import LayerwiseScheduler
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> scheduler = LayerwiseScheduler(model, num_active=2, interval_steps=20, seed=0)  # doctest: +SKIP
        >>> scheduler.freeze_all_but_active(optimizer)  # doctest: +SKIP
        >>> for step, batch in enumerate(loader):  # doctest: +SKIP
        ...     scheduler.maybe_switch(step, optimizer)
        ...     model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        num_active: int,
        interval_steps: int,
        strategy: str = "uniform",
        seed: int = 0,
        always_trainable: Optional[Sequence[str]] = DEFAULT_ALWAYS_TRAINABLE,
        optimizer_state_policy: str = "drop",
        layers_attribute: Optional[str] = None,
        candidate_params: Optional[Iterable[nn.Parameter]] = None,
    ) -> None:
        if not _is_int(interval_steps) or interval_steps < 1:
            raise ValueError(
                f"interval_steps (lisa_interval_steps, K)={interval_steps!r} is invalid; allowed: an integer >= 1."
            )
        if optimizer_state_policy not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(
                f"optimizer_state_policy={optimizer_state_policy!r} is invalid; allowed: {OPTIMIZER_STATE_POLICIES}."
            )
        if isinstance(always_trainable, str):
            always_trainable = (always_trainable,)
        self.interval_steps = interval_steps
        self.optimizer_state_policy = optimizer_state_policy
        self.always_trainable_spec = None if always_trainable is None else tuple(always_trainable)

        if candidate_params is None:
            candidate_params = [p for p in model.parameters() if p.requires_grad]
        self.candidates: list[nn.Parameter] = list({id(p): p for p in candidate_params}.values())
        if not self.candidates:
            raise ValueError(
                "The model has no trainable parameters to schedule. LISA freezes blocks *after* the optimizer was "
                "built over every candidate parameter: leave them trainable (requires_grad=True) when training starts."
            )
        candidate_ids = {id(p) for p in self.candidates}

        # blocks with no candidate parameter (e.g. not adapted, layers_to_transform) are not worth a sampling slot
        self.block_names: list[str] = []
        self.block_params: list[list[nn.Parameter]] = []
        self.skipped_blocks: list[str] = []
        seen: set[int] = set()
        for name, block in find_blocks(model, layers_attribute):
            params = [p for p in block.parameters() if id(p) in candidate_ids and id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                self.block_names.append(name)
                self.block_params.append(params)
            else:
                self.skipped_blocks.append(name)
        if not self.block_names:
            raise ValueError(
                "None of the model's transformer blocks holds a trainable parameter, so there is nothing to sample. "
                "Check lisa_layers_attribute / the adapter's target_modules."
            )
        outside = [p for p in self.candidates if id(p) not in seen]
        self.always_params: list[nn.Parameter] = self._resolve_always_trainable(model, outside, seen)
        always_ids = {id(p) for p in self.always_params}
        self.frozen_params: list[nn.Parameter] = [p for p in outside if id(p) not in always_ids]

        self.sampler = LayerSampler(len(self.block_names), num_active, strategy, seed)
        self.active: list[int] = []
        self.last_switch_step: Optional[int] = None
        self.history: list[tuple[int, list[int]]] = []  # (global_step, active blocks) of every switch this session

    @classmethod
    def for_adapter(
        cls,
        model: nn.Module,
        adapter_name: Optional[str] = None,
        seed: int = 0,
        num_active: Optional[int] = None,
        interval_steps: Optional[int] = None,
        strategy: Optional[str] = None,
        optimizer_state_policy: str = "drop",
        layers_attribute: Optional[str] = None,
    ) -> Optional["LayerwiseScheduler"]:
        """Build the scheduler of a ``PeftModel`` with a ``LisaConfig``; ``None`` if γ = 0 (every adapter trains).

        γ, K, the strategy and the block path come from the adapter's config unless overridden.
        """
        config = lisa_config_of(model, adapter_name)
        num_active = config.lisa_activated_layers if num_active is None else num_active
        if num_active == 0:
            return None
        return cls(
            model,
            num_active=num_active,
            interval_steps=config.lisa_interval_steps if interval_steps is None else interval_steps,
            strategy=config.lisa_sampling if strategy is None else strategy,
            seed=seed,
            always_trainable=None,
            optimizer_state_policy=optimizer_state_policy,
            layers_attribute=config.lisa_layers_attribute if layers_attribute is None else layers_attribute,
        )

    # -- the always-trainable set -------------------------------------------------------------------------------------
    def _resolve_always_trainable(
        self, model: nn.Module, outside: list[nn.Parameter], block_ids: set[int]
    ) -> list[nn.Parameter]:
        if self.always_trainable_spec is None:
            return list(outside)
        outside_ids = {id(p) for p in outside}
        root = _unwrap(model)
        chosen: dict[int, nn.Parameter] = {}

        def take(module: Optional[nn.Module]) -> int:
            if module is None:
                return 0
            n = 0
            for p in module.parameters():
                if id(p) in outside_ids and id(p) not in block_ids:
                    chosen.setdefault(id(p), p)
                    n += 1
            return n

        def outside_modules():
            for name, module in root.named_modules():
                own = list(module.parameters(recurse=False))
                if own and all(id(p) not in block_ids for p in own):
                    yield name, module

        for spec in self.always_trainable_spec:
            if spec == "embeddings":
                take(root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None)
                for _, module in outside_modules():
                    if isinstance(module, nn.Embedding):
                        take(module)
            elif spec == "lm_head":
                take(root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None)
            elif spec == "norm":
                for _, module in outside_modules():
                    if "norm" in type(module).__name__.lower():
                        take(module)
            else:
                try:
                    pattern = re.compile(spec)
                except re.error as err:
                    raise ValueError(
                        f"always_trainable entry {spec!r} is not a keyword nor a valid regex: {err}"
                    ) from None
                matched = 0
                for name, module in root.named_modules():
                    if name == spec or name.endswith("." + spec) or pattern.fullmatch(name):
                        matched += take(module)
                if not matched:
                    raise ValueError(
                        f"always_trainable entry {spec!r} matches no trainable module outside the transformer blocks. "
                        f"Allowed: the keywords {ALWAYS_TRAINABLE_KEYWORDS} or a module name/regex such as 'score' or "
                        "'classifier'."
                    )
        # keep the model's parameter order, so logs and tests see a stable list
        return [p for p in outside if id(p) in chosen]

    # -- switching ---------------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def num_active(self) -> int:
        return self.sampler.num_active

    @property
    def strategy(self) -> str:
        return self.sampler.strategy

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters that train in the current period: always-trainable + active blocks."""
        return list(self.always_params) + [p for b in self.active for p in self.block_params[b]]

    def freeze_all_but_active(self, optimizer: Any = None, global_step: int = 0) -> list[int]:
        """Apply the current active set to ``requires_grad`` (drawing the first set if there is none).

        Call it once the optimizer has been built over every candidate parameter (``on_train_begin``). With the drop
        policy and an ``optimizer``, the state of every frozen candidate is dropped too.
        """
        if not self.active:
            self.active = self.sampler.sample()
            self.last_switch_step = global_step
            self.history.append((global_step, list(self.active)))
        trainable = {id(p) for p in self.trainable_parameters()}
        frozen = [p for p in self.candidates if id(p) not in trainable]
        if frozen and optimizer is not None:  # DeepSpeed ZeRO and flat-parameter engines would train silently wrong
            from .distributed import check_layer_switching_supported

            check_layer_switching_supported(optimizer=optimizer, params=self.candidates)
        for p in self.candidates:
            p.requires_grad_(id(p) in trainable)
        for p in frozen:
            p.grad = None
        if optimizer is not None and self.optimizer_state_policy == "drop":
            drop_optimizer_state(optimizer, frozen)
        return list(self.active)

    def maybe_switch(self, global_step: int, optimizer: Any = None) -> bool:
        """Draw a new active set if ``global_step`` starts a period (``global_step % K == 0``); at most once per step.

        Call it once per optimizer step, before the forward pass (``on_step_begin``). Returns whether it switched.
        """
        if not self.active:
            raise RuntimeError("call freeze_all_but_active() once before the first maybe_switch()")
        if global_step % self.interval_steps != 0 or global_step == self.last_switch_step:
            return False
        self.switch_to(self.sampler.sample(), optimizer, global_step)
        return True

    def switch_to(self, blocks: Sequence[int], optimizer: Any = None, global_step: Optional[int] = None) -> None:
        """Make exactly ``blocks`` active: freeze the others, clear their grads and (drop policy) optimizer state."""
        new = sorted(set(int(b) for b in blocks))
        old = set(self.active)
        deactivated = [p for b in sorted(old - set(new)) for p in self.block_params[b]]
        for p in deactivated:
            p.requires_grad_(False)
            p.grad = None
        if optimizer is not None and self.optimizer_state_policy == "drop":
            drop_optimizer_state(optimizer, deactivated)
        for b in new:
            for p in self.block_params[b]:
                p.requires_grad_(True)
        self.active = new
        self.sampler.current = list(new)
        if global_step is not None:
            self.last_switch_step = global_step
            self.history.append((global_step, list(new)))

    def observe_gradients(self) -> dict[int, float]:
        """Feed the active blocks' gradient norms to the sampler (``"importance"`` strategy); needs grads present."""
        norms = {}
        for b in self.active:
            grads = [p.grad for p in self.block_params[b] if p.grad is not None]
            if grads:
                norms[b] = float(torch.stack([_grad_norm(g).to(grads[0].device) for g in grads]).norm())
        self.sampler.observe(norms)
        return norms

    def restore_trainable(self) -> None:
        """Make every candidate trainable again (end of training), leaving the model as it was handed over."""
        for p in self.candidates:
            p.requires_grad_(True)

    # -- reporting ---------------------------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Parameter counts: always-trainable set, active blocks, all blocks, and frozen non-block candidates."""
        always = _numel(self.always_params)
        active = sum(_numel(self.block_params[b]) for b in self.active)
        return {
            "always_trainable": always,
            "active_blocks": active,
            "trainable": always + active,
            "all_blocks": sum(_numel(ps) for ps in self.block_params),
            "frozen_outside_blocks": _numel(self.frozen_params),
        }

    def optimizer_state_bytes(self, optimizer: Any) -> int:
        """Bytes of optimizer state currently held (see :func:`hf_lisa.optim_state.optimizer_state_bytes`)."""
        return optimizer_state_bytes(optimizer)

    # -- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sampler (generator included), active set and last switch step; plain Python data and tensors."""
        return {
            "version": SCHEDULER_STATE_VERSION,
            "block_names": list(self.block_names),
            "interval_steps": self.interval_steps,
            "optimizer_state_policy": self.optimizer_state_policy,
            "sampler": self.sampler.state_dict(),
            "active": list(self.active),
            "last_switch_step": self.last_switch_step,
        }

    def load_state_dict(self, state: Mapping[str, Any], optimizer: Any = None) -> None:
        """Restore :meth:`state_dict` output and apply the restored active set to ``requires_grad``."""
        if list(state["block_names"]) != self.block_names:
            raise ValueError(
                "Cannot restore the LISA layer schedule: the checkpoint schedules blocks "
                f"{list(state['block_names'])} but this model has {self.block_names}. Resume with the same model and "
                "lisa_layers_attribute."
            )
        if state["interval_steps"] != self.interval_steps:
            warnings.warn(
                f"Resuming a LISA schedule saved with interval_steps={state['interval_steps']} using "
                f"interval_steps={self.interval_steps}; the run will not follow the uninterrupted run's path."
            )
        self.sampler.load_state_dict(state["sampler"])
        self.active = [int(b) for b in state["active"]]
        self.last_switch_step = state["last_switch_step"]
        if self.active:
            self.freeze_all_but_active(optimizer)


# ---------------------------------------------------------------------------------------------------------------------
# Sparse-mask re-selection
# ---------------------------------------------------------------------------------------------------------------------


def lisa_config_of(model: nn.Module, adapter_name: Optional[str] = None):
    """The ``LisaConfig`` of ``adapter_name`` (default: the active adapter) of a PEFT-wrapped model."""
    from .config import LisaConfig

    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        raise ValueError(
            f"Expected a PeftModel with a LisaConfig adapter, got {type(model).__name__} without `peft_config`. For a "
            "plain transformers model use full-parameter LISA (trainer_callbacks.LisaCallback)."
        )
    if adapter_name is None:
        adapter_name = getattr(model, "active_adapter", None)
        if not isinstance(adapter_name, str):
            adapter_name = next(iter(peft_config))
    if adapter_name not in peft_config:
        raise ValueError(f"adapter_name={adapter_name!r} is not an adapter of this model; it has {list(peft_config)}.")
    config = peft_config[adapter_name]
    if not isinstance(config, LisaConfig):
        raise ValueError(
            f"Adapter {adapter_name!r} has a {type(config).__name__}, not a LisaConfig; LISA adapter scheduling needs "
            "an adapter created with hf_lisa.LisaConfig (or use trainer_callbacks.LisaCallback without PEFT)."
        )
    return config


def _active_adapter_name(model: nn.Module, adapter_name: Optional[str]) -> str:
    if adapter_name is not None:
        return adapter_name
    name = getattr(model, "active_adapter", None)
    return name if isinstance(name, str) else next(iter(model.peft_config))


def _dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class MaskScheduler:
    """Selects the element mask ``M`` of every sparse LISA layer from accumulated importance ``|∂L/∂W|``.

    Timeline (U = ``mask_update_interval``, W = ``importance_steps``):

    * train begin, ``mask_init="importance"``: :meth:`calibrate` runs forward/backward on W training batches without
      an optimizer step, selects ``M`` and clears the grads. Because ``B = 0`` then, ``ΔW = 0`` whatever ``M`` is, so
      this first selection does not change the function.
    * optimizer steps ``kU - W … kU - 1``: importance accumulates during the normal backward passes (free).
    * at the start of step ``kU`` (``global_step % U == 0``): importance is all-reduced over ranks, the new-cell bonus
      is added, ``M`` is re-selected with its structure and written into the adapter's mask buffer (what
      ``save_pretrained`` stores), and the accumulators are cleared.

    Layers that received no gradient during the window (their block was frozen by layerwise sampling) keep their
    mask: changing it would change the function of a block that cannot adapt to the change.

    Args:
        model: a ``PeftModel`` whose adapter has a ``LisaConfig``.
        adapter_name: the adapter to schedule (default: the active adapter).
        update_interval / importance_steps / new_block_bonus / mask_init: override the config's
            ``mask_update_interval`` / ``importance_steps`` / ``new_block_bonus`` / ``mask_init``.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter_name: Optional[str] = None,
        update_interval: Optional[int] = None,
        importance_steps: Optional[int] = None,
        new_block_bonus: Optional[float] = None,
        mask_init: Optional[str] = None,
    ) -> None:
        from .layer import LisaLayer

        config = lisa_config_of(model, adapter_name)
        self.adapter_name = _active_adapter_name(model, adapter_name)
        self.update_interval = config.mask_update_interval if update_interval is None else update_interval
        self.importance_steps = config.importance_steps if importance_steps is None else importance_steps
        self.new_block_bonus = config.new_block_bonus if new_block_bonus is None else new_block_bonus
        self.mask_init = config.mask_init if mask_init is None else mask_init
        if not _is_int(self.update_interval) or self.update_interval < 0:
            raise ValueError(
                f"mask_update_interval={self.update_interval!r} is invalid; allowed: an integer >= 0 (0 never "
                "re-selects)."
            )
        if not _is_int(self.importance_steps) or self.importance_steps < 1:
            raise ValueError(f"importance_steps={self.importance_steps!r} is invalid; allowed: an integer >= 1.")
        if self.update_interval and self.update_interval < self.importance_steps:
            raise ValueError(
                f"mask_update_interval={self.update_interval} is shorter than the importance window "
                f"importance_steps={self.importance_steps}; allowed: mask_update_interval >= importance_steps, or 0."
            )
        if self.new_block_bonus < 0:
            raise ValueError(f"new_block_bonus={self.new_block_bonus!r} is invalid; allowed: a float >= 0.")
        self.layers: list[tuple[str, Any]] = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, LisaLayer) and self.adapter_name in module.lisa_mask
        ]
        self.new_cells: dict[str, torch.Tensor] = {}  # per layer: grid cells switched on at the last update
        self.last_update_step: Optional[int] = None
        self.num_updates = 0
        self.calibrated = False
        self.updates: list[dict[str, Any]] = []  # what each re-selection of this session did (logged)

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    def _spec(self, layer) -> dict[str, Any]:
        return layer.lisa_mask_spec[self.adapter_name]

    def _grid_shape(self, layer) -> tuple[int, int]:
        spec = self._spec(layer)
        return M.grid_shape((layer.out_features, layer.in_features), spec["structure"], spec["block_size"])

    def _current_grid(self, layer) -> torch.Tensor:
        spec = self._spec(layer)
        mask = layer.get_mask(self.adapter_name)
        if spec["structure"] == "block":
            bo, bi = spec["block_size"]
            return mask[::bo, ::bi]
        return mask

    def set_tracking(self, enabled: bool) -> None:
        """Switch importance accumulation on or off in every sparse layer."""
        for _, layer in self.layers:
            layer.lisa_track_importance = enabled

    def reset_importance(self) -> None:
        for _, layer in self.layers:
            layer.lisa_importance.pop(self.adapter_name, None)

    def in_window(self, global_step: int) -> bool:
        """Whether the optimizer step starting at ``global_step`` contributes to the next re-selection's importance."""
        u, w = self.update_interval, self.importance_steps
        return u > 0 and global_step % u >= u - w

    def is_due(self, global_step: int) -> bool:
        u = self.update_interval
        return u > 0 and global_step > 0 and global_step % u == 0 and global_step != self.last_update_step

    def collect_importance(self) -> dict[str, torch.Tensor]:
        """Per-layer accumulated importance on the selection grid, summed over ranks when torch.distributed is up.

        Only layers that accumulated something on at least one rank are returned; in DDP every rank returns the same.
        """
        present = [layer.lisa_importance.get(self.adapter_name) for _, layer in self.layers]
        if _dist_world_size() > 1:
            import torch.distributed as dist

            device = next((t.device for t in present if t is not None), None)
            if device is None:
                device = self.layers[0][1].lisa_A[self.adapter_name].weight.device
            flags = torch.tensor([0.0 if t is None else 1.0 for t in present], device=device)
            flat = torch.cat(
                [
                    (torch.zeros(self._grid_shape(layer), device=device) if t is None else t.float().to(device))
                    .reshape(-1)
                    for t, (_, layer) in zip(present, self.layers)
                ]
                + [flags]
            )
            dist.all_reduce(flat)  # SUM: identical scores, hence identical masks, on every rank
            sizes = [math.prod(self._grid_shape(layer)) for _, layer in self.layers]
            chunks = torch.split(flat[: sum(sizes)], sizes)
            flags = flat[sum(sizes):]
            return {
                name: chunk.reshape(self._grid_shape(layer))
                for (name, layer), chunk, flag in zip(self.layers, chunks, flags.tolist())
                if flag > 0
            }
        return {name: t.float() for (name, _), t in zip(self.layers, present) if t is not None}

    # -- selection ---------------------------------------------------------------------------------------------------
    def select(self, global_step: int, loss_fn: Optional[Callable[[], float]] = None, bonus: bool = True) -> dict:
        """Re-select ``M`` from the accumulated importance, then clear it. Returns a record of the change.

        ``loss_fn`` (e.g. the loss on a fixed batch) is evaluated just before and just after the new masks are
        installed; the difference is the jump the abrupt change causes.
        """
        importance = self.collect_importance()
        loss_before = float(loss_fn()) if loss_fn is not None and importance else None
        changed = total = 0
        for name, layer in self.layers:
            scores = importance.get(name)
            if scores is None:
                continue
            spec = self._spec(layer)
            current = self._current_grid(layer).to(scores.device)
            previous_new = self.new_cells.get(name)
            if bonus and previous_new is not None and self.new_block_bonus > 0:
                scores = M.add_new_block_bonus(scores, current, previous_new.to(scores.device), self.new_block_bonus)
            full = M.select_mask(
                scores, spec["structure"], spec["sparsity"], spec["block_size"], spec["n_m"], pooled=True
            )
            layer.set_mask(self.adapter_name, full)
            grid = self._current_grid(layer).to(current.device)
            self.new_cells[name] = (grid & ~current).cpu() if bonus else torch.zeros_like(grid, device="cpu")
            changed += int((grid != current).sum())
            total += grid.numel()
        self.reset_importance()
        loss_after = float(loss_fn()) if loss_fn is not None and importance else None
        record = {
            "step": global_step,
            "layers_updated": len(importance),
            "changed_fraction": changed / total if total else 0.0,
            "loss_before": loss_before,
            "loss_after": loss_after,
            "loss_jump": None if loss_before is None else loss_after - loss_before,
        }
        self.updates.append(record)
        return record

    def step(self, global_step: int, loss_fn: Optional[Callable[[], float]] = None) -> Optional[dict]:
        """Call at the start of every optimizer step: re-select if due, then set importance tracking for this step."""
        record = None
        if self.is_due(global_step):
            record = self.select(global_step, loss_fn)
            self.last_update_step = global_step
            self.num_updates += 1
        self.set_tracking(self.in_window(global_step))
        return record

    def calibrate(self, model: nn.Module, batches: Iterable[Mapping[str, Any]]) -> dict:
        """First importance-based selection from calibration batches, before any optimizer step.

        Runs forward and backward on ``batches`` without an optimizer step and selects ``M``. Gradients are taken with
        ``torch.autograd.grad``, so no ``.grad`` is written: under DDP a backward outside the wrapper's forward would
        fire the reducer's hooks and corrupt its bookkeeping of unused parameters (seen with layerwise sampling). The
        global RNG state is left untouched, so training sees the same dropout and shuffling as without calibration.
        """
        inputs = [
            p for _, layer in self.layers for p in layer.lisa_B[self.adapter_name].parameters() if p.requires_grad
        ]
        if not inputs:
            raise ValueError(
                "mask_init='importance' needs trainable LISA adapters at train begin to score |dL/dW|; the sparse "
                "adapters are frozen. Make the adapter trainable (is_trainable=True) or use mask_init='magnitude'."
            )
        self.reset_importance()
        was_training = model.training
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=devices):
                model.train()
                seen = 0
                for batch in batches:
                    self._importance_pass(model, batch, inputs)
                    seen += 1
                if not seen:
                    raise ValueError("mask_init='importance' needs at least one training batch for calibration.")
        finally:
            self.set_tracking(False)
            model.train(was_training)
        record = self.select(0, loss_fn=None, bonus=False)
        self.calibrated = True
        return record

    def _importance_pass(self, model: nn.Module, batch: Mapping[str, Any], inputs: list[nn.Parameter]) -> None:
        snapshot = {name: t.clone() for name, t in self._accumulators().items()}
        self.set_tracking(True)
        try:
            grads = torch.autograd.grad(self._loss(model, batch), inputs, allow_unused=True)
            reached = any(g is not None for g in grads)
        except RuntimeError as err:
            if "checkpoint" not in str(err).lower():
                raise
            reached = False
        if not reached:
            # reentrant activation checkpointing hides the parameters from autograd.grad (it returns None, or raises
            # on some versions): redo the batch with a plain backward, which replays the checkpointed segments
            self._restore_accumulators(snapshot)
            self._loss(model, batch).backward()
            for p in model.parameters():
                p.grad = None

    @staticmethod
    def _loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        outputs = model(**batch)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise ValueError(
                "mask_init='importance' selects the first mask from |dL/dW| on training batches, but the model "
                "returned no loss (are labels in the batch?). Use mask_init='magnitude' instead."
            )
        return loss

    def _accumulators(self) -> dict[str, torch.Tensor]:
        return {
            name: layer.lisa_importance[self.adapter_name]
            for name, layer in self.layers
            if self.adapter_name in layer.lisa_importance
        }

    def _restore_accumulators(self, snapshot: Mapping[str, torch.Tensor]) -> None:
        self.reset_importance()
        layers = dict(self.layers)
        for name, tensor in snapshot.items():
            layers[name].lisa_importance[self.adapter_name] = tensor

    def mask_checksum(self) -> int:
        """CRC32 over every layer's packed mask buffer: a cheap check that the model and the schedule agree."""
        crc = 0
        for name, layer in self.layers:
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(layer.lisa_mask[self.adapter_name].detach().cpu().numpy().tobytes(), crc)
        return crc

    # -- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, the new-cell grids (bit-packed), the live importance accumulators and a mask checksum."""
        importance = {
            name: layer.lisa_importance[self.adapter_name].detach().cpu()
            for name, layer in self.layers
            if self.adapter_name in layer.lisa_importance
        }
        return {
            "version": SCHEDULER_STATE_VERSION,
            "adapter_name": self.adapter_name,
            "layers": [name for name, _ in self.layers],
            "update_interval": self.update_interval,
            "importance_steps": self.importance_steps,
            "last_update_step": self.last_update_step,
            "num_updates": self.num_updates,
            "calibrated": self.calibrated,
            "tracking": any(layer.lisa_track_importance for _, layer in self.layers),
            "new_cells": {name: M.pack_mask(grid.reshape(-1)) for name, grid in self.new_cells.items()},
            "importance": importance,
            "mask_checksum": self.mask_checksum(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The masks themselves come back with the adapter weights."""
        names = [name for name, _ in self.layers]
        if list(state["layers"]) != names:
            raise ValueError(
                f"Cannot restore the mask schedule: the checkpoint has sparse layers {list(state['layers'])} but this "
                f"model has {names}. Resume with the same adapter configuration."
            )
        if state["mask_checksum"] != self.mask_checksum():
            raise RuntimeError(
                "The adapter masks loaded from the checkpoint differ from the masks the schedule saved with it. Resume "
                "from a checkpoint written by the same run (model weights and trainer_state.json together)."
            )
        self.last_update_step = state["last_update_step"]
        self.num_updates = int(state["num_updates"])
        self.calibrated = bool(state["calibrated"])
        layers = dict(self.layers)
        self.new_cells = {}
        for name, packed in state["new_cells"].items():
            shape = self._grid_shape(layers[name])
            packed = torch.as_tensor(packed, dtype=torch.uint8)
            self.new_cells[name] = M.unpack_mask(packed, (math.prod(shape),)).reshape(shape)
        self.reset_importance()
        for name, tensor in state["importance"].items():
            layer = layers[name]
            layer.lisa_importance[self.adapter_name] = tensor.to(layer.lisa_A[self.adapter_name].weight.device)
        self.set_tracking(bool(state["tracking"]))
