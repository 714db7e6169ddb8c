"""Issue 34, item 1: the LISA callbacks are complete on their own, in any ``Trainer``.

A LISA callback added to a plain ``transformers.Trainer``, to a third-party ``Trainer`` subclass that overrides
``training_step`` and ``compute_loss`` (calling ``super()``), and to TRL's ``SFTTrainer`` / ``DPOTrainer`` trains
the same weights, bit for bit (``torch.equal`` on every entry of the state dict, sparse masks included), as hf-lisa's
own trainer on the same loss:

* plain ``Trainer`` and the foreign subclass against :class:`hf_lisa.train.LisaTrainer`;
* ``SFTTrainer`` against ``LisaTrainer`` composed over ``SFTTrainer`` (as ``LisaDPOTrainer`` is over ``DPOTrainer``):
  TRL computes the SFT loss with its fused LM head, which agrees with the model's loss only to float rounding
  (~1e-6 after 6 steps here), so a plain ``LisaTrainer`` is not the reference for it (it is checked to be close);
* ``DPOTrainer`` (``peft_config=LisaConfig``, as docs/trl.md shows) against ``hf_lisa.trainer.trl.LisaDPOTrainer`` on
  a ``PeftModel`` built beforehand (as ``hf-lisa train --stage dpo`` does).

``LisaTrainer`` runs with ``chunked_loss=False`` throughout: its default chunked causal-LM loss is a different loss
kernel (equal to rounding, not bit for bit: ``tests/test_chunked_loss.py``), unrelated to the LISA schedule. Every
other ``LisaTrainer`` option is at its default (its progress guard and whole-run loss callbacks included).

The forms: full-parameter ``LisaCallback`` (γ = 1 of 4 blocks, K = 3, 6 steps: two blocks train, two never do) and
``LisaAdapterCallback`` with dense adapters, sparse adapters (ρ = 0.5: the first masks calibrated before step 0
through the trainer's own ``compute_loss``, a re-selection inside the run) and layer interpolation (the penalty's
gradient ``2λβ``), γ = 1 of 4 blocks, K = 2. Cases run with gradient accumulation (2 micro-batches) and a binding
clip (``max_grad_norm`` below every step's gradient norm, checked), others without. Every run also records, per
optimizer step, which parameters changed: only the active block's (and what trains throughout), and the active
block's did.

One thing needs the Trainer itself, which a Trainer does not hand its callbacks: calibrating the first sparse masks
through *its* ``compute_loss`` (TRL's DPO loss, a subclass's own). So the sparse runs in the users' Trainers hand it
over with ``hf_lisa.trainer_callbacks.prepare_trainer(trainer)``, as ``LisaTrainer`` does itself; without it the
callback calibrates on the model's own loss (or, on DPO's batches without labels, in training) and warns
(``tests/test_trainer_handover.py``). Every other form runs with the callback alone.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa.trainer import LisaTrainer
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback, prepare_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
    pytest.mark.slow,  # ~30 tiny training runs of 6 steps, TRL's included
]

NUM_BLOCKS, STEPS = 4, 6
ALWAYS_TRAINABLE = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")  # E+H+final norm

#: full-parameter LISA: γ = 1, K = 3; seed 3 draws block 2 then block 3 (blocks 0 and 1 never train)
FULL = dict(lisa_activated_layers=1, lisa_interval_steps=3, seed=3)
#: training settings per case: gradient accumulation and a clip that binds (every grad_norm is above it), or neither
ACCUMULATE_CLIP = dict(gradient_accumulation_steps=2, max_grad_norm=1e-3)
ONE_PASS_NO_CLIP = dict(gradient_accumulation_steps=1, max_grad_norm=0.0)
FULL_CASES = {"accumulate-clip": ACCUMULATE_CLIP, "one-pass": ONE_PASS_NO_CLIP}
#: LISA adapter forms: (LisaConfig settings, training settings)
ADAPTER_FORMS = {
    "dense": (dict(), ONE_PASS_NO_CLIP),
    "sparse": (dict(sparsity=0.5, importance_steps=1, mask_update_interval=2), ACCUMULATE_CLIP),
    "interpolation": (dict(layer_interpolation=True, interpolation_beta_l2=0.5), ACCUMULATE_CLIP),
}
ADAPTER_SEED = 1  # the adapter callback's sampler seed


def adapter_config(**form) -> hf_lisa.LisaConfig:
    return hf_lisa.LisaConfig(
        task_type="CAUSAL_LM", r=4, lisa_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
        lisa_activated_layers=1, lisa_interval_steps=2, **form,
    )


def peft_model(base, config: hf_lisa.LisaConfig):
    from peft import get_peft_model

    torch.manual_seed(0)  # the adapters' A are drawn from the global generator
    return get_peft_model(base, config)


class Foreign(Trainer):
    """A third party's Trainer subclass (axolotl, LLaMA-Factory style): its own ``training_step`` and ``compute_loss``,
    each calling ``super()``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.training_steps = self.loss_calls = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.training_steps += 1
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.loss_calls += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def lisa_sft_trainer_class():
    """``LisaTrainer`` over TRL's ``SFTTrainer``: the library face's :class:`hf_lisa.trainer.trl.LisaSFTTrainer`."""
    from hf_lisa.trainer.trl import LisaSFTTrainer

    return LisaSFTTrainer


