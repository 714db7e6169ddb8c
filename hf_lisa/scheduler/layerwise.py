"""Layerwise importance sampling: every K optimizer steps, γ blocks train beside the always-trainable set."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..blocks import unwrap_model
from ..renamed import RenamedAttribute, renamed_keywords
from ..tuner.config import check_lisa_settings
from .active_set import ActiveSet, BlockIndex
from .common import SCHEDULER_STATE_VERSION, _numel, lisa_config_of
from ..optim.state import drop_optimizer_state, optimizer_state_bytes
from .sampler import LayerSampler

ALWAYS_TRAINABLE_KEYWORDS = ("embeddings", "lm_head", "norm", "heads")


# E+H(+final norm), the paper's setting, plus task heads (a classifier's ``score``, BERT's ``pooler``/``classifier``),
# which LMFlow and axolotl train too: a head frozen at its random initialisation would silently never learn
DEFAULT_ALWAYS_TRAINABLE = ("embeddings", "lm_head", "norm", "heads")


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
      E+H+final norm and task heads by default (:data:`DEFAULT_ALWAYS_TRAINABLE`).
    * **Adapter form** (a ``PeftModel`` with ``LisaConfig``, see :meth:`for_adapter`): the candidates are the adapter's
      parameters; ``lisa_always_trainable=None`` keeps every non-block candidate (layer-interpolation scalars,
      ``modules_to_save`` outside the blocks) trainable; a ``modules_to_save`` copy inside a block is a candidate of
      that block and trains with it.

    The blocks come from the model's :class:`~hf_lisa.scheduler.active_set.BlockIndex` (``index``, the object every
    other consumer reads too), and the current blocks are held by :attr:`active_set`: the sampler only proposes.
    The scheduler checks no distributed engine; the callbacks (or a custom loop) call
    :func:`hf_lisa.distributed.check_layer_switching_supported` before the first freeze.

    Args:
        model: the model being trained (optionally wrapped by PEFT or DDP).
        lisa_activated_layers: γ, blocks active at a time, ``1 <= γ <= N``.
        lisa_interval_steps: K, optimizer steps per period, ``>= 1``.
        lisa_sampling: ``"uniform"``, ``"importance"`` or ``"cyclic"`` (see
            :class:`~hf_lisa.scheduler.sampler.LayerSampler`).
        seed: seed of the sampler's private generator; identical on every rank.
        lisa_always_trainable: keywords ``"embeddings"`` (every ``nn.Embedding`` outside the blocks), ``"lm_head"`` (the
            output embeddings), ``"norm"`` (norm layers outside the blocks, e.g. the final norm) and/or module names
            or regexes (e.g. ``"score"``, ``"classifier"``); ``None`` means every candidate outside the blocks. Tied
            weights are one parameter and are counted once.
        lisa_optimizer_state_policy: ``"drop"`` (default) frees the optimizer state of deactivated parameters;
            ``"keep"`` keeps it, so a re-activated block resumes its old moments.
        lisa_layers_attribute: dotted path of the block list, overriding discovery.
        candidate_params: the parameters to schedule; by default those with ``requires_grad=True`` now.

    The names before 0.3 (``num_active``, ``interval_steps``, ``strategy``, ``always_trainable``,
    ``optimizer_state_policy``, ``layers_attribute``) work until 0.4 with a ``FutureWarning`` (:mod:`hf_lisa.renamed`).

    Example:
        ```py
        >>> from hf_lisa.distributed import check_layer_switching_supported
        >>> from hf_lisa.scheduler import LayerwiseScheduler
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> scheduler = LayerwiseScheduler(  # doctest: +SKIP
        ...     model, lisa_activated_layers=2, lisa_interval_steps=20, seed=0)
        >>> check_layer_switching_supported(model, optimizer, params=scheduler.candidates)  # doctest: +SKIP
        >>> scheduler.freeze_all_but_active(optimizer)  # doctest: +SKIP
        >>> for step, batch in enumerate(loader):  # doctest: +SKIP
        ...     scheduler.maybe_switch(step, optimizer)
        ...     model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
        ```
    """

    num_active = RenamedAttribute("lisa_activated_layers")
    interval_steps = RenamedAttribute("lisa_interval_steps")
    strategy = RenamedAttribute("lisa_sampling")
    optimizer_state_policy = RenamedAttribute("lisa_optimizer_state_policy")

    @renamed_keywords("num_active", "interval_steps", "strategy", "always_trainable", "optimizer_state_policy",
                      "layers_attribute")
    def __init__(
        self,
        model: nn.Module,
        lisa_activated_layers: int,
        lisa_interval_steps: int,
        lisa_sampling: str = "uniform",
        seed: int = 0,
        lisa_always_trainable: Optional[Sequence[str]] = DEFAULT_ALWAYS_TRAINABLE,
        lisa_optimizer_state_policy: str = "drop",
        lisa_layers_attribute: Optional[str] = None,
        candidate_params: Optional[Iterable[nn.Parameter]] = None,
    ) -> None:
        check_lisa_settings(
            {"lisa_interval_steps": lisa_interval_steps, "lisa_optimizer_state_policy": lisa_optimizer_state_policy},
            where="LayerwiseScheduler ",
        )
        if isinstance(lisa_always_trainable, str):
            lisa_always_trainable = (lisa_always_trainable,)
        self.lisa_interval_steps = lisa_interval_steps
        self.lisa_optimizer_state_policy = lisa_optimizer_state_policy
        self.always_trainable_spec = None if lisa_always_trainable is None else tuple(lisa_always_trainable)

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
        self.index = BlockIndex.of(model, lisa_layers_attribute)
        blocks = dict(self.index.blocks)
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

        self.sampler = LayerSampler(len(self.block_names), lisa_activated_layers, lisa_sampling, seed)
        self.active_set = ActiveSet(self.index, self.block_names)
        self.last_switch_step: Optional[int] = None
        self.history: list[tuple[int, list[int]]] = []  # (global_step, active blocks) of every switch this session

    @classmethod
    @renamed_keywords("num_active", "interval_steps", "strategy", "optimizer_state_policy", "layers_attribute")
    def for_adapter(
        cls,
        model: nn.Module,
        adapter_name: Optional[str] = None,
        seed: int = 0,
        lisa_activated_layers: Optional[int] = None,
        lisa_interval_steps: Optional[int] = None,
        lisa_sampling: Optional[str] = None,
        lisa_optimizer_state_policy: str = "drop",
        lisa_layers_attribute: Optional[str] = None,
    ) -> Optional["LayerwiseScheduler"]:
        """Build the scheduler of a ``PeftModel`` with a ``LisaConfig``; ``None`` if γ = 0 (every adapter trains).

        γ, K, the strategy and the block path come from the adapter's config unless overridden.
        """
        config = lisa_config_of(model, adapter_name)
        gamma = config.lisa_activated_layers if lisa_activated_layers is None else lisa_activated_layers
        if gamma == 0:
            return None
        return cls(
            model,
            lisa_activated_layers=gamma,
            lisa_interval_steps=config.lisa_interval_steps if lisa_interval_steps is None else lisa_interval_steps,
            lisa_sampling=config.lisa_sampling if lisa_sampling is None else lisa_sampling,
            seed=seed,
            lisa_always_trainable=None,
            lisa_optimizer_state_policy=lisa_optimizer_state_policy,
            lisa_layers_attribute=(config.lisa_layers_attribute if lisa_layers_attribute is None
                                   else lisa_layers_attribute),
        )

    # -- the always-trainable set -------------------------------------------------------------------------------------
    def _resolve_always_trainable(
        self, model: nn.Module, outside: list[nn.Parameter], block_ids: set[int]
    ) -> list[nn.Parameter]:
        self.head_params: list[nn.Parameter] = []
        if self.always_trainable_spec is None:
            return list(outside)
        outside_ids = {id(p) for p in outside}
        root = unwrap_model(model)
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
    def active(self) -> list[int]:
        """The blocks that train in the current period (indices into ``block_names``), read from :attr:`active_set`."""
        return self.active_set.blocks

    @property
    def freezes_candidates(self) -> bool:
        """Whether the schedule ever freezes a candidate (γ < N, or candidates outside the always-trainable set).

        Only then does the distributed engine have to support a changing trainable set.
        """
        return self.lisa_activated_layers < self.num_blocks or bool(self.frozen_params)

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def lisa_activated_layers(self) -> int:
        """γ, the blocks active at a time."""
        return self.sampler.lisa_activated_layers

    @property
    def lisa_sampling(self) -> str:
        """How the blocks are drawn: ``"uniform"``, ``"importance"`` or ``"cyclic"``."""
        return self.sampler.lisa_sampling

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters that train in the current period: always-trainable + active blocks."""
        return list(self.always_params) + [p for b in self.active for p in self.block_params[b]]

    def freeze_all_but_active(self, optimizer: Any = None, global_step: int = 0) -> list[int]:
        """Apply the current active set to ``requires_grad`` (drawing the first set if there is none).

        Call it once the optimizer has been built over every candidate parameter (``on_train_begin``), and, when
        :attr:`freezes_candidates`, after :func:`hf_lisa.distributed.check_layer_switching_supported` has accepted the
        engine (the callbacks call it). With the drop policy and an ``optimizer``, the state of every frozen candidate
        is dropped too.
        """
        if not self.active:
            self.active_set.set(self.sampler.sample())
            self.last_switch_step = global_step
            self.history.append((global_step, self.active))
        frozen = self.frozen_candidates()
        self.enforce()
        for p in frozen:
            p.grad = None
        if optimizer is not None and self.lisa_optimizer_state_policy == "drop":
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
        if global_step % self.lisa_interval_steps != 0 or global_step == self.last_switch_step:
            return False
        self.switch_to(self.sampler.sample(), optimizer, global_step)
        return True

    def switch_to(self, blocks: Sequence[int], optimizer: Any = None, global_step: Optional[int] = None) -> None:
        """Make exactly ``blocks`` active: freeze the others, clear their grads and (drop policy) optimizer state."""
        old = set(self.active)
        new = self.active_set.set(blocks)
        deactivated = [p for b in sorted(old - set(new)) for p in self.block_params[b]]
        for p in deactivated:
            p.grad = None
        if optimizer is not None and self.lisa_optimizer_state_policy == "drop":
            drop_optimizer_state(optimizer, deactivated)
        self.enforce()
        if global_step is not None:
            self.last_switch_step = global_step
            self.history.append((global_step, new))

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
        """Bytes of optimizer state currently held (see :func:`hf_lisa.optim.state.optimizer_state_bytes`)."""
        return optimizer_state_bytes(optimizer)

    # -- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sampler (generator included), active set and last switch step; plain Python data and tensors."""
        return {
            "version": SCHEDULER_STATE_VERSION,
            "block_names": list(self.block_names),
            "interval_steps": self.lisa_interval_steps,  # the format's keys, unchanged since 0.1
            "optimizer_state_policy": self.lisa_optimizer_state_policy,
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
        if state["interval_steps"] != self.lisa_interval_steps:
            raise ValueError(
                f"Cannot resume the LISA layer schedule: the checkpoint has lisa_interval_steps (K)="
                f"{state['interval_steps']} but this run has {self.lisa_interval_steps}; the run would follow neither "
                "schedule. Resume with the checkpoint's K, or start a new run."
            )
        self.sampler.load_state_dict(state["sampler"])
        self.active_set.set(state["active"])
        self.last_switch_step = state["last_switch_step"]
        if self.active:
            self.freeze_all_but_active(optimizer)
