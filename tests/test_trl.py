"""LISA under TRL: ``SFTTrainer`` and ``DPOTrainer`` train exactly what the LISA schedule says, in every LISA form.

Every training test records, for each optimizer step, the blocks that the LISA callback made active and the
parameters whose values changed (bit for bit, ``torch.equal``), and asserts that

* nothing outside the active blocks changed, except what trains throughout (E+H+final norm for full-parameter LISA;
  the interpolation scalars for adapters), and no base weight of an adapter model changed at all;
* everything that should train did: every parameter of an active block (full-parameter), every ``lisa_B`` of an
  active block (adapters; ``lisa_A`` gets no gradient while its ``B`` is still 0), the interpolation scalars. A sparse
  adapter's layers, every block's, calibrate their first mask before step 0 through the trainer's own loss, training
  nothing, so their ``B`` trains from their block's first active step on.

The LISA forms: full-parameter ``LisaCallback`` on a plain model, dense adapters with γ = 1 of 4 blocks, sparse
adapters (ρ = 0.4; first masks chosen in training from the trainer's own loss, re-selected when a block trains again
in a later mask interval), and layer interpolation; each with gradient checkpointing on (TRL's default) and off.
DPO runs against the base model with the adapters disabled (PEFT) or an explicit reference model (plain model).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import hf_lisa
from train_fixtures import build_char_tokenizer, build_tiny_lm_dir, copy_task_rows, write_jsonl
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback, prepare_trainer

trl = pytest.importorskip("trl", reason="TRL is the optional extra hf-lisa[trl]")
datasets = pytest.importorskip("datasets")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUM_BLOCKS = 4
STEPS, K = 4, 2  # two LISA periods: switches at steps 0 and 2
ALWAYS_TRAINABLE = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")  # E+H+final norm

FORMS = {
    "adapters": dict(),
    "sparse": dict(sparsity=0.4, mask_update_interval=2, importance_steps=1),
    "interpolation": dict(layer_interpolation=True),
}
GRADIENT_CHECKPOINTING = pytest.mark.parametrize("gradient_checkpointing", [True, False], ids=["gc", "no-gc"])


# ----------------------------------------------------------------------------------------------------------------------
# tiny models, data and trainers
# ----------------------------------------------------------------------------------------------------------------------
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
    pytest.mark.slow,  # SFTTrainer and DPOTrainer training runs and the TRL examples, end to end (~20 s in all)
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()  # character level, with a chat template; vocab < 128


@pytest.fixture
def base_model(tiny_llama, tokenizer):
    """Factory: the same 4-block llama (fixed seed) on every call, with the tokenizer's special tokens."""

    def build():
        model = tiny_llama(num_layers=NUM_BLOCKS, vocab=128)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        return model

    return build


def preference_rows(n: int) -> list[dict]:
    """The copy task as preferences: "say c" prefers "ccc" to "ddd"."""
    shift = str.maketrans("abcdefgh", "bcdefghi")
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"].translate(shift)}
            for r in copy_task_rows(n, seed=0)]


def sft_dataset(n: int = 16):
    return datasets.Dataset.from_list(copy_task_rows(n, seed=0))  # prompt/completion: "say c" -> "ccc"


def preference_dataset(n: int = 16):
    return datasets.Dataset.from_list(preference_rows(n))


def trl_args(kind: str, output_dir, gradient_checkpointing: bool, **overrides):
    """SFTConfig / DPOConfig for fast, deterministic CPU runs (fp32: TRL defaults to bf16 mixed precision)."""
    kwargs = dict(
        max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, max_length=32, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, bf16=False, seed=0, data_seed=0,
        dataloader_num_workers=0, gradient_checkpointing=gradient_checkpointing,
    )
    kwargs.update(overrides)
    config_cls = trl.SFTConfig if kind == "sft" else trl.DPOConfig
    return config_cls(str(output_dir), **kwargs)


def make_trainer(kind: str, model, tokenizer, args, callbacks, peft_config=None, ref_model=None):
    torch.manual_seed(0)  # DPOTrainer draws the adapters' A without seeding first
    if kind == "sft":
        return trl.SFTTrainer(model=model, args=args, train_dataset=sft_dataset(), processing_class=tokenizer,
                              peft_config=peft_config, callbacks=callbacks)
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=preference_dataset(),
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)


