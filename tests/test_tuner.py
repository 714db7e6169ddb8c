"""The LISA tuner: LoRA equivalence, merging, save/load, several adapters, interpolation, validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import hf_lisa
from hf_lisa import LisaConfig
from hf_lisa.tuner.layer import LisaLayer
from hf_lisa.tuner.schedule_guard import attach_schedule
from tiny_models import randomize_adapters, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5

IDS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])


def logits(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# -- ρ = 0 is exactly LoRA -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero_sparsity_lisa_equals_lora_with_same_weights(arch):
    build, targets = (tiny_llama, ["q_proj", "v_proj", "down_proj"]) if arch == "llama" else (tiny_gpt2, ["c_attn", "c_fc"])
    lora = get_peft_model(build(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    lisa = get_peft_model(build(), LisaConfig(r=4, lisa_alpha=8, target_modules=targets, sparsity=0.0))
    lisa_layers = {n.replace("lisa", "lora"): m for n, m in lisa.named_modules() if isinstance(m, LisaLayer)}
    copied = 0
    with torch.no_grad():
        for name, module in lora.named_modules():
            if name in lisa_layers:
                lisa_layers[name].lisa_A["default"].weight.copy_(module.lora_A["default"].weight)
                lisa_layers[name].lisa_B["default"].weight.copy_(module.lora_B["default"].weight)
                assert lisa_layers[name].scaling["default"] == module.scaling["default"] == 2.0
                copied += 1
    assert copied == len(lisa_layers) > 0
    out_lora, out_lisa = logits(lora), logits(lisa)
    assert not torch.allclose(out_lora, logits(build()), atol=1e-4), "the LoRA deltas must matter for this test"
    torch.testing.assert_close(out_lisa, out_lora, rtol=1e-5, atol=1e-6)


def test_fresh_adapter_is_a_no_op_because_b_starts_at_zero():
    base_out = logits(tiny_llama())
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, sparsity=0.5, mask_init="random"))
    assert all(torch.count_nonzero(m.lisa_B["default"].weight) == 0 for _, m in model.base_model.lisa_layers())
    torch.testing.assert_close(logits(model), base_out)


def test_sparse_forward_uses_the_mask():
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, sparsity=0.5, mask_init="random", target_modules=["q_proj"]))
    randomize_adapters(model)
    layer = model.base_model.lisa_layers()[0][1]
    mask = layer.get_mask("default")
    delta = layer.get_delta_weight("default")
    B, A, s = layer.lisa_B["default"].weight, layer.lisa_A["default"].weight, layer.scaling["default"]
    torch.testing.assert_close(delta, s * mask * (B @ A))
    assert torch.all(delta[~mask] == 0) and torch.count_nonzero(delta[mask]) > 0
    x = torch.randn(3, layer.in_features)
    torch.testing.assert_close(layer(x), layer.base_layer(x) + x @ delta.T, rtol=1e-5, atol=1e-6)


# -- merging ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_merge_unmerge_restores_base_and_merged_equals_unmerged(arch, sparsity):
    build = tiny_llama if arch == "llama" else tiny_gpt2
    base_state = {k: v.clone() for k, v in build().state_dict().items()}
    model = get_peft_model(build(), LisaConfig(r=4, sparsity=sparsity, mask_init="magnitude"))
    randomize_adapters(model)
    unmerged = logits(model)
    model.merge_adapter()
    torch.testing.assert_close(logits(model), unmerged, rtol=1e-4, atol=1e-5)
    model.unmerge_adapter()
    restored = {k.replace("base_layer.", ""): v for k, v in model.get_base_model().state_dict().items() if "lisa_" not in k}
    for key, value in base_state.items():
        torch.testing.assert_close(restored[key], value, rtol=0, atol=1e-6)
    merged_model = model.merge_and_unload()
    assert not any(isinstance(m, LisaLayer) for m in merged_model.modules())
    torch.testing.assert_close(logits(merged_model), unmerged, rtol=1e-4, atol=1e-5)


def test_safe_merge_refuses_nan_and_leaves_weights_untouched():
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, target_modules=["q_proj"]))
    layer = model.base_model.lisa_layers()[0][1]
    before = layer.base_layer.weight.clone()
    with torch.no_grad():
        layer.lisa_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected"):
        layer.merge(safe_merge=True)
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


# -- save / load -----------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a fresh python process
def test_reloaded_adapter_in_fresh_process_reproduces_outputs(tmp_path):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base_dir)
    config = LisaConfig(r=4, sparsity=0.5, sparsity_structure="n:m", mask_init="random", layer_interpolation=True,
                        task_type="CAUSAL_LM")
    model = get_peft_model(tiny_llama(), config)
    randomize_adapters(model)
    with torch.no_grad():
        model.base_model.lisa_interp_delta["default"].copy_(torch.tensor([0.1, -0.2, 0.3]))
        model.base_model.lisa_interp_beta["default"].copy_(torch.tensor([0.01, 0.02, -0.03]))
    expected = logits(model)
    model.save_pretrained(adapter_dir)
    files = sorted(os.listdir(adapter_dir))
    assert "adapter_model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    mask_keys = [k for k in saved if ".lisa_mask" in k]
    assert len(mask_keys) == 9 and all(saved[k].dtype == torch.uint8 for k in mask_keys)
    assert "base_model.lisa_interp_beta" in saved
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import torch, hf_lisa
        from peft import PeftModel, AutoPeftModelForCausalLM
        from transformers import AutoModelForCausalLM
        ids = torch.tensor({IDS.tolist()})
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        for model in (
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base_dir)!r}), {str(adapter_dir)!r}),
            AutoPeftModelForCausalLM.from_pretrained({str(adapter_dir)!r}),
        ):
            model.eval()
            with torch.no_grad():
                out = model(input_ids=ids).logits
            assert torch.equal(out, expected), (out - expected).abs().max()
        print("REPRODUCED")
    """)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base_dir)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REPRODUCED" in result.stdout, result.stderr[-3000:]


