"""Tiny models built from config, shared by the tests. Seeds are fixed so every call builds the same weights."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)


def tiny_llama(num_layers: int = 3, seed: int = 0, hidden: int = 32, vocab: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(num_layers: int = 2, seed: int = 0, tie_word_embeddings: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_embd=32, n_layer=num_layers, n_head=4, n_positions=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_bert(num_layers: int = 2, seed: int = 0, num_labels: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=64,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(config).eval()


def tiny_t5(seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4)
    return T5ForConditionalGeneration(config).eval()


def randomize_adapters(model, seed: int = 1, std: float = 0.1) -> None:
    """Give every adapter parameter non-zero values so that adapters visibly change outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lisa_" in name or "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def randomize_masks_and_interpolation(model, seed: int = 123) -> None:
    """Give every sparse LISA layer a random mask of its structure, and interpolation scalars non-trivial values, so
    that a reloaded adapter can only match if masks and α/β were restored (a fresh injection computes other ones)."""
    from hf_lisa.tuner import masks as M
    from hf_lisa.tuner.layer import LisaLayer

    gen = torch.Generator().manual_seed(seed)
    for layer in model.modules():
        if isinstance(layer, LisaLayer) and "default" in layer.lisa_mask:
            spec = layer.lisa_mask_spec["default"]
            scores = torch.rand(layer.out_features, layer.in_features, generator=gen)
            layer.set_mask(
                "default", M.select_mask(scores, spec["structure"], spec["sparsity"], spec["block_size"], spec["n_m"])
            )
    tuner = model.base_model
    if "default" in getattr(tuner, "lisa_interp_delta", {}):
        n = tuner.lisa_interp_delta["default"].numel()
        with torch.no_grad():
            tuner.lisa_interp_delta["default"].copy_(torch.linspace(-0.4, 0.3, n))
            tuner.lisa_interp_beta["default"].copy_(torch.linspace(0.5, -0.5, n))