# ----------------------------------------------------------------------------------------------------------------------
# what trained, step by step
# ----------------------------------------------------------------------------------------------------------------------
class WhatTrained(TrainerCallback):
    """Per optimizer step: the active blocks (read after the LISA callback's switch: it must come after it in
    ``callbacks``) and the names of the parameters whose values changed."""

    def __init__(self, lisa) -> None:
        self.lisa = lisa
        self.steps: list[tuple[list[int], set[str]]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._active = list(self.lisa.layer_scheduler.active)
        self._before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), self._before[n])}
        self.steps.append((self._active, changed))


def block_of(name: str) -> Optional[int]:
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None


def full_parameter_may_train(name: str, active) -> bool:
    return name.split("base_model.model.")[-1] in ALWAYS_TRAINABLE or block_of(name) in active


def adapter_may_train(name: str, active) -> bool:
    if "lisa_interp_" in name:  # the interpolation scalars train throughout
        return True
    return ".lisa_" in name and block_of(name) in active


def assert_schedule_kept(record: WhatTrained, names: list[str], may_train: Callable[[str, list], bool],
                         must_train: Callable[[str, list], bool]) -> None:
    assert len(record.steps) == STEPS
    trained_blocks = set()
    for step, (active, changed) in enumerate(record.steps):
        assert len(active) == 1, f"step {step}: active blocks {active}, expected γ = 1"
        trained_blocks.update(active)
        outside = sorted(n for n in changed if not may_train(n, active))
        assert not outside, f"step {step}: only block {active} may train, but these changed: {outside}"
        missing = sorted(n for n in names if must_train(n, active) and n not in changed)
        assert not missing, f"step {step}: block {active} is active but these did not change: {missing}"
    # the schedule switched inside the run, and some block never trained (it must not have moved: checked above)
    assert len(trained_blocks) >= 2, f"no switch to another block in {STEPS} steps: {record.steps}"
    assert len(trained_blocks) < NUM_BLOCKS, "every block trained: nothing frozen throughout to check"


def assert_clip_binds(trainer, args: dict) -> None:
    """Every step's gradient norm is above ``max_grad_norm``: the clip scaled every update."""
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == STEPS
    if args["max_grad_norm"]:
        assert min(norms) > args["max_grad_norm"], norms


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(trained: dict, reference: dict, what: str) -> None:
    assert trained.keys() == reference.keys()
    differ = {k: float((trained[k].float() - reference[k].float()).abs().max())
              for k in reference if not torch.equal(trained[k], reference[k])}
    assert not differ, f"{what}: {len(differ)} tensor(s) differ from the reference (max |Δ|): {differ}"


def assert_moved(trained: dict, initial: dict) -> None:
    moved = [k for k in initial if not torch.equal(trained[k], initial[k])]
    assert moved, "nothing trained: the equality proves nothing"


# ----------------------------------------------------------------------------------------------------------------------
# plain Trainer and a foreign subclass against LisaTrainer (the model's own loss)
# ----------------------------------------------------------------------------------------------------------------------
PLAIN_TRAINERS = {"Trainer": Trainer, "Foreign": Foreign}
_references: dict = {}  # (form, case) -> the LisaTrainer run's trained weights: one per module


def _plain_run(cls, form: str, make_model, dataset, training_args, settings: dict):
    """Train ``form`` ("full" or an adapter form) with ``cls``, checking the schedule step by step; returns
    (trainer, LISA callback, trained weights)."""
    base = make_model(num_layers=NUM_BLOCKS)
    if form == "full":
        model, lisa = base, LisaCallback(**FULL)
    else:
        model, lisa = peft_model(base, adapter_config(**ADAPTER_FORMS[form][0])), LisaAdapterCallback(seed=ADAPTER_SEED)
    record = WhatTrained(lisa)
    initial = state_of(model)
    args = training_args(max_steps=STEPS, **settings)
    extra = dict(chunked_loss=False) if cls is LisaTrainer else {}
    trainer = cls(model=model, args=args, train_dataset=dataset(), callbacks=[lisa, record], **extra)
    if form == "sparse":  # the first masks calibrate through the Trainer's own loss once it is handed over
        prepare_trainer(trainer)
    trainer.train()
    names = [n for n, _ in model.named_parameters()]
    if form == "full":
        assert_schedule_kept(record, names, full_parameter_may_train, full_parameter_may_train)
    else:
        def must_train(name, active):  # B of the active block (A gets no gradient while its B is 0); the scalars
            return (".lisa_B." in name and block_of(name) in active) or "lisa_interp_beta" in name

        assert_schedule_kept(record, names, adapter_may_train, must_train)
        assert all(torch.equal(initial[k], v) for k, v in state_of(model).items() if ".lisa_" not in k
                   and "lisa_interp" not in k and "lisa_mask" not in k), "a base weight moved"
    assert_clip_binds(trainer, settings)
    trained = state_of(model)
    assert_moved(trained, initial)
    return trainer, lisa, trained