def adapter_config(**form) -> hf_lisa.LisaConfig:
    return hf_lisa.LisaConfig(
        task_type="CAUSAL_LM", r=4, lisa_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
        lisa_activated_layers=1, lisa_interval_steps=K, **form,
    )


class WhatTrained(TrainerCallback):
    """Per optimizer step: the active blocks (read after the LISA callback's switch) and the parameters that changed.

    It must come after the LISA callback in ``callbacks``, so that its ``on_step_begin`` sees the new active set.
    """

    def __init__(self, lisa) -> None:
        self.lisa = lisa
        self.steps: list[tuple[list[int], set[str]]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._active = list(self.lisa.layer_scheduler.active)
        self._before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), self._before[n])}
        self.steps.append((self._active, changed))


def block_of(name: str):
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None


def assert_trained_exactly(record: WhatTrained, names: list[str], allowed, required) -> None:
    """``allowed(name, active)``: may change at a step with these active blocks; ``required(name, active, fresh)``:
    must change (``fresh``: the active blocks that train for the first time in this run)."""
    assert len(record.steps) == STEPS
    seen: set[int] = set()
    for step, (active, changed) in enumerate(record.steps, start=1):
        assert len(active) == 1, f"step {step}: active blocks {active}, expected γ = 1"
        fresh = set(active) - seen
        seen.update(active)
        outside = sorted(n for n in changed if not allowed(n, active))
        assert not outside, f"step {step}: only block {active} may train, but these changed too: {outside}"
        missing = sorted(n for n in names if required(n, active, fresh) and n not in changed)
        assert not missing, f"step {step}: block {active} is active but these did not train: {missing}"


def assert_adapters_trained_exactly(trainer, lisa, record: WhatTrained, form: str) -> None:
    names = [n for n, _ in trainer.model.named_parameters()]
    assert [s for s, _ in lisa.layer_scheduler.history] == [0, K]

    def allowed(name, active):
        return "lisa_" in name and (block_of(name) is None or block_of(name) in active)

    def required(name, active, fresh):
        if form == "interpolation" and "lisa_interp_" in name:
            return True
        return ".lisa_B." in name and block_of(name) in active  # sparse: masks calibrated before step 0

    assert_trained_exactly(record, names, allowed, required)


# ----------------------------------------------------------------------------------------------------------------------
# full-parameter LISA (LisaCallback on a plain model)
# ----------------------------------------------------------------------------------------------------------------------
def _full_parameter_run(kind, base_model, tokenizer, tmp_path, gradient_checkpointing):
    model = base_model()
    ref_model = base_model() if kind == "dpo" else None  # a model built from config has no Hub id to load one from
    ref_before = None if ref_model is None else {n: p.clone() for n, p in ref_model.named_parameters()}
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=K, seed=0)
    record = WhatTrained(lisa)
    trainer = make_trainer(kind, model, tokenizer, trl_args(kind, tmp_path, gradient_checkpointing),
                           [lisa, record], ref_model=ref_model)
    trainer.train()

    names = [n for n, _ in model.named_parameters()]
    assert [s for s, _ in lisa.layer_scheduler.history] == [0, K]

    def allowed(name, active):
        return name in ALWAYS_TRAINABLE or block_of(name) in active

    def required(name, active, fresh):
        return name in ALWAYS_TRAINABLE or block_of(name) in active

    assert_trained_exactly(record, names, allowed, required)
    if ref_model is not None:
        assert all(torch.equal(p, ref_before[n]) for n, p in ref_model.named_parameters()), "the reference moved"


@GRADIENT_CHECKPOINTING
def test_sft_full_parameter_lisa_trains_only_embeddings_head_and_the_active_block(
    base_model, tokenizer, tmp_path, gradient_checkpointing
):
    _full_parameter_run("sft", base_model, tokenizer, tmp_path, gradient_checkpointing)


@GRADIENT_CHECKPOINTING
def test_dpo_full_parameter_lisa_with_a_reference_model_trains_only_embeddings_head_and_the_active_block(
    base_model, tokenizer, tmp_path, gradient_checkpointing
):
    _full_parameter_run("dpo", base_model, tokenizer, tmp_path, gradient_checkpointing)


