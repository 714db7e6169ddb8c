"""Trainer callbacks that run LISA's schedule inside a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (Pan et al., 2024) on a plain transformers model: E+H+γL.
* :class:`LisaAdapterCallback`: the same layer schedule for the adapters of a ``PeftModel`` with a ``LisaConfig``,
  plus the sparse-mask re-selection.

The decisions live in :mod:`hf_lisa.scheduler`; these callbacks only call it at the right events:

* ``on_init_end``: prepare the Trainer being built (:func:`configure_trainer`): the LISA callbacks run before the
  reporting integrations, and under DDP the wrap gets unused-parameter detection and the active-set all-reduce.
* ``on_train_begin``: the Trainer has built the optimizer over every candidate parameter, prepared it and loaded any
  checkpoint; freeze everything but the first active set here (LMFlow #726), or restore the checkpointed schedule.
* ``on_step_begin``: fires once per optimizer step, gradient accumulation included; switch when
  ``global_step % K == 0``, re-assert the trainable set otherwise, then let the mask schedule select and track.
* ``on_pre_optimizer_step``: gradients are complete; drop any that reached frozen parameters, feed the
  ``"importance"`` sampler, fold the step's mask importance, apply the interpolation penalty's gradient.
* ``on_optimizer_step``: project δ back into its bound.
* ``on_log``: active blocks, parameter counts, optimizer-state bytes and mask/penalty values join the Trainer's logs.

Checkpoint and resume: both callbacks are ``ExportableState``. Their state (sampler and generator, active set, mask
bookkeeping, importance accumulators) is stored as exact JSON in ``trainer_state.json``. Resuming from ``checkpoint-N``
restores it *with or without* ``TrainingArguments(restore_callback_states_from_checkpoint=True)``: with the flag the
Trainer rebuilds the callback from its stored state; without it, the callback reads the same stored state from the
resumed ``TrainerState`` in ``on_train_begin``. Tensors larger than ``inline_state_max_bytes`` (the importance
accumulators of a big model, when a checkpoint falls inside an importance window) go to
``checkpoint-N/lisa_scheduler_tensors.safetensors`` instead.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from hf_lisa.json_state import decode_state, encode_state, has_spilled
from hf_lisa.scheduler.optim_state import OPTIMIZER_STATE_POLICIES, exclude_from_weight_decay, optimizer_state_bytes
from hf_lisa.scheduler.sampler import LAYER_SAMPLING_STRATEGIES
from hf_lisa.scheduler import DEFAULT_ALWAYS_TRAINABLE, LayerwiseScheduler, MaskScheduler, lisa_config_of

SPILL_FILE = "lisa_scheduler_tensors.safetensors"

logger = logging.getLogger(__name__)

__all__ = ["LisaAdapterCallback", "LisaCallback", "check_lisa_training_setup"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def _uses_deepspeed(args) -> bool:
    return bool(getattr(args, "deepspeed", None)) or getattr(args, "deepspeed_plugin", None) is not None or _env_true(
        "ACCELERATE_USE_DEEPSPEED"
    )


def _uses_fsdp(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or _env_true("ACCELERATE_USE_FSDP")


def _ddp_find_unused_parameters(args, model) -> bool:
    """What the Trainer passes to DDP as ``find_unused_parameters`` (mirrors ``Trainer._build_accelerator_args``)."""
    if args.ddp_find_unused_parameters is not None:
        return bool(args.ddp_find_unused_parameters)
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        checkpointing = getattr(model, "is_activation_checkpointing", False) or getattr(
            args, "activation_checkpointing", False
        )
        return not (checkpointing or getattr(args, "gradient_checkpointing", False))
    return True


def check_lisa_training_setup(args, model=None, freezes_parameters: bool = True, form: str = "full-parameter") -> None:
    """Refuse the training setups in which LISA's freezing is known to silently not work.

    Args:
        args: the Trainer's ``TrainingArguments``.
        model: the (unwrapped) model; used to tell what the Trainer gives DDP.
        freezes_parameters: whether the schedule freezes anything that the optimizer was built over (γ < N, or
            parameters outside the always-trainable set). Setups that only change masks are always fine.
        form: ``"full-parameter"`` or ``"adapter"``, for the messages.

    Raises:
        ValueError: for DeepSpeed ZeRO, FSDP1 without ``use_orig_params``, DDP without unused-parameter detection,
            and DDP with ``static_graph``; each message names the reason and what to use instead.
    """
    if not freezes_parameters:
        return
    if _uses_deepspeed(args):
        raise ValueError(
            f"{form} LISA changes which parameters train every K steps, but DeepSpeed ZeRO fixes the trainable set "
            "when its engine is created (DeepSpeed #5639): blocks frozen later would keep moving under Adam and blocks "
            "unfrozen later would never be updated. Use FSDP2 instead (TrainingArguments(fsdp='full_shard', "
            "fsdp_config={'version': 2}) or the shipped accelerate FSDP2 config), or DDP. With DeepSpeed, train the "
            "adapter form with lisa_activated_layers=0."
        )
    if _uses_fsdp(args):
        fsdp_config = args.fsdp_config if isinstance(getattr(args, "fsdp_config", None), dict) else {}
        version = int(fsdp_config.get("version", 2))
        use_orig = str(fsdp_config.get("use_orig_params", "true")).lower() == "true"
        if version == 1 and not use_orig:
            raise ValueError(
                f"{form} LISA freezes parts of FSDP units, which FSDP1 only supports with use_orig_params=True. Set "
                "fsdp_config={'use_orig_params': True}, or better use FSDP2 (fsdp_config={'version': 2}), whose "
                "per-parameter sharding is the supported engine."
            )
        return
    if args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size > 1:
        if args.ddp_static_graph:
            raise ValueError(
                f"{form} LISA changes the set of parameters that receive gradients every K steps, which DDP's "
                "static_graph=True forbids. Set TrainingArguments(ddp_static_graph=False)."
            )
        if not _ddp_find_unused_parameters(args, model):
            raise ValueError(
                f"{form} LISA freezes blocks after DDP has wrapped the model, so frozen parameters produce no gradient "
                "and DDP fails with 'Expected to have finished reduction' (axolotl #1474) unless it looks for unused "
                "parameters. Set TrainingArguments(ddp_find_unused_parameters=True); with gradient checkpointing also "
                "pass gradient_checkpointing_kwargs={'use_reentrant': False}. Alternative: FSDP2."
            )


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _probe_batch(dataloader, batch_size: int, device) -> Any:
    """The first ``batch_size`` training examples, collated, without touching the training dataloader or any RNG.

    The same batch on every rank, so the loss measured around a mask re-selection is the same number everywhere.
    """
    base = getattr(dataloader, "base_dataloader", dataloader)
    dataset, collate = base.dataset, base.collate_fn
    if isinstance(dataset, torch.utils.data.IterableDataset):
        examples = [example for _, example in zip(range(batch_size), dataset)]
    else:
        examples = [dataset[i % len(dataset)] for i in range(batch_size)] if len(dataset) else []
    if not examples:
        raise ValueError("The training dataset is empty; LISA's mask schedule needs training batches.")
    return _to_device(collate(examples), device)


_CONFIGURED = "_hf_lisa_configured"


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _calling_trainer():
    """The ``transformers.Trainer`` whose event is running, found on the call stack (``None`` outside a Trainer).

    Trainer events do not receive the Trainer itself, but a LISA callback must adjust it before ``train()`` wraps the
    model (DDP's unused-parameter detection, the active-set all-reduce) and order the callbacks. The Trainer is the
    ``self`` of a frame a few levels up: ``Trainer.__init__`` for ``on_init_end``, the training loop otherwise.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
    return None


def configure_trainer(trainer) -> None:
    """Prepare a Trainer for the LISA callbacks it holds; idempotent.

    * The LISA callbacks move ahead of the reporting integrations (TensorBoard, W&B, ...) and the printer, which
      ``Trainer`` registers before user callbacks, so the values they add in ``on_log`` reach all of them.
    * Under DDP, :func:`hf_lisa.distributed.configure_trainer_for_lisa` (unused-parameter detection, the active-set
      all-reduce, the wrap check after ``evaluate()``), unless the user already called it.
    """
    from hf_lisa.trainer_callbacks.ordering import run_before_reporting_integrations

    ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, _LisaCallbackBase)]
    run_before_reporting_integrations(trainer, ours)
    if getattr(trainer, _CONFIGURED, False):
        return
    from hf_lisa.distributed import configure_trainer_for_lisa

    configure_trainer_for_lisa(trainer)


