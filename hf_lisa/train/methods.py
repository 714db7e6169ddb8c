"""Load the model and wrap it for the chosen ``--method`` (lisa, lisa-adapter, lora, dora, full), and the table of
which option each method uses (:data:`OPTION_METHODS`), from which options a method does not use are refused.

A new method: add it to ``METHODS`` (``arguments.py``), to the methods of the options it uses in
:data:`OPTION_METHODS`, and a branch to :func:`apply_method`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from .arguments import (
    ADAPTER_METHODS,
    LISA_CONFIG_OPTIONS,
    METHODS,
    LisaArguments,
    ModelArguments,
    lisa_config_kwargs,
)
from .memory import STEP_IN_BACKWARD_METHODS
from .quantization import bnb_config
from ..tuner.config import FULL_LISA_ACTIVATED_LAYERS, LisaConfig

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


# ----------------------------------------------------------------------------------------------------------------------
# Which option applies to which method: the one table, and the one cross-check made from it
# ----------------------------------------------------------------------------------------------------------------------
#: LisaConfig settings that PEFT's LoraConfig has too, and their names there: what --method lora / dora use
LORA_CONFIG_NAMES = {
    "r": "r",
    "lisa_alpha": "lora_alpha",
    "lisa_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
    "layers_to_transform": "layers_to_transform",
    "layers_pattern": "layers_pattern",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
}
_LAYERWISE = ("lisa", "lisa-adapter")

#: option -> the methods that use it. An option is *given* when its value differs from its default, whether it comes
#: from the command line, a config file or Python; a given option that the method does not use is refused.
OPTION_METHODS: dict[str, tuple[str, ...]] = {
    # every LisaConfig setting configures a LISA adapter; the ones LoraConfig shares configure LoRA and DoRA too
    **{
        name: ADAPTER_METHODS if name in LORA_CONFIG_NAMES else ("lisa-adapter",)
        for name in LISA_CONFIG_OPTIONS
    },
    # the layer schedule: both LISA forms (full-parameter LISA runs it through LisaCallback)
    "lisa_activated_layers": _LAYERWISE,
    "lisa_interval_steps": _LAYERWISE,
    "lisa_sampling": _LAYERWISE,
    "lisa_optimizer_state_policy": _LAYERWISE,
    "lisa_always_trainable": ("lisa",),
    # every method finds the block list: monitoring and layer-wise LR decay use it too
    "lisa_layers_attribute": METHODS,
    **dict.fromkeys(
        ("layerwise_lr_decay", "monitor_plateau_grad_norm", "monitor_plateau_steps", "monitor_block_groups",
         "ddp_comm_hook", "powersgd_rank", "powersgd_start_iter", "push_mode"),
        METHODS,
    ),
    # AdamW stepped in the backward pass: the full-parameter methods (hf_lisa.train.memory)
    "optim_step_in_backward": STEP_IN_BACKWARD_METHODS,
    "cpu_allocator": METHODS,
    "optim_8bit_embeddings": METHODS,
    "chunked_loss": METHODS,
}


def method_defaults(method: str) -> dict[str, Any]:
    """The defaults of the settings whose default depends on the method, from the Python API they match:
    ``--method lisa`` takes ``LisaCallback``'s γ (:data:`~hf_lisa.tuner.config.FULL_LISA_ACTIVATED_LAYERS`),
    ``--method lisa-adapter`` ``LisaConfig``'s."""
    if method == "lisa":
        return {"lisa_activated_layers": FULL_LISA_ACTIVATED_LAYERS}
    if method == "lisa-adapter":
        return {"lisa_activated_layers": LisaConfig.__dataclass_fields__["lisa_activated_layers"].default}
    return {}


def resolve_method_defaults(lisa_args) -> None:
    """Fill the settings left unset (``None``) with :func:`method_defaults` of ``lisa_args.method``."""
    for name, default in method_defaults(lisa_args.method).items():
        if getattr(lisa_args, name) is None:
            setattr(lisa_args, name, default)