# ----------------------------------------------------------------------------------------------------------------------
# LISA adapters (peft_config=LisaConfig, LisaAdapterCallback)
# ----------------------------------------------------------------------------------------------------------------------
def _adapter_run(kind, form, base_model, tokenizer, tmp_path, gradient_checkpointing):
    lisa = LisaAdapterCallback(seed=0)
    record = WhatTrained(lisa)
    trainer = make_trainer(kind, base_model(), tokenizer, trl_args(kind, tmp_path, gradient_checkpointing),
                           [lisa, record], peft_config=adapter_config(**FORMS[form]))
    if kind == "dpo" and form == "sparse":
        # the first masks are calibrated on the loss the trainer trains (DPO's) only when the callback is handed the
        # Trainer; without it they calibrate in training (a warning; tests/test_trainer_equivalence.py)
        prepare_trainer(trainer)
    trainer.train()
    assert_adapters_trained_exactly(trainer, lisa, record, form)
    if form == "sparse":
        # every block chose its first mask before step 0, from the trainer's own loss (3 sparse layers per block); the
        # block active in the mask interval [2, 4) is re-selected in it, after a window of one step
        def layers_updated(kind):
            return [(u["step"], u["layers_updated"]) for u in lisa.mask_updates if u["kind"] == kind]

        assert layers_updated("calibration") == [(0, 3 * NUM_BLOCKS)], lisa.mask_updates
        assert layers_updated("reselection") == [(3, 3 * len(record.steps[2][0]))], lisa.mask_updates
    return trainer


@GRADIENT_CHECKPOINTING
@pytest.mark.parametrize("form", list(FORMS))
def test_sft_trains_only_the_active_blocks_adapters(base_model, tokenizer, tmp_path, form, gradient_checkpointing):
    _adapter_run("sft", form, base_model, tokenizer, tmp_path, gradient_checkpointing)


@GRADIENT_CHECKPOINTING
@pytest.mark.parametrize("form", list(FORMS))
def test_dpo_trains_only_the_active_blocks_adapters(base_model, tokenizer, tmp_path, form, gradient_checkpointing):
    # DPOTrainer runs its reference pass between the policy forward and the backward, under disable_adapter()
    _adapter_run("dpo", form, base_model, tokenizer, tmp_path, gradient_checkpointing)


