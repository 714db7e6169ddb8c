"""Sparse-mask calibration and re-selection for LISA adapters, per layer, from accumulated |dL/dW|."""

from __future__ import annotations

import math
import weakref
import zlib
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..tuner import masks as M
from ..tuner.config import check_lisa_settings
from ..renamed import RenamedAttribute, renamed_keywords
from .common import SCHEDULER_STATE_VERSION, _active_adapter_name, lisa_config_of
from .state import check_state_version


def _dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _GradientSink:
    """What a measured layer's backward pass calls with ``dL/dW``: adds it to its scheduler's sum for that layer.

    It holds the scheduler weakly and is not copied with the model (a deep copy or pickle of the model carries
    ``None``): the measurement belongs to the schedule, not to the weights."""

    __slots__ = ("scheduler", "name")

    def __init__(self, scheduler: "MaskScheduler", name: str) -> None:
        self.scheduler, self.name = weakref.ref(scheduler), name

    def __call__(self, grad: torch.Tensor) -> None:
        scheduler = self.scheduler()
        if scheduler is not None:
            scheduler._add_gradient(self.name, grad)

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()


class MaskScheduler:
    """Selects the element mask ``M`` of every sparse LISA layer from importance gathered while the layer trains.

    Timeline, per sparse layer (U = ``mask_update_interval``, W = ``importance_steps``, both in optimizer steps):

    * **Calibration** (a *fresh* layer: ``B = 0`` and ``mask_init="importance"``) happens *outside* the training
      steps, before the first optimizer step of a fresh schedule (:meth:`calibrate`, which the adapter callback runs):
      W steps' worth of forward/backward passes score ``|∂L/∂W|`` of every fresh layer at once (frozen blocks'
      layers too) through the trainer's own loss (plain causal LM, TRL's SFT or DPO, a custom ``compute_loss``:
      whatever the backward pass differentiates); nothing is updated and no training step is spent, so the
      learning-rate warmup, and a block sampled later, train from their first step. ``B = 0`` is why the mask must be
      chosen first: ``∂L/∂A = 0`` and ``ΔW = 0``, so the choice of ``M`` never changes the function, while any update
      of ``B`` before it would be cut by the choice. A layer those passes do not reach (no tokens route to it), and a
      caller that drives :meth:`step`/:meth:`end_step` alone, calibrates *in training* instead: its first W
      trainable steps (at most ⌊K/2⌋ under layerwise sampling, :attr:`calibration_window`) gather the importance
      while its ``A`` and ``B`` get no update (:meth:`end_step` withholds their gradients). A loaded, trained adapter
      (``B ≠ 0``) keeps its masks unless ``recalibrate_masks=True``.
    * **Re-selection**: once per interval ``[kU, (k+1)U)`` in which the layer trains, after it has gathered W steps of
      importance *while trainable*, at the start of an optimizer step in which it still trains (never the step that
      freezes its block). With layerwise sampling, W is capped at K − 1 so that the window completes, and the
      selection happens, inside one active period.
    * **Importance**: the hook on ``M ⊙ (B A)`` sums the *signed* ``∂L/∂W`` over the micro-batches of a step (summed
      over ranks under DDP); ``|·|`` of each step's sum, pooled on the selection grid, is added to the window's
      score. The split of a batch into micro-batches therefore does not change the mask.
    * **Score**: ``|∂L/∂W| / mean + mask_keep_learned · |ΔW| / mean``, plus the ``new_block_bonus`` for cells switched
      on at the previous update. The second term keeps what the adapter has learned: scoring by the gradient alone drops
      17% of ``ΔW``'s energy per re-selection on SmolLM2-135M (up to 21%), against 0.3% with it
      (``benchmarks/mask_reselection.py``).
      Entries dropped from ``M`` vanish at once (an abrupt change); each record carries the retained energy and, with
      a ``loss_fn``, the loss on a fixed batch just before and after.

    Args:
        model: a ``PeftModel`` whose adapter has a ``LisaConfig``.
        adapter_name: the adapter to schedule (default: the active adapter).
        mask_update_interval / importance_steps / new_block_bonus / mask_init / mask_keep_learned: override the
            config's settings of these names.
        lisa_interval_steps: K of the layerwise schedule, if any; caps the importance window.
        recalibrate_masks: calibrate the masks of trained adapters too (their function changes at the selection).
            The names before 0.3 work until 0.4 (:mod:`hf_lisa.renamed`).
    """

    update_interval = RenamedAttribute("mask_update_interval")
    keep_learned = RenamedAttribute("mask_keep_learned")

    @renamed_keywords("update_interval", "keep_learned", "interval_steps", "recalibrate")
    def __init__(
        self,
        model: nn.Module,
        adapter_name: Optional[str] = None,
        mask_update_interval: Optional[int] = None,
        importance_steps: Optional[int] = None,
        new_block_bonus: Optional[float] = None,
        mask_init: Optional[str] = None,
        mask_keep_learned: Optional[float] = None,
        lisa_interval_steps: Optional[int] = None,
        recalibrate_masks: bool = False,
    ) -> None:
        from ..tuner.layer import LisaLayer

        config = lisa_config_of(model, adapter_name)
        self.adapter_name = _active_adapter_name(model, adapter_name)
        given = dict(mask_update_interval=mask_update_interval, importance_steps=importance_steps,
                     new_block_bonus=new_block_bonus, mask_init=mask_init, mask_keep_learned=mask_keep_learned)
        for name, value in given.items():  # the config's value unless given here
            setattr(self, name, getattr(config, name) if value is None else value)
        check_lisa_settings({name: getattr(self, name) for name in given if name != "mask_init"},
                            where="MaskScheduler ")
        # a block trains K steps at a time: the window must complete, and the selection happen, inside one period
        K = lisa_interval_steps
        self.window = self.importance_steps if K is None else min(self.importance_steps, max(1, K - 1))
        #: the steps of a fresh layer's calibration *in training* (its update withheld): at most half of a block's
        #: active period. :meth:`calibrate`, outside the training steps, takes the whole ``importance_steps``.
        self.calibration_window = self.window if K is None else min(self.window, max(1, K // 2))
        self.layers: list[tuple[str, Any]] = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, LisaLayer) and self.adapter_name in module.lisa_mask
        ]
        # what is measured, per layer (as PEFT's AdaLoRA keeps it in its RankAllocator, not in the layers): the signed
        # dL/dW of the current optimizer step summed over its micro-batches, and |.| of each step's sum pooled on the
        # selection grid, summed over the window
        self.grad_sum: dict[str, torch.Tensor] = {}
        self.importance: dict[str, torch.Tensor] = {}
        self.new_cells: dict[str, torch.Tensor] = {}  # per layer: grid cells switched on at its last update
        # per layer: steps of importance gathered, interval of its last selection (None: never), still to calibrate
        self.window_steps: dict[str, int] = {name: 0 for name, _ in self.layers}
        self.selected_interval: dict[str, Optional[int]] = {name: None for name, _ in self.layers}
        self.fresh: dict[str, bool] = {
            name: self.mask_init == "importance"
            and (recalibrate_masks or not bool(layer.lisa_B[self.adapter_name].weight.any()))
            for name, layer in self.layers
        }
        self.num_updates = 0
        self.updates: list[dict[str, Any]] = []  # what each selection of this session did (logged)
        self.withheld: list[nn.Parameter] = []  # factors whose update the last end_step() withheld (calibrating)
        #: whether :meth:`calibrate` should run before the first optimizer step (set by :meth:`start`, a fresh schedule)
        self.calibration_due = False

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
        return global_step // self.mask_update_interval if self.mask_update_interval else 0

    def _pending(self, name: str, global_step: int) -> bool:
        """Whether layer ``name`` still owes a selection: calibration, or this interval's re-selection."""
        if self.fresh[name]:
            return True
        if not self.mask_update_interval:
            return False
        last = self.selected_interval[name]
        return last is None or last < self._interval(global_step)

    @property
    def calibrated(self) -> bool:
        """Whether every sparse layer has had its first importance-based selection."""
        return not any(self.fresh.values())

    def start(self, global_step: int = 0) -> None:
        """Begin a fresh schedule at ``global_step``: trained layers count as selected in the current interval, and
        fresh layers are due for :meth:`calibrate` (a resumed schedule, :meth:`load_state_dict`, never is)."""
        for name, _ in self.layers:
            if not self.fresh[name]:
                self.selected_interval[name] = self._interval(global_step)
        self.calibration_due = not self.calibrated

    def _add_gradient(self, name: str, grad: torch.Tensor) -> None:
        # signed: micro-batches of one optimizer step add up to that step's gradient before |.| is taken, so the
        # importance does not depend on how a batch is split for gradient accumulation
        grad = grad.detach().float()
        acc = self.grad_sum.get(name)
        self.grad_sum[name] = grad.clone() if acc is None else acc.add_(grad)

    def is_tracking(self, layer) -> bool:
        """Whether ``layer``'s backward pass hands this adapter's ``dL/dW`` to this scheduler."""
        return layer.lisa_gradient_sinks.get(self.adapter_name) is not None

    def track(self, name: str, layer, enabled: bool) -> None:
        """Measure ``dL/dW`` of layer ``name`` in the backward passes from now on, or stop."""
        if enabled:
            if not self.is_tracking(layer):
                layer.lisa_gradient_sinks[self.adapter_name] = _GradientSink(self, name)
        else:
            layer.lisa_gradient_sinks.pop(self.adapter_name, None)

    def set_tracking(self, enabled: bool) -> None:
        """Switch importance accumulation on or off in every sparse layer."""
        for name, layer in self.layers:
            self.track(name, layer, enabled)
            if not enabled:
                self.grad_sum.pop(name, None)

    def discard_gradient_sums(self) -> None:
        """Drop the signed gradients summed since the last fold (a pass that must not count)."""
        self.grad_sum.clear()

    def reset_importance(self) -> None:
        self.importance.clear()
        self.grad_sum.clear()
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
            if self._trains(layer) and self._pending(name, global_step)
            and self.window_steps[name] >= (self.calibration_window if self.fresh[name] else self.window)
        ]
        records = []
        for names in ([n for n in due if self.fresh[n]], [n for n in due if not self.fresh[n]]):
            if names:
                records.append(self.select(global_step, names, loss_fn))
        for name, layer in self.layers:
            self.track(name, layer, self._trains(layer) and self._pending(name, global_step))
        return records

    def factors(self, withheld: bool = False) -> list[nn.Parameter]:
        """``A`` and ``B`` of every sparse layer; with ``withheld``, only those whose update the current step withholds
        (the fresh layers calibrating in training, whose gradients :meth:`end_step` clears)."""
        return [factor for name, layer in self.layers if not withheld or (self.fresh[name] and self.is_tracking(layer))
                for factor in (layer.lisa_A[self.adapter_name].weight, layer.lisa_B[self.adapter_name].weight)]

    def end_step(self) -> list[str]:
        """Call once the step's gradients are complete, before the optimizer steps.

        Folds the step's signed gradient into the importance, and withholds the update of layers still calibrating
        in training (their ``B`` stays 0; see :meth:`calibrate` for the calibration that spends no training step).
        The LISA callbacks also zero the withheld gradients in the backward pass (:meth:`factors`), so that the
        Trainer's clip and ``grad_norm`` see only the gradients applied. Returns the layers that gathered importance.
        """
        self.withheld = []
        gathered = self._fold([(name, layer) for name, layer in self.layers if self.is_tracking(layer)])
        layers = dict(self.layers)
        for name in gathered:
            if self.fresh[name]:
                layer = layers[name]
                for factor in (layer.lisa_A[self.adapter_name].weight, layer.lisa_B[self.adapter_name].weight):
                    factor.grad = None
                    self.withheld.append(factor)
        return gathered

    def _fold(self, tracked: Sequence[tuple[str, Any]]) -> list[str]:
        """Add ``|·|`` of the signed gradient summed since the last fold (over ranks too), pooled, to each tracked
        layer's importance; returns the layers that had one."""
        sums = [self.grad_sum.pop(name, None) for name, _ in tracked]
        if _dist_world_size() > 1 and tracked:
            sums = self._all_reduce_sums(tracked, sums)
        gathered = []
        for (name, layer), grad in zip(tracked, sums):
            if grad is None:  # tracked but not reached by this step's backward (e.g. no tokens for it)
                continue
            spec = self._spec(layer)
            pooled = M.pool_scores(grad.abs(), spec["structure"], spec["block_size"])
            acc = self.importance.get(name)
            self.importance[name] = pooled if acc is None else acc + pooled
            self.window_steps[name] += 1
            gathered.append(name)
        return gathered

    def calibrate(self, run_step: Callable[[list[nn.Parameter]], None], global_step: int) -> Optional[dict]:
        """Select the first mask of every fresh layer from ``importance_steps`` steps of passes that train nothing.

        Call before the optimizer step ``global_step`` of a fresh schedule (:attr:`calibration_due`). ``run_step``
        runs one step's forward and backward passes (its micro-batches), with the gradient taken with respect to the
        factors it is given (the fresh layers' ``A`` and ``B``, trainable for the duration, a frozen block's too, and
        not declared frozen to PEFT meanwhile) or with ``backward()``; it must update nothing. Each step's signed ``∂L/∂W`` is folded as in training (summed
        over micro-batches and ranks, then ``|·|``). Returns the calibration record (as :meth:`select`), or ``None``
        when no fresh layer was reached; a layer not reached stays fresh and calibrates in training.
        """
        self.calibration_due = False
        layers = dict(self.layers)
        names = [name for name, _ in self.layers if self.fresh[name]]
        if not names:
            return None
        fresh = [(name, layers[name]) for name in names]
        factors = [f for _, layer in fresh for f in (layer.lisa_A[self.adapter_name].weight,
                                                     layer.lisa_B[self.adapter_name].weight)]
        flags = [f.requires_grad for f in factors]
        tracking = [self.is_tracking(layer) for _, layer in self.layers]
        # a frozen block's layers are declared frozen where PEFT re-applies it (disable_adapter()'s exit in TRL's DPO
        # reference pass, see LayerwiseScheduler.enforce): lift that for the passes, or their factors freeze mid-pass
        declared = [dict(layer.frozen_peft_weight_names) for _, layer in fresh]
        for name, layer in fresh:  # partial importance of an in-training calibration (an older checkpoint): restart
            self.importance.pop(name, None)
            self.window_steps[name] = 0
        try:
            for factor in factors:
                factor.requires_grad_(True)
            for _, layer in fresh:
                layer.frozen_peft_weight_names = {
                    k: v for k, v in layer.frozen_peft_weight_names.items() if k != self.adapter_name
                }
            self.grad_sum.clear()
            for name, layer in self.layers:
                self.track(name, layer, self.fresh[name])
            for _ in range(self.importance_steps):
                run_step(factors)
                self._fold(fresh)
        finally:
            for factor, flag in zip(factors, flags):
                factor.requires_grad_(flag)
            for (_, layer), frozen in zip(fresh, declared):
                layer.frozen_peft_weight_names = frozen
            self.grad_sum.clear()
            for (name, layer), flag in zip(self.layers, tracking):
                self.track(name, layer, flag)
        reached = [name for name in names if self.window_steps[name] > 0]
        return self.select(global_step, reached) if reached else None

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
        importance = self.importance[name].float()
        current = self._current_grid(layer).to(importance.device)
        with torch.no_grad():
            learned = M.pool_scores(
                layer._delta_out_in(self.adapter_name).detach().abs().float().to(importance.device),
                spec["structure"], spec["block_size"],
            )
        scores = M.reselection_scores(importance, learned, self.mask_keep_learned)
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
            self.importance.pop(name, None)
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
        importance = {name: self.importance[name].detach().cpu() for name, _ in self.layers if name in self.importance}
        return {
            "version": SCHEDULER_STATE_VERSION,
            "adapter_name": self.adapter_name,
            "layers": [name for name, _ in self.layers],
            "update_interval": self.mask_update_interval,  # the format's key, unchanged since 0.1
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
        check_state_version(state.get("version"), "the mask schedule")
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
        for key, name in (("update_interval", "mask_update_interval"), ("importance_steps", "importance_steps")):
            if state[key] != getattr(self, name):
                raise ValueError(
                    f"Cannot resume the mask schedule with {name}={getattr(self, name)}: the checkpoint was written "
                    f"with {name}={state[key]}, and the resumed run would not follow the original path. Resume with "
                    "the same value."
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
        self.importance, self.grad_sum = {}, {}
        for name, tensor in state["importance"].items():
            self.importance[name] = tensor.to(layers[name].lisa_A[self.adapter_name].weight.device)