def given_options(lisa_args) -> dict[str, Any]:
    """The options of ``lisa_args`` (``method`` aside) whose value differs from their default.

    A setting whose default depends on the method (γ: 2 for ``lisa``, 0 for ``lisa-adapter``) is not given at any of
    those defaults, so that a config file shared by several methods may state them."""
    per_method = [method_defaults(method) for method in METHODS]
    given = {}
    for f in dataclasses.fields(lisa_args):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        defaults = [default, *(d[f.name] for d in per_method if f.name in d)]
        value = getattr(lisa_args, f.name)
        if f.name != "method" and value not in defaults:
            given[f.name] = value
    return given


def check_method_options(lisa_args) -> None:
    """Refuse the given options that ``lisa_args.method`` does not use, naming them, the method and what it uses."""
    method = lisa_args.method
    refused = {name: value for name, value in given_options(lisa_args).items() if method not in OPTION_METHODS[name]}
    if not refused:
        return
    listed = ", ".join(f"--{name}={value!r} (used by {', '.join(OPTION_METHODS[name])})" for name, value in
                       refused.items())
    own = [f"--{name}" for name, methods in OPTION_METHODS.items() if method in methods and methods != METHODS]
    uses = f"its own options are {', '.join(own)}" if own else "it has no options of its own"
    raise ValueError(
        f"--method {method} does not use {listed}; {uses}, besides those every method takes. Remove the option(s), "
        "or choose a method that uses them."
    )



#: the summary's names of the schedule settings (``training_summary.json`` and the model card read these)
_SUMMARY_NAMES = {
    "lisa_activated_layers": "activated_layers",
    "lisa_interval_steps": "interval_steps",
    "lisa_sampling": "sampling",
    "lisa_layers_attribute": "layers_attribute",
    "lisa_optimizer_state_policy": "optimizer_state_policy",
    "lisa_always_trainable": "always_trainable",
}


def _always_trainable(lisa_args: LisaArguments) -> list[str]:
    return [v for v in (lisa_args.lisa_always_trainable or []) if v.lower() != "none"]


def lisa_knobs(lisa_args: LisaArguments) -> dict:
    """The settings the method used, as recorded in ``training_summary.json`` (``lisa`` key)."""
    settings = {
        **lisa_config_kwargs(lisa_args),
        "lisa_always_trainable": _always_trainable(lisa_args),
        "lisa_optimizer_state_policy": lisa_args.lisa_optimizer_state_policy,
        "layerwise_lr_decay": lisa_args.layerwise_lr_decay,
    }
    return {
        _SUMMARY_NAMES.get(name, name): value
        for name, value in settings.items()
        if lisa_args.method in OPTION_METHODS[name]
    }


def apply_method(model: nn.Module, lisa_args: LisaArguments, seed: int):
    """Wrap ``model`` for ``lisa_args.method`` and return ``(model, scheduling callbacks)``.

    The LISA settings go in whole: to a ``LisaConfig`` for ``lisa-adapter``, the layer schedule to ``LisaCallback``
    for full-parameter ``lisa``, and the ones ``LoraConfig`` shares (:data:`LORA_CONFIG_NAMES`) to LoRA / DoRA.
    """
    method = lisa_args.method
    settings = lisa_config_kwargs(lisa_args)
    if method == "full":
        return model, []
    if method == "lisa":
        from hf_lisa.trainer_callbacks import LisaCallback

        callback = LisaCallback(
            activated_layers=settings["lisa_activated_layers"],
            interval_steps=settings["lisa_interval_steps"],
            sampling=settings["lisa_sampling"],
            seed=seed,
            always_trainable=tuple(_always_trainable(lisa_args)),
            optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
            layers_attribute=settings["lisa_layers_attribute"],
        )
        return model, [callback]

    from peft import get_peft_model

    if method == "lisa-adapter":
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        from ..tuner.config import LisaConfig

        peft_model = get_peft_model(model, LisaConfig(task_type="CAUSAL_LM", **settings))
        callback = LisaAdapterCallback(seed=seed, optimizer_state_policy=lisa_args.lisa_optimizer_state_policy)
        return peft_model, [callback]

    from peft import LoraConfig

    lora = {LORA_CONFIG_NAMES[name]: value for name, value in settings.items() if name in LORA_CONFIG_NAMES}
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", use_dora=method == "dora", **lora)), []
