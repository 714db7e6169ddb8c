"""Adapters on a bitsandbytes-quantized base keep training after any evaluation (issue 22).

bitsandbytes 0.50 repacks a ``Linear4bit`` weight into an inference-only layout (its AVX512-BF16 CPU kernel, no
backward) the first time the layer runs in eval mode on such a CPU: an evaluation before training, ``evaluate()`` during
it, a generation, the sparse-mask probe or a user's ``model.eval()`` left every later step with no gradient. These tests
run each of those paths and then train: ``hf-lisa train`` for every adapter method on 4-bit and 8-bit bases with its
evaluations on, the Trainer's evaluation during training, a user's generation, and a base repacked before wrapping.

The 4-bit failures show only where bitsandbytes repacks (``has_avx512bf16()``); the layout checks run everywhere.
"""

from __future__ import annotations

import ast
import json
import re
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from conftest import TokenDataset, build_tiny_llama, build_training_args  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback  # noqa: E402

import hf_lisa  # noqa: E402
from hf_lisa import cli  # noqa: E402
from hf_lisa.trainer_callbacks import LisaAdapterCallback  # noqa: E402

#: whether bitsandbytes takes its CPU inference layout on this machine (where the untreated bug shows)
REPACKS_HERE = bool(bnb.functional.has_avx512bf16())
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
TARGETS = ["q_proj", "v_proj", "down_proj"]  # down_proj: in_features 128, two 4-bit blocks per row


def _4bit_layers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def _packed(model) -> list[str]:
    return [n for n, m in _4bit_layers(model) if getattr(m.weight.quant_state, "packing_format_for_cpu", False)]


# -- hf-lisa train: every adapter method x 4-bit / 8-bit, evaluations on -----------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_eval")
    return {
        "model": build_tiny_lm_dir(root / "model", num_layers=2, hidden=64),
        "train": write_jsonl(root / "train.jsonl", copy_task_rows(32, seed=0)),
    }


#: variant -> its method options; the sparse one re-selects masks every 2 steps, each time probing in eval mode
VARIANTS = {
    "lisa-dense": ["--method", "lisa-adapter"],
    "lisa-sparse": ["--method", "lisa-adapter", "--sparsity", "0.5", "--mask_init", "importance",
                    "--importance_steps", "1", "--mask_update_interval", "2"],
    "lisa-interp": ["--method", "lisa-adapter", "--layer_interpolation", "true"],
    "lora": ["--method", "lora"],
    "dora": ["--method", "dora"],
}
QUANT_OPTIONS = {"4bit": ["--load_in_4bit"], "8bit": ["--load_in_8bit"]}


def _logged(stdout: str) -> list[dict]:
    """The console's log lines (``[hf-lisa] step 3/6: loss 4.8123, grad_norm 0.3012, ...``, ``[hf-lisa] eval at step
    3: eval_loss 4.9, ...``), the metrics used as floats."""
    keys = ("loss", "grad_norm", "eval_loss")
    logs = []
    for line in stdout.splitlines():
        if re.match(r"\[hf-lisa\] (step \d+|eval at step \d+)", line):
            pairs = re.findall(r"(\w+) (-?[\d.]+(?:e[-+]?\d+)?|nan|inf)", line.split(":", 1)[1])
            logs.append({k: float(v) for k, v in pairs if k in keys})
    return logs


