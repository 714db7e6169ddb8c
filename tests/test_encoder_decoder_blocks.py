"""Encoder-decoder models: blocks are ordered encoder first, then decoder (input side to output side).

Layer-wise LR decay gives block ``l`` the rate ``lr · d^(N-1-l)``, so the order of `find_blocks` decides which blocks
train slowest: with the decoder listed first, BART's lowest encoder block got the *highest* block rate.
"""

from __future__ import annotations

import pytest
import torch

from hf_lisa.blocks import find_blocks
from hf_lisa.scheduler.param_groups import layerwise_lr_decay_param_groups


def _tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    ))


def _tiny_mbart():
    from transformers import MBartConfig, MBartForConditionalGeneration

    torch.manual_seed(0)
    return MBartForConditionalGeneration(MBartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    ))


def _tiny_bart_base():
    from transformers import BartConfig, BartModel

    torch.manual_seed(0)
    return BartModel(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    ))


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    ))


ENCODER_DECODER = [
    pytest.param(_tiny_bart, [
        "model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1",
    ], id="bart"),
    pytest.param(_tiny_mbart, [
        "model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1",
    ], id="mbart"),
    pytest.param(_tiny_bart_base, [
        "encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1",
    ], id="bart-base-model"),
    pytest.param(_tiny_t5, [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1",
    ], id="t5"),
]


@pytest.mark.parametrize("build,expected", ENCODER_DECODER)
def test_encoder_decoder_blocks_are_ordered_encoder_then_decoder(build, expected):
    assert [name for name, _ in find_blocks(build())] == expected


@pytest.mark.parametrize("build,expected", ENCODER_DECODER)
def test_encoder_decoder_llrd_rates_rise_from_first_encoder_to_last_decoder_block(build, expected):
    lr, decay = 1e-3, 0.5
    model = build()
    groups = layerwise_lr_decay_param_groups(model, lr=lr, decay=decay)
    lrs = {g["name"]: g["lr"] for g in groups}
    blocks = dict(find_blocks(model))
    # block l trains at lr · d^(N-1-l), with l counted from the first encoder block
    n = len(expected)
    assert [lrs[f"block.{i}"] for i in range(n)] == pytest.approx([lr * decay ** (n - 1 - i) for i in range(n)])
    assert lrs["embeddings"] == pytest.approx(lr * decay**n)
    # and the parameters of each named block sit in the group with the expected rate
    param_lr = {id(p): g["lr"] for g in groups for p in g["params"]}
    rates_by_name = [param_lr[id(next(blocks[name].parameters()))] for name in expected]
    assert rates_by_name == pytest.approx([lr * decay**3, lr * decay**2, lr * decay, lr])
    assert rates_by_name == sorted(rates_by_name)