def test_peft_config_and_seq_cls_auto_class_load(tmp_path):
    from peft import AutoPeftModelForSequenceClassification

    base_dir, adapter_dir = tmp_path / "bert", tmp_path / "bert-lisa"
    tiny_bert().save_pretrained(base_dir)
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(base_dir)
    model = get_peft_model(base, LisaConfig(r=4, sparsity=0.5, mask_init="random", task_type="SEQ_CLS"))
    randomize_adapters(model)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    model.save_pretrained(adapter_dir)
    config = PeftConfig.from_pretrained(adapter_dir)
    assert isinstance(config, LisaConfig) and config.sparsity == 0.5 and config.block_size == (2, 2)
    loaded = AutoPeftModelForSequenceClassification.from_pretrained(adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected)


@pytest.mark.slow  # a fresh python process
def test_loading_without_import_fails_with_peft_key_error(tmp_path):
    """Documents why hf_lisa.from_pretrained exists: PEFT alone cannot resolve the LISA type."""
    get_peft_model(tiny_llama(), LisaConfig(r=2)).save_pretrained(tmp_path)
    code = f"from peft import PeftConfig; PeftConfig.from_pretrained({str(tmp_path)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "LISA" in result.stderr


def test_import_twice_and_reload_do_not_raise():
    import importlib

    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import PeftType

    importlib.reload(hf_lisa.tuner.peft_type)
    importlib.reload(hf_lisa)
    assert PeftType("LISA") is PeftType.LISA and PeftType.LISA.value == "LISA"
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.LISA] is hf_lisa.LisaModel
    assert list(PeftType).count(PeftType.LISA) == 1


# -- several adapters ------------------------------------------------------------------------------------------------
def test_disable_switch_and_delete_adapters():
    base_out = logits(tiny_llama())
    model = get_peft_model(tiny_llama(), LisaConfig(r=4, sparsity=0.5, mask_init="random"))
    model.add_adapter("other", LisaConfig(r=2, sparsity=0.0, init_weights=False))
    randomize_adapters(model)
    out_default = logits(model)
    with model.disable_adapter():
        torch.testing.assert_close(logits(model), base_out)
    model.set_adapter("other")
    out_other = logits(model)
    assert not torch.allclose(out_default, out_other)
    model.set_adapter("default")
    torch.testing.assert_close(logits(model), out_default)
    model.delete_adapter("other")
    assert all("other" not in m.lisa_A and "other" not in m.lisa_mask for _, m in model.base_model.lisa_layers())
    torch.testing.assert_close(logits(model), out_default)


# -- the mixed strategy (seed 000, §3.3) ---------------------------------------------------------------------------
def test_mixed_qkv_sparse_and_ffn_dense_in_one_config():
    config = LisaConfig(
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        r=4,
        sparsity=0.4,
        rank_pattern={"gate_proj": 8, "up_proj": 8, "down_proj": 8},
        sparsity_pattern={"gate_proj": 0.0, "up_proj": 0.0, "down_proj": 0.0},
        mask_init="magnitude",
    )
    model = get_peft_model(tiny_llama(), config)
    layers = dict(model.base_model.lisa_layers())
    assert len(layers) == 3 * 6
    for name, layer in layers.items():
        if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj"):
            assert layer.r["default"] == 4 and "default" in layer.lisa_mask
            n_blocks = layer.out_features * layer.in_features / 4
            assert abs((1 - layer.get_mask("default").float().mean()) - 0.4) <= 1 / n_blocks
        else:
            assert layer.r["default"] == 8 and "default" not in layer.lisa_mask


