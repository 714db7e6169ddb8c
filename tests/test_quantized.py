"""LISA adapters on bitsandbytes-quantized bases (4-bit NF4/FP4 and 8-bit), on CPU: the adapter forward against the
maths on the dequantized weight, masks scored on the dequantized weight, training (dense, sparse, layer-sampled) that
moves only the active adapters, save and reload in a fresh process, merging, and ``hf-lisa train --load_in_4bit``."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from conftest import TokenDataset, build_tiny_llama, build_training_args  # noqa: E402
from peft import PeftModel, get_peft_model  # noqa: E402
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer  # noqa: E402

import hf_lisa  # noqa: E402
from hf_lisa import cli  # noqa: E402
from hf_lisa.trainer_callbacks import LisaAdapterCallback  # noqa: E402
from hf_lisa.tuner import masks as M  # noqa: E402
from hf_lisa.tuner.bnb import Linear4bit, Linear8bitLt  # noqa: E402
from hf_lisa.tuner.layer import LisaLayer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-nested": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32,
                       bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}
TARGETS = ["q_proj", "v_proj", "up_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """A tiny llama on disk (hidden 64: whole 4-bit blocks of 64), the fp32 weights a quantized load starts from."""
    path = tmp_path_factory.mktemp("quant") / "base"
    build_tiny_llama(num_layers=3, hidden=64, vocab=64).save_pretrained(path)
    return str(path)


def _load(base_dir: str, quant: str = "nf4"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            base_dir, quantization_config=BitsAndBytesConfig(**QUANT[quant]), dtype=torch.float32
        )


def _randomize(model, seed: int = 1, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lisa_A." in name or ".lisa_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def _layers(model) -> list[tuple[str, LisaLayer]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LisaLayer)]


# -- the layer -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", list(QUANT))
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_forward_is_the_quantized_base_plus_the_masked_delta(base_dir, quant, sparsity):
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(_load(base_dir, quant), hf_lisa.LisaConfig(
        r=4, lisa_alpha=8, target_modules=TARGETS, sparsity=sparsity, mask_init="magnitude"))
    _randomize(model)
    expected_cls = Linear8bitLt if quant == "int8" else Linear4bit
    layers = _layers(model)
    assert len(layers) == 9 and all(type(m) is expected_cls for _, m in layers)
    gen = torch.Generator().manual_seed(0)
    for name, layer in layers:
        x = torch.randn(2, 5, layer.in_features, generator=gen)
        A, B = layer.lisa_A["default"].weight, layer.lisa_B["default"].weight
        mask = torch.ones(layer.out_features, layer.in_features) if sparsity == 0 else layer.get_mask("default")
        delta = (B @ A) * mask * (8 / 4)
        with torch.no_grad():
            out, base_out = layer(x), layer.base_layer(x)
        torch.testing.assert_close(out, base_out + x @ delta.T, atol=1e-5, rtol=1e-5)
        # the dequantized weight has the true (out, in) shape and is the fp32 weight up to the quantization's error
        weight = layer.base_weight_out_in()
        original = reference.get_submodule(name.removeprefix("base_model.model.")).weight
        assert weight.shape == original.shape == (layer.out_features, layer.in_features)
        relative = ((weight.float() - original).norm() / original.norm()).item()
        assert 0 < relative < (0.02 if quant == "int8" else 0.2), (name, relative)
        if quant != "int8":  # 4-bit layers compute with exactly the dequantized weight
            torch.testing.assert_close(base_out, x @ weight.float().T, atol=1e-5, rtol=1e-5)


def test_magnitude_masks_are_scored_on_the_dequantized_weight(base_dir):
    model = get_peft_model(_load(base_dir), hf_lisa.LisaConfig(
        r=4, target_modules=TARGETS, sparsity=0.5, mask_init="magnitude", sparsity_structure="block"))
    for name, layer in _layers(model):
        weight = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
        expected = M.select_mask(M.magnitude_scores(weight), "block", 0.5, (2, 2), (2, 4))
        assert torch.equal(layer.get_mask("default"), expected), name


def test_the_cpu_packed_4bit_format_dequantizes_to_the_same_weight(base_dir):
    # bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU kernel at inference; masks must still read W
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = get_peft_model(_load(base_dir), hf_lisa.LisaConfig(r=4, target_modules=["q_proj"]))
    layer = _layers(model)[0][1]
    before = layer.dequantized_weight().clone()
    weight = layer.base_layer.weight
    weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    assert weight.quant_state.packing_format_for_cpu
    after = layer.dequantized_weight()
    assert after.shape == before.shape
    torch.testing.assert_close(after.float(), before.float(), atol=0.0, rtol=1e-2)  # absmax was kept in bf16


# -- merging -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_merge_dequantizes_adds_and_requantizes_with_a_warning(base_dir, quant):
    model = get_peft_model(_load(base_dir, quant), hf_lisa.LisaConfig(
        r=4, target_modules=TARGETS, sparsity=0.5, mask_init="magnitude"))
    _randomize(model, std=0.3)  # a delta well above the quantization step
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    layer = _layers(model)[0][1]
    weight, delta = layer.dequantized_weight().float(), layer.get_delta_weight("default").float()
    with pytest.warns(UserWarning, match=rf"{'8' if quant == 'int8' else '4'}-bit bitsandbytes layer.*rounded"):
        model.base_model.merge_adapter()
    merged_weight = layer.dequantized_weight().float()
    # the merged weight is W + delta rounded to the grid: much nearer to it than to W
    assert (merged_weight - (weight + delta)).norm() < 0.5 * delta.norm()
    with torch.no_grad():
        merged = model(ids).logits
    assert (merged - adapted).abs().max() < 0.5 * (base - adapted).abs().max()
    with pytest.warns(UserWarning, match="Unmerging"):
        model.base_model.unmerge_adapter()
    assert not layer.merged
    assert (layer.dequantized_weight().float() - weight).norm() < 0.5 * delta.norm()
    # merge_and_unload hands back the quantized layers
    unloaded = model.merge_and_unload()
    expected = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    assert type(unloaded.model.layers[0].self_attn.q_proj) is expected


def test_safe_merge_refuses_a_broken_adapter_and_leaves_the_base_unchanged(base_dir):
    model = get_peft_model(_load(base_dir), hf_lisa.LisaConfig(r=4, target_modules=["q_proj"]))
    layer = _layers(model)[0][1]
    stored = layer.base_layer.weight.data.clone()
    with torch.no_grad():
        layer.lisa_B["default"].weight[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="NaNs detected in the merged weights"):
            layer.merge(safe_merge=True)
    assert torch.equal(layer.base_layer.weight.data, stored) and not layer.merged


# -- training, save, reload ----------------------------------------------------------------------------------------------
#: variant -> LisaConfig settings: layer-sampled (γ = 1) dense adapters, every sparse adapter training (γ = 0) with
#: gradient-importance masks, and both at once
VARIANTS = {
    "dense-sampled": dict(lisa_activated_layers=1, lisa_interval_steps=2),
    "sparse": dict(sparsity=0.5, mask_init="importance", importance_steps=2, mask_update_interval=0,
                   lisa_activated_layers=0),
    "sparse-sampled": dict(sparsity=0.5, mask_init="importance", importance_steps=1, mask_update_interval=0,
                           lisa_activated_layers=1, lisa_interval_steps=2),
}
PROBE_IDS = [[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 63, 0, 7]]


def _block_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """Each variant trained 4 steps on a 4-bit NF4 base with LisaAdapterCallback, saved; what the tests check."""
    root = tmp_path_factory.mktemp("trained")
    results = {}
    for variant, settings in VARIANTS.items():
        model = get_peft_model(_load(base_dir), hf_lisa.LisaConfig(r=4, target_modules=TARGETS, **settings))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        masks = {n: m.get_mask("default").clone() for n, m in _layers(model) if "default" in m.lisa_mask}
        lisa = LisaAdapterCallback(seed=0)
        args = build_training_args(root / f"run-{variant}", max_steps=4, learning_rate=1e-2)
        Trainer(model=model, args=args, train_dataset=TokenDataset(vocab=64), callbacks=[lisa]).train()
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(PROBE_IDS)).logits
        model.save_pretrained(root / variant)
        results[variant] = dict(
            model=model, lisa=lisa, before=before, masks=masks, logits=logits, adapter=str(root / variant),
            after={n: p.detach().clone() for n, p in model.named_parameters()},
        )
    return results


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_moves_the_active_adapters_and_never_the_quantized_base(trained, variant):
    run = trained[variant]
    lisa, before, after = run["lisa"], run["before"], run["after"]
    if variant.endswith("sampled"):
        ever = {b for _, blocks in lisa.layer_scheduler.history for b in blocks}
        assert [s for s, _ in lisa.layer_scheduler.history] == [0, 2] and len(ever) <= 2
    else:
        assert lisa.layer_scheduler is None
        ever = {0, 1, 2}
    for name, value in before.items():
        moved = not torch.equal(after[name], value)
        if ".lisa_B." in name:
            assert moved == (_block_of(name) in ever), name
        elif "lisa_" not in name:
            assert not moved, f"base parameter {name} moved"
    # the 4-bit weights are still 4-bit and untouched
    for name, layer in _layers(run["model"]):
        assert type(layer.base_layer.weight).__name__ == "Params4bit"
    if variant.startswith("sparse"):
        # gradient-importance calibration, before step 0 through the 4-bit base, selected new masks of every sparse
        # layer (the blocks sampled later too), on the (out, in) grid
        calibrated = [(u["step"], u["layers_updated"]) for u in lisa.mask_updates if u["kind"] == "calibration"]
        assert calibrated == [(0, len(run["masks"]))]
        changed = [n for n, m in _layers(run["model"]) if not torch.equal(m.get_mask("default"), run["masks"][n])]
        assert {_block_of(n) for n in changed} == {_block_of(n) for n in run["masks"]}


_RELOAD = """
import json, sys, torch, warnings
import hf_lisa
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
warnings.simplefilter("ignore")
base_dir, ids, adapters = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
out = {}
for adapter in adapters:
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, hf_lisa.LisaLayer)})
    with torch.no_grad():
        out[adapter] = {"logits": model(torch.tensor(ids)).logits.tolist(), "layers": kinds}
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh python process
def test_saved_adapters_reload_on_a_4bit_base_in_a_fresh_process_with_the_same_logits(trained, base_dir):
    adapters = [run["adapter"] for run in trained.values()]
    result = subprocess.run(
        [sys.executable, "-c", _RELOAD, base_dir, json.dumps(PROBE_IDS), *adapters],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    for variant, run in trained.items():
        got = reloaded[run["adapter"]]
        assert got["layers"] == ["Linear4bit"], variant
        torch.testing.assert_close(torch.tensor(got["logits"]), run["logits"], atol=1e-5, rtol=0, msg=variant)
        # and the trained adapter changes the function, so matching logits mean its weights and masks came back
        with torch.no_grad(), run["model"].disable_adapter():
            base = run["model"](torch.tensor(PROBE_IDS)).logits
        assert (run["logits"] - base).abs().max() > 1e-3, variant


# -- hf-lisa train ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cli(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_cli")
    return {
        "root": root,
        "model": build_tiny_lm_dir(root / "model", num_layers=2, hidden=64),
        "train": write_jsonl(root / "train.jsonl", copy_task_rows(24, seed=0)),
        "validation": write_jsonl(root / "validation.jsonl", copy_task_rows(8, seed=1)),
    }


def _train_argv(tiny, out, *extra) -> list[str]:
    return [
        "train", "--model_name_or_path", tiny["model"], "--train_file", tiny["train"],
        "--validation_file", tiny["validation"], "--output_dir", str(out), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2",
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true",
        "--disable_tqdm", "true", "--eval_generation_samples", "0", "--max_seq_length", "64", *extra,
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "lisa", "--load_in_4bit"], "--load_in_4bit cannot be used with --method lisa"),
        (["--method", "full", "--load_in_8bit"], "--load_in_8bit cannot be used with --method full"),
        (["--method", "lisa-adapter", "--load_in_4bit", "--load_in_8bit"], "exclude each other"),
        (["--method", "lora", "--bnb_4bit_quant_type", "fp4"], "--bnb_4bit_quant_type='fp4' only applies with"),
        (["--method", "lora", "--load_in_4bit", "--bnb_4bit_quant_type", "int4"], "allowed: nf4, fp4"),
        (["--method", "lora", "--load_in_4bit", "--bnb_4bit_compute_dtype", "int8"], "allowed: float32, bfloat16"),
    ],
)
def test_quantization_options_that_cannot_take_effect_are_refused(tiny_cli, tmp_path, capsys, extra, message):
    code = cli.main(_train_argv(tiny_cli, tmp_path / "out", *extra))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # full hf-lisa train runs on a 4-bit base
@pytest.mark.parametrize("method", ["lisa-adapter", "lora"])
def test_hf_lisa_train_trains_an_adapter_on_a_4bit_base(tiny_cli, tmp_path, method):
    out = tmp_path / method
    extra = ["--r", "4", "--load_in_4bit", "--use_bnb_nested_quant"]
    if method == "lisa-adapter":
        extra += ["--sparsity", "0.5", "--mask_init", "magnitude", "--lisa_activated_layers", "1",
                  "--lisa_interval_steps", "1"]
    assert cli.main(_train_argv(tiny_cli, out, "--method", method, *extra)) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["arguments"]["model"]["load_in_4bit"] is True
    assert summary["arguments"]["model"]["use_bnb_nested_quant"] is True
    assert summary["metrics"]["eval_loss"] != summary["metrics"]["eval_loss_before"]
    # the adapter loads back on a 4-bit base, as its LISA / LoRA bnb layers
    base = AutoModelForCausalLM.from_pretrained(
        tiny_cli["model"], dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32,
                                               bnb_4bit_use_double_quant=True),
    )
    model = PeftModel.from_pretrained(base, str(out))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear4bit" and isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    assert isinstance(q_proj, LisaLayer) == (method == "lisa-adapter")
