"""LISA stays correct in the training paths users take: reference passes under ``disable_adapter()``, trainers with
their own loss, gradient accumulation, label smoothing, continued training, classification heads, interpolation
bounds and weight decay, reporting integrations, and the long-run mask schedule.

Each test asserts on what trained (tensors compared bit for bit), on gradients or on logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa.tuner.layer import LisaLayer
from hf_lisa.tuner.schedule_guard import attach_schedule
from hf_lisa.scheduler import SCHEDULER_STATE_VERSION, LayerwiseScheduler, MaskScheduler
from hf_lisa.optim.state import unwrap_optimizer
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def _block_of(name):
    return int(name.split(".layers.")[1].split(".")[0])


class ReferencePassTrainer(Trainer):
    """Like TRL's DPO: a reference forward under ``disable_adapter()`` inside every training step.

    On leaving the context PEFT calls ``enable_adapters``, which sets ``requires_grad=True`` on every adapter of the
    active adapter name, frozen blocks included. The reference pass runs *between* the policy forward and its backward,
    where a flip also breaks activation checkpointing's recomputation ("Recomputed values ... different metadata").
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        with torch.no_grad(), model.disable_adapter():
            model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_reference_pass_under_disable_adapter_does_not_undo_layer_sampling(
    tiny_llama, token_dataset, training_args, checkpointing
):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], lisa_activated_layers=1,
                                lisa_interval_steps=10, init_weights=False)
    base = tiny_llama()
    model = get_peft_model(base, config)
    before = _snapshot(model)
    lisa = LisaAdapterCallback(seed=0)
    args = training_args(max_steps=3, gradient_checkpointing=checkpointing,
                         gradient_checkpointing_kwargs={"use_reentrant": False})
    ReferencePassTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[lisa]).train()

    (active,) = lisa.layer_scheduler.active
    changed = _changed(model, before)
    adapters = {n for n in before if ".lisa_" in n}
    assert changed == {n for n in adapters if _block_of(n) == active}


class OwnLossTrainer(Trainer):
    """A trainer that computes its own loss from the logits (as TRL's trainers do), never reading ``outputs.loss``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return loss


def test_mask_calibration_works_with_a_trainer_that_computes_its_own_loss(tiny_llama, token_dataset, training_args):
    # before: calibration called model(**batch)["loss"] on raw batches (a bare KeyError: 'loss' under TRL's DPO)
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], sparsity=0.5, importance_steps=2,
                                mask_update_interval=0)
    model = get_peft_model(tiny_llama(), config)
    provisional = {n: m.get_mask("default").clone() for n, m in model.named_modules() if isinstance(m, LisaLayer)}
    lisa = LisaAdapterCallback()
    OwnLossTrainer(model=model, args=training_args(max_steps=3), train_dataset=token_dataset(), callbacks=[lisa]).train()
    assert [(u["step"], u["kind"]) for u in lisa.mask_updates] == [(0, "calibration")]
    assert lisa.mask_scheduler.calibrated
    for name, layer in model.named_modules():
        if isinstance(layer, LisaLayer):
            assert not torch.equal(layer.get_mask("default"), provisional[name]), name


def test_sparse_adapters_hold_b_at_zero_while_calibrating(tiny_llama, token_dataset, training_args):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], sparsity=0.5, importance_steps=3,
                                mask_update_interval=0)
    model = get_peft_model(tiny_llama(), config)
    seen = []
    lisa = LisaAdapterCallback()

    class Probe(TrainerCallback):  # after the LISA callback: step 0's calibration has run
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append((len(lisa.mask_updates),
                         all(not m.lisa_B["default"].weight.any() for m in model.modules() if isinstance(m, LisaLayer))))

    Trainer(model=model, args=training_args(max_steps=5), train_dataset=token_dataset(),
            callbacks=[lisa, Probe()]).train()
    # the masks are calibrated before step 0 with B = 0 throughout (so the mask choice never changes the function);
    # B trains from step 0 on
    assert seen == [(1, True)] + [(1, False)] * 4


# -- the interpolation penalty -----------------------------------------------------------------------------------------
class BetaGradProbe(TrainerCallback):
    """Records β's gradient as the optimizer step begins (after the LISA callback, which runs first)."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(self.model.base_model.lisa_interp_beta["default"].grad.detach().clone())


def _beta_grad(tiny_llama, token_dataset, training_args, lam, trainer_cls=Trainer, **overrides):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], layer_interpolation=True, interpolation_beta_l2=lam)
    model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():
        model.base_model.lisa_interp_beta["default"].copy_(torch.tensor([0.5, -1.0, 0.25, 2.0]))
    probe = BetaGradProbe(model)
    lisa = LisaAdapterCallback()
    args = training_args(max_steps=1, learning_rate=0.0, **overrides)
    trainer = trainer_cls(model=model, args=args, train_dataset=token_dataset(), callbacks=[lisa, probe])
    trainer.train()
    logged = [h.get("lisa/interp_penalty") for h in trainer.state.log_history if "loss" in h]
    return probe.grads[0], logged


