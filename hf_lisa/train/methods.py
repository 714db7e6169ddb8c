"""Load the model and wrap it for the chosen ``--method``, as the registry (:mod:`hf_lisa.methods`) describes it:
the library's :func:`hf_lisa.trainer.methods.setup_method` (``LisaCallback`` for full-parameter LISA, ``LisaConfig`` +
``LisaAdapterCallback`` for a LISA adapter, PEFT's ``LoraConfig`` for LoRA and DoRA, nothing for full fine-tuning).
Which option each method uses is :data:`hf_lisa.train.parsing.options.OPTION_METHODS`."""

from __future__ import annotations

import logging

from torch import nn

from .parsing.arguments import LisaArguments, ModelArguments, lisa_config_kwargs
from .parsing.options import uses
from .quantization import bnb_config

logger = logging.getLogger("hf_lisa.train")


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------
def resolve_model_path(model_args: ModelArguments) -> tuple[str, str]:
    """``(path to load, base model id for the card)``; converts the embedded default model on first use."""
    from ..models import DEFAULT_MODEL_ID, default_model_path, is_default_model

    if model_args.model_name_or_path is None:
        return default_model_path(), model_args.base_model_id or DEFAULT_MODEL_ID
    path = model_args.model_name_or_path
    if model_args.base_model_id:
        return path, model_args.base_model_id
    return path, DEFAULT_MODEL_ID if is_default_model(path) else path


def load_model_and_tokenizer(model_args: ModelArguments, path: str):
    """``(model, tokenizer)`` of ``path`` with the command's model options: the library's
    :func:`hf_lisa.models.load_model_and_tokenizer` (the quantization options were checked when parsed)."""
    from ..models import load_model_and_tokenizer as load

    return load(
        path, dtype=model_args.torch_dtype, quantization_config=bnb_config(model_args),
        tokenizer_name=model_args.tokenizer_name, revision=model_args.model_revision, cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code, attn_implementation=model_args.attn_implementation,
    )


def _always_trainable(lisa_args: LisaArguments) -> list[str]:
    return [v for v in (lisa_args.lisa_always_trainable or []) if v.lower() != "none"]


def lisa_knobs(lisa_args: LisaArguments) -> dict:
    """The settings the method used, as recorded in ``training_summary.json`` (``lisa`` key)."""
    settings = {
        **lisa_config_kwargs(lisa_args),
        "lisa_always_trainable": _always_trainable(lisa_args),
        "lisa_optimizer_state_policy": lisa_args.lisa_optimizer_state_policy,
    }
    return {name: value for name, value in settings.items() if uses(lisa_args.method, name)}


def apply_method(model: nn.Module, lisa_args: LisaArguments, seed: int):
    """Wrap ``model`` for ``lisa_args.method`` and return ``(model, scheduling callbacks)``: the library's
    :func:`hf_lisa.trainer.methods.setup_method`, given the LisaConfig settings the method's wrapping uses (options the
    method does not use at all were refused when the arguments were parsed; ``lisa_layers_attribute`` also serves the
    monitor and the learning-rate decay of every method)."""
    from ..trainer.methods import method_settings, setup_method

    method = lisa_args.method
    wrapping = method_settings(method)
    settings = {name: value for name, value in lisa_config_kwargs(lisa_args).items() if name in wrapping}
    extra = {}
    if uses(method, "lisa_always_trainable"):
        extra["lisa_always_trainable"] = tuple(_always_trainable(lisa_args))
    if uses(method, "lisa_optimizer_state_policy"):
        extra["lisa_optimizer_state_policy"] = lisa_args.lisa_optimizer_state_policy
    return setup_method(model, method, seed=seed, **extra, **settings)
