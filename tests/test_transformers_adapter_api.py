"""LISA adapters through transformers' adapter API (``PeftAdapterMixin``) and ``peft.inject_adapter_in_model``.

transformers' ``model.load_adapter``, ``model.add_adapter`` and ``AutoModel*.from_pretrained(adapter_dir)`` all go
through ``peft.inject_adapter_in_model``, which builds a ``LisaModel`` to inject the layers and then drops it, keeping
only the transformers model. Masks live in the layers and survive; the per-block interpolation scalars α/β live on the
dropped tuner, so an interpolation adapter must be refused there, never half-loaded.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model, inject_adapter_in_model
from transformers import AutoModelForCausalLM

import hf_lisa  # noqa: F401  (registers LISA)
from hf_lisa import LisaConfig
from hf_lisa.tuner.layer import LisaLayer
from tiny_models import randomize_adapters, randomize_masks_and_interpolation, tiny_llama

IDS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])

# dense (the LoRA path) and the three mask structures; "magnitude" and "random" masks would be recomputed identically
# by a fresh injection, so the saved masks are re-selected from other scores below: only a restored mask reproduces
CONFIGS = {
    "dense": {},
    "block": {"sparsity": 0.5, "mask_init": "magnitude"},
    "n:m": {"sparsity": 0.5, "sparsity_structure": "n:m", "mask_init": "random"},
    "unstructured": {"sparsity": 0.3, "sparsity_structure": "unstructured", "mask_init": "magnitude"},
}


def logits(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _lisa_layers(model):
    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if isinstance(m, LisaLayer)}


def _save_trained_adapter(tmp_path, **config_kwargs):
    """A base checkpoint and an adapter whose A, B, masks (and α/β) all differ from what a fresh injection makes."""
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LisaConfig(r=4, **config_kwargs))
    randomize_adapters(model)
    randomize_masks_and_interpolation(model, seed=123)
    model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir, model


def _assert_same_masks(loaded, reference, fresh):
    ref_layers, fresh_layers = _lisa_layers(reference), _lisa_layers(fresh)
    layers = _lisa_layers(loaded)
    assert layers.keys() == ref_layers.keys() and layers
    restored_differs_from_fresh = False
    for name, layer in layers.items():
        mask, ref_mask = layer.get_mask("default"), ref_layers[name].get_mask("default")
        assert (mask is None) == (ref_mask is None), name
        if mask is not None:
            assert torch.equal(mask, ref_mask), name
            restored_differs_from_fresh |= not torch.equal(mask, fresh_layers[name].get_mask("default"))
    if any(m.get_mask("default") is not None for m in layers.values()):
        assert restored_differs_from_fresh, "the saved masks must differ from a fresh injection's for this test"


# -- adapters without interpolation load through transformers ---------------------------------------------------------
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_transformers_load_adapter_restores_weights_and_masks(tmp_path, cfg):
    base_dir, adapter_dir, _ = _save_trained_adapter(tmp_path, **CONFIGS[cfg])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LisaConfig(r=4, **CONFIGS[cfg]))
    expected = logits(reference)
    assert not torch.allclose(expected, logits(AutoModelForCausalLM.from_pretrained(base_dir)), atol=1e-3)

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.load_adapter(str(adapter_dir))
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-6)
    _assert_same_masks(model, reference, fresh)


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_transformers_from_pretrained_on_adapter_dir_restores_weights_and_masks(tmp_path, cfg):
    base_dir, adapter_dir, _ = _save_trained_adapter(tmp_path, **CONFIGS[cfg])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LisaConfig(r=4, **CONFIGS[cfg]))

    model = AutoModelForCausalLM.from_pretrained(adapter_dir)  # base_model_name_or_path points at base_dir
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-6)
    _assert_same_masks(model, reference, fresh)


def test_transformers_disable_and_enable_adapters_switch_between_base_and_lisa_logits(tmp_path):
    base_dir, adapter_dir, _ = _save_trained_adapter(tmp_path, **CONFIGS["block"])
    expected = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir))
    base_logits = logits(AutoModelForCausalLM.from_pretrained(base_dir))
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.load_adapter(str(adapter_dir))
    model.disable_adapters()
    torch.testing.assert_close(logits(model), base_logits, rtol=0, atol=0)
    model.enable_adapters()
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-6)


# -- adapters with interpolation are refused, never half-loaded --------------------------------------------------------
def _assert_untouched(model, base_logits):
    assert not any(isinstance(m, LisaLayer) for m in model.modules()), "the refused adapter left LISA layers behind"
    torch.testing.assert_close(logits(model), base_logits, rtol=0, atol=0)


@pytest.fixture
def interpolation_adapter(tmp_path):
    base_dir, adapter_dir, _ = _save_trained_adapter(tmp_path, layer_interpolation=True, **CONFIGS["block"])
    peft_logits = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir))
    # the same A, B and masks without α/β: what a silent load produces, visibly different
    config = LisaConfig.from_pretrained(adapter_dir)
    config.layer_interpolation = False
    without_interp = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir,
                                               config=config)
    assert (logits(without_interp) - peft_logits).abs().max() > 0.05
    base_logits = logits(AutoModelForCausalLM.from_pretrained(base_dir))
    return base_dir, adapter_dir, base_logits


REFUSAL = r"layer_interpolation.*PeftModel\.from_pretrained.*hf_lisa\.from_pretrained"


def test_transformers_load_adapter_refuses_interpolation_adapter(interpolation_adapter):
    base_dir, adapter_dir, base_logits = interpolation_adapter
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises(ValueError, match=REFUSAL):
        model.load_adapter(str(adapter_dir))
    _assert_untouched(model, base_logits)


def test_refused_second_adapter_leaves_the_first_one_and_its_config_untouched(interpolation_adapter, tmp_path):
    base_dir, interp_dir, _ = interpolation_adapter
    _, plain_dir, _ = _save_trained_adapter(tmp_path / "plain", **CONFIGS["n:m"])
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.load_adapter(str(plain_dir))
    before = logits(model)
    with pytest.raises(ValueError, match=REFUSAL):
        model.load_adapter(str(interp_dir), adapter_name="interp")
    assert list(model.peft_config) == ["default"]
    assert all("interp" not in m.lisa_A for m in model.modules() if isinstance(m, LisaLayer))
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)


def test_transformers_from_pretrained_on_adapter_dir_refuses_interpolation_adapter(interpolation_adapter):
    _, adapter_dir, _ = interpolation_adapter
    with pytest.raises(ValueError, match=REFUSAL):
        AutoModelForCausalLM.from_pretrained(adapter_dir)


def test_transformers_add_adapter_refuses_layer_interpolation(interpolation_adapter):
    base_dir, _, base_logits = interpolation_adapter
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises(ValueError, match=REFUSAL):
        model.add_adapter(LisaConfig(r=4, layer_interpolation=True))
    _assert_untouched(model, base_logits)


def test_inject_adapter_in_model_refuses_layer_interpolation():
    model = tiny_llama()
    base_logits = logits(model)
    with pytest.raises(ValueError, match=REFUSAL):
        inject_adapter_in_model(LisaConfig(r=4, layer_interpolation=True), model)
    _assert_untouched(model, base_logits)


def test_inject_adapter_in_model_without_interpolation_round_trips_state_dict():
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    config = LisaConfig(r=4, sparsity=0.5, sparsity_structure="n:m", mask_init="random", init_weights=False)
    source = inject_adapter_in_model(config, tiny_llama())
    state = get_peft_model_state_dict(source)
    assert any(".lisa_mask" in k for k in state)
    target = inject_adapter_in_model(LisaConfig(r=4, sparsity=0.5, sparsity_structure="n:m", mask_init="random",
                                                mask_seed=1, init_weights=False), tiny_llama())
    assert not torch.equal(logits(target), logits(source))
    result = set_peft_model_state_dict(target, state)
    assert not result.unexpected_keys
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)


def test_peft_model_keeps_interpolation_where_transformers_refuses(interpolation_adapter):
    """The refusal is specific to the tuner-dropping path: PeftModel and the tuner itself keep α/β."""
    base_dir, adapter_dir, _ = interpolation_adapter
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    tuner = reference.base_model
    torch.testing.assert_close(tuner.lisa_interp_beta["default"], torch.linspace(0.5, -0.5, 3))
    direct = hf_lisa.LisaModel(tiny_llama(), {"default": LisaConfig(r=4, layer_interpolation=True)}, "default")
    assert direct.lisa_interp_delta["default"].shape == (3,)
    # a bare config is how inject_adapter_in_model builds the tuner it drops: refused, with the kept form named
    with pytest.raises(ValueError, match=r"LisaModel\(model, \{adapter_name: config\}, adapter_name\)"):
        hf_lisa.LisaModel(tiny_llama(), LisaConfig(r=4, layer_interpolation=True), "default")
