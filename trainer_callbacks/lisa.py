"""Trainer callbacks that run LISA's schedule inside a plain ``transformers.Trainer``.

* :class:`LisaCallback`: full-parameter LISA (Pan et al., 2024) on a plain transformers model: E+H+γL.
* :class:`LisaAdapterCallback`: the same layer schedule for the adapters of a ``PeftModel`` with a ``LisaConfig``,
  plus the sparse-mask re-selection.

The decisions live in :mod:`hf_lisa.scheduler`; these callbacks only call it at the right events:

* ``on_train_begin``: the Trainer has built the optimizer over every candidate parameter, prepared it and loaded any
  checkpoint; freeze everything but the first active set here (LMFlow #726), or restore the checkpointed schedule.
* ``on_step_begin``: fires once per optimizer step, gradient accumulation included; switch when
  ``global_step % K == 0``.
* ``on_pre_optimizer_step``: gradients are present; feed the ``"importance"`` sampler.
* ``on_log``: active blocks, parameter counts and optimizer-state bytes join the Trainer's logs.

Checkpoint and resume: both callbacks are ``ExportableState``. Their state (sampler and generator, active set, mask
bookkeeping, importance accumulators) is stored as exact JSON in ``trainer_state.json``. Resuming from ``checkpoint-N``
restores it *with or without* ``TrainingArguments(restore_callback_states_from_checkpoint=True)``: with the flag the
Trainer rebuilds the callback from its stored state; without it, the callback reads the same stored state from the
resumed ``TrainerState`` in ``on_train_begin``. Tensors larger than ``inline_state_max_bytes`` (the importance
accumulators of a big model, when a checkpoint falls inside an importance window) go to
``checkpoint-N/lisa_scheduler_tensors.safetensors`` instead.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from hf_lisa.json_state import decode_state, encode_state, has_spilled
from hf_lisa.optim_state import OPTIMIZER_STATE_POLICIES, optimizer_state_bytes
from hf_lisa.sampler import LAYER_SAMPLING_STRATEGIES
from hf_lisa.scheduler import DEFAULT_ALWAYS_TRAINABLE, LayerwiseScheduler, MaskScheduler, lisa_config_of

SPILL_FILE = "lisa_scheduler_tensors.safetensors"

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


def _fixed_batches(dataloader, num_batches: int, batch_size: int, rank: int, world_size: int, device) -> list:
    """Deterministic batches from the training set, without touching the training dataloader or any RNG.

    Rank ``r`` of ``w`` takes examples ``r, r + w, r + 2w, ...`` (wrapping around a small dataset), so ranks see
    different data and the all-reduced importance covers ``w`` times as many examples.
    """
    base = getattr(dataloader, "base_dataloader", dataloader)
    dataset, collate = base.dataset, base.collate_fn
    needed = num_batches * batch_size
    if isinstance(dataset, torch.utils.data.IterableDataset):
        examples = []
        for i, example in enumerate(dataset):
            if i % world_size == rank:
                examples.append(example)
            if len(examples) == needed:
                break
    else:
        n = len(dataset)
        if n == 0:
            raise ValueError("The training dataset is empty; LISA mask calibration needs training batches.")
        examples = [dataset[(rank + world_size * i) % n] for i in range(needed)]
    return [
        _to_device(collate(examples[i : i + batch_size]), device)
        for i in range(0, len(examples), batch_size)
        if examples[i : i + batch_size]
    ]


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

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.layer_scheduler is not None and self.layer_scheduler.strategy == "importance":
            self.layer_scheduler.observe_gradients()

    def on_train_end(self, args, state, control, **kwargs):
        # leave the model as it was handed over (every candidate trainable), e.g. for a second trainer.train()
        if self.layer_scheduler is not None:
            self.layer_scheduler.restore_trainable()
        if self.mask_scheduler is not None:
            self.mask_scheduler.set_tracking(False)
            self.mask_scheduler.reset_importance()


class LisaCallback(_LisaCallbackBase):
    """Full-parameter LISA on a plain transformers model: the embeddings, LM head and final norm train throughout,
    and γ transformer blocks train at a time, re-drawn every K optimizer steps.

    Args:
        activated_layers (`int`, defaults to `2`): γ (LMFlow's ``lisa_activated_layers``), ``1 <= γ <= N``.
        interval_steps (`int`, defaults to `20`): K (``lisa_interval_steps``), optimizer steps per period.
        sampling (`str`, defaults to `"uniform"`): ``"uniform"`` (the paper), ``"importance"`` (running gradient
            norm) or ``"cyclic"`` (every block once per cycle); see :class:`hf_lisa.sampler.LayerSampler`.
        seed (`int`, defaults to `42`): seed of the sampler; every rank draws the same blocks.
        always_trainable (`Sequence[str]`, defaults to `("embeddings", "lm_head", "norm")`): what trains throughout
            (keywords or module names such as ``"score"``; ``()`` trains only the sampled blocks).
        optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` frees the optimizer state of deactivated
            parameters (the paper's behaviour; LISA then holds state for E+H+γL only), ``"keep"`` keeps it.
        layers_attribute (`str`, *optional*): dotted path of the block list (``lisa_layers_attribute``), e.g.
            ``"model.layers"``; discovered automatically by default.

    Example:
        ```py
        >>> from transformers import Trainer, TrainingArguments
        >>> from trainer_callbacks import LisaCallback
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
        self.layer_scheduler.maybe_switch(state.global_step, optimizer)


class LisaAdapterCallback(_LisaCallbackBase):
    """LISA scheduling for the adapters of a ``PeftModel`` with a ``LisaConfig``.

    * **Layerwise sampling** (``lisa_activated_layers`` = γ > 0): only the ``lisa_*`` parameters of γ sampled blocks
      train in each period of ``lisa_interval_steps`` steps; layer-interpolation scalars and ``modules_to_save`` train
      throughout. γ = 0 trains every adapter (no sampling).
    * **Sparse-mask re-selection** (adapters with ``sparsity > 0``): the first mask is chosen from ``|∂L/∂W|`` on
      ``importance_steps`` calibration batches at train begin (``mask_init="importance"``), and re-selected every
      ``mask_update_interval`` steps from the importance accumulated over the preceding ``importance_steps`` steps,
      with the ``new_block_bonus``. Entries dropped at a re-selection vanish at once (an abrupt change); the loss on a
      fixed batch just before and after is logged as ``lisa/mask_loss_before``/``_after``/``_jump``.

    Settings come from the adapter's ``LisaConfig``; keyword arguments override them.

    Args:
        seed (`int`, defaults to `42`): seed of the layer sampler.
        activated_layers, interval_steps, sampling: override ``lisa_activated_layers``, ``lisa_interval_steps``,
            ``lisa_sampling``.
        optimizer_state_policy (`str`, defaults to `"drop"`): ``"drop"`` or ``"keep"``, as for :class:`LisaCallback`.
        mask_update_interval, importance_steps, new_block_bonus: override the config's mask settings.
        adapter_name (`str`, *optional*): the adapter to schedule; the active adapter by default.
        measure_mask_change (`bool`, defaults to `True`): evaluate the loss on a fixed batch around each re-selection.

    Example:
        ```py
        >>> import hf_lisa
        >>> from peft import get_peft_model
        >>> from trainer_callbacks import LisaAdapterCallback
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
        )
        if not mask_scheduler.layers:
            mask_scheduler = None
        if layer_scheduler is None and mask_scheduler is None:
            warnings.warn(
                "LisaAdapterCallback has nothing to schedule: lisa_activated_layers=0 and no adapter has sparsity > 0. "
                "The adapters train like LoRA; the callback can be removed."
            )
        check_lisa_training_setup(
            args,
            model,
            layer_scheduler is not None
            and (layer_scheduler.num_active < layer_scheduler.num_blocks or bool(layer_scheduler.frozen_params)),
            form="adapter",
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
            if mask_scheduler is not None and mask_scheduler.mask_init == "importance" and state.global_step == 0:
                # before freezing: every block's adapter takes part, and B = 0 so the choice does not change outputs
                batches = _fixed_batches(
                    train_dataloader, mask_scheduler.importance_steps, args.per_device_train_batch_size,
                    args.process_index, args.world_size, device,
                )
                mask_scheduler.calibrate(model, batches)
            if layer_scheduler is not None:
                layer_scheduler.freeze_all_but_active(optimizer, global_step=state.global_step)
        if mask_scheduler is not None and self.measure_mask_change and mask_scheduler.update_interval:
            self._probe_batch = _fixed_batches(train_dataloader, 1, args.per_device_train_batch_size, 0, 1, device)[0]
        self._model = model
        self.layer_scheduler = layer_scheduler
        self.mask_scheduler = mask_scheduler
        self.resume_state = None
        self._global_step = state.global_step

    def _probe_loss(self) -> float:
        """Loss on a fixed batch, in eval mode: the function before/after a mask change, without dropout noise."""
        model = self._model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = model(**self._probe_batch)
        finally:
            model.train(was_training)
        return float(outputs["loss"] if isinstance(outputs, dict) else outputs.loss)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.mask_scheduler is not None:
            record = self.mask_scheduler.step(
                state.global_step, self._probe_loss if self._probe_batch is not None else None
            )
            if record is not None:
                self._pending_logs.update(
                    {
                        "lisa/mask_update_step": record["step"],
                        "lisa/mask_changed_fraction": record["changed_fraction"],
                        **(
                            {
                                "lisa/mask_loss_before": record["loss_before"],
                                "lisa/mask_loss_after": record["loss_after"],
                                "lisa/mask_loss_jump": record["loss_jump"],
                            }
                            if record["loss_before"] is not None
                            else {}
                        ),
                    }
                )
        if self.layer_scheduler is not None:
            self.layer_scheduler.maybe_switch(state.global_step, optimizer)