class _LisaCallbackBase(TrainerCallback, ExportableState):
    """State export/restore, logging and guard rails shared by the two LISA callbacks."""

    #: tensors above this size are written next to the checkpoint instead of into trainer_state.json
    inline_state_max_bytes: int = 8 * 2**20

    def __init__(self) -> None:
        self.layer_scheduler: Optional[LayerwiseScheduler] = None
        self.mask_scheduler: Optional[MaskScheduler] = None
        self.resume_state: Optional[dict] = None  # set by the Trainer when it restores the callback
        self._spill: dict[str, torch.Tensor] = {}
        self._global_step = 0
        self._pending_logs: dict[str, Any] = {}
        self._warned_stray = False

    # -- ExportableState -----------------------------------------------------------------------------------------------
    def _ctor_args(self) -> dict[str, Any]:
        raise NotImplementedError

    def state(self) -> dict:
        return {"args": self._ctor_args(), "attributes": {"resume_state": self._export_state()}}

    def _export_state(self) -> Optional[dict]:
        if self.layer_scheduler is None and self.mask_scheduler is None:
            return self.resume_state
        self._spill = {}
        raw = {
            "global_step": self._global_step,
            "layers": self.layer_scheduler.state_dict() if self.layer_scheduler is not None else None,
            "masks": self.mask_scheduler.state_dict() if self.mask_scheduler is not None else None,
        }
        return encode_state(raw, spill=self._spill, inline_max_bytes=self.inline_state_max_bytes)

    def on_save(self, args, state, control, **kwargs):
        # state() ran in Trainer._save_checkpoint just before this event; write what it spilled next to the checkpoint
        if self._spill and args.should_save:
            from safetensors.torch import save_file

            checkpoint_dir = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(checkpoint_dir, exist_ok=True)
            save_file(self._spill, os.path.join(checkpoint_dir, SPILL_FILE))
        self._spill = {}

    def _stored_state(self, args, state) -> Optional[dict]:
        """The schedule saved with the checkpoint being resumed, decoded; ``None`` for a fresh run."""
        if state.global_step == 0:
            return None
        stored = self.resume_state
        if stored is None:
            # without restore_callback_states_from_checkpoint the resumed TrainerState still carries our state
            entry = (state.stateful_callbacks or {}).get(type(self).__name__)
            if isinstance(entry, list):
                raise ValueError(f"Only one {type(self).__name__} per Trainer is supported; found {len(entry)} states.")
            stored = ((entry or {}).get("attributes") or {}).get("resume_state")
        if stored is None:
            warnings.warn(
                f"Resuming at global step {state.global_step} from a checkpoint without {type(self).__name__} state: "
                "a new LISA schedule starts here, so the run will not follow the original run's path."
            )
            return None
        load_spilled = None
        if has_spilled(stored):
            load_spilled = self._spill_loader(args, state)
        decoded = decode_state(stored, load_spilled)
        if decoded["global_step"] != state.global_step:
            raise RuntimeError(
                f"The LISA schedule stored in the checkpoint was saved at step {decoded['global_step']} but training "
                f"resumes at step {state.global_step}; resume from a checkpoint written by the Trainer."
            )
        return decoded

    def _spill_loader(self, args, state):
        from safetensors.torch import load_file

        candidates = []
        if isinstance(getattr(args, "resume_from_checkpoint", None), str):
            candidates.append(args.resume_from_checkpoint)
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        for directory in candidates:
            path = os.path.join(directory, SPILL_FILE)
            if os.path.isfile(path):
                tensors = load_file(path)
                return tensors.__getitem__
        raise FileNotFoundError(
            f"The LISA schedule of this checkpoint keeps large tensors in {SPILL_FILE}, which was not found in "
            f"{candidates}. Resume from the checkpoint folder under output_dir, or set "
            "TrainingArguments(resume_from_checkpoint=<path>) to the folder you pass to trainer.train()."
        )

    # -- logging -------------------------------------------------------------------------------------------------------
    def _log_values(self, optimizer) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if self.layer_scheduler is not None:
            counts = self.layer_scheduler.param_counts()
            values["lisa/active_blocks"] = ",".join(str(b) for b in self.layer_scheduler.active)
            values["lisa/always_trainable_params"] = counts["always_trainable"]
            values["lisa/active_block_params"] = counts["active_blocks"]
            values["lisa/trainable_params"] = counts["trainable"]
        if optimizer is not None:
            values["lisa/optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
        if self.mask_scheduler is not None:
            values["lisa/mask_updates"] = self.mask_scheduler.num_updates
        values.update(self._pending_logs)
        return values

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None:
            return
        values = self._log_values(optimizer)
        logs.update(values)
        # Trainer.log appended a copy of `logs` to log_history just before this event: keep the two in step
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
        self._pending_logs = {}

    def on_step_end(self, args, state, control, **kwargs):
        self._global_step = state.global_step

    # -- the Trainer that runs us --------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is not None:
            configure_trainer(trainer)

    def _check_configured(self, args) -> None:
        """Refuse multi-process training that the callback could not set up (added after the Trainer was built)."""
        trainer = _calling_trainer()
        if trainer is not None and not getattr(trainer, _CONFIGURED, False):
            if _launched_world_size() > 1 or args.world_size > 1:
                raise RuntimeError(
                    f"{type(self).__name__} was added after the Trainer was built, so it could not prepare the "
                    "Trainer's DDP wrap for LISA before train() (unused-parameter detection, the active-set "
                    "all-reduce). Pass it as Trainer(callbacks=[...]), or call "
                    "hf_lisa.distributed.configure_trainer_for_lisa(trainer) before trainer.train()."
                )
            configure_trainer(trainer)

    # -- the step ------------------------------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # gradients are complete (all micro-batches, all-reduced under DDP); the update has not happened yet
        if self.layer_scheduler is not None:
            stray = self.layer_scheduler.drop_stray_gradients()
            if stray and not self._warned_stray:
                self._warned_stray = True
                logger.warning(
                    "LISA: %d frozen parameter(s) received gradients at step %d: something re-enabled requires_grad "
                    "behind the schedule (a library or user code). Their gradients were dropped, so they did not "
                    "move; the compute was wasted.", len(stray), state.global_step,
                )
            if self.layer_scheduler.strategy == "importance":
                self.layer_scheduler.observe_gradients()
        if self.mask_scheduler is not None:
            self.mask_scheduler.end_step()
        self._apply_penalty(optimizer)

    def _apply_penalty(self, optimizer) -> None:
        """Hook for the adapter form's interpolation penalty (nothing to do for full-parameter LISA)."""

    def on_train_end(self, args, state, control, **kwargs):
        # leave the model as it was handed over (every candidate trainable), e.g. for a second trainer.train()
        if self.layer_scheduler is not None:
            self.layer_scheduler.restore_trainable()
        if self.mask_scheduler is not None:
            self.mask_scheduler.set_tracking(False)
            self.mask_scheduler.reset_importance()


class LisaCallback(_LisaCallbackBase):
    """Full-parameter LISA on a plain transformers model: the embeddings, LM head, final norm and any task head train
    throughout, and γ transformer blocks train at a time, re-drawn every K optimizer steps.

    Args:
        activated_layers (`int`, defaults to `2`): γ (LMFlow's ``lisa_activated_layers``), ``1 <= γ <= N``.
        interval_steps (`int`, defaults to `20`): K (``lisa_interval_steps``), optimizer steps per period.
        sampling (`str`, defaults to `"uniform"`): ``"uniform"`` (the paper), ``"importance"`` (running gradient
            norm) or ``"cyclic"`` (every block once per cycle); see :class:`hf_lisa.scheduler.sampler.LayerSampler`.
        seed (`int`, defaults to `42`): seed of the sampler; every rank draws the same blocks.
        always_trainable (`Sequence[str]`, defaults to `("embeddings", "lm_head", "norm", "heads")`): what trains
            throughout: keywords (``"heads"`` is every other parameter outside the blocks, e.g. a classifier's
            ``score``, BERT's ``pooler`` and ``classifier``) or module names/regexes such as ``"score"``; ``()``
            trains only the sampled blocks. The task heads that train are listed in the log at train begin.
        optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` frees the optimizer state of deactivated
            parameters (the paper's behaviour; LISA then holds state for E+H+γL only), ``"keep"`` keeps it.
        layers_attribute (`str`, *optional*): dotted path of the block list (``lisa_layers_attribute``), e.g.
            ``"model.layers"``; discovered automatically by default.

    Example:
        ```py
        >>> from transformers import Trainer, TrainingArguments
        >>> from hf_lisa.trainer_callbacks import LisaCallback
        >>> trainer = Trainer(
        ...     model=model, args=TrainingArguments("out", max_steps=1000), train_dataset=train_dataset,
        ...     callbacks=[LisaCallback(activated_layers=2, interval_steps=20, seed=42)],
        ... )  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        ```
    """

    def __init__(
        self,
        activated_layers: int = 2,
        interval_steps: int = 20,
        sampling: str = "uniform",
        seed: int = 42,
        always_trainable: Optional[Sequence[str]] = DEFAULT_ALWAYS_TRAINABLE,
        optimizer_state_policy: str = "drop",
        layers_attribute: Optional[str] = None,
    ) -> None:
        super().__init__()
        if not _is_int(activated_layers) or activated_layers < 1:
            raise ValueError(
                f"activated_layers (lisa_activated_layers, γ)={activated_layers!r} is invalid; allowed: an integer "
                ">= 1 and at most the number of transformer blocks. To train every block, use plain fine-tuning."
            )
        if not _is_int(interval_steps) or interval_steps < 1:
            raise ValueError(
                f"interval_steps (lisa_interval_steps, K)={interval_steps!r} is invalid; allowed: an integer >= 1."
            )
        if sampling not in LAYER_SAMPLING_STRATEGIES:
            raise ValueError(f"sampling (lisa_sampling)={sampling!r} is invalid; allowed: {LAYER_SAMPLING_STRATEGIES}.")
        if not _is_int(seed):
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer.")
        if optimizer_state_policy not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(
                f"optimizer_state_policy={optimizer_state_policy!r} is invalid; allowed: {OPTIMIZER_STATE_POLICIES}."
            )
        if isinstance(always_trainable, str):
            always_trainable = (always_trainable,)
        if always_trainable is not None and not all(isinstance(s, str) for s in always_trainable):
            raise ValueError(f"always_trainable={always_trainable!r} is invalid; allowed: a sequence of strings.")
        self.activated_layers = activated_layers
        self.interval_steps = interval_steps
        self.sampling = sampling
        self.seed = seed
        self.always_trainable = None if always_trainable is None else tuple(always_trainable)
        self.optimizer_state_policy = optimizer_state_policy
        self.layers_attribute = layers_attribute

    def _ctor_args(self) -> dict[str, Any]:
        return {
            "activated_layers": self.activated_layers,
            "interval_steps": self.interval_steps,
            "sampling": self.sampling,
            "seed": self.seed,
            "always_trainable": None if self.always_trainable is None else list(self.always_trainable),
            "optimizer_state_policy": self.optimizer_state_policy,
            "layers_attribute": self.layers_attribute,
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
            num_active=self._checked_gamma(model),
            interval_steps=self.interval_steps,
            strategy=self.sampling,
            seed=self.seed,
            always_trainable=self.always_trainable,
            optimizer_state_policy=self.optimizer_state_policy,
            layers_attribute=self.layers_attribute,
        )
        check_lisa_training_setup(
            args, model, scheduler.num_active < scheduler.num_blocks or bool(scheduler.frozen_params)
        )
        self._check_configured(args)
        if scheduler.head_params:
            names = {id(p): n for n, p in model.named_parameters()}
            logger.info(
                "LISA: task-head parameters outside the blocks train throughout: %s (always_trainable narrows this).",
                ", ".join(names.get(id(p), "?") for p in scheduler.head_params),
            )
        stored = self._stored_state(args, state)
        if stored is not None:
            scheduler.load_state_dict(stored["layers"], optimizer)
        else:
            scheduler.freeze_all_but_active(optimizer, global_step=state.global_step)
        self.layer_scheduler = scheduler
        self.resume_state = None
        self._global_step = state.global_step

    def _checked_gamma(self, model) -> int:
        from hf_lisa.blocks import find_blocks

        n = len(find_blocks(model, self.layers_attribute))
        if self.activated_layers > n:
            raise ValueError(
                f"activated_layers (lisa_activated_layers, γ)={self.activated_layers} is larger than the number of "
                f"transformer blocks ({n}); allowed: 1..{n}."
            )
        return self.activated_layers

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if not self.layer_scheduler.maybe_switch(state.global_step, optimizer):
            self.layer_scheduler.enforce()


class LisaAdapterCallback(_LisaCallbackBase):
    """LISA scheduling for the adapters of a ``PeftModel`` with a ``LisaConfig``.

    * **Layerwise sampling** (``lisa_activated_layers`` = γ > 0): only the ``lisa_*`` parameters of γ sampled blocks
      train in each period of ``lisa_interval_steps`` steps; layer-interpolation scalars and ``modules_to_save`` train
      throughout. γ = 0 trains every adapter (no sampling).
    * **Sparse masks** (adapters with ``sparsity > 0``, see :class:`hf_lisa.scheduler.MaskScheduler`): a fresh
      adapter's first mask comes from ``|∂L/∂W|`` over its first ``importance_steps`` trainable steps, through the
      trainer's own loss, while its ``B`` stays 0 (``mask_init="importance"``); a loaded, trained adapter keeps its
      masks. Each sparse layer is then re-selected once per ``mask_update_interval`` in which it trains, while its
      block is active, from the signed gradient summed per step and what it has learned. Logged as
      ``lisa/mask_*`` (changed fraction, retained ``ΔW`` energy, loss on a fixed batch before/after).
    * **Layer interpolation**: the penalty λ·Σβ² is applied once per optimizer step as the gradient ``2λβ``, whatever
      the trainer's loss, gradient accumulation or world size (logged as ``lisa/interp_penalty``); δ is projected
      back into ``±interpolation_delta_bound`` after each step; δ and β get no weight decay.
    * **One authority on what trains**: the schedule re-asserts the trainable set at every step and declares frozen
      blocks where PEFT itself re-applies them (``disable_adapter()`` in TRL's DPO reference pass re-enables every
      adapter otherwise); gradients that reach frozen parameters anyway are dropped before the optimizer step.

    Settings come from the adapter's ``LisaConfig``; keyword arguments override them.

    Args:
        seed (`int`, defaults to `42`): seed of the layer sampler.
        activated_layers, interval_steps, sampling: override ``lisa_activated_layers``, ``lisa_interval_steps``,
            ``lisa_sampling``.
        optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` or ``"keep"``, as for :class:`LisaCallback`.
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

    def __init__(
        self,
        seed: int = 42,
        activated_layers: Optional[int] = None,
        interval_steps: Optional[int] = None,
        sampling: Optional[str] = None,
        optimizer_state_policy: str = "drop",
        mask_update_interval: Optional[int] = None,
        importance_steps: Optional[int] = None,
        new_block_bonus: Optional[float] = None,
        adapter_name: Optional[str] = None,
        measure_mask_change: bool = True,
        recalibrate_masks: bool = False,
    ) -> None:
        super().__init__()
        if not _is_int(seed):
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer.")
        if activated_layers is not None and (not _is_int(activated_layers) or activated_layers < 0):
            raise ValueError(
                f"activated_layers (lisa_activated_layers, γ)={activated_layers!r} is invalid; allowed: an integer "
                ">= 0 (0 trains every adapter) and at most the number of adapted blocks."
            )
        if interval_steps is not None and (not _is_int(interval_steps) or interval_steps < 1):
            raise ValueError(
                f"interval_steps (lisa_interval_steps, K)={interval_steps!r} is invalid; allowed: an integer >= 1."
            )
        if sampling is not None and sampling not in LAYER_SAMPLING_STRATEGIES:
            raise ValueError(f"sampling (lisa_sampling)={sampling!r} is invalid; allowed: {LAYER_SAMPLING_STRATEGIES}.")
        if optimizer_state_policy not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(
                f"optimizer_state_policy={optimizer_state_policy!r} is invalid; allowed: {OPTIMIZER_STATE_POLICIES}."
            )
        if mask_update_interval is not None and (not _is_int(mask_update_interval) or mask_update_interval < 0):
            raise ValueError(
                f"mask_update_interval={mask_update_interval!r} is invalid; allowed: an integer >= 0 (0 never "
                "re-selects)."
            )
        if importance_steps is not None and (not _is_int(importance_steps) or importance_steps < 1):
            raise ValueError(f"importance_steps={importance_steps!r} is invalid; allowed: an integer >= 1.")
        if new_block_bonus is not None and new_block_bonus < 0:
            raise ValueError(f"new_block_bonus={new_block_bonus!r} is invalid; allowed: a float >= 0.")
        self.seed = seed
        self.activated_layers = activated_layers
        self.interval_steps = interval_steps
        self.sampling = sampling
        self.optimizer_state_policy = optimizer_state_policy
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
            "activated_layers": self.activated_layers,
            "interval_steps": self.interval_steps,
            "sampling": self.sampling,
            "optimizer_state_policy": self.optimizer_state_policy,
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
        gamma = config.lisa_activated_layers if self.activated_layers is None else self.activated_layers
        layer_scheduler = None
        if gamma > 0:
            from hf_lisa.blocks import find_blocks

            path = config.lisa_layers_attribute
            n = len(find_blocks(model, path))
            if gamma > n:
                raise ValueError(
                    f"lisa_activated_layers (γ)={gamma} is larger than the number of transformer blocks ({n}); "
                    f"allowed: 0 (every adapter trains) or 1..{n}."
                )
            layer_scheduler = LayerwiseScheduler.for_adapter(
                model,
                adapter_name=self.adapter_name,
                seed=self.seed,
                num_active=gamma,
                interval_steps=self.interval_steps,
                strategy=self.sampling,
                optimizer_state_policy=self.optimizer_state_policy,
            )
        mask_scheduler = MaskScheduler(
            model,
            adapter_name=self.adapter_name,
            update_interval=self.mask_update_interval,
            importance_steps=self.importance_steps,
            new_block_bonus=self.new_block_bonus,
            interval_steps=None if layer_scheduler is None else layer_scheduler.interval_steps,
            recalibrate=self.recalibrate_masks,
        )
        if not mask_scheduler.layers:
            mask_scheduler = None
        tuner = _tuner_of(model)
        interpolation = tuner.interpolation_parameters() if tuner is not None else []
        if layer_scheduler is None and mask_scheduler is None and not interpolation:
            warnings.warn(
                "LisaAdapterCallback has nothing to schedule: lisa_activated_layers=0, no adapter has sparsity > 0 "
                "and no layer interpolation. The adapters train like LoRA; the callback can be removed."
            )
        check_lisa_training_setup(
            args,
            model,
            layer_scheduler is not None
            and (layer_scheduler.num_active < layer_scheduler.num_blocks or bool(layer_scheduler.frozen_params)),
            form="adapter",
        )
        self._check_configured(args)
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
        if mask_scheduler is not None and self.measure_mask_change and mask_scheduler.update_interval:
            self._probe_batch = _probe_batch(train_dataloader, args.per_device_train_batch_size, device)
        self._model = model
        self._tuner = tuner if interpolation else None
        self.layer_scheduler = layer_scheduler
        self.mask_scheduler = mask_scheduler
        self.resume_state = None
        self._global_step = state.global_step

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

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # the layer switch first: masks are re-selected only in blocks that train in this step
        if self.layer_scheduler is not None:
            if not self.layer_scheduler.maybe_switch(state.global_step, optimizer):
                self.layer_scheduler.enforce()
        if self.mask_scheduler is not None:
            probe = self._probe_loss if self._probe_batch is not None else None
            for record in self.mask_scheduler.step(state.global_step, probe):
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

    def _apply_penalty(self, optimizer) -> None:
        if self._tuner is not None:
            penalty = self._tuner.apply_interpolation_penalty_grad(grad_scale=_unscaled_factor(optimizer))
            if penalty is not None:
                self._pending_logs["lisa/interp_penalty"] = penalty

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._tuner is not None:
            self._tuner.project_interpolation_delta()

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self._tuner is not None:
            self._tuner.interpolation_penalty_in_loss = True


def _tuner_of(model):
    """The ``LisaModel`` inside a (possibly wrapped) ``PeftModel``, or ``None``."""
    from hf_lisa.tuner.model import LisaModel

    while type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        model = model.module
    base = getattr(model, "base_model", None)
    return base if isinstance(base, LisaModel) else None


def _unscaled_factor(optimizer) -> float:
    """The loss scale still applied to the gradients at ``on_pre_optimizer_step`` (1.0 without fp16 loss scaling).

    With fp16 loss scaling, gradients are unscaled by gradient clipping; without clipping they are still scaled when
    the optimizer step begins, and a gradient added there must be scaled alike.
    """
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return 1.0
    from torch.amp.grad_scaler import OptState

    inner = getattr(optimizer, "optimizer", optimizer)
    stage = scaler._per_optimizer_states[id(inner)]["stage"]
    return 1.0 if stage is OptState.UNSCALED else float(scaler.get_scale())