def _plain_reference(form: str, case: str, make_model, dataset, training_args, settings: dict) -> dict:
    if (form, case) not in _references:
        _references[form, case] = _plain_run(LisaTrainer, form, make_model, dataset, training_args, settings)[2]
    return _references[form, case]


@pytest.mark.parametrize("trainer_name", list(PLAIN_TRAINERS))
@pytest.mark.parametrize("case", list(FULL_CASES))
def test_full_parameter_callback_trains_what_lisa_trainer_trains(tiny_llama, token_dataset, training_args,
                                                                 trainer_name, case):
    settings = FULL_CASES[case]
    reference = _plain_reference("full", case, tiny_llama, token_dataset, training_args, settings)
    trainer, lisa, trained = _plain_run(PLAIN_TRAINERS[trainer_name], "full", tiny_llama, token_dataset,
                                        training_args, settings)
    assert [blocks for _, blocks in lisa.layer_scheduler.history] == [[2], [3]]
    assert_same_weights(trained, reference, f"LisaCallback in {trainer_name}")
    if isinstance(trainer, Foreign):  # its overrides ran: one training_step and one loss per micro-batch
        assert trainer.training_steps == trainer.loss_calls == STEPS * settings["gradient_accumulation_steps"]


@pytest.mark.parametrize("trainer_name", list(PLAIN_TRAINERS))
@pytest.mark.parametrize("form", list(ADAPTER_FORMS))
def test_adapter_callback_trains_what_lisa_trainer_trains(tiny_llama, token_dataset, training_args, trainer_name,
                                                          form):
    settings = ADAPTER_FORMS[form][1]
    reference = _plain_reference(form, "adapters", tiny_llama, token_dataset, training_args, settings)
    trainer, lisa, trained = _plain_run(PLAIN_TRAINERS[trainer_name], form, tiny_llama, token_dataset,
                                        training_args, settings)
    assert_same_weights(trained, reference, f"LisaAdapterCallback ({form}) in {trainer_name}")
    calibration = [u for u in lisa.mask_updates if u["kind"] == "calibration"]
    if form == "sparse":  # the first masks came from the trainer's loss before step 0; re-selected inside the run
        assert [u["step"] for u in calibration] == [0], lisa.mask_updates
        assert any(u["kind"] == "reselection" for u in lisa.mask_updates), lisa.mask_updates
    if isinstance(trainer, Foreign):  # the calibration passes (1 step of `micro` batches) went through its compute_loss
        micro = settings["gradient_accumulation_steps"]
        assert trainer.training_steps == STEPS * micro
        assert trainer.loss_calls == STEPS * micro + (micro if calibration else 0)


# ----------------------------------------------------------------------------------------------------------------------
# TRL: SFTTrainer against LisaTrainer over SFTTrainer, DPOTrainer against LisaDPOTrainer
# ----------------------------------------------------------------------------------------------------------------------
TRL_FORMS = ["full", *ADAPTER_FORMS]


def trl_config(kind: str, output_dir, settings: dict, **overrides):
    import trl

    kwargs = dict(
        max_steps=STEPS, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, bf16=False, seed=0, data_seed=0, dataloader_num_workers=0, gradient_checkpointing=False,
        **settings, **overrides,
    )
    return (trl.SFTConfig if kind == "sft" else trl.DPOConfig)(str(output_dir), **kwargs)