@pytest.mark.parametrize(
    "setting",
    [
        {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 4},
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 1},
        {"label_smoothing_factor": 0.1, "per_device_train_batch_size": 4},
        {"trainer_cls": OwnLossTrainer, "per_device_train_batch_size": 4},
    ],
    ids=["ga1", "ga2", "ga4", "label-smoothing", "own-loss"],
)
def test_interpolation_penalty_gradient_is_exactly_two_lambda_beta_per_step(
    tiny_llama, token_dataset, training_args, setting
):
    # before: the penalty joined outputs.loss, so it was multiplied by GA (0.02 / 0.04 / 0.08), and dropped by label
    # smoothing and by trainers that compute their own loss (TRL)
    beta = torch.tensor([0.5, -1.0, 0.25, 2.0])
    with_penalty, logged = _beta_grad(tiny_llama, token_dataset, training_args, 0.01, **setting)
    without, _ = _beta_grad(tiny_llama, token_dataset, training_args, 0.0, **setting)
    torch.testing.assert_close(with_penalty - without, 2 * 0.01 * beta, rtol=0, atol=1e-7)
    assert logged == [pytest.approx(0.01 * float(beta.pow(2).sum()))]


def test_plain_forward_still_adds_the_penalty_to_the_loss_outside_the_callback(tiny_llama):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], layer_interpolation=True)
    model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():
        model.base_model.lisa_interp_beta["default"].fill_(1.0)
    ids = torch.arange(8).reshape(1, 8)
    model.train()
    attach_schedule(model, owner="a custom loop")  # it declares that it runs the schedule (test_schedule_guard.py)
    with_penalty = model(input_ids=ids, labels=ids).loss
    model.base_model.interpolation_penalty_in_loss = False
    without = model(input_ids=ids, labels=ids).loss
    assert float(with_penalty - without) == pytest.approx(0.01 * 4, rel=1e-5)


def test_delta_stays_within_its_bound_with_a_live_gradient_and_no_weight_decay(tiny_llama, token_dataset, training_args):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], layer_interpolation=True, interpolation_delta_bound=0.5)
    model = get_peft_model(tiny_llama(), config)
    tuner = model.base_model
    with torch.no_grad():
        tuner.lisa_interp_delta["default"].fill_(0.5)  # at the bound: the clamp still passes gradient there
    grads = []

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            grads.append(tuner.lisa_interp_delta["default"].grad.clone())
            decay = {id(p): g["weight_decay"] for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]}
            assert decay[id(tuner.lisa_interp_delta["default"])] == 0.0
            assert decay[id(tuner.lisa_interp_beta["default"])] == 0.0

    args = training_args(max_steps=6, learning_rate=0.5, weight_decay=0.1)
    Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[LisaAdapterCallback(), Probe()]).train()
    delta = tuner.lisa_interp_delta["default"]
    assert float(delta.abs().max()) <= 0.5
    assert all(bool(g.ne(0).all()) for g in grads)  # never a dead gradient
    assert tuner.interpolation_penalty_in_loss  # handed back for plain loops after train()


# -- continued training ------------------------------------------------------------------------------------------------
def test_continuing_a_trained_sparse_adapter_keeps_its_masks(tiny_llama, token_dataset, training_args, tmp_path):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, importance_steps=2,
                                mask_update_interval=0)
    model = get_peft_model(tiny_llama(), config)
    Trainer(model=model, args=training_args(max_steps=4), train_dataset=token_dataset(),
            callbacks=[LisaAdapterCallback()]).train()
    model.save_pretrained(tmp_path / "adapter")

    resumed = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter", is_trainable=True)
    masks = {n: m.get_mask("default").clone() for n, m in resumed.named_modules() if isinstance(m, LisaLayer)}
    ids = token_dataset().input_ids[:2]
    resumed.eval()
    with torch.no_grad():
        logits = resumed(input_ids=ids).logits
    lisa = LisaAdapterCallback()
    Trainer(model=resumed, args=training_args(max_steps=4, learning_rate=0.0), train_dataset=token_dataset(),
            callbacks=[lisa]).train()
    assert lisa.mask_updates == []
    for name, layer in resumed.named_modules():
        if isinstance(layer, LisaLayer):
            assert torch.equal(layer.get_mask("default"), masks[name]), name
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(resumed(input_ids=ids).logits, logits)


# -- task heads ----------------------------------------------------------------------------------------------------------
def _tiny_llama_classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    return LlamaForSequenceClassification(config)


class LabelledTokens(torch.utils.data.Dataset):
    def __init__(self, n=32):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (n, 8), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": int(self.ids[i, 0] % 3)}


