"""``LisaTrainingArguments``: transformers' ``TrainingArguments`` with :class:`~hf_lisa.trainer.LisaTrainer`'s own
settings as typed fields, checked once, in ``__post_init__``.

The same fields are ``hf-lisa train`` options (its arguments class subclasses this one), TRL's configs take them
through :class:`~hf_lisa.trainer.trl.LisaSFTConfig` / :class:`~hf_lisa.trainer.trl.LisaDPOConfig`, and a plain
``TrainingArguments`` gives ``LisaTrainer`` their defaults.

Example:
    ```py
    >>> from hf_lisa.trainer import LisaTrainingArguments
    >>> args = LisaTrainingArguments("out", layerwise_lr_decay=0.9, chunked_loss=False, report_to="none")
    >>> args.layerwise_lr_decay, args.progress_check_steps
    (0.9, 3)
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from transformers import TrainingArguments

from ..optim.memory import CPU_ALLOCATORS, MEMORY_HELP

__all__ = ["LisaTrainingArguments", "TRAINER_OPTIONS", "check_trainer_options"]

#: ``LisaTrainer``'s own settings, with their defaults (the fields :class:`LisaTrainingArguments` adds)
TRAINER_OPTIONS: dict[str, Any] = {
    "layerwise_lr_decay": 1.0,
    "optim_step_in_backward": False,
    "optim_8bit_embeddings": False,
    "cpu_allocator": "default",
    "chunked_loss": True,
    "progress_check_steps": 3,
}


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


#: the rule of each setting: ``(test, what is allowed)``
_RULES = {
    "layerwise_lr_decay": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0,
                           "a float in (0, 1] (1 disables)"),
    "optim_step_in_backward": (_is_bool, "true or false"),
    "optim_8bit_embeddings": (_is_bool, "true or false"),
    "cpu_allocator": (lambda v: v in CPU_ALLOCATORS, ", ".join(CPU_ALLOCATORS)),
    "chunked_loss": (_is_bool, "true or false"),
    "progress_check_steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                             "an integer >= 0 (0 turns the guard off)"),
}


def check_trainer_options(values: Mapping[str, Any], *, prefix: str = "", error: type = ValueError) -> None:
    """Raise ``error`` naming the first of ``values`` (keyed by :data:`TRAINER_OPTIONS` names) that breaks its rule:
    the setting as ``prefix + name``, the value and what is allowed."""
    for name, value in values.items():
        test, allowed = _RULES[name]
        if not test(value):
            raise error(f"{prefix}{name}={value!r} is invalid; allowed: {allowed}.")


@dataclass
class LisaTrainingArguments(TrainingArguments):
    """transformers' ``TrainingArguments`` with the settings :class:`~hf_lisa.trainer.LisaTrainer` adds.

    Args:
        layerwise_lr_decay (`float`, defaults to `1.0`): layer-wise learning-rate decay ``d`` in ``(0, 1]``: block
            ``l`` of ``N`` trains at ``lr * d^(N-1-l)``, the embeddings at ``lr * d^N``; 1 disables.
        optim_step_in_backward (`bool`, defaults to `False`): AdamW stepped inside the backward pass, each gradient
            freed at once (:mod:`hf_lisa.optim.memory`).
        optim_8bit_embeddings (`bool`, defaults to `False`): with a bitsandbytes 8-bit ``optim``, the embeddings'
            state in 8 bits too.
        cpu_allocator (`str`, defaults to `"default"`): ``"default"``, ``"trim"`` or ``"lean"`` (CPU with glibc).
        chunked_loss (`bool`, defaults to `True`): the causal-LM loss a few hundred tokens at a time.
        progress_check_steps (`int`, defaults to `3`): a run whose first this many optimizer steps (and the first
            after each evaluation) train nothing stops with ``NothingTrainedError``; 0 turns the guard off.
    """

    layerwise_lr_decay: float = field(default=1.0, metadata={"help": MEMORY_HELP["layerwise_lr_decay"]})
    optim_step_in_backward: bool = field(default=False, metadata={"help": MEMORY_HELP["optim_step_in_backward"]})
    optim_8bit_embeddings: bool = field(default=False, metadata={"help": MEMORY_HELP["optim_8bit_embeddings"]})
    cpu_allocator: str = field(default="default", metadata={"help": MEMORY_HELP["cpu_allocator"]})
    chunked_loss: bool = field(default=True, metadata={"help": MEMORY_HELP["chunked_loss"]})
    progress_check_steps: int = field(default=3, metadata={"help": MEMORY_HELP["progress_check_steps"]})

    #: how the settings are named in messages, and what is raised (``hf-lisa train``: ``--`` and ``UsageError``)
    _option_prefix = ""
    _option_error = ValueError

    def __post_init__(self) -> None:
        super().__post_init__()
        check_trainer_options({name: getattr(self, name) for name in TRAINER_OPTIONS},
                              prefix=self._option_prefix or f"{type(self).__name__}: ", error=self._option_error)
