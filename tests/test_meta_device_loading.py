"""Sparse LISA adapters created on the meta device: ``low_cpu_mem_usage=True`` loading and PEFT's dtype autocast.

With ``low_cpu_mem_usage=True`` PEFT builds the adapter weights on the meta device and lets the state dict load assign
the real tensors. A LISA mask is a packed ``uint8`` buffer: it must be created as an empty placeholder of the saved
shape and filled by that load, never computed from (or copied out of) meta tensors.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_lisa  # noqa: F401  (registers LISA)
from hf_lisa import LisaConfig
from hf_lisa.tuner.layer import LisaLayer
from tiny_models import randomize_adapters, randomize_masks_and_interpolation, tiny_llama

IDS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])

SPARSE = {
    "block": {"sparsity": 0.5, "mask_init": "magnitude"},
    "n:m": {"sparsity": 0.5, "sparsity_structure": "n:m", "mask_init": "random"},
    "unstructured": {"sparsity": 0.3, "sparsity_structure": "unstructured"},  # importance: magnitude until trained
}
CASES = {
    **SPARSE,
    "dense": {},
    "block+interpolation": {**SPARSE["block"], "layer_interpolation": True},
}


def logits(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _lisa_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LisaLayer)}


def _save_trained_adapter(base_dir, adapter_dir, dtype=torch.float32, **config_kwargs):
    """An adapter whose masks differ from the provisional mask a fresh injection would compute.

    Its weights are saved in the base dtype: PEFT's low_cpu_mem_usage load moves the assigned weights to the base
    layer's dtype before autocasting them back to fp32 (LoRA too), so only weights that bf16 holds exactly can reload
    bit for bit on both paths.
    """
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    model = get_peft_model(base, LisaConfig(r=4, **config_kwargs), autocast_adapter_dtype=False)
    randomize_adapters(model)
    randomize_masks_and_interpolation(model, seed=321)
    model.save_pretrained(adapter_dir)


@pytest.fixture
def base_dir(tmp_path):
    path = tmp_path / "base"
    tiny_llama().save_pretrained(path)
    return path


def _assert_no_meta_and_same_masks(model, reference):
    assert not [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    layers, ref_layers = _lisa_layers(model), _lisa_layers(reference)
    for name, layer in layers.items():
        mask, ref_mask = layer.get_mask("default"), ref_layers[name].get_mask("default")
        assert (mask is None) == (ref_mask is None), name
        if mask is not None:
            assert torch.equal(mask, ref_mask), name


@pytest.mark.parametrize("case", list(CASES))
def test_low_cpu_mem_usage_load_equals_normal_load(base_dir, tmp_path, case):
    adapter_dir = tmp_path / "adapter"
    _save_trained_adapter(base_dir, adapter_dir, **CASES[case])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    expected = logits(reference)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir,
                                      low_cpu_mem_usage=True)
    assert torch.equal(logits(model), expected)
    _assert_no_meta_and_same_masks(model, reference)

    # a second adapter through PeftModel.load_adapter takes the same meta path
    if not CASES[case].get("layer_interpolation"):
        model.load_adapter(adapter_dir, adapter_name="again", low_cpu_mem_usage=True)
        model.set_adapter("again")
        assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
@pytest.mark.parametrize("case", list(SPARSE))
def test_low_cpu_mem_usage_load_with_dtype_autocast_equals_normal_load(base_dir, tmp_path, case,
                                                                        autocast_adapter_dtype):
    adapter_dir = tmp_path / "adapter"
    _save_trained_adapter(base_dir, adapter_dir, dtype=torch.bfloat16, **SPARSE[case])

    def load(low_cpu_mem_usage):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
        return PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=autocast_adapter_dtype,
                                         low_cpu_mem_usage=low_cpu_mem_usage)

    reference, model = load(False), load(True)
    assert torch.equal(logits(model), logits(reference))
    _assert_no_meta_and_same_masks(model, reference)
    expected_dtype = torch.float32 if autocast_adapter_dtype else torch.bfloat16
    for layer in _lisa_layers(model).values():
        assert layer.lisa_A["default"].weight.dtype == layer.lisa_B["default"].weight.dtype == expected_dtype
        assert layer.lisa_mask["default"].dtype == torch.uint8


def test_meta_initialised_mask_placeholder_has_the_saved_packed_shape():
    """The placeholder must match the checkpoint's shape, or PEFT reports the mask as mismatched and drops it."""
    reference = get_peft_model(tiny_llama(), LisaConfig(r=4, **SPARSE["block"]))
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, **SPARSE["block"]), low_cpu_mem_usage=True)
    ref_layers = _lisa_layers(reference)
    for name, layer in _lisa_layers(model).items():
        placeholder = layer.lisa_mask["default"]
        assert placeholder.is_meta and placeholder.dtype == torch.uint8
        assert placeholder.shape == ref_layers[name].lisa_mask["default"].shape


def test_unfilled_placeholder_gets_the_provisional_mask_once_real_weights_arrive():
    """A placeholder that no state dict filled is computed on first use, as the injection would have done."""
    reference = get_peft_model(tiny_llama(), LisaConfig(r=4, **SPARSE["block"]))
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, **SPARSE["block"]), low_cpu_mem_usage=True)
    assert all(layer.get_mask("default").is_meta for layer in _lisa_layers(model).values())
    # real A and B arrive (e.g. a state dict saved without masks); the masks do not
    weights = {k: v for k, v in reference.state_dict().items() if ".lisa_A." in k or ".lisa_B." in k}
    model.load_state_dict(weights, strict=False, assign=True)
    ref_layers = _lisa_layers(reference)
    for name, layer in _lisa_layers(model).items():
        assert torch.equal(layer.get_mask("default"), ref_layers[name].get_mask("default")), name
    assert torch.equal(logits(model), logits(reference))
