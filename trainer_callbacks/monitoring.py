"""Training monitor: gradient norm, per-block-group update/weight ratio, active blocks and optimizer-state bytes.

The source documents (seed 000, §4) ask for TensorBoard scalars of the gradient norm and the size of parameter updates,
and say that a gradient norm that *stays* below 1e-5 means training is stuck (adjust the learning rate or diversify
the data). This callback measures those quantities for any method (LISA, LoRA, full) and adds them to the Trainer's
logs, so every integration named by ``report_to`` (TensorBoard, wandb, trackio, ...) records them:

* ``monitor/grad_norm``: global L2 norm of the gradients before clipping (the Trainer's measurement, else ours; with
  an optimizer stepping in the backward pass, the norm its hooks measured, which also replaces the Trainer's
  ``grad_norm``, computed over gradients that are gone) and
  ``monitor/grad_norm_applied``: the norm after clipping, i.e. of what the optimizer applies, at the logged step;
* ``monitor/update_ratio/<group>``: ``‖W_after − W_before‖ / ‖W_before‖`` of that step, per group:
  ``embeddings``, ``blocks_<first>-<last>`` (the blocks split into ``num_block_groups`` contiguous groups) and
  ``head`` (everything else). Groups without gradients that step (frozen by LISA) report 0;
* ``monitor/active_blocks``: blocks with at least one trainable parameter, ``monitor/trainable_params``;
* ``monitor/optimizer_state_bytes``: bytes held by the optimizer's per-parameter state.

Update ratios need a copy of the parameters that receive gradients, taken on logging steps only.

Order matters: integrations write ``logs`` in their own ``on_log``, so this callback must run before them. The Trainer
puts user callbacks after the integrations; :meth:`TrainingMonitorCallback.attach` moves it in front.

Example:
    ```py
    >>> from transformers import Trainer
    >>> from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds)  # doctest: +SKIP
    >>> TrainingMonitorCallback(plateau_steps=50).attach(trainer)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Optional

import torch
from transformers import TrainerCallback

from hf_lisa.scheduler.active_set import EMBEDDINGS_GROUP, BlockIndex
from hf_lisa.renamed import RenamedAttribute, renamed_keywords
from hf_lisa.optim.in_backward import check_in_backward_arguments, steps_in_backward

logger = logging.getLogger(__name__)

__all__ = ["TrainingMonitorCallback", "GradientPlateauWarning"]


class GradientPlateauWarning(UserWarning):
    """The global gradient norm stayed below the plateau threshold for the configured number of steps."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards are DTensors: reduce over the full tensor so every rank sees the same norm
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class TrainingMonitorCallback(TrainerCallback):
    """Log gradient norm, update/weight ratios, active blocks and optimizer-state bytes; warn on gradient plateaus.

    Args:
        plateau_grad_norm (`float`, defaults to `1e-5`): gradient norms below this count as a plateau step.
        plateau_steps (`int`, defaults to `50`): warn (once per plateau) after this many consecutive plateau steps.
        num_block_groups (`int`, defaults to `4`): the transformer blocks are split into this many contiguous groups
            for the update/weight ratios.
        lisa_layers_attribute (`str`, *optional*): dotted path of the block list, overriding discovery
            (``layers_attribute`` before 0.3, until 0.4 with a ``FutureWarning``).
        update_ratio (`bool`, defaults to `True`): measure update/weight ratios (copies the parameters that receive
            gradients on logging steps).
        prefix (`str`, defaults to `"monitor/"`): prefix of the logged names.
    """

    layers_attribute = RenamedAttribute("lisa_layers_attribute")

    @renamed_keywords("layers_attribute")
    def __init__(
        self,
        plateau_grad_norm: float = 1e-5,
        plateau_steps: int = 50,
        num_block_groups: int = 4,
        lisa_layers_attribute: Optional[str] = None,
        update_ratio: bool = True,
        prefix: str = "monitor/",
    ) -> None:
        if not plateau_grad_norm > 0:
            raise ValueError(f"plateau_grad_norm={plateau_grad_norm!r} is invalid; allowed: a float > 0.")
        if not isinstance(plateau_steps, int) or plateau_steps < 1:
            raise ValueError(f"plateau_steps={plateau_steps!r} is invalid; allowed: an integer >= 1.")
        if not isinstance(num_block_groups, int) or num_block_groups < 1:
            raise ValueError(f"num_block_groups={num_block_groups!r} is invalid; allowed: an integer >= 1.")
        self.plateau_grad_norm = plateau_grad_norm
        self.plateau_steps = plateau_steps
        self.num_block_groups = num_block_groups
        self.lisa_layers_attribute = lisa_layers_attribute
        self.update_ratio = update_ratio
        self.prefix = prefix
        self.plateau_count = 0
        self.plateau_warnings = 0
        self.last_grad_norm: Optional[float] = None
        self.index: Optional[BlockIndex] = None  # the model's block index, read at train begin
        self._groups: list[tuple[str, list[tuple[str, torch.nn.Parameter]]]] = []
        self._block_params: list[list[torch.nn.Parameter]] = []
        self._snapshot: Optional[dict[str, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = None
        self._snapshot_hook = None  # with AdamW stepping in backward: the hook that fills the snapshot
        self._pending: dict[str, float] = {}
        self._stepping = False  # the optimizer steps in the backward pass (its hooks measure the gradient norm)

    # -- wiring --------------------------------------------------------------------------------------------------------
    def attach(self, trainer) -> "TrainingMonitorCallback":
        """Add this callback to ``trainer`` ahead of the reporting integrations and the progress printer, so that
        they all receive its scalars."""
        from hf_lisa.trainer_callbacks.ordering import run_before_reporting_integrations

        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self)
        run_before_reporting_integrations(trainer, [self])
        return self

    # -- setup ---------------------------------------------------------------------------------------------------------
    def _build_groups(self, model) -> None:
        """Coarsen the model's block index (the groups LLRD and the LISA schedule use) into the monitored groups."""
        # a model without a recognisable block list is still monitored, as embeddings and head
        self.index = BlockIndex.of(model, self.lisa_layers_attribute, require_blocks=False)
        self._block_params = [list(block.parameters()) for _, block in self.index.blocks]
        n = self.index.num_blocks
        k = min(self.num_block_groups, n) if n else 0
        bounds = [round(i * n / k) for i in range(k + 1)] if k else []
        names = [f"blocks_{bounds[i]:02d}-{bounds[i + 1] - 1:02d}" for i in range(k)]

        def group_of_block(index: int) -> str:
            for i in range(k):
                if bounds[i] <= index < bounds[i + 1]:
                    return names[i]
            return names[-1]

        grouped: dict[str, list] = {"embeddings": [], **{name: [] for name in names}, "head": []}
        for name, p in model.named_parameters():
            block = self.index.block_of(name)
            if block is not None:
                grouped[group_of_block(block)].append((name, p))
            elif self.index.groups[name] == EMBEDDINGS_GROUP:
                grouped["embeddings"].append((name, p))
            else:
                grouped["head"].append((name, p))
        self._groups = [(g, params) for g, params in grouped.items() if params]

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if steps_in_backward(optimizer) is not None:  # no clipping etc.: the rules hf-lisa train and LisaTrainer run
            check_in_backward_arguments(args, check_optim=False)
        self.plateau_count = 0
        self._stepping = False
        if model is not None:
            self._build_groups(model)

    # -- per step ------------------------------------------------------------------------------------------------------
    def _will_log(self, args, state) -> bool:
        step = state.global_step + 1  # the step being taken; global_step increments after the optimizer step
        if args.logging_first_step and step == 1:
            return True
        every = state.logging_steps or args.logging_steps
        return bool(every) and step % max(int(every), 1) == 0

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # AdamW stepping in the backward pass (--optim_step_in_backward): copy each parameter just before its update
        stepping = steps_in_backward(optimizer)
        if stepping is None or not self.update_ratio or not self._will_log(args, state):
            return
        group_of = {id(p): group for group, params in self._groups for _, p in params}
        snapshot: dict[str, list] = {group: [] for group, _ in self._groups}

        def copy(p: torch.nn.Parameter) -> None:
            if id(p) in group_of:
                snapshot[group_of[id(p)]].append((p, _local(p.detach()).float().clone()))

        self._snapshot, self._snapshot_hook = snapshot, stepping.register_update_pre_hook(copy)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        stepping = steps_in_backward(optimizer)
        self._stepping = stepping is not None
        grads = [p.grad for _, params in self._groups for _, p in params if p.grad is not None]
        if stepping is not None:  # the gradients were applied and freed in the backward pass; the hooks measured them
            grad_norm = stepping.grad_norm()
        elif grads:
            norms = torch.stack([torch.linalg.vector_norm(_local(g).detach().float()) for g in grads])
            grad_norm = float(torch.linalg.vector_norm(norms))
        else:
            grad_norm = 0.0
        self.last_grad_norm = grad_norm
        # below the clipping threshold the applied norm is the raw norm, so a plateau is detected exactly
        self._check_plateau(grad_norm, state.global_step + 1)
        if stepping is None:
            self._snapshot = None
        if self._will_log(args, state):
            self._pending[self.prefix + "grad_norm"] = grad_norm
            self._pending[self.prefix + "grad_norm_applied"] = grad_norm
            if self.update_ratio and stepping is None:
                self._snapshot = {
                    group: [(p, _local(p.detach()).float().clone()) for _, p in params if p.grad is not None]
                    for group, params in self._groups
                }

    def _check_plateau(self, grad_norm: float, step: int) -> None:
        if math.isfinite(grad_norm) and grad_norm < self.plateau_grad_norm:
            self.plateau_count += 1
            if self.plateau_count == self.plateau_steps:
                self.plateau_warnings += 1
                message = (
                    f"The global gradient norm has stayed below {self.plateau_grad_norm:g} for {self.plateau_steps} "
                    f"steps (now {grad_norm:.3g} at step {step}): training has plateaued, possibly in a local optimum. "
                    "Adjust the learning rate or make the data more diverse; with LISA, also check that the active "
                    "blocks receive gradients."
                )
                warnings.warn(message, GradientPlateauWarning, stacklevel=2)
                logger.warning(message)
        else:
            self.plateau_count = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._snapshot_hook is not None:
            self._snapshot_hook.remove()
            self._snapshot_hook = None
        if self._snapshot is None:
            return
        for group, params in self._groups:
            before = self._snapshot.get(group) or []
            delta_sq = weight_sq = 0.0
            for p, old in before:
                new = _local(p.detach()).float()
                delta_sq += float((new - old).pow(2).sum())
                weight_sq += float(old.pow(2).sum())
            ratio = math.sqrt(delta_sq) / math.sqrt(weight_sq) if weight_sq > 0 else 0.0
            self._pending[f"{self.prefix}update_ratio/{group}"] = ratio
        self._snapshot = None

    # -- logging -------------------------------------------------------------------------------------------------------
    def _state_values(self, model, optimizer) -> dict[str, float]:
        values: dict[str, float] = {}
        if self._block_params:
            active = sum(any(p.requires_grad for p in params) for params in self._block_params)
            values[self.prefix + "active_blocks"] = float(active)
        if model is not None:
            seen, trainable = set(), 0
            for p in model.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    trainable += p.numel()
            values[self.prefix + "trainable_params"] = float(trainable)
        if optimizer is not None:
            from hf_lisa.optim.state import optimizer_state_bytes

            values[self.prefix + "optimizer_state_bytes"] = float(optimizer_state_bytes(optimizer))
        return values

    def on_log(self, args, state, control, logs=None, model=None, optimizer=None, **kwargs):
        if logs is None or "loss" not in logs:  # training logs only, not evaluation or the final summary
            return
        values = {**self._pending, **self._state_values(model, optimizer)}
        if self._stepping and self.last_grad_norm is not None:
            # stepped in the backward pass: a plain Trainer measures a norm over gradients that are gone (0.0); the
            # logged value is the norm the optimizer's hooks measured (LisaTrainer logs that one itself)
            values["grad_norm"] = values[self.prefix + "grad_norm"] = self.last_grad_norm
        elif isinstance(logs.get("grad_norm"), (int, float)):
            values[self.prefix + "grad_norm"] = float(logs["grad_norm"])  # before clipping, as the Trainer measured
        self._pending = {}
        logs.update(values)
        # Trainer.log appended a copy of `logs` to log_history just before this event: keep them in step
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
