"""Load the model and wrap it for the chosen ``--method``, as the registry (:mod:`hf_lisa.methods`) describes it:
full-parameter LISA gets ``LisaCallback``, a LISA adapter ``LisaConfig`` + ``LisaAdapterCallback``, a LoRA-type
adapter PEFT's ``LoraConfig``, and a method that trains the base weights without a schedule nothing. Which option
each method uses is :data:`hf_lisa.train.parsing.options.OPTION_METHODS`."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..methods import get_method, schedules_anything
from .parsing.arguments import LisaArguments, ModelArguments, lisa_config_kwargs
from .parsing.options import LORA_CONFIG_NAMES, uses
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = model_args.torch_dtype if model_args.torch_dtype == "auto" else getattr(torch, model_args.torch_dtype)
    kwargs = dict(
        revision=model_args.model_revision,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, **kwargs)
    quantization = bnb_config(model_args)  # --load_in_4bit / --load_in_8bit, else None
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=model_args.attn_implementation, **kwargs
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"The tokenizer of {path!r} has neither a pad nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


#: PEFT task types by the model class's head suffix; any other model is wrapped as a causal LM
_TASK_TYPES = {"ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS",
               "ForQuestionAnswering": "QUESTION_ANS"}


def peft_task_type(model) -> str:
    """PEFT's ``task_type`` for ``model``: ``SEQ_CLS`` for a ``*ForSequenceClassification`` (PEFT then trains and saves
    its ``score``/``classifier`` head in full), ``TOKEN_CLS``, ``QUESTION_ANS``, else ``CAUSAL_LM``."""
    name = type(model).__name__
    return next((task for suffix, task in _TASK_TYPES.items() if name.endswith(suffix)), "CAUSAL_LM")


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
    """Wrap ``model`` for ``lisa_args.method`` and return ``(model, scheduling callbacks)``.

    The LISA settings go in whole: to a ``LisaConfig`` for ``lisa-adapter``, the layer schedule to ``LisaCallback``
    for full-parameter ``lisa``, and the ones ``LoraConfig`` shares (:data:`LORA_CONFIG_NAMES`) to LoRA / DoRA.
    """
    method = get_method(lisa_args.method)
    settings = lisa_config_kwargs(lisa_args)
    if method.samples_base_blocks:
        from hf_lisa.trainer_callbacks import LisaCallback

        callback = LisaCallback(
            lisa_activated_layers=settings["lisa_activated_layers"],
            lisa_interval_steps=settings["lisa_interval_steps"],
            lisa_sampling=settings["lisa_sampling"],
            seed=seed,
            lisa_always_trainable=tuple(_always_trainable(lisa_args)),
            lisa_optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
            lisa_layers_attribute=settings["lisa_layers_attribute"],
        )
        return model, [callback]
    if not method.is_adapter:
        return model, []

    from peft import get_peft_model

    if method.is_lisa_adapter:
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        from ..tuner.config import LisaConfig

        config = LisaConfig(task_type=peft_task_type(model), **settings)
        peft_model = get_peft_model(model, config)
        if not schedules_anything(config):
            # γ = 0, ρ = 0, no interpolation: the same update as LoRA, nothing for the schedule to do; the start line
            # and the card say so (no callback, so no "nothing to schedule" warning a CLI user cannot act on)
            return peft_model, []
        callback = LisaAdapterCallback(seed=seed, lisa_optimizer_state_policy=lisa_args.lisa_optimizer_state_policy)
        return peft_model, [callback]

    from peft import LoraConfig

    lora = {LORA_CONFIG_NAMES[name]: value for name, value in settings.items() if name in LORA_CONFIG_NAMES}
    return get_peft_model(model, LoraConfig(task_type=peft_task_type(model), use_dora=method.use_dora, **lora)), []
