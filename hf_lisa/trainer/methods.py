"""One call that sets a model up for any training method of the registry (:mod:`hf_lisa.methods`), as ``hf-lisa train``
does: full-parameter LISA gets ``LisaCallback``, a LISA adapter ``LisaConfig`` + ``LisaAdapterCallback``, LoRA and DoRA
PEFT's ``LoraConfig``, full fine-tuning nothing. The command builds its methods through :func:`setup_method`, so a
benchmark or your own script that calls it trains what the command trains.

Example:
    ```py
    >>> from hf_lisa.trainer.methods import setup_method
    >>> model, callbacks = setup_method(model, "lisa", seed=0, lisa_activated_layers=2)  # doctest: +SKIP
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)  # doctest: +SKIP
    ```
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ..methods import LORA_CONFIG_NAMES, get_method, method_defaults, schedules_anything
from ..tuner.config import LisaConfig, lisa_config_fields

__all__ = ["SCHEDULE_SETTINGS", "method_settings", "peft_task_type", "setup_method"]

#: the LisaConfig settings of the layer schedule, which full-parameter LISA runs through ``LisaCallback``
SCHEDULE_SETTINGS = ("lisa_activated_layers", "lisa_interval_steps", "lisa_sampling", "lisa_layers_attribute")

#: PEFT task types by the model class's head suffix; any other model is wrapped as a causal LM
_TASK_TYPES = {"ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS",
               "ForQuestionAnswering": "QUESTION_ANS"}


def peft_task_type(model: nn.Module) -> str:
    """PEFT's ``task_type`` for ``model``: ``SEQ_CLS`` for a ``*ForSequenceClassification`` (PEFT then trains and saves
    its ``score``/``classifier`` head in full), ``TOKEN_CLS``, ``QUESTION_ANS``, else ``CAUSAL_LM``."""
    name = type(model).__name__
    return next((task for suffix, task in _TASK_TYPES.items() if name.endswith(suffix)), "CAUSAL_LM")


def method_settings(method: str) -> frozenset[str]:
    """The ``LisaConfig`` settings that ``method`` uses: every one for a LISA adapter, the layer schedule's for
    full-parameter LISA, the ones ``LoraConfig`` shares for LoRA and DoRA, none for full fine-tuning."""
    spec = get_method(method)
    if spec.is_lisa_adapter:
        return frozenset(f.name for f in lisa_config_fields())
    if spec.samples_base_blocks:
        return frozenset(SCHEDULE_SETTINGS)
    if spec.is_adapter:
        return frozenset(LORA_CONFIG_NAMES)
    return frozenset()


def setup_method(
    model: nn.Module,
    method: str,
    *,
    seed: int,
    lisa_always_trainable: Optional[Sequence[str]] = None,
    lisa_optimizer_state_policy: str = "drop",
    **settings: Any,
) -> tuple[nn.Module, list]:
    """Wrap ``model`` for ``method`` and return ``(model, the callbacks to give the Trainer)``.

    Args:
        model: a transformers model (a ``*ForSequenceClassification`` gets PEFT's ``SEQ_CLS`` task type).
        method: a name of :data:`hf_lisa.methods.METHODS` (``lisa``, ``lisa-adapter``, ``lora``, ``dora``, ``full``).
        seed: the layer sampling's seed.
        lisa_always_trainable: full-parameter LISA's modules that train throughout (``None``: ``LisaCallback``'s
            default, embeddings, head and final norm; ``()``: only the sampled blocks).
        lisa_optimizer_state_policy: ``"drop"`` or ``"keep"`` the optimizer state of blocks that leave the active set.
        **settings: ``LisaConfig`` settings, by their names (``lisa_activated_layers``, ``r``, ``lisa_alpha``,
            ``target_modules``, ``sparsity``, ...). A setting not given takes the method's default, as in
            ``hf-lisa train``: γ = 2 for full-parameter LISA and 0 for the adapter form, all linear layers and
            ``lisa_alpha = 2·r`` for LoRA and DoRA; the rest ``LisaConfig``'s.

    Raises:
        TypeError: a setting that ``method`` does not use (:func:`method_settings`), named with what it uses.
        ValueError: an unknown method, or a value ``LisaConfig`` refuses.
    """
    spec = get_method(method)
    unused = sorted(set(settings) - method_settings(method))
    if unused:
        raise TypeError(f"setup_method({method!r}): {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not "
                        f"used by method {method!r}; it uses: {', '.join(sorted(method_settings(method))) or 'none'}.")
    if lisa_always_trainable is not None and not spec.samples_base_blocks:
        raise TypeError(f"setup_method({method!r}): lisa_always_trainable is used by full-parameter LISA only.")
    if not spec.samples_layers and lisa_optimizer_state_policy != "drop":
        raise TypeError(f"setup_method({method!r}): lisa_optimizer_state_policy is used by the LISA methods only.")
    for name, default in method_defaults(method).items():
        if settings.get(name) is None:
            settings[name] = list(default) if isinstance(default, (list, tuple)) else default
    if settings.get("target_modules") == ["all-linear"]:  # the command line's list form of PEFT's keyword string
        settings["target_modules"] = "all-linear"
    per_rank = spec.alpha_per_rank
    if per_rank is not None and "lisa_alpha" not in settings:
        settings["lisa_alpha"] = per_rank * settings.get("r", LisaConfig.__dataclass_fields__["r"].default)

    if spec.samples_base_blocks:
        from ..trainer_callbacks import LisaCallback

        defaults = LisaConfig.__dataclass_fields__
        schedule = {name: settings.get(name, defaults[name].default) for name in SCHEDULE_SETTINGS}
        always = {} if lisa_always_trainable is None else {"lisa_always_trainable": tuple(lisa_always_trainable)}
        return model, [LisaCallback(seed=seed, lisa_optimizer_state_policy=lisa_optimizer_state_policy, **always,
                                    **schedule)]
    if not spec.is_adapter:
        return model, []

    from peft import get_peft_model

    if spec.is_lisa_adapter:
        from ..trainer_callbacks import LisaAdapterCallback

        config = LisaConfig(task_type=peft_task_type(model), **settings)
        peft_model = get_peft_model(model, config)
        if not schedules_anything(config):
            # γ = 0, ρ = 0, no interpolation: the same update as LoRA, nothing for a schedule to do (no callback, so
            # no "nothing to schedule" warning)
            return peft_model, []
        return peft_model, [LisaAdapterCallback(seed=seed, lisa_optimizer_state_policy=lisa_optimizer_state_policy)]

    from peft import LoraConfig

    lora = {LORA_CONFIG_NAMES[name]: value for name, value in settings.items()}
    return get_peft_model(model, LoraConfig(task_type=peft_task_type(model), use_dora=spec.use_dora, **lora)), []