@pytest.mark.parametrize("build", ["llama", "bert"])
def test_lisa_callback_trains_task_heads_by_default(training_args, build, caplog):
    from tiny_models import tiny_bert

    model = _tiny_llama_classifier() if build == "llama" else tiny_bert(num_layers=4, num_labels=3)
    heads = ("score.",) if build == "llama" else ("classifier.", "bert.pooler.")
    before = _snapshot(model)
    with caplog.at_level("INFO", logger="hf_lisa.trainer_callbacks"):
        Trainer(model=model, args=training_args(max_steps=2), train_dataset=LabelledTokens(),
                callbacks=[LisaCallback(lisa_activated_layers=1)]).train()
    moved = _changed(model, before)
    head_names = {n for n in before if n.startswith(heads)}
    assert head_names and head_names <= moved
    assert any("task-head parameters" in r.message and heads[0].rstrip(".") in r.message for r in caplog.records)


def test_always_trainable_still_narrows_the_heads(training_args):
    model = _tiny_llama_classifier()
    before = _snapshot(model)
    Trainer(model=model, args=training_args(max_steps=2), train_dataset=LabelledTokens(),
            callbacks=[LisaCallback(lisa_activated_layers=1, lisa_always_trainable=("embeddings",))]).train()
    assert not any(n.startswith("score.") for n in _changed(model, before))


# -- reporting integrations ------------------------------------------------------------------------------------------
def test_lisa_callbacks_run_before_the_reporting_integrations(tiny_llama, token_dataset, training_args):
    from transformers.integrations import TensorBoardCallback

    from hf_lisa.trainer_callbacks import prepare_trainer

    lisa = LisaCallback(lisa_activated_layers=1)
    trainer = Trainer(model=tiny_llama(), args=training_args(max_steps=1, report_to=["tensorboard"]),
                      train_dataset=token_dataset(), callbacks=[lisa])
    prepare_trainer(trainer)  # hands the Trainer over (tests/test_trainer_handover.py: without it, nothing moves)
    order = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert order.index(LisaCallback) < order.index(TensorBoardCallback)


# -- the long-run mask schedule ------------------------------------------------------------------------------------------
def _simulate(num_blocks, lisa_kwargs, steps):
    """Drive the real schedulers through ``steps`` optimizer steps of a tiny model, with synthetic gradients."""
    from conftest import build_tiny_llama

    config = hf_lisa.LisaConfig(r=2, target_modules=["q_proj"], sparsity=0.5, **lisa_kwargs)
    model = get_peft_model(build_tiny_llama(num_layers=num_blocks, hidden=8), config)
    layers = LayerwiseScheduler.for_adapter(model, seed=0)
    masks = MaskScheduler(model, lisa_interval_steps=layers.lisa_interval_steps)
    masks.start(0)
    layers.freeze_all_but_active()
    gen = torch.Generator().manual_seed(0)
    active_at, selections = [], []
    for step in range(steps):
        layers.maybe_switch(step)
        active_at.append(set(layers.active))
        for record in masks.step(step):
            selections += [(step, _block_of(name), record["kind"]) for name in record["layers"]]
        for name, layer in masks.layers:  # what the backward pass would hand the scheduler in this step
            if masks.is_tracking(layer):
                layer.lisa_gradient_sinks["default"](torch.randn(layer.out_features, layer.in_features, generator=gen))
        masks.end_step()
    return active_at, selections, config


@pytest.mark.parametrize(
    "lisa_kwargs",
    [
        # examples/configs/smollm2_lisa_adapter.yaml on SmolLM2's 30 blocks
        dict(mask_update_interval=50, importance_steps=8, lisa_activated_layers=4, lisa_interval_steps=20),
        # LisaConfig's defaults, with the paper's gamma = 2
        dict(lisa_activated_layers=2),
    ],
    ids=["shipped-adapter-config", "defaults"],
)
def test_every_sparse_layer_is_reselected_in_every_interval_its_block_trains(lisa_kwargs):
    steps = 2000
    active_at, selections, config = _simulate(30, lisa_kwargs, steps)
    u = config.mask_update_interval
    # never in a step in which the block does not train (the step that freezes it included)
    assert all(block in active_at[step] for step, block, _ in selections)
    # calibration first, then exactly one re-selection per interval in which the block trained
    for block in range(30):
        trained = {s // u for s in range(steps) if block in active_at[s]}
        mine = [(s, kind) for s, b, kind in selections if b == block]
        calibrations = [s for s, kind in mine if kind == "calibration"]
        reselections = [s // u for s, kind in mine if kind == "reselection"]
        assert len(calibrations) == (1 if trained else 0), block
        first = calibrations[0] // u if calibrations else None
        assert sorted(reselections) == sorted(k for k in trained if k != first), block


def test_mask_schedule_from_an_older_checkpoint_format_is_refused_with_a_clear_error(tiny_llama):
    config = hf_lisa.LisaConfig(r=2, target_modules=["q_proj"], sparsity=0.5)
    scheduler = MaskScheduler(get_peft_model(tiny_llama(num_layers=1), config))
    state = scheduler.state_dict()
    state["version"] = 1  # written before per-layer calibration and re-selection
    with pytest.raises(ValueError, match=f"version 1 .* reads version {SCHEDULER_STATE_VERSION}"):
        scheduler.load_state_dict(state)