def _trl_run(kind: str, ours: bool, form: str, make_model, tmp_path):
    """SFT or DPO of ``form`` with TRL's trainer (``ours=False``) or hf-lisa's; returns (trainer, initial, trained)."""
    import datasets
    import trl

    from train_fixtures import build_char_tokenizer, copy_task_rows

    tokenizer = build_char_tokenizer()
    settings = ACCUMULATE_CLIP if form == "full" else ADAPTER_FORMS[form][1]
    vocab = 64 if kind == "sft" else 128  # SFT: the plain tests' token ids; DPO: the character tokenizer's
    base = make_model(num_layers=NUM_BLOCKS, vocab=vocab)
    base.config.pad_token_id, base.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = None if form == "full" else adapter_config(**ADAPTER_FORMS[form][0])
    lisa = LisaCallback(**FULL) if form == "full" else LisaAdapterCallback(seed=ADAPTER_SEED)
    record = WhatTrained(lisa)
    args = trl_config(kind, tmp_path / f"{kind}-{form}-{ours}", settings,
                      **(dict(per_device_train_batch_size=2) if kind == "sft" else
                         dict(per_device_train_batch_size=4, max_length=32)))
    common = dict(args=args, processing_class=tokenizer, callbacks=[lisa, record])
    if kind == "sft":  # pre-tokenised: the same ids as the plain Trainer tests
        from conftest import TokenDataset

        common["train_dataset"] = datasets.Dataset.from_dict({"input_ids": TokenDataset().input_ids.tolist()})
        cls = lisa_sft_trainer_class() if ours else trl.SFTTrainer
        torch.manual_seed(0)  # SFTTrainer wraps the model with the LisaConfig: the adapters' A are drawn
        kwargs = dict(model=base, peft_config=config, **common)
    else:
        shift = str.maketrans("abcdefgh", "bcdefghi")
        rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"].translate(shift)}
                for r in copy_task_rows(16, seed=0)]
        common["train_dataset"] = datasets.Dataset.from_list(rows)
        ref_model = None
        if form == "full":
            ref_model = make_model(num_layers=NUM_BLOCKS, vocab=vocab)
        if ours:  # hf-lisa's way: the model wrapped before the trainer (apply_method), TRL's "ref" copy dropped
            from hf_lisa.trainer.trl import LisaDPOTrainer

            cls, model = LisaDPOTrainer, base if config is None else peft_model(base, config)
            kwargs = dict(model=model, ref_model=ref_model, **common)
        else:  # as docs/trl.md shows: TRL wraps the model with the LisaConfig
            cls = trl.DPOTrainer
            torch.manual_seed(0)
            kwargs = dict(model=base, ref_model=ref_model, peft_config=config, **common)
    if ours:
        kwargs["chunked_loss"] = False
    trainer = cls(**kwargs)
    if form == "sparse":  # the first masks calibrate through the Trainer's own loss once it is handed over
        prepare_trainer(trainer)
    model = trainer.model
    initial = state_of(model)
    trainer.train()
    names = [n for n, _ in model.named_parameters()]
    if form == "full":
        assert_schedule_kept(record, names, full_parameter_may_train, full_parameter_may_train)
    else:
        def must_train(name, active):
            return (".lisa_B." in name and block_of(name) in active) or "lisa_interp_beta" in name

        assert_schedule_kept(record, names, adapter_may_train, must_train)
    assert_clip_binds(trainer, settings)
    trained = state_of(model)
    assert_moved(trained, initial)
    return trainer, initial, trained


@pytest.mark.parametrize("form", TRL_FORMS)
def test_sft_trainer_with_the_callback_trains_what_lisa_trainer_trains(tiny_llama, tmp_path, form):
    pytest.importorskip("trl", reason="TRL is the optional extra hf-lisa[trl]")
    _, initial_ours, reference = _trl_run("sft", True, form, tiny_llama, tmp_path)
    _, initial, trained = _trl_run("sft", False, form, tiny_llama, tmp_path)
    assert_same_weights(initial, initial_ours, "the initial weights")
    assert_same_weights(trained, reference, f"SFTTrainer + LISA callback ({form})")


def test_sft_trainer_trains_the_plain_trainers_loss(tiny_llama, token_dataset, training_args, tmp_path):
    """The SFT cases train the same loss as the plain ones: TRL's fused LM head agrees with the model's loss to float
    rounding (so bit-for-bit comparisons pair SFTTrainer with LisaTrainer over SFTTrainer)."""
    pytest.importorskip("trl", reason="TRL is the optional extra hf-lisa[trl]")
    _, _, sft = _trl_run("sft", False, "full", tiny_llama, tmp_path)
    plain = _plain_reference("full", "accumulate-clip", tiny_llama, token_dataset, training_args, ACCUMULATE_CLIP)
    assert sft.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(sft[name], plain[name], rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form", TRL_FORMS)
def test_dpo_trainer_with_the_callback_trains_what_lisa_dpo_trainer_trains(tiny_llama, tmp_path, form):
    pytest.importorskip("trl", reason="TRL is the optional extra hf-lisa[trl]")
    _, initial_ours, reference = _trl_run("dpo", True, form, tiny_llama, tmp_path)
    _, initial, trained = _trl_run("dpo", False, form, tiny_llama, tmp_path)
    assert_same_weights(initial, initial_ours, "the initial weights")
    assert_same_weights(trained, reference, f"DPOTrainer + LISA callback ({form})")