@pytest.mark.slow  # full hf-lisa train runs with evaluations, one per method and quantization
@pytest.mark.parametrize("quant", list(QUANT_OPTIONS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_lisa_train_trains_every_adapter_method_on_a_quantized_base_with_evaluations_on(
        tiny, tmp_path, capsys, variant, quant):
    out = tmp_path / "out"
    argv = [
        "train", "--model_name_or_path", tiny["model"], "--train_file", tiny["train"],
        "--validation_split_percentage", "25", "--output_dir", str(out), "--max_steps", "6", "--r", "4",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--learning_rate", "2e-2",
        "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "3", "--save_strategy", "no",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--seed", "0",
        "--eval_generation_samples", "2", "--generation_max_new_tokens", "2", "--max_seq_length", "64",
        *VARIANTS[variant], *QUANT_OPTIONS[quant],
    ]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    logs = _logged(stdout)
    steps = [e for e in logs if "loss" in e and "grad_norm" in e]
    assert len(steps) == 6 and sum(1 for e in logs if "eval_loss" in e) == 2  # at 3 and at 6
    assert "[hf-lisa] before training: " in stdout and "[hf-lisa] after training: " in stdout
    # a gradient at every step, the steps after the evaluation at step 3 included
    assert all(e["grad_norm"] > 1e-4 for e in steps), [e["grad_norm"] for e in steps]
    losses = [e["loss"] for e in steps]
    assert sum(losses[3:]) / 3 < sum(losses[:3]) / 3, losses
    metrics = json.loads((out / "training_summary.json").read_text())["metrics"]
    assert metrics["eval_loss"] < metrics["eval_loss_before"] - 1e-3, metrics
    # the adapters moved: every B factor starts at zero (and the interpolation's beta), so nonzero means trained
    weights = load_file(out / "adapter_model.safetensors")
    moved = {k: v.float().abs().max().item() for k, v in weights.items() if "lisa_B" in k or "lora_B" in k
             or "interp_beta" in k}
    assert moved and all(v > 0 for v in moved.values()), moved
    if variant == "lisa-interp":
        assert any("interp" in k for k in moved), sorted(weights)


# -- the Python API ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("quant_eval_base") / "base"
    build_tiny_llama(num_layers=2, hidden=64, vocab=64).save_pretrained(path)  # intermediate 128
    return str(path)


def _load_4bit(base_dir: str, **quant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            base_dir, quantization_config=BitsAndBytesConfig(**{**NF4, **quant}), dtype=torch.float32
        )


def _adapter_grads(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters() if p.requires_grad}


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("adapter", ["lisa", "lisa-sparse", "lora"])
def test_a_users_eval_and_generation_leave_the_4bit_model_trainable(base_dir, adapter):
    configs = {
        "lisa": lambda: hf_lisa.LisaConfig(r=4, target_modules=TARGETS),
        "lisa-sparse": lambda: hf_lisa.LisaConfig(r=4, target_modules=TARGETS, sparsity=0.5, mask_init="magnitude",
                                                     mask_update_interval=0),
        "lora": lambda: LoraConfig(r=4, target_modules=TARGETS),
    }
    reference = get_peft_model(_load_4bit(base_dir), configs[adapter]())
    model = get_peft_model(_load_4bit(base_dir), configs[adapter]())
    with torch.no_grad():  # the same adapter weights, B random so that every factor gets a gradient
        gen = torch.Generator().manual_seed(1)
        for (name, ref), (_, param) in zip(reference.named_parameters(), model.named_parameters()):
            if ref.requires_grad:
                ref.copy_(torch.randn(ref.shape, generator=gen) * 0.1)
                param.copy_(ref)
    if adapter == "lora":  # PEFT's own layers: hf-lisa's guard, as hf-lisa train applies it to every adapter method
        from hf_lisa.tuner.bnb import keep_4bit_layers_trainable

        keep_4bit_layers_trainable(model)
    model.eval()
    with torch.no_grad():
        model(IDS)
    model.generate(IDS[:, :4], max_new_tokens=2, do_sample=False)
    # training after them gets the gradients of a model that never ran in eval mode
    expected, got = _adapter_grads(reference, IDS), _adapter_grads(model, IDS)
    assert expected and all(g is not None and g.abs().max() > 0 for g in expected.values())
    for name, grad in expected.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # every 4-bit layer, with an adapter or not (gradients must flow through both), refuses the inference-only layout
    assert _packed(model) == []
    assert len(_4bit_layers(model)) == 14
    assert all(not m.support_avx512bf16_for_cpu for _, m in _4bit_layers(model))


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_a_base_repacked_before_wrapping_is_unpacked_with_its_true_weights(base_dir, nested):
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    base = _load_4bit(base_dir, bnb_4bit_use_double_quant=nested)
    before = {n: bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).clone()
              for n, m in _4bit_layers(base)}
    for _, module in _4bit_layers(base):  # what bitsandbytes does at an eval forward on an AVX512-BF16 CPU
        module.weight.data, _ = _convert_weight_packed_for_cpu(module.weight.data, module.weight.quant_state)
    with pytest.warns(UserWarning, match=r"14 bitsandbytes 4-bit layers.*inference-only"):
        model = get_peft_model(base, hf_lisa.LisaConfig(r=4, target_modules=TARGETS))
    assert _packed(model) == []
    for name, module in _4bit_layers(model):
        after = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        original = before[name.removeprefix("base_model.model.").replace(".base_layer", "")]
        # the scales went through bfloat16 in the packed layout: the weights come back up to that rounding
        torch.testing.assert_close(after, original, atol=1e-6, rtol=2 ** -7, msg=name)
    grads = _adapter_grads(model, IDS)
    assert all(g is not None and g.abs().max() > 0 for n, g in grads.items() if "lisa_B" in n)


def test_the_dequantized_weight_of_a_repacked_layer_wider_than_one_block(base_dir):
    # bitsandbytes' own inverse of the CPU layout leaves the scales transposed when a row holds several 4-bit blocks
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = get_peft_model(_load_4bit(base_dir), hf_lisa.LisaConfig(r=4, target_modules=["down_proj"]))
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert layer.in_features == 128  # two blocks of 64 per row
    before = layer.dequantized_weight().clone()
    weight = layer.base_layer.weight
    weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    torch.testing.assert_close(layer.dequantized_weight(), before, atol=1e-6, rtol=2 ** -7)


class _Snapshot(TrainerCallback):
    """The LISA B factors at each evaluation, and the logged gradient norms."""

    def __init__(self, model):
        self.model, self.at_eval, self.grad_norms = model, [], []

    def on_evaluate(self, args, state, control, **kwargs):
        self.at_eval.append((state.global_step, {n: p.detach().clone() for n, p in self.model.named_parameters()
                                                 if "lisa_B" in n}))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.grad_norms.append((state.global_step, float(logs["grad_norm"])))


def test_evaluation_during_training_does_not_stop_training(base_dir, tmp_path):
    model = get_peft_model(_load_4bit(base_dir), hf_lisa.LisaConfig(r=4, target_modules=TARGETS))
    snapshot = _Snapshot(model)
    args = build_training_args(tmp_path / "run", max_steps=6, learning_rate=1e-2, eval_strategy="steps",
                               eval_steps=2, per_device_eval_batch_size=4)
    Trainer(model=model, args=args, train_dataset=TokenDataset(vocab=64), eval_dataset=TokenDataset(8, vocab=64),
            callbacks=[LisaAdapterCallback(seed=0), snapshot]).train()
    assert [step for step, _ in snapshot.at_eval] == [2, 4, 6]
    assert [step for step, _ in snapshot.grad_norms] == [1, 2, 3, 4, 5, 6]
    assert all(norm > 1e-4 for _, norm in snapshot.grad_norms), snapshot.grad_norms
    (_, at_2), (_, at_4), (_, at_6) = snapshot.at_eval
    for name in at_2:  # every B factor keeps moving after each evaluation
        assert not torch.equal(at_4[name], at_2[name]) and not torch.equal(at_6[name], at_4[name]), name
    assert _packed(model) == []


def test_the_packing_case_is_real_on_this_machine():
    """Say whether the behavioural checks above reproduce issue 22 here (they can pass trivially elsewhere)."""
    if not REPACKS_HERE:
        pytest.skip("bitsandbytes does not repack 4-bit weights on this CPU (no AVX512-BF16): the behavioural "
                    "checks cannot fail here without the guard; the layout checks still ran")
    layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    assert layer.support_avx512bf16_for_cpu
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    assert layer.weight.quant_state.packing_format_for_cpu  # the bitsandbytes behaviour the guard exists for
