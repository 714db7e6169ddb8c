"""Trainer callbacks that run LISA's schedule inside a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (Pan et al., 2024) on a plain transformers model: E+H+γL.
* :class:`LisaAdapterCallback`: the same for the adapters of a ``PeftModel`` with a ``LisaConfig``, plus the masks.

The decisions live in :mod:`hf_lisa.scheduler`; these callbacks call it at the events of any Trainer, through the
objects the events hand over and torch's public hooks (the Trainer itself only where it is handed over:
:func:`.setup.prepare_trainer`):

* ``on_train_begin``: the Trainer has built the optimizer over every candidate parameter, prepared it and loaded any
  checkpoint; freeze everything but the first active set here (LMFlow #726), or restore the checkpointed schedule.
* ``on_step_begin``: fires once per optimizer step, gradient accumulation included; switch when
  ``global_step % K == 0``, re-assert the trainable set otherwise, then let the mask schedule select and track (at a
  fresh schedule's first step, after calibrating the first masks with passes that train nothing: :mod:`.calibration`).
* In the step's backward passes, through tensor hooks armed at the end of ``on_step_begin`` (:mod:`.gradients`):
  zero the gradients the step withholds and add the interpolation penalty's ``2λβ``, before any clip or norm.
* ``on_pre_optimizer_step`` (``complete_lisa_gradients``): clear the withheld gradients, fold the step's mask
  importance, feed the ``"importance"`` sampler.
* ``on_optimizer_step``: project δ back into its bound.
* ``on_log``: active blocks, parameter counts, optimizer-state bytes and mask/penalty values join the Trainer's logs.

Checkpoint and resume (:mod:`.state`): both callbacks are ``ExportableState``. The schedule's small values go to
``trainer_state.json``, its tensors (sampler generator, mask bookkeeping, importance accumulators) to
``checkpoint-N/lisa_state.safetensors``; resuming from ``checkpoint-N`` follows the uninterrupted run exactly. The
Trainer's preparation and the run's one engine check are in :mod:`.setup`; what the two share in :mod:`.base`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Mapping, Optional, Sequence

import torch

from hf_lisa.scheduler import DEFAULT_ALWAYS_TRAINABLE, LayerwiseScheduler, MaskScheduler, lisa_config_of
from hf_lisa.optim.state import exclude_from_weight_decay
from hf_lisa.methods import FULL_LISA_ACTIVATED_LAYERS
from hf_lisa.tuner.config import is_int, check_lisa_settings
from hf_lisa.tuner.schedule_guard import attach_schedule, detach_schedule, settings_needing_schedule
from hf_lisa.renamed import RenamedAttribute, renamed_keywords

from .base import _LisaCallbackBase
from .calibration import calibrate_due_masks
from .setup import check_engine, check_lisa_training_setup, probe_batch, tuner_of, unscaled_factor

logger = logging.getLogger(__name__)

__all__ = ["LisaAdapterCallback", "LisaCallback", "check_lisa_training_setup"]


class LisaCallback(_LisaCallbackBase):
    """Full-parameter LISA on a plain transformers model: the embeddings, LM head, final norm and any task head train
    throughout, and γ transformer blocks train at a time, re-drawn every K optimizer steps.

    Each setting has its one name, as in ``LisaConfig`` and ``hf-lisa train`` (older names: :mod:`hf_lisa.renamed`).

    Args:
        lisa_activated_layers (`int`, defaults to `2`): γ, ``1 <= γ <= N``.
        lisa_interval_steps (`int`, defaults to `20`): K, optimizer steps per period.
        lisa_sampling (`str`, defaults to `"uniform"`): ``"uniform"`` (the paper), ``"importance"`` (running gradient
            norm) or ``"cyclic"`` (every block once per cycle); see :class:`hf_lisa.scheduler.sampler.LayerSampler`.
        seed (`int`, defaults to `42`): seed of the sampler; every rank draws the same blocks.
        lisa_always_trainable (`Sequence[str]`, defaults to `("embeddings", "lm_head", "norm", "heads")`): what trains
            throughout: keywords (``"heads"`` is every other parameter outside the blocks, e.g. a classifier's
            ``score``, BERT's ``pooler`` and ``classifier``) or module names/regexes such as ``"score"``; ``()``
            trains only the sampled blocks. The task heads that train are listed in the log at train begin.
        lisa_optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` frees the optimizer state of
            deactivated parameters (the paper's behaviour; LISA then holds state for E+H+γL only), ``"keep"`` keeps it.
        lisa_layers_attribute (`str`, *optional*): dotted path of the block list, e.g. ``"model.layers"``;
            discovered automatically by default.

    Example:
        ```py
        >>> from transformers import Trainer, TrainingArguments
        >>> from hf_lisa.trainer_callbacks import LisaCallback
        >>> trainer = Trainer(
        ...     model=model, args=TrainingArguments("out", max_steps=1000), train_dataset=train_dataset,
        ...     callbacks=[LisaCallback(lisa_activated_layers=2, lisa_interval_steps=20, seed=42)],
        ... )  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        ```
    """

    always_trainable = RenamedAttribute("lisa_always_trainable")
    layers_attribute = RenamedAttribute("lisa_layers_attribute")

    @renamed_keywords("activated_layers", "interval_steps", "sampling", "always_trainable", "optimizer_state_policy",
                      "layers_attribute")
    def __init__(
        self,
        lisa_activated_layers: int = FULL_LISA_ACTIVATED_LAYERS,
        lisa_interval_steps: int = 20,
        lisa_sampling: str = "uniform",
        seed: int = 42,
        lisa_always_trainable: Optional[Sequence[str]] = DEFAULT_ALWAYS_TRAINABLE,
        lisa_optimizer_state_policy: str = "drop",
        lisa_layers_attribute: Optional[str] = None,
    ) -> None:
        super().__init__()
        check_lisa_settings(
            dict(lisa_activated_layers=lisa_activated_layers, lisa_interval_steps=lisa_interval_steps,
                 lisa_sampling=lisa_sampling, lisa_optimizer_state_policy=lisa_optimizer_state_policy),
            where="LisaCallback ",
            allow_every_block=False,
        )
        if not is_int(seed):
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer.")
        if isinstance(lisa_always_trainable, str):
            lisa_always_trainable = (lisa_always_trainable,)
        if lisa_always_trainable is not None and not all(isinstance(s, str) for s in lisa_always_trainable):
            raise ValueError(f"lisa_always_trainable={lisa_always_trainable!r} is invalid; allowed: a sequence of "
                             "strings.")
        self.lisa_activated_layers = lisa_activated_layers
        self.lisa_interval_steps = lisa_interval_steps
        self.lisa_sampling = lisa_sampling
        self.seed = seed
        self.lisa_always_trainable = None if lisa_always_trainable is None else tuple(lisa_always_trainable)
        self.lisa_optimizer_state_policy = lisa_optimizer_state_policy
        self.lisa_layers_attribute = lisa_layers_attribute

    def _ctor_args(self) -> dict[str, Any]:
        return {
            "lisa_activated_layers": self.lisa_activated_layers,
            "lisa_interval_steps": self.lisa_interval_steps,
            "lisa_sampling": self.lisa_sampling,
            "seed": self.seed,
            "lisa_always_trainable": None if self.lisa_always_trainable is None else list(self.lisa_always_trainable),
            "lisa_optimizer_state_policy": self.lisa_optimizer_state_policy,
            "lisa_layers_attribute": self.lisa_layers_attribute,
        }

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(model, "peft_config", None):
            raise ValueError(
                "LisaCallback trains base weights in place (full-parameter LISA) but got a PEFT model. For LISA "
                "adapters use trainer_callbacks.LisaAdapterCallback, which reads γ and K from the LisaConfig."
            )
        if self.layer_scheduler is not None:  # a previous train() on this callback: undo its freezing first
            self.layer_scheduler.restore_trainable()
        scheduler = LayerwiseScheduler(
            model,
            lisa_activated_layers=self.lisa_activated_layers,  # the sampler checks γ against the blocks it finds
            lisa_interval_steps=self.lisa_interval_steps,
            lisa_sampling=self.lisa_sampling,
            seed=self.seed,
            lisa_always_trainable=self.lisa_always_trainable,
            lisa_optimizer_state_policy=self.lisa_optimizer_state_policy,
            lisa_layers_attribute=self.lisa_layers_attribute,
        )
        self._check_trainer(args, model)
        check_engine(args, model, optimizer, scheduler, form="full-parameter LISA", trainer=self._trainer)
        self._check_gradients_reachable(optimizer, ["importance sampling" if self.lisa_sampling == "importance" else ""])
        names = {id(p): n for n, p in model.named_parameters()}
        if scheduler.head_params:
            logger.info(
                "LISA: task-head parameters outside the blocks train throughout: %s (always_trainable narrows this).",
                ", ".join(names.get(id(p), "?") for p in scheduler.head_params),
            )
        if scheduler.frozen_params:
            logger.warning(
                "LISA: %d parameter(s) outside the blocks never train, since lisa_always_trainable=%s does not name them: "
                "%s. Add 'heads' or their module names to lisa_always_trainable to train them.",
                len(scheduler.frozen_params), list(self.lisa_always_trainable or ()),
                ", ".join(names.get(id(p), "?") for p in scheduler.frozen_params),
            )
        stored = self._stored_state(args, state)
        if stored is not None:
            scheduler.load_state_dict(stored["layers"], optimizer)
        else:
            scheduler.freeze_all_but_active(optimizer, global_step=state.global_step)
        self.layer_scheduler = scheduler
        self.resume_state = None
        self._global_step = state.global_step
        self._install_gradient_hooks(optimizer)
        self._relay("on_train_begin", args, state, control, model=model, optimizer=optimizer, **kwargs)

    def resolved_settings(self) -> dict[str, Any]:
        """The schedule's settings as this callback runs them (the names of ``training_summary.json``'s ``lisa``)."""
        return {**self._ctor_args(), "lisa_always_trainable": list(self.lisa_always_trainable or ())}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self._begin_step()
        if not self.layer_scheduler.maybe_switch(state.global_step, optimizer):
            self.layer_scheduler.enforce()
        self._arm_gradient_hooks()
        self._relay("on_step_begin", args, state, control, optimizer=optimizer, **kwargs)


class LisaAdapterCallback(_LisaCallbackBase):
    """LISA scheduling for the adapters of a ``PeftModel`` with a ``LisaConfig``.

    * **Layerwise sampling** (``lisa_activated_layers`` = γ > 0): only the ``lisa_*`` parameters of γ sampled blocks
      train in each period of ``lisa_interval_steps`` steps; layer-interpolation scalars and ``modules_to_save`` outside
      the blocks (task heads) train throughout; ``modules_to_save`` inside a block train with their block, like its
      adapters (named in the log at train begin). γ = 0 trains every adapter (no sampling).
    * **Sparse masks** (adapters with ``sparsity > 0``, see :class:`hf_lisa.scheduler.MaskScheduler`): a fresh
      adapter's first masks (``mask_init="importance"``, ``B = 0``) come from ``|∂L/∂W|`` through the trainer's own
      loss, gathered before the first optimizer step over ``importance_steps`` steps' worth of extra passes that
      train nothing (:mod:`.calibration`), for every sparse layer at once: no training step is spent, so the adapter
      trains from the first step whose learning rate is > 0 (the warmup applies to it) and a block sampled later
      trains for its whole first period; a loaded, trained adapter keeps its masks. Each sparse layer is then
      re-selected once per ``mask_update_interval`` in which it trains, while its block is active, from the signed
      gradient summed per step and what it has learned. Logged as ``lisa/mask_*`` (changed fraction, retained ``ΔW``
      energy, loss on a fixed batch before/after).
    * **Layer interpolation**: the penalty λ·Σβ² is applied once per optimizer step as the gradient ``2λβ``, whatever
      the trainer's loss, gradient accumulation or world size (logged as ``lisa/interp_penalty``); δ is projected
      back into ``±interpolation_delta_bound`` after each step; δ and β get no weight decay.
    * **One authority on what trains**: the schedule re-asserts the trainable set at every step and declares frozen
      blocks where PEFT itself re-applies them (``disable_adapter()`` in TRL's DPO reference pass re-enables every
      adapter otherwise); gradients that reach frozen parameters anyway are dropped before the clip and the step.

    Settings come from the adapter's ``LisaConfig``; keywords of the same names override them (:mod:`hf_lisa.renamed`).

    Args:
        seed (`int`, defaults to `42`): seed of the layer sampler.
        lisa_activated_layers, lisa_interval_steps, lisa_sampling: override the config's layer schedule.
        lisa_optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` or ``"keep"``, as for
            :class:`LisaCallback`.
        mask_update_interval, importance_steps, new_block_bonus: override the config's mask settings.
        adapter_name (`str`, *optional*): the adapter to schedule; the active adapter by default.
        measure_mask_change (`bool`, defaults to `True`): evaluate the loss on a fixed batch around each re-selection.
        recalibrate_masks (`bool`, defaults to `False`): calibrate the masks of a loaded, trained adapter too (its
            function then changes at the first selection).

    Example:
        ```py
        >>> import hf_lisa
        >>> from peft import get_peft_model
        >>> from hf_lisa.trainer_callbacks import LisaAdapterCallback
        >>> config = hf_lisa.LisaConfig(r=8, sparsity=0.4, lisa_activated_layers=2, lisa_interval_steps=20)
        >>> model = get_peft_model(base_model, config)  # doctest: +SKIP
        >>> callbacks = [LisaAdapterCallback(seed=42)]
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)  # doctest: +SKIP
        ```
    """

    @renamed_keywords("activated_layers", "interval_steps", "sampling", "optimizer_state_policy")
    def __init__(
        self,
        seed: int = 42,
        lisa_activated_layers: Optional[int] = None,
        lisa_interval_steps: Optional[int] = None,
        lisa_sampling: Optional[str] = None,
        lisa_optimizer_state_policy: str = "drop",
        mask_update_interval: Optional[int] = None,
        importance_steps: Optional[int] = None,
        new_block_bonus: Optional[float] = None,
        adapter_name: Optional[str] = None,
        measure_mask_change: bool = True,
        recalibrate_masks: bool = False,
    ) -> None:
        super().__init__()
        if not is_int(seed):
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer.")
        overrides = {
            "lisa_activated_layers": lisa_activated_layers,
            "lisa_interval_steps": lisa_interval_steps,
            "lisa_sampling": lisa_sampling,
            "mask_update_interval": mask_update_interval,
            "importance_steps": importance_steps,
            "new_block_bonus": new_block_bonus,
            "lisa_optimizer_state_policy": lisa_optimizer_state_policy,
        }
        check_lisa_settings(
            {name: value for name, value in overrides.items() if value is not None},
            where="LisaAdapterCallback ",
        )
        self.seed = seed
        self.lisa_activated_layers = lisa_activated_layers
        self.lisa_interval_steps = lisa_interval_steps
        self.lisa_sampling = lisa_sampling
        self.lisa_optimizer_state_policy = lisa_optimizer_state_policy
        self.mask_update_interval = mask_update_interval
        self.importance_steps = importance_steps
        self.new_block_bonus = new_block_bonus
        self.adapter_name = adapter_name
        self.measure_mask_change = measure_mask_change
        self.recalibrate_masks = recalibrate_masks
        self._tuner = None
        self._probe_batch = None
        self._model = None

    @property
    def mask_updates(self) -> list[dict]:
        """What every mask re-selection of this session did: step, changed fraction, loss before/after/jump."""
        return [] if self.mask_scheduler is None else list(self.mask_scheduler.updates)

    def _ctor_args(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "lisa_activated_layers": self.lisa_activated_layers,
            "lisa_interval_steps": self.lisa_interval_steps,
            "lisa_sampling": self.lisa_sampling,
            "lisa_optimizer_state_policy": self.lisa_optimizer_state_policy,
            "mask_update_interval": self.mask_update_interval,
            "importance_steps": self.importance_steps,
            "new_block_bonus": self.new_block_bonus,
            "adapter_name": self.adapter_name,
            "measure_mask_change": self.measure_mask_change,
            "recalibrate_masks": self.recalibrate_masks,
        }

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        config = lisa_config_of(model, self.adapter_name)
        if self.layer_scheduler is not None:  # a previous train() on this callback: undo its freezing first
            self.layer_scheduler.restore_trainable()
        gamma = config.lisa_activated_layers if self.lisa_activated_layers is None else self.lisa_activated_layers
        if gamma == 0:  # nothing is sampled: the layer schedule's settings given here would change nothing
            given = {"lisa_interval_steps": self.lisa_interval_steps, "lisa_sampling": self.lisa_sampling,
                     "lisa_optimizer_state_policy": self.lisa_optimizer_state_policy}
            check_lisa_settings(
                {"lisa_activated_layers": 0, **{name: value for name, value in given.items() if value is not None}},
                where="LisaAdapterCallback ",
            )
        layer_scheduler = None
        if gamma > 0:  # γ <= N is checked where the blocks are known: the sampler
            layer_scheduler = LayerwiseScheduler.for_adapter(
                model,
                adapter_name=self.adapter_name,
                seed=self.seed,
                lisa_activated_layers=gamma,
                lisa_interval_steps=self.lisa_interval_steps,
                lisa_sampling=self.lisa_sampling,
                lisa_optimizer_state_policy=self.lisa_optimizer_state_policy,
            )
        if layer_scheduler is not None:
            in_blocks = [name for name, p in model.named_parameters()
                         if ".modules_to_save." in name and p.requires_grad
                         and layer_scheduler.index.block_of(name) is not None]
            if in_blocks:
                logger.info("LISA: modules_to_save inside the blocks train with their block, not throughout: %s.",
                            ", ".join(in_blocks))
        mask_scheduler = MaskScheduler(
            model,
            adapter_name=self.adapter_name,
            mask_update_interval=self.mask_update_interval,
            importance_steps=self.importance_steps,
            new_block_bonus=self.new_block_bonus,
            lisa_interval_steps=None if layer_scheduler is None else layer_scheduler.lisa_interval_steps,
            recalibrate_masks=self.recalibrate_masks,
        )
        if not mask_scheduler.layers:
            mask_scheduler = None
        tuner = tuner_of(model)
        interpolation = tuner.interpolation_parameters() if tuner is not None else []
        if not settings_needing_schedule(  # the rule that refuses to train without this callback
            lisa_activated_layers=gamma, num_blocks=layer_scheduler and len(layer_scheduler.block_names),
            sparse=mask_scheduler is not None, uncalibrated=bool(mask_scheduler and not mask_scheduler.calibrated),
            mask_update_interval=mask_scheduler.mask_update_interval if mask_scheduler else 0,
            layer_interpolation=bool(interpolation),
        ):
            warnings.warn(
                "LisaAdapterCallback has nothing to schedule: no block sampling (γ=0 or every block), no sparse mask "
                "to calibrate or re-select, no layer interpolation. The adapters train like LoRA; the callback can be "
                "removed."
            )
        self._check_trainer(args, model)
        check_engine(args, model, optimizer, layer_scheduler, form="LISA adapter layer switching",
                     trainer=self._trainer)
        self._check_gradients_reachable(optimizer, [
            "importance sampling" if layer_scheduler is not None and layer_scheduler.lisa_sampling == "importance" else "",
            "sparse-mask selection" if mask_scheduler is not None else "",
            "the interpolation penalty" if interpolation else ""])
        if interpolation:
            # the penalty is applied as a gradient once per optimizer step (see _apply_penalty), never via the loss
            tuner.interpolation_penalty_in_loss = False
            if optimizer is not None:
                stuck = exclude_from_weight_decay(optimizer, interpolation)
                if stuck:
                    warnings.warn(
                        f"weight decay still applies to {len(stuck)} LISA interpolation parameter(s) (δ/β): the "
                        "optimizer has no parameter group without weight decay and otherwise equal settings to move "
                        "them to. Build the optimizer with such a group, or set weight_decay=0."
                    )
        device = next(model.parameters()).device
        stored = self._stored_state(args, state)
        if stored is not None:
            # masks came back with the adapter weights; the schedule checks they match what it saved
            if mask_scheduler is not None and stored.get("masks") is not None:
                mask_scheduler.load_state_dict(stored["masks"])
            if layer_scheduler is not None and stored.get("layers") is not None:
                layer_scheduler.load_state_dict(stored["layers"], optimizer)
            elif layer_scheduler is not None:
                layer_scheduler.freeze_all_but_active(optimizer, global_step=state.global_step)
        else:
            if mask_scheduler is not None:
                mask_scheduler.start(state.global_step)
            if layer_scheduler is not None:
                layer_scheduler.freeze_all_but_active(optimizer, global_step=state.global_step)
        self._probe_batch = None
        if mask_scheduler is not None and self.measure_mask_change and mask_scheduler.mask_update_interval:
            self._probe_batch = probe_batch(train_dataloader, args.per_device_train_batch_size, device)
        self._model = model
        self._tuner = tuner if interpolation else None
        self.layer_scheduler = layer_scheduler
        self.mask_scheduler = mask_scheduler
        self.resume_state = None
        self._global_step = state.global_step
        self._install_gradient_hooks(optimizer, tuner.interpolation_penalty_terms() if interpolation else ())
        attach_schedule(model, self)  # lets the tuner's guard admit training forwards (hf_lisa.tuner.schedule_guard)
        self._relay("on_train_begin", args, state, control, model=model, optimizer=optimizer, **kwargs)

    def resolved_settings(self, model=None) -> dict[str, Any]:
        """The schedule's settings as this callback runs them on ``model``'s adapter (the one it trained last by
        default): the ``LisaConfig``'s values with this callback's overrides, named as in ``training_summary.json``'s
        ``lisa``."""
        config = lisa_config_of(model if model is not None else self._model, self.adapter_name)

        def pick(override, name):
            return getattr(config, name) if override is None else override

        return {
            "lisa_activated_layers": pick(self.lisa_activated_layers, "lisa_activated_layers"),
            "lisa_interval_steps": pick(self.lisa_interval_steps, "lisa_interval_steps"),
            "lisa_sampling": pick(self.lisa_sampling, "lisa_sampling"),
            "lisa_optimizer_state_policy": self.lisa_optimizer_state_policy,
            "lisa_layers_attribute": config.lisa_layers_attribute,
            "mask_update_interval": pick(self.mask_update_interval, "mask_update_interval"),
            "importance_steps": pick(self.importance_steps, "importance_steps"),
            "new_block_bonus": pick(self.new_block_bonus, "new_block_bonus"),
            "seed": self.seed,
        }

    def _probe_loss(self) -> Optional[float]:
        """Loss on a fixed batch, in eval mode: the function before/after a mask change, without dropout noise.

        ``None`` when the trainer's batches are not plain model inputs with labels (TRL's DPO batches, for example):
        the jump is then not measured, and the log says so once.
        """
        model = self._model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = model(**self._probe_batch)
        except (TypeError, ValueError) as err:
            logger.info("LISA: the loss jump at mask re-selections is not measured (%s).", err)
            self._probe_batch = None
            return None
        finally:
            model.train(was_training)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            logger.info("LISA: the loss jump at mask re-selections is not measured: the batches carry no labels.")
            self._probe_batch = None
            return None
        return float(loss)

    def on_step_begin(self, args, state, control, optimizer=None, train_dataloader=None, **kwargs):
        self._begin_step()
        # the layer switch first: masks are re-selected only in blocks that train in this step
        if self.layer_scheduler is not None:
            if not self.layer_scheduler.maybe_switch(state.global_step, optimizer):
                self.layer_scheduler.enforce()
        if self.mask_scheduler is not None:
            probe = self._probe_loss if self._probe_batch is not None else None
            records = calibrate_due_masks(self, args, state, train_dataloader, optimizer)  # a fresh schedule's only
            records += self.mask_scheduler.step(state.global_step, probe)
            for record in records:
                if record["kind"] == "calibration":
                    self._pending_logs["lisa/mask_calibrated_layers"] = record["layers_updated"]
                    continue
                logs = {
                    "lisa/mask_update_step": record["step"],
                    "lisa/mask_layers_updated": record["layers_updated"],
                    "lisa/mask_changed_fraction": record["changed_fraction"],
                    "lisa/mask_retained_energy": record["retained_energy"],
                }
                if record["loss_before"] is not None:
                    logs.update(
                        {
                            "lisa/mask_loss_before": record["loss_before"],
                            "lisa/mask_loss_after": record["loss_after"],
                            "lisa/mask_loss_jump": record["loss_jump"],
                        }
                    )
                self._pending_logs.update(logs)
        self._arm_gradient_hooks()
        self._relay("on_step_begin", args, state, control, optimizer=optimizer, **kwargs)

    def _apply_penalty(self, optimizer, added: frozenset) -> None:
        if self._tuner is not None:
            penalty = self._tuner.apply_interpolation_penalty_grad(grad_scale=unscaled_factor(optimizer), skip=added)
            if penalty is not None:
                self._pending_logs["lisa/interp_penalty"] = penalty

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._tuner is not None:
            self._tuner.project_interpolation_delta()
        super().on_optimizer_step(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self._tuner is not None:
            self._tuner.interpolation_penalty_in_loss = True
        if self._model is not None:
            detach_schedule(self._model, self)

