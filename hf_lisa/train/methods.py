"""Load the model and wrap it for the chosen ``--method`` (lisa, lisa-adapter, lora, dora, full)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .arguments import ADAPTER_METHODS, LisaArguments, ModelArguments, _json_pattern

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


def lisa_knobs(lisa_args: LisaArguments) -> dict:
    """The method's knobs as recorded in ``training_summary.json`` (``lisa`` key)."""
    knobs: dict[str, Any] = {}
    if lisa_args.method in ("lisa", "lisa-adapter"):
        knobs.update(
            activated_layers=lisa_args.lisa_activated_layers,
            interval_steps=lisa_args.lisa_interval_steps,
            sampling=lisa_args.lisa_sampling,
            layers_attribute=lisa_args.lisa_layers_attribute,
            optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
        )
    if lisa_args.method == "lisa":
        knobs["always_trainable"] = _always_trainable(lisa_args)
    if lisa_args.method in ADAPTER_METHODS:
        knobs.update(
            r=lisa_args.r, lisa_alpha=lisa_args.lisa_alpha, lisa_dropout=lisa_args.lisa_dropout,
            target_modules=lisa_args.target_modules,
            rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
            alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
        )
    if lisa_args.method == "lisa-adapter":
        knobs.update(
            sparsity=lisa_args.sparsity, sparsity_structure=lisa_args.sparsity_structure,
            block_size=lisa_args.block_size, n_m=lisa_args.n_m, mask_init=lisa_args.mask_init,
            mask_update_interval=lisa_args.mask_update_interval, importance_steps=lisa_args.importance_steps,
            sparsity_pattern=_json_pattern(lisa_args.sparsity_pattern, "sparsity_pattern"),
            layer_interpolation=lisa_args.layer_interpolation, interpolation_beta_l2=lisa_args.interpolation_beta_l2,
        )
    knobs["layerwise_lr_decay"] = lisa_args.layerwise_lr_decay
    return knobs


def _always_trainable(lisa_args: LisaArguments) -> list[str]:
    values = [v for v in (lisa_args.lisa_always_trainable or []) if v.lower() != "none"]
    return values


def _target_modules(lisa_args: LisaArguments):
    tm = lisa_args.target_modules
    if tm and len(tm) == 1 and tm[0] == "all-linear":
        return "all-linear"
    return tm


def apply_method(model: nn.Module, lisa_args: LisaArguments, seed: int):
    """Wrap ``model`` for ``lisa_args.method`` and return ``(model, scheduling callbacks)``."""
    method = lisa_args.method
    if method == "full":
        return model, []
    if method == "lisa":
        from hf_lisa.trainer_callbacks import LisaCallback

        callback = LisaCallback(
            activated_layers=lisa_args.lisa_activated_layers,
            interval_steps=lisa_args.lisa_interval_steps,
            sampling=lisa_args.lisa_sampling,
            seed=seed,
            always_trainable=tuple(_always_trainable(lisa_args)),
            optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
            layers_attribute=lisa_args.lisa_layers_attribute,
        )
        return model, [callback]

    from peft import get_peft_model

    if method == "lisa-adapter":
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        from ..tuner.config import LisaConfig

        config = LisaConfig(
            task_type="CAUSAL_LM",
            r=lisa_args.r,
            lisa_alpha=lisa_args.lisa_alpha,
            lisa_dropout=lisa_args.lisa_dropout,
            target_modules=_target_modules(lisa_args),
            sparsity=lisa_args.sparsity,
            sparsity_structure=lisa_args.sparsity_structure,
            block_size=lisa_args.block_size,
            n_m=lisa_args.n_m,
            mask_init=lisa_args.mask_init,
            mask_update_interval=lisa_args.mask_update_interval,
            importance_steps=lisa_args.importance_steps,
            new_block_bonus=lisa_args.new_block_bonus,
            mask_keep_learned=lisa_args.mask_keep_learned,
            layer_interpolation=lisa_args.layer_interpolation,
            interpolation_beta_l2=lisa_args.interpolation_beta_l2,
            lisa_activated_layers=lisa_args.lisa_activated_layers,
            lisa_interval_steps=lisa_args.lisa_interval_steps,
            lisa_sampling=lisa_args.lisa_sampling,
            lisa_layers_attribute=lisa_args.lisa_layers_attribute,
            rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
            alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
            sparsity_pattern=_json_pattern(lisa_args.sparsity_pattern, "sparsity_pattern"),
        )
        peft_model = get_peft_model(model, config)
        callback = LisaAdapterCallback(seed=seed, optimizer_state_policy=lisa_args.lisa_optimizer_state_policy)
        return peft_model, [callback]

    from peft import LoraConfig

    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=lisa_args.r,
        lora_alpha=lisa_args.lisa_alpha,
        lora_dropout=lisa_args.lisa_dropout,
        target_modules=_target_modules(lisa_args),
        use_dora=method == "dora",
        rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
        alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
    )
    return get_peft_model(model, config), []