def test_sft_mask_calibration_leaves_no_trace_in_the_trainers_metrics(base_model, tokenizer, tmp_path):
    # the calibration passes run SFTTrainer.compute_loss, which appends to its metrics (tokens seen, accuracy): with
    # B = 0 the first step's function does not depend on the masks, so its logs must equal a run without calibration
    # (all but grad_norm: the gradient of B does depend on them)
    logs = {}
    for init in ("importance", "magnitude"):
        lisa = LisaAdapterCallback(seed=0)
        trainer = make_trainer("sft", base_model(), tokenizer, trl_args("sft", tmp_path / init, False, max_steps=1),
                               [lisa], peft_config=adapter_config(**FORMS["sparse"], mask_init=init))
        trainer.train()
        assert [u["kind"] for u in lisa.mask_updates] == (["calibration"] if init == "importance" else [])
        (logs[init],) = [{k: v for k, v in h.items() if not k.startswith("lisa/") and k != "grad_norm"}
                         for h in trainer.state.log_history if "loss" in h]
    assert {"num_tokens", "mean_token_accuracy"} <= set(logs["importance"])
    assert logs["importance"] == logs["magnitude"]


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_without_the_callback_refuses_a_config_that_needs_the_schedule(base_model, tokenizer, tmp_path,
                                                                                    kind):
    # issue 22, item 5: with γ=1 of 4, every block's adapter used to move at every step, the schedule silently unused
    trainer = make_trainer(kind, base_model(), tokenizer, trl_args(kind, tmp_path, False), callbacks=None,
                           peft_config=adapter_config())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"lisa_activated_layers=1 .*SFTTrainer\(\.\.\., peft_config=config, "
                                           r"callbacks=\[LisaAdapterCallback\(\)\]\)"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_dpo_reference_log_probs_are_the_base_models_after_training(base_model, tokenizer, tmp_path):
    """Sparse masks and interpolation scalars must be off in the reference pass, as the adapters are."""
    config = adapter_config(sparsity=0.4, mask_init="magnitude", mask_update_interval=0, layer_interpolation=True)
    trainer = make_trainer("dpo", base_model(), tokenizer, trl_args("dpo", tmp_path, False, max_steps=3),
                           [LisaAdapterCallback(seed=0)], peft_config=config)
    trainer.train()
    batch = next(iter(trainer.get_train_dataloader()))
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, batch)

    base = base_model()
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["input_ids"][:, 1:]
        token_logps = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        logps = (token_logps * batch["completion_mask"][:, 1:]).sum(-1)
        policy = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    expected_chosen, expected_rejected = logps.chunk(2)
    torch.testing.assert_close(ref_chosen, expected_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_rejected, expected_rejected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(policy, logits), "the adapters did not train, so the reference check proves nothing"


# ----------------------------------------------------------------------------------------------------------------------
# layer interpolation: TRL optimises the penalty λ·Σβ² too
# ----------------------------------------------------------------------------------------------------------------------
class BetaGradient(TrainerCallback):
    """The gradient of β that the optimizer used (read after its step, whatever the order of the callbacks)."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grad = model.base_model.lisa_interp_beta["default"].grad.detach().clone()


@GRADIENT_CHECKPOINTING
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_optimises_the_interpolation_penalty(base_model, tokenizer, tmp_path, kind, gradient_checkpointing):
    """One step with λ = 0 and one with λ = 0.5, from the same weights, β and batch: the gradient of β that the
    optimizer used must differ by exactly ∂(λΣβ²)/∂β = 2λβ, and the logged penalty be λΣβ². TRL computes its losses
    from token log-probabilities (SFT) or preference margins (DPO), not from the model's ``outputs.loss``."""
    beta0 = torch.tensor([0.5, -1.0, 1.5, 2.0])

    def one_step(lam: float):
        probe = BetaGradient()
        args = trl_args(kind, tmp_path / f"lambda{lam}", gradient_checkpointing, max_steps=1,
                        per_device_train_batch_size=8, max_grad_norm=0.0)  # one batch: the whole dataset, unclipped
        trainer = make_trainer(kind, base_model(), tokenizer, args, [LisaAdapterCallback(seed=0), probe],
                               peft_config=adapter_config(layer_interpolation=True, interpolation_beta_l2=lam))
        with torch.no_grad():
            trainer.model.base_model.lisa_interp_beta["default"].copy_(beta0)
        trainer.train()
        logged = next(h for h in trainer.state.log_history if "loss" in h)
        return probe.grad, logged.get("lisa/interp_penalty")

    grad0, _ = one_step(0.0)
    grad1, penalty = one_step(0.5)
    torch.testing.assert_close(grad1 - grad0, 2 * 0.5 * beta0, rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"the gradient of β lacks the penalty's 2λβ: λΣβ² is not optimised\n{m}")
    assert penalty == pytest.approx(0.5 * float(beta0.pow(2).sum()), rel=1e-5), "lisa/interp_penalty not logged"


# ----------------------------------------------------------------------------------------------------------------------
# the example scripts
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_examples")
    return {
        "model": build_tiny_lm_dir(root / "model", num_layers=3),
        "sft": write_jsonl(root / "sft.jsonl", copy_task_rows(80, seed=0)),
        "dpo": write_jsonl(root / "dpo.jsonl", preference_rows(80)),
    }


def run_example(name: str, argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def _eval_losses(out: str) -> tuple[float, float]:
    line = next((line for line in out.splitlines() if line.startswith("eval loss:")), None)
    assert line, out[-2000:]
    before, after = line.removeprefix("eval loss:").split("->")
    return float(before), float(after)


@pytest.mark.parametrize("script, data", [("sft_trl.py", "sft"), ("dpo_trl.py", "dpo")])
def test_trl_example_trains_and_saves_a_lisa_adapter(tiny_files, tmp_path, monkeypatch, capsys, script, data):
    out = run_example(script, [
        "--model_name_or_path", tiny_files["model"], "--train_file", tiny_files[data], "--output_dir", str(tmp_path),
        "--max_steps", "12", "--learning_rate", "1e-2",  # sparse masks: 8 calibration steps (importance_steps)
    ], monkeypatch, capsys)
    before, after = _eval_losses(out)
    assert after < before
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LISA" and config["lisa_activated_layers"] == 2
    assert (tmp_path / "adapter_model.safetensors").exists()
