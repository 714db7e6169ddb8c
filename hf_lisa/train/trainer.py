"""The ``Trainer`` every method runs on: transformers' own, with optional layer-wise learning-rate decay."""

from __future__ import annotations

from typing import Optional

from transformers import Trainer


class LisaTrainer(Trainer):
    """``transformers.Trainer`` with optional layer-wise learning-rate decay (see [`hf_lisa.scheduler.param_groups`]).

    The optimizer is built, as the Trainer's own, over every parameter that requires a gradient when training
    starts, i.e. before the LISA callbacks freeze anything: every candidate block has its parameter group. With
    ``layerwise_lr_decay=1.0`` (the default) it is exactly ``transformers.Trainer``.

    Args:
        layerwise_lr_decay: LR multiplier per block below the top (1.0 = off).
        layers_attribute: dotted path of the block list, when auto-detection cannot find it.
    """

    def __init__(self, *args, layerwise_lr_decay: float = 1.0, layers_attribute: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.layerwise_lr_decay = layerwise_lr_decay
        self.layers_attribute = layers_attribute

    def create_optimizer(self, model=None):
        if self.layerwise_lr_decay >= 1.0 or self.optimizer is not None:
            return super().create_optimizer(model)
        from ..scheduler.param_groups import layerwise_lr_decay_param_groups

        opt_model = self.model if model is None else model
        groups = layerwise_lr_decay_param_groups(
            opt_model,
            lr=self.args.learning_rate,
            decay=self.layerwise_lr_decay,
            weight_decay=self.args.weight_decay,
            no_decay_names=set(n for n, _ in opt_model.named_parameters())
            - set(self.get_decay_parameter_names(opt_model)),
            layers_attribute=self.layers_attribute,
        )
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs.pop("lr", None)  # each group carries its own rate
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer
