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

from .tuner import masks as M
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

ALWAYS_TRAINABLE_KEYWORDS = ("embeddings", "lm_head", "norm", "heads")
# E+H(+final norm), the paper's setting, plus task heads (a classifier's ``score``, BERT's ``pooler``/``classifier``),
# which LMFlow and axolotl train too: a head frozen at its random initialisation would silently never learn
DEFAULT_ALWAYS_TRAINABLE = ("embeddings", "lm_head", "norm", "heads")

SCHEDULER_STATE_VERSION = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _adapter_keys(layer: nn.Module) -> list[str]:
    """Names of the adapters a PEFT tuner layer holds (keys of its adapter ModuleDicts)."""
    keys: dict[str, None] = {}
    for attr in getattr(layer, "adapter_layer_names", ()):
        keys.update(dict.fromkeys(getattr(layer, attr, {}).keys()))
    return list(keys)


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
        blocks = dict(find_blocks(model, layers_attribute))
        for name, block in blocks.items():
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
        # PEFT tuner layers per scheduled block: PEFT re-enables requires_grad on every adapter when it leaves
        # ``disable_adapter()`` (TRL's DPO reference pass) or on ``set_adapter``; its own per-layer
        # ``frozen_peft_weight_names`` is re-applied on those paths, so the schedule declares frozen blocks there too
        self.block_tuner_layers: list[list[nn.Module]] = [
            [m for m in blocks[name].modules() if hasattr(m, "frozen_peft_weight_names")] for name in self.block_names
        ]
        self._peft_frozen_before = {
            id(m): dict(m.frozen_peft_weight_names) for layers in self.block_tuner_layers for m in layers
        }

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
        self.head_params: list[nn.Parameter] = []
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

        named = [spec for spec in self.always_trainable_spec if spec != "heads"]
        for spec in named:
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
        if "heads" in self.always_trainable_spec:
            # after the named entries: every remaining candidate outside the blocks and outside E+H+norm
            self.head_params = [p for p in outside if id(p) not in chosen]
            for p in self.head_params:
                chosen[id(p)] = p
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
        frozen = self.frozen_candidates()
        if frozen and optimizer is not None:  # DeepSpeed ZeRO and flat-parameter engines would train silently wrong
            from .distributed import check_layer_switching_supported

            check_layer_switching_supported(optimizer=optimizer, params=self.candidates)
        self.enforce()
        for p in frozen:
            p.grad = None
        if optimizer is not None and self.optimizer_state_policy == "drop":
            drop_optimizer_state(optimizer, frozen)
        return list(self.active)

    def frozen_candidates(self) -> list[nn.Parameter]:
        """The candidates that do not train in the current period."""
        trainable = {id(p) for p in self.trainable_parameters()}
        return [p for p in self.candidates if id(p) not in trainable]

    def enforce(self) -> None:
        """Make ``requires_grad`` say exactly what the schedule says, and declare it where PEFT looks.

        The schedule is the one authority on what trains: whatever flipped ``requires_grad`` since (PEFT's
        ``disable_adapter()`` exit in TRL's DPO reference pass, ``set_adapter``, user code), this restores it. Frozen
        blocks' adapter layers also list their weights in PEFT's ``frozen_peft_weight_names``, which PEFT re-applies
        itself whenever it re-enables adapters, so the flip cannot happen between a forward and its backward (where
        it would also break activation checkpointing's recomputation).
        """
        trainable = {id(p) for p in self.trainable_parameters()}
        for p in self.candidates:
            wanted = id(p) in trainable
            if p.requires_grad != wanted:
                p.requires_grad_(wanted)
        active = set(self.active)
        for b, layers in enumerate(self.block_tuner_layers):
            for layer in layers:
                declared = dict(self._peft_frozen_before[id(layer)])
                if b not in active:
                    names = tuple(getattr(layer, "adapter_layer_names", ()))
                    for adapter in _adapter_keys(layer):
                        declared[adapter] = tuple(dict.fromkeys(declared.get(adapter, ()) + names))
                layer.frozen_peft_weight_names = declared

    def drop_stray_gradients(self) -> list[nn.Parameter]:
        """Clear gradients that reached frozen candidates anyway; returns them. Call before the optimizer step.

        A safety net behind :meth:`enforce`: a parameter unfrozen behind the schedule's back for a whole step still
        gets no update (its grad is ``None``, so Adam skips it, weight decay included).
        """
        stray = [p for p in self.frozen_candidates() if p.grad is not None]
        for p in stray:
            p.grad = None
        return stray

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
            p.grad = None
        if optimizer is not None and self.optimizer_state_policy == "drop":
            drop_optimizer_state(optimizer, deactivated)
        self.active = new
        self.sampler.current = list(new)
        self.enforce()
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
        for layers in self.block_tuner_layers:
            for layer in layers:
                layer.frozen_peft_weight_names = dict(self._peft_frozen_before[id(layer)])

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
    from .tuner.config import LisaConfig

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
    """Selects the element mask ``M`` of every sparse LISA layer from importance gathered while the layer trains.

    Timeline, per sparse layer (U = ``mask_update_interval``, W = ``importance_steps``, both in optimizer steps):

    * **Calibration** (a *fresh* layer: ``B = 0`` and ``mask_init="importance"``): the layer's first W *trainable*
      optimizer steps score ``|∂L/∂W|`` through the trainer's own loss (plain causal LM, TRL's SFT or DPO, a custom
      ``compute_loss``: whatever the backward pass differentiates). Its ``A`` and ``B`` get no update during those
      steps, so ``ΔW`` stays 0 and the choice of ``M`` never changes the function. A loaded, trained adapter
      (``B ≠ 0``) keeps its masks unless ``recalibrate=True``.
    * **Re-selection**: once per interval ``[kU, (k+1)U)`` in which the layer trains, after it has gathered W steps of
      importance *while trainable*, at the start of an optimizer step in which it still trains (never the step that
      freezes its block). With layerwise sampling, W is capped at K − 1 so that the window completes, and the
      selection happens, inside one active period.
    * **Importance**: the hook on ``M ⊙ (B A)`` sums the *signed* ``∂L/∂W`` over the micro-batches of a step (summed
      over ranks under DDP); ``|·|`` of each step's sum, pooled on the selection grid, is added to the window's
      score. The split of a batch into micro-batches therefore does not change the mask.
    * **Score**: ``|∂L/∂W| / mean + keep_learned · |ΔW| / mean``, plus the ``new_block_bonus`` for cells switched on
      at the previous update. The second term keeps what the adapter has learned: scoring by the gradient alone drops
      17% of ``ΔW``'s energy per re-selection on SmolLM2-135M (up to 21%), against 0.3% with it
      (``benchmarks/mask_reselection.py``).
      Entries dropped from ``M`` vanish at once (an abrupt change); each record carries the retained energy and, with
      a ``loss_fn``, the loss on a fixed batch just before and after.

    Args:
        model: a ``PeftModel`` whose adapter has a ``LisaConfig``.
        adapter_name: the adapter to schedule (default: the active adapter).
        update_interval / importance_steps / new_block_bonus / mask_init / keep_learned: override the config's
            ``mask_update_interval`` / ``importance_steps`` / ``new_block_bonus`` / ``mask_init`` /
            ``mask_keep_learned``.
        interval_steps: K of the layerwise schedule, if any; caps the importance window.
        recalibrate: calibrate the masks of trained adapters too (their function changes at the selection).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter_name: Optional[str] = None,
        update_interval: Optional[int] = None,
        importance_steps: Optional[int] = None,
        new_block_bonus: Optional[float] = None,
        mask_init: Optional[str] = None,
        keep_learned: Optional[float] = None,
        interval_steps: Optional[int] = None,
        recalibrate: bool = False,
    ) -> None:
        from .tuner.layer import LisaLayer

        config = lisa_config_of(model, adapter_name)
        self.adapter_name = _active_adapter_name(model, adapter_name)
        self.update_interval = config.mask_update_interval if update_interval is None else update_interval
        self.importance_steps = config.importance_steps if importance_steps is None else importance_steps
        self.new_block_bonus = config.new_block_bonus if new_block_bonus is None else new_block_bonus
        self.mask_init = config.mask_init if mask_init is None else mask_init
        self.keep_learned = config.mask_keep_learned if keep_learned is None else keep_learned
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
        if self.keep_learned < 0:
            raise ValueError(f"mask_keep_learned={self.keep_learned!r} is invalid; allowed: a float >= 0.")
        # a block trains K steps at a time: the window must complete, and the selection happen, inside one period
        self.window = (
            self.importance_steps if interval_steps is None else min(self.importance_steps, max(1, interval_steps - 1))
        )
        self.layers: list[tuple[str, Any]] = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, LisaLayer) and self.adapter_name in module.lisa_mask
        ]
        self.new_cells: dict[str, torch.Tensor] = {}  # per layer: grid cells switched on at its last update
        # per layer: steps of importance gathered, interval of its last selection (None: never), still to calibrate
        self.window_steps: dict[str, int] = {name: 0 for name, _ in self.layers}
        self.selected_interval: dict[str, Optional[int]] = {name: None for name, _ in self.layers}
        self.fresh: dict[str, bool] = {
            name: self.mask_init == "importance" and (recalibrate or not bool(layer.lisa_B[self.adapter_name].weight.any()))
            for name, layer in self.layers
        }
        self.num_updates = 0
        self.updates: list[dict[str, Any]] = []  # what each selection of this session did (logged)
        self.withheld: list[nn.Parameter] = []  # factors whose update the last end_step() withheld (calibrating)

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

    def _trains(self, layer) -> bool:
        # the layerwise schedule is the authority; it expresses itself through requires_grad
        return bool(layer.lisa_B[self.adapter_name].weight.requires_grad)

    def _interval(self, global_step: int) -> int:
        return global_step // self.update_interval if self.update_interval else 0

    def _pending(self, name: str, global_step: int) -> bool:
        """Whether layer ``name`` still owes a selection: calibration, or this interval's re-selection."""
        if self.fresh[name]:
            return True
        if not self.update_interval:
            return False
        last = self.selected_interval[name]
        return last is None or last < self._interval(global_step)

    @property
    def calibrated(self) -> bool:
        """Whether every sparse layer has had its first importance-based selection."""
        return not any(self.fresh.values())

    def start(self, global_step: int = 0) -> None:
        """Begin a fresh schedule at ``global_step``: trained layers count as selected in the current interval."""
        for name, _ in self.layers:
            if not self.fresh[name]:
                self.selected_interval[name] = self._interval(global_step)

    def set_tracking(self, enabled: bool) -> None:
        """Switch importance accumulation on or off in every sparse layer."""
        for _, layer in self.layers:
            layer.lisa_track_importance = enabled
            if not enabled:
                layer.lisa_grad_sum.pop(self.adapter_name, None)

    def reset_importance(self) -> None:
        for _, layer in self.layers:
            layer.lisa_importance.pop(self.adapter_name, None)
            layer.lisa_grad_sum.pop(self.adapter_name, None)
        self.window_steps = {name: 0 for name, _ in self.layers}

    # -- the two events ----------------------------------------------------------------------------------------------
    def step(self, global_step: int, loss_fn: Optional[Callable[[], Optional[float]]] = None) -> list[dict]:
        """Call at the start of every optimizer step, *after* the layerwise switch of that step.

        Selects the masks of the trainable layers whose window is complete, then turns importance tracking on for the
        trainable layers that still owe a selection. Returns the records of this step's selections: at most one
        calibration (fresh layers) and one re-selection.
        """
        due = [
            name for name, layer in self.layers
            if self._trains(layer) and self._pending(name, global_step) and self.window_steps[name] >= self.window
        ]
        records = []
        for names in ([n for n in due if self.fresh[n]], [n for n in due if not self.fresh[n]]):
            if names:
                records.append(self.select(global_step, names, loss_fn))
        for name, layer in self.layers:
            layer.lisa_track_importance = self._trains(layer) and self._pending(name, global_step)
        return records

    def end_step(self) -> list[str]:
        """Call once the step's gradients are complete, before the optimizer step (``on_pre_optimizer_step``).

        Folds the step's signed gradient into the importance, and withholds the update of layers still calibrating
        (their ``B`` stays 0). Returns the names of the layers that gathered importance in this step.
        """
        self.withheld = []
        tracked = [(name, layer) for name, layer in self.layers if layer.lisa_track_importance]
        sums = [layer.lisa_grad_sum.pop(self.adapter_name, None) for _, layer in tracked]
        if _dist_world_size() > 1 and tracked:
            sums = self._all_reduce_sums(tracked, sums)
        gathered = []
        for (name, layer), grad in zip(tracked, sums):
            if grad is None:  # tracked but not reached by this step's backward (e.g. no tokens for it)
                continue
            spec = self._spec(layer)
            pooled = M.pool_scores(grad.abs(), spec["structure"], spec["block_size"])
            acc = layer.lisa_importance.get(self.adapter_name)
            layer.lisa_importance[self.adapter_name] = pooled if acc is None else acc + pooled
            self.window_steps[name] += 1
            gathered.append(name)
            if self.fresh[name]:
                for factor in (layer.lisa_A[self.adapter_name].weight, layer.lisa_B[self.adapter_name].weight):
                    factor.grad = None
                    self.withheld.append(factor)
        return gathered

    def _all_reduce_sums(self, tracked, sums: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        # every rank tracks the same layers (same schedule); a rank without a gradient for one contributes zeros
        import torch.distributed as dist

        device = next((t.device for t in sums if t is not None), tracked[0][1].lisa_A[self.adapter_name].weight.device)
        shapes = [(layer.out_features, layer.in_features) for _, layer in tracked]
        flags = torch.tensor([0.0 if t is None else 1.0 for t in sums], device=device)
        flat = torch.cat(
            [(torch.zeros(shape, device=device) if t is None else t.to(device)).reshape(-1) for t, shape in zip(sums, shapes)]
            + [flags]
        )
        dist.all_reduce(flat)
        sizes = [math.prod(shape) for shape in shapes]
        chunks = torch.split(flat[: sum(sizes)], sizes)
        reached = flat[sum(sizes):].tolist()
        return [chunk.reshape(shape) if flag > 0 else None for chunk, shape, flag in zip(chunks, shapes, reached)]

    # -- selection ---------------------------------------------------------------------------------------------------
    def scores(self, name: str, layer) -> torch.Tensor:
        """The selection score of a layer on its grid: gradient importance plus what is learned, plus the bonus."""
        spec = self._spec(layer)
        importance = layer.lisa_importance[self.adapter_name].float()
        current = self._current_grid(layer).to(importance.device)
        with torch.no_grad():
            learned = M.pool_scores(
                layer._delta_out_in(self.adapter_name).detach().abs().float().to(importance.device),
                spec["structure"], spec["block_size"],
            )
        scores = M.reselection_scores(importance, learned, self.keep_learned)
        previous_new = self.new_cells.get(name)
        if previous_new is not None and self.new_block_bonus > 0:
            scores = M.add_new_block_bonus(scores, current, previous_new.to(scores.device), self.new_block_bonus)
        return scores

    def select(
        self, global_step: int, names: Sequence[str], loss_fn: Optional[Callable[[], Optional[float]]] = None
    ) -> dict:
        """Re-select ``M`` of the layers ``names`` from their gathered importance, then clear it.

        Returns a record: step, layers, fraction of grid cells that changed, the fraction of ``ΔW``'s energy that the
        new masks keep, and (with ``loss_fn``, e.g. the loss on a fixed batch) the loss just before and after.
        """
        layers = dict(self.layers)
        calibration = all(self.fresh[name] for name in names)  # B = 0: the function cannot change
        loss_before = None if loss_fn is None or calibration else loss_fn()  # None: not measurable here
        changed = total = 0
        energy_before = energy_kept = 0.0
        for name in names:
            layer = layers[name]
            spec = self._spec(layer)
            current = self._current_grid(layer)
            scores = self.scores(name, layer)
            with torch.no_grad():
                delta = layer._delta_out_in(self.adapter_name).detach().float()
            full = M.select_mask(
                scores, spec["structure"], spec["sparsity"], spec["block_size"], spec["n_m"], pooled=True
            )
            energy_before += float(delta.pow(2).sum())
            energy_kept += float(delta.pow(2)[full.to(delta.device)].sum())
            layer.set_mask(self.adapter_name, full)
            grid = self._current_grid(layer).to(current.device)
            # calibration replaces a provisional mask: nothing was "switched on" in the bonus's sense
            self.new_cells[name] = (
                torch.zeros_like(grid, device="cpu") if self.fresh[name] else (grid & ~current).cpu()
            )
            changed += int((grid != current).sum())
            total += grid.numel()
            layer.lisa_importance.pop(self.adapter_name, None)
            self.window_steps[name] = 0
            self.selected_interval[name] = self._interval(global_step)
            self.fresh[name] = False
        loss_after = None if loss_before is None else float(loss_fn())
        record = {
            "step": global_step,
            "kind": "calibration" if calibration else "reselection",
            "layers": list(names),
            "layers_updated": len(names),
            "changed_fraction": changed / total if total else 0.0,
            "retained_energy": energy_kept / energy_before if energy_before > 0 else 1.0,
            "loss_before": loss_before,
            "loss_after": loss_after,
            "loss_jump": None if loss_before is None else loss_after - loss_before,
        }
        self.num_updates += 1
        self.updates.append(record)
        return record

    def mask_checksum(self) -> int:
        """CRC32 over every layer's packed mask buffer: a cheap check that the model and the schedule agree."""
        crc = 0
        for name, layer in self.layers:
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(layer.lisa_mask[self.adapter_name].detach().cpu().numpy().tobytes(), crc)
        return crc

    # -- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-layer window counters and flags, the new-cell grids (bit-packed), the importance and a mask checksum.

        Saved between optimizer steps, so no per-step signed gradient sum is ever pending.
        """
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
            "num_updates": self.num_updates,
            "fresh": dict(self.fresh),
            "window_steps": dict(self.window_steps),
            "selected_interval": dict(self.selected_interval),
            "new_cells": {name: M.pack_mask(grid.reshape(-1)) for name, grid in self.new_cells.items()},
            "importance": importance,
            "mask_checksum": self.mask_checksum(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The masks themselves come back with the adapter weights."""
        if state.get("version") != SCHEDULER_STATE_VERSION:
            raise ValueError(
                f"Cannot restore the mask schedule: the checkpoint stores version {state.get('version')!r} of its state "
                f"and this hf-lisa reads version {SCHEDULER_STATE_VERSION} (per-layer calibration and re-selection). "
                "Resume with the hf-lisa release that wrote the checkpoint, or start a new run from the saved adapter "
                "(PeftModel.from_pretrained(..., is_trainable=True) keeps its masks)."
            )
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
        for key in ("update_interval", "importance_steps"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"Cannot resume the mask schedule with {key}={getattr(self, key)}: the checkpoint was written with "
                    f"{key}={state[key]}, and the resumed run would not follow the original path. Resume with the same "
                    "value."
                )
        self.num_updates = int(state["num_updates"])
        self.fresh = {name: bool(state["fresh"][name]) for name in names}
        self.window_steps = {name: int(state["window_steps"][name]) for name in names}
        self.selected_interval = {
            name: None if state["selected_interval"][name] is None else int(state["selected_interval"][name])
            for name in names
        }
        layers = dict(self.layers)
        self.new_cells = {}
        for name, packed in state["new_cells"].items():
            shape = self._grid_shape(layers[name])
            packed = torch.as_tensor(packed, dtype=torch.uint8)
            self.new_cells[name] = M.unpack_mask(packed, (math.prod(shape),)).reshape(shape)
        for _, layer in self.layers:
            layer.lisa_importance.pop(self.adapter_name, None)
            layer.lisa_grad_sum.pop(self.adapter_name, None)
        for name, tensor in state["importance"].items():
            layer = layers[name]
            layer.lisa_importance[self.adapter_name] = tensor.to(layer.lisa_A[self.adapter_name].weight.device)