# -- layer interpolation ---------------------------------------------------------------------------------------------
def test_interpolation_init_clamp_penalty_and_merge_refusal():
    base_out = logits(tiny_llama())
    model = get_peft_model(tiny_llama(), LisaConfig(r=2, layer_interpolation=True, interpolation_beta_l2=0.01))
    tuner = model.base_model
    assert torch.equal(tuner.interpolation_alpha("default"), torch.ones(3))
    assert torch.equal(tuner.lisa_interp_beta["default"], torch.zeros(3))
    torch.testing.assert_close(logits(model), base_out)
    with torch.no_grad():
        tuner.lisa_interp_delta["default"].copy_(torch.tensor([9.0, -7.0, 0.5]))
        tuner.lisa_interp_beta["default"].copy_(torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(tuner.interpolation_alpha("default"), torch.exp(torch.tensor([5.0, -5.0, 0.5])))
    torch.testing.assert_close(tuner.interpolation_penalty(), torch.tensor(0.01 * (1 + 4 + 9)))
    # the penalty joins the training loss
    # the penalty joins the loss in training mode only (no dropout in the tiny model, so the rest is identical)
    model.train()
    with pytest.raises(RuntimeError, match="layer_interpolation=True"):  # no schedule runs (test_schedule_guard.py)
        model(input_ids=IDS, labels=IDS)
    attach_schedule(model, owner="a custom loop")  # a loop that keeps the in-loss penalty and projects δ itself
    with_penalty = model(input_ids=IDS, labels=IDS).loss
    model.eval()
    plain = model(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(with_penalty - plain, torch.tensor(0.14), rtol=1e-4, atol=1e-5)
    # block outputs are scaled and shifted: h_0 = e^5 * f_0(x) + 1
    inputs_to_block_1 = []

    def record_input(module, args, kwargs):
        inputs_to_block_1.append(args[0] if args else kwargs["hidden_states"])

    handle = tuner.model.model.layers[1].register_forward_pre_hook(record_input, with_kwargs=True)
    logits(model)
    with torch.no_grad():
        tuner.lisa_interp_delta["default"][0] = 0.0
        tuner.lisa_interp_beta["default"][0] = 0.0
    logits(model)  # now α_0 = 1, β_0 = 0: block 1 receives f_0(x) itself
    handle.remove()
    scaled, raw = inputs_to_block_1
    torch.testing.assert_close(scaled, torch.exp(torch.tensor(5.0)) * raw + 1.0)
    with torch.no_grad():
        tuner.lisa_interp_delta["default"].copy_(torch.tensor([9.0, -7.0, 0.5]))
    with pytest.raises(ValueError, match="layer_interpolation"):
        model.merge_and_unload()
    unloaded = model.unload()
    torch.testing.assert_close(logits(unloaded), base_out)


@pytest.mark.parametrize(
    "build,expected",
    [
        (tiny_llama, ["model.layers"]),
        (tiny_gpt2, ["transformer.h"]),
        (tiny_bert, ["bert.encoder.layer"]),
        (tiny_t5, ["encoder.block", "decoder.block"]),
    ],
)
def test_block_discovery(build, expected):
    from hf_lisa.blocks import find_block_lists

    assert [path for path, _ in find_block_lists(build())] == expected


def test_block_discovery_gpt_neox_and_opt():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM

    from hf_lisa.blocks import find_block_lists

    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64))
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   ffn_dim=64, word_embed_proj_dim=32))
    assert [p for p, _ in find_block_lists(neox)] == ["gpt_neox.layers"]
    assert [p for p, _ in find_block_lists(opt)] == ["model.decoder.layers"]
    with pytest.raises(ValueError, match="lisa_layers_attribute"):
        find_block_lists(neox, "gpt_neox.nope")


def test_interpolation_on_t5_covers_encoder_and_decoder():
    model = get_peft_model(tiny_t5(), LisaConfig(r=2, layer_interpolation=True))
    assert model.base_model.lisa_interp_delta["default"].numel() == 4


# -- validation ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"r": 0}, "r"),
        ({"lisa_alpha": -1}, "lisa_alpha"),
        ({"lisa_dropout": 1.5}, "lisa_dropout"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"sparsity_structure": "diagonal"}, "sparsity_structure"),
        ({"mask_init": "oracle"}, "mask_init"),
        ({"block_size": (0, 2)}, "block_size"),
        ({"n_m": (4, 2)}, "n_m"),
        ({"sparsity_structure": "n:m", "sparsity": 0.3}, "sparsity"),
        ({"sparsity_pattern": {"q_proj": 2.0}}, "sparsity_pattern"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
        ({"importance_steps": 0}, "importance_steps"),
        ({"mask_update_interval": 4, "importance_steps": 8}, "mask_update_interval"),
        ({"lisa_activated_layers": -1}, "lisa_activated_layers"),
        ({"lisa_interval_steps": 0}, "lisa_interval_steps"),
        ({"lisa_sampling": "greedy"}, "lisa_sampling"),
        ({"interpolation_delta_bound": 0}, "interpolation_delta_bound"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"LisaConfig\.{field}") as info:
        LisaConfig(**kwargs)
    assert "allowed" in str(info.value)


def test_block_that_does_not_divide_the_weight_names_module_and_field():
    # GPT-2 c_attn is 32 -> 96; a 5x5 block divides neither
    with pytest.raises(ValueError, match=r"sparsity_structure='block'.*c_attn.*block_size=5x5"):
        get_peft_model(tiny_gpt2(), LisaConfig(sparsity=0.5, block_size=(5, 5), target_modules=["c_attn"]))


def test_target_that_matches_nothing_raises():
    with pytest.raises(ValueError, match="not_a_module"):
        get_peft_model(tiny_llama(), LisaConfig(target_modules=["not_a_module"]))
