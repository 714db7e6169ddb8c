"""Loading a model as ``hf-lisa train`` does, as a library call (``hf_lisa.models``, issue 34 item 4): the model and
tokenizer, the pad token, the dtype, and the bitsandbytes base's ``BitsAndBytesConfig`` with the command's defaults."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from train_fixtures import build_tiny_lm_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_lisa.models import load_model_and_tokenizer, quantization_config
from hf_lisa.train import ModelArguments
from hf_lisa.train.quantization import bnb_config

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_lm_dir(tmp_path_factory.mktemp("tiny-lm"))


def test_the_model_loads_with_its_weights_in_the_dtype_asked(tiny_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model, tokenizer = load_model_and_tokenizer(tiny_dir, dtype="float32")
    assert tokenizer.pad_token_id == AutoTokenizer.from_pretrained(tiny_dir).pad_token_id
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    half, _ = load_model_and_tokenizer(tiny_dir, dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_a_tokenizer_without_pad_token_pads_with_eos_and_generation_learns_it(tiny_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no-pad")
    model, loaded = load_model_and_tokenizer(tiny_dir, tokenizer_name=str(tmp_path / "no-pad"))
    assert loaded.pad_token_id is not None and loaded.pad_token_id == loaded.eos_token_id
    model.generation_config.pad_token_id = None
    model.save_pretrained(tmp_path / "model")
    model, loaded = load_model_and_tokenizer(str(tmp_path / "model"), tokenizer_name=str(tmp_path / "no-pad"))
    assert model.generation_config.pad_token_id == loaded.eos_token_id


def test_a_dtype_torch_does_not_have_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match=r"dtype='float33' is not a torch dtype; allowed: 'auto' or the name of one"):
        load_model_and_tokenizer(tiny_dir, dtype="float33")
    with pytest.raises(ValueError, match=r"dtype='Tensor' is not a torch dtype"):
        load_model_and_tokenizer(tiny_dir, dtype="Tensor")  # a torch attribute, but no dtype


def test_quantization_settings_that_cannot_take_effect_are_refused():
    assert quantization_config() is None
    cases = [
        (dict(load_in_4bit=True, load_in_8bit=True), "load_in_4bit=True and load_in_8bit=True exclude each other"),
        (dict(load_in_4bit=True, quant_type="int4"), r"quant_type='int4' is invalid; allowed: nf4, fp4"),
        (dict(load_in_4bit=True, compute_dtype="float64"),
         r"compute_dtype='float64' is invalid; allowed: float32, bfloat16, float16"),
        (dict(load_in_8bit=True, quant_type="fp4"), r"quant_type='fp4' only applies with load_in_4bit=True"),
        (dict(nested_quant=True), r"nested_quant=True only applies with load_in_4bit=True"),
        (dict(quant_type="fp4", nested_quant=True),
         r"quant_type='fp4', nested_quant=True only apply with load_in_4bit=True; pass load_in_4bit=True or leave them"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            quantization_config(**kwargs)


@needs_bnb
def test_the_4bit_defaults_follow_the_dtype_and_what_is_typed_decides():
    default = quantization_config(load_in_4bit=True)
    assert default.bnb_4bit_quant_type == "nf4" and default.bnb_4bit_compute_dtype == torch.float32
    assert not default.bnb_4bit_use_double_quant
    assert quantization_config(load_in_4bit=True, dtype="bfloat16").bnb_4bit_compute_dtype == torch.bfloat16
    typed = quantization_config(load_in_4bit=True, dtype="bfloat16", compute_dtype="float32", quant_type="fp4",
                                nested_quant=True)
    assert typed.bnb_4bit_compute_dtype == torch.float32 and typed.bnb_4bit_quant_type == "fp4"
    assert typed.bnb_4bit_use_double_quant
    assert quantization_config(load_in_8bit=True).load_in_8bit


@needs_bnb
@pytest.mark.parametrize("options, expected", [
    (dict(load_in_4bit=True), ("nf4", torch.float32, False)),
    (dict(load_in_4bit=True, torch_dtype="bfloat16"), ("nf4", torch.bfloat16, False)),
    (dict(load_in_4bit=True, torch_dtype="float16", bnb_4bit_compute_dtype="float32", bnb_4bit_quant_type="fp4",
          use_bnb_nested_quant=True), ("fp4", torch.float32, True)),
    (dict(load_in_8bit=True), "8bit"),
])
def test_the_command_builds_the_config_its_options_name(options, expected):
    """``hf-lisa train --load_in_4bit ...`` hands each option to the library's ``quantization_config``."""
    config = bnb_config(ModelArguments(**options))
    if expected == "8bit":
        assert config.load_in_8bit and not config.load_in_4bit
        return
    assert config.load_in_4bit
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_compute_dtype, config.bnb_4bit_use_double_quant) == expected
