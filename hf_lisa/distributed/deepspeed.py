"""LISA layer switching under DeepSpeed ZeRO-1/2/3: rebuild the ZeRO optimizer over the new trainable set at every
switch, so the optimizer state per rank follows the active set (E+H+γL, adapters γL) and frozen blocks' gradients are
neither reduced nor kept.

DeepSpeed's ZeRO optimizers flatten the parameters that require grad when they are built and hook exactly those
(``runtime/zero/stage_1_and_2.py``: ``is_optimized_parameter`` in the group loop, ``create_gradient_handling_hooks``;
``runtime/zero/stage3.py``: ``trainable_param_groups``, ``create_reduce_and_remove_grad_hooks``), so they cannot follow
a changing ``requires_grad`` (DeepSpeed #5639). :class:`DeepSpeedLayerSwitcher` builds a fresh one whenever the
active set changes:

1. read the state of every parameter that stays trainable through DeepSpeed's public API
   (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: collectives, called in the same
   order on every rank) and the Adam step count of its flat group;
2. ``destroy()`` the old ZeRO optimizer (removes its gradient hooks; ZeRO-3 also its module hooks through
   ``parameter_offload.destroy()``) and give every parameter its own storage again (it was a view into the old flat
   buffer: ``param.data`` under ZeRO-1/2, the partition ``param.ds_tensor`` under ZeRO-3);
3. build a new base optimizer of the same class over the new trainable set, one param group per (original group,
   step count): a block activated later starts at Adam step 0, exactly as the single-process ``drop`` policy does,
   and each ZeRO flat group has one step counter;
4. wrap it with the engine's own factory ``DeepSpeedEngine._configure_zero_optimizer`` (private, engine.py; under
   ZeRO-3 it builds a new ``DeepSpeedZeRoOffload`` whose hooks gather and free the parameters as before, with a fresh
   prefetch trace) and install it as ``engine.optimizer`` / ``engine.basic_optimizer``;
5. seed the new optimizer's state (step counters, zero moments) keyed by its fp32 partitions (ZeRO-1/2
   ``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat`` / ``sub_group_to_group_id``), link it
   under ZeRO-1/2 (``_lazy_init_hp_params_optimizer_state``, private) and write the carried values back with
   ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``.

Checkpoints are DeepSpeed's own (``engine.save_checkpoint`` / ``load_checkpoint``); the group layout they hold is
restored first (:meth:`DeepSpeedLayerSwitcher.state_dict`). Tested on CPU with torch's AdamW (2 ranks, gloo):
``tests/distributed/test_deepspeed_lisa.py``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .guards import UnsupportedEngineError

#: Adam-style per-parameter state keys that are carried across a rebuild (others are refused)
_CARRIED_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def zero_stage(engine: Any) -> int:
    """The ZeRO stage of a ``DeepSpeedEngine`` (0 when ZeRO is off)."""
    return int(engine.zero_optimization_stage())


def _flat_groups(zero: Any) -> list[tuple[list, torch.Tensor, int]]:
    """``(parameters, fp32 partition, base param-group index)`` of every flat group of a ZeRO optimizer.

    ZeRO-1/2: ``bit16_groups`` / ``single_partition_of_fp32_groups``, one per param group (stage_1_and_2.py);
    ZeRO-3: ``fp16_groups`` / ``fp32_partitioned_groups_flat`` per sub-group, ``sub_group_to_group_id`` (stage3.py).
    The base optimizer's state is keyed by these fp32 partitions.
    """
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return [(list(params), zero.fp32_partitioned_groups_flat[i], zero.sub_group_to_group_id[i])
                for i, params in enumerate(zero.fp16_groups)]
    return [(list(params), zero.single_partition_of_fp32_groups[i], i) for i, params in enumerate(zero.bit16_groups)]


def _relink_optimizer_state(zero: Any) -> None:
    """Point every parameter's fragment mapping at the optimizer's current state tensors.

    DeepSpeed links them once, after the first step (``DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state``
    and its ``_hp_optimizer_states_linked`` flag, private, stage_1_and_2.py); a rebuilt optimizer's seeded state and
    the tensors ``engine.load_checkpoint`` installs need it again.
    """
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 only; ZeRO-3 reads its state directly
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


class DeepSpeedLayerSwitcher:
    """Drive a :class:`~hf_lisa.scheduler.LayerwiseScheduler` on a ZeRO-1/2/3 ``DeepSpeedEngine`` in a custom loop.

    Build the engine over *every* candidate parameter (all trainable), then the scheduler on ``engine.module``, then
    this object; call :meth:`start` once before the first step and :meth:`maybe_switch` before every forward.
    Only the ``drop`` optimizer-state policy is supported (the state of a left block is discarded: ZeRO keeps no state
    outside its flat partitions). An LR scheduler owned by the engine is refused: it is bound to the base optimizer
    that a switch replaces; set the learning rate on ``engine.optimizer.param_groups`` instead (carried across
    rebuilds). Only Adam-style state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) is carried. Under fp16 the
    dynamic loss scale starts again at its initial value after every rebuild (untested: the CPU tests run fp32).

    Example:
        ```py
        >>> params = model.parameters()  # every candidate trainable  # doctest: +SKIP
        >>> engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)  # doctest: +SKIP
        >>> scheduler = LayerwiseScheduler(  # doctest: +SKIP
        ...     engine.module, lisa_activated_layers=2, lisa_interval_steps=20)
        >>> switcher = DeepSpeedLayerSwitcher(engine, scheduler)  # doctest: +SKIP
        >>> switcher.start()  # doctest: +SKIP
        >>> for step, batch in enumerate(loader):  # doctest: +SKIP
        ...     switcher.maybe_switch(step)
        ...     loss = engine(**batch).loss; engine.backward(loss); engine.step()
        ```
    """

    def __init__(self, engine: Any, scheduler: Any) -> None:
        stage = zero_stage(engine)
        if stage not in (1, 2, 3):
            raise UnsupportedEngineError(
                f"DeepSpeedLayerSwitcher needs ZeRO stage 1, 2 or 3 (got stage {stage}); without ZeRO the engine's "
                "optimizer holds the model's own parameters and LISA's usual freezing applies."
            )
        if scheduler.lisa_optimizer_state_policy != "drop":
            raise UnsupportedEngineError(
                f"lisa_optimizer_state_policy={scheduler.lisa_optimizer_state_policy!r} cannot work under DeepSpeed "
                "ZeRO: "
                "the state of a block lives in the flat partitions of the ZeRO optimizer, which is rebuilt over the "
                "new trainable set at every switch. Use lisa_optimizer_state_policy='drop'."
            )
        if getattr(engine, "lr_scheduler", None) is not None:
            raise UnsupportedEngineError(
                "DeepSpeedLayerSwitcher rebuilds the engine's optimizer at every switch, and the engine's LR "
                "scheduler is bound to the optimizer it was built with. Leave 'scheduler' out of the DeepSpeed config "
                "(a constant learning rate) for now."
            )
        self.engine = engine
        self.scheduler = scheduler
        zero = engine.optimizer
        base = zero.optimizer
        # the original hyperparameters of every candidate, from the group ZeRO put it in
        self._group_of: dict[int, int] = {}
        self._hyper: list[dict] = []
        for group in base.param_groups:
            self._hyper.append({k: v for k, v in group.items() if k != "params"})
        for params, _, g in _flat_groups(zero):
            for p in params:
                self._group_of[id(p)] = g
        missing = [p for p in scheduler.candidates if id(p) not in self._group_of]
        if missing:
            raise UnsupportedEngineError(
                f"{len(missing)} LISA candidate parameters are not in DeepSpeed's optimizer: build the engine with "
                "every candidate trainable (model_parameters=model.parameters()) before the scheduler freezes."
            )
        self._keys = [(g, 0) for g in range(len(base.param_groups))]  # (original group, step) of every base group
        self._base_class = type(base)
        # the constructor's own arguments only (torch records more in ``defaults``, e.g. decoupled_weight_decay);
        # every group carries its full hyperparameters anyway
        accepted = inspect.signature(type(base).__init__).parameters
        self._defaults = {k: v for k, v in base.defaults.items() if k in accepted}
        self.rebuilds = 0
        engine._hf_lisa_layer_switcher = self  # check_layer_switching_supported accepts this engine
        self._restored_steps: dict[int, int] = {}

    # -- public ------------------------------------------------------------------------------------------------------
    def start(self, global_step: int = 0) -> list[int]:
        """Freeze all but the first active set (or the restored one) and rebuild the optimizer over it."""
        active = self.scheduler.freeze_all_but_active(None, global_step)
        self.rebuild()
        return active

    def maybe_switch(self, global_step: int) -> bool:
        """Switch blocks when ``global_step`` starts a period, rebuilding the ZeRO optimizer; returns whether it did.

        ``global_step`` counts optimizer steps (``engine.global_steps``); call it before the forward of the first
        micro-batch of a step, never inside a gradient-accumulation window.
        """
        if self.scheduler.maybe_switch(global_step, None):
            self.rebuild()
            return True
        return False

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (every tensor of the base optimizer's state)."""
        total = 0
        for state in self.engine.optimizer.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def partition_numel(self) -> int:
        """Elements of this rank's fp32 partitions (padding included): the state is ``keys × 4 ×`` this."""
        return sum(int(flat.numel()) for _, flat, _ in _flat_groups(self.engine.optimizer))

    def state_dict(self) -> dict[str, int]:
        """Adam step count of every trainable parameter, by name: what a resume needs to rebuild the same groups.

        Save it with the checkpoint (``engine.save_checkpoint(..., client_state={...})``); on resume call
        :meth:`load_state_dict` *before* :meth:`start`, then ``engine.load_checkpoint``.
        """
        zero = self.engine.optimizer
        out = {}
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        for params, flat, _ in _flat_groups(zero):
            step = zero.optimizer.state.get(flat, {}).get("step", 0)
            for p in params:
                out[names[id(p)]] = int(step.item() if torch.is_tensor(step) else step)
        return out

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` output; the next rebuild (:meth:`start`) groups the parameters as saved."""
        params = dict(self.engine.module.named_parameters())
        self._restored_steps = {id(params[name]): int(step) for name, step in state.items()}

    # -- the rebuild -------------------------------------------------------------------------------------------------
    def _carry(self, trainable: list) -> tuple[dict, dict, dict]:
        """Step count, fp32 master and moments of every parameter that stays trainable (collective)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        zero = self.engine.optimizer
        base = zero.optimizer
        _relink_optimizer_state(zero)  # engine.load_checkpoint replaces the state tensors without relinking
        steps, masters, moments = {}, {}, {}
        flat_of = {id(p): flat for params, flat, _ in _flat_groups(zero) for p in params}
        keep = [p for p in trainable if id(p) in flat_of]
        for p in keep:  # same parameters, same order on every rank: the gathers are collectives
            state = base.state.get(flat_of[id(p)], {})
            step = state.get("step")
            steps[id(p)] = int(step.item() if torch.is_tensor(step) else (step or 0))
            masters[id(p)] = safe_get_full_fp32_param(p).detach().clone()
            moments[id(p)] = {
                key: safe_get_full_optimizer_state(p, key).detach().clone()
                for key in _CARRIED_KEYS if key in state
            }
            unknown = [k for k in state if k != "step" and k not in _CARRIED_KEYS]
            if unknown:
                raise UnsupportedEngineError(
                    f"DeepSpeedLayerSwitcher carries Adam state only, but the optimizer "
                    f"{type(base).__name__} holds {unknown}."
                )
        return steps, masters, moments

    def rebuild(self) -> None:
        """Build a new ZeRO optimizer over the parameters that require grad now, carrying the state of those that
        trained before (see the module docstring for the steps and the DeepSpeed internals used)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        engine = self.engine
        trainable = [p for p in self.scheduler.candidates if p.requires_grad]
        steps, masters, moments = self._carry(trainable)
        if self._restored_steps:  # resume: group as the checkpoint did, engine.load_checkpoint fills the state
            steps, self._restored_steps = dict(self._restored_steps), {}
        old = engine.optimizer
        for (g, _), group in zip(self._keys, old.optimizer.param_groups):  # current values (a changed lr)
            self._hyper[g].update({k: v for k, v in group.items() if k != "params"})
        old_params = [p for params, _, _ in _flat_groups(old) for p in params]
        old.destroy()  # removes its gradient hooks (and ZeRO-3's module hooks: parameter_offload.destroy)
        for p in old_params:  # own storage again, so no left block keeps the old flat buffer alive
            if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition was a view into fp16_partitioned_groups_flat
                p.ds_tensor.data = p.ds_tensor.data.detach().clone()
            else:
                p.data = p.data.detach().clone()
            p.grad = None
        # one group per (original group, step count): each ZeRO flat group has a single Adam step counter
        cohorts: dict[tuple[int, int], list] = {}
        for p in trainable:
            cohorts.setdefault((self._group_of[id(p)], steps.get(id(p), 0)), []).append(p)
        keys = self._keys = sorted(cohorts)
        groups = [dict(self._hyper[g], params=cohorts[(g, s)]) for g, s in keys]
        base = self._base_class(groups, **self._defaults)
        engine.basic_optimizer = base
        engine.optimizer = engine._configure_zero_optimizer(base)  # private: the engine's own ZeRO factory
        zero = engine.optimizer
        carried_keys = sorted({k for m in moments.values() for k in m}) or ["exp_avg", "exp_avg_sq"]
        for _, flat, i in _flat_groups(zero):
            state = {"step": torch.tensor(float(keys[i][1]), dtype=torch.float32)}
            state.update({k: torch.zeros_like(flat) for k in carried_keys})
            base.state[flat] = state
        _relink_optimizer_state(zero)
        for p in trainable:
            if id(p) in masters:
                safe_set_full_fp32_param(p, masters[id(p)])
                for key, value in moments[id(p)].items():
                    safe_set_full_optimizer_state(p, value, key)
        self.rebuilds += 1
