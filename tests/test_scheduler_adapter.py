"""Adapter-form LISA (LisaAdapterCallback): layerwise sampling of LISA adapters and sparse-mask re-selection."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa.tuner import masks as M
from hf_lisa.tuner.layer import LisaLayer
from hf_lisa.optim.state import unwrap_optimizer
from hf_lisa.scheduler import MaskScheduler
from hf_lisa.trainer_callbacks import LisaAdapterCallback


def _train(model, args, dataset, callbacks=()):
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.train()
    return trainer


def _lisa_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LisaLayer)]


def _block_of(name):
    return int(name.split(".layers.")[1].split(".")[0])


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_only_sampled_blocks_adapters_train_and_the_rest_stays_trainable(tiny_llama, token_dataset, training_args):
    config = hf_lisa.LisaConfig(
        r=4, target_modules=["q_proj", "v_proj"], lisa_activated_layers=1, lisa_interval_steps=2,
        layer_interpolation=True, modules_to_save=["lm_head"],
    )
    model = get_peft_model(tiny_llama(), config)
    before = _snapshot(model)
    lisa = LisaAdapterCallback(seed=0)
    trainer = _train(model, training_args(max_steps=4), token_dataset(), [lisa])

    scheduler = lisa.layer_scheduler
    assert lisa.mask_scheduler is None  # dense adapters: nothing to re-select
    assert [s for s, _ in scheduler.history] == [0, 2]
    ever = {b for _, blocks in scheduler.history for b in blocks}
    assert len(ever) <= 2
    after = dict(model.named_parameters())
    for name, value in before.items():
        moved = not torch.equal(after[name], value)
        if ".lisa_B." in name:
            assert moved == (_block_of(name) in ever), name
        elif ".lisa_A." in name and _block_of(name) not in ever:
            assert not moved, name  # never active: A untouched (B = 0 gives A no gradient on the first step only)
        elif "lisa_interp" in name or "modules_to_save" in name:
            assert moved, f"{name} must train throughout"
        elif "lisa_" not in name:
            assert not moved, f"base weight {name} moved"
    # interpolation scalars and the modules_to_save head are the always-trainable set, counted beside the blocks
    counts = scheduler.param_counts()
    assert counts["always_trainable"] == 2 * 4 + 64 * 32
    state_ids = {id(p) for p in unwrap_optimizer(trainer.optimizer).state}
    assert state_ids <= {id(p) for p in scheduler.trainable_parameters()}
    logged = [h["lisa/active_blocks"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [",".join(map(str, scheduler.history[i // 2][1])) for i in range(4)]


def test_gamma_zero_trains_every_adapter_without_sampling(tiny_llama, token_dataset, training_args):
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj"], sparsity=0.5, mask_update_interval=0,
                                mask_init="magnitude", lisa_activated_layers=0)
    model = get_peft_model(tiny_llama(), config)
    before = _snapshot(model)
    lisa = LisaAdapterCallback()
    _train(model, training_args(max_steps=3), token_dataset(), [lisa])
    assert lisa.layer_scheduler is None and lisa.mask_scheduler is not None
    for name, p in model.named_parameters():
        if ".lisa_B." in name:
            assert not torch.equal(p, before[name]), name


def _structure_ok(mask, structure):
    if structure == "block":
        grid = mask[::2, ::2]
        return torch.equal(M.expand_grid(grid, "block", (2, 2)), mask) and grid.float().mean().item() == 0.5
    groups = mask.reshape(mask.shape[0], -1, 4).sum(-1)
    return bool((groups == 2).all())


@pytest.mark.parametrize("structure", ["block", "n:m"])
def test_sparse_mask_is_reselected_on_schedule_keeps_structure_and_saved_mask_equals_live(
    tiny_llama, token_dataset, training_args, tmp_path, structure
):
    config = hf_lisa.LisaConfig(
        r=4, target_modules=["q_proj", "up_proj"], sparsity=0.5, sparsity_structure=structure, block_size=(2, 2),
        n_m=(2, 4), mask_init="importance", mask_update_interval=3, importance_steps=2, lisa_activated_layers=0,
    )
    model = get_peft_model(tiny_llama(), config)
    magnitude = {n: m.get_mask("default").clone() for n, m in _lisa_layers(model)}
    lisa = LisaAdapterCallback()
    trainer = _train(model, training_args(max_steps=9), token_dataset(), [lisa])

    # calibration before step 0 (2 steps' passes, nothing trained), then once per interval [3k, 3k+3) after a window
    # of 2 trainable steps
    assert [u["step"] for u in lisa.mask_updates] == [0, 5, 8]
    assert [u["kind"] for u in lisa.mask_updates] == ["calibration", "reselection", "reselection"]
    assert all(u["layers_updated"] == len(magnitude) for u in lisa.mask_updates)
    assert all(u["changed_fraction"] > 0 for u in lisa.mask_updates)
    for name, layer in _lisa_layers(model):
        live = layer.get_mask("default")
        assert _structure_ok(live, structure), name
        assert not torch.equal(live, magnitude[name])
    # the loss jump of each re-selection is measured on a fixed batch and reaches the Trainer's logs
    logged = [h for h in trainer.state.log_history if "lisa/mask_loss_jump" in h]
    assert [h["lisa/mask_update_step"] for h in logged] == [5, 8]
    for h, update in zip(logged, lisa.mask_updates[1:]):
        assert math.isfinite(h["lisa/mask_loss_jump"])
        assert h["lisa/mask_loss_jump"] == pytest.approx(h["lisa/mask_loss_after"] - h["lisa/mask_loss_before"])
        assert h["lisa/mask_loss_jump"] == update["loss_jump"]
    # the mask saved with the adapter is the live one
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    reloaded_layers = dict(_lisa_layers(reloaded))
    for name, layer in _lisa_layers(model):
        assert torch.equal(reloaded_layers[name].get_mask("default"), layer.get_mask("default")), name
    ids = token_dataset().input_ids[:2]
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def _record_training_batches(model):
    """Forward pre-hook on the base model: the (input_ids, labels) of every training micro-batch, in order."""
    seen = []

    def hook(module, args, kwargs):
        if module.training:
            seen.append((kwargs["input_ids"].clone(), kwargs["labels"].clone()))

    return seen, model.get_base_model().register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_first_mask_is_selected_from_calibration_gradients(tiny_llama, token_dataset, training_args, accumulation):
    importance_steps, examples_per_step = 2, 4
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance",
                                importance_steps=importance_steps, mask_update_interval=0)
    model = get_peft_model(tiny_llama(), config)
    magnitude = {n: m.get_mask("default").clone() for n, m in _lisa_layers(model)}
    batches, handle = _record_training_batches(model)
    lisa = LisaAdapterCallback()
    args = training_args(max_steps=1, per_device_train_batch_size=examples_per_step // accumulation,
                         gradient_accumulation_steps=accumulation)
    _train(model, args, token_dataset(), [lisa])
    handle.remove()
    assert [(u["step"], u["kind"]) for u in lisa.mask_updates] == [(0, "calibration")]

    # reference: B = 0 during calibration, so dL/d(W + ΔW) is the base weight's own gradient. Per calibration step (the
    # first forwards in training mode, before step 0's): the gradient of the step's whole batch (its micro-batches
    # summed, signed), then |.| pooled per 2x2 block, summed
    reference = tiny_llama()
    scores: dict[str, torch.Tensor] = {}
    for step in range(importance_steps):
        micro = batches[step * accumulation : (step + 1) * accumulation]
        reference.zero_grad()
        reference(input_ids=torch.cat([b[0] for b in micro]), labels=torch.cat([b[1] for b in micro])).loss.backward()
        for name, module in reference.named_modules():
            if name.endswith(("q_proj", "v_proj")):
                pooled = M.pool_scores(module.weight.grad.abs(), "block", (2, 2))
                scores[name] = pooled if name not in scores else scores[name] + pooled
    for name, layer in _lisa_layers(model):
        expected = M.select_mask(scores[name.removeprefix("base_model.model.")], "block", 0.5, (2, 2), pooled=True)
        assert torch.equal(layer.get_mask("default"), expected), name
        assert not torch.equal(expected, magnitude[name])
        assert not layer.lisa_track_importance and not layer.lisa_gradient_sinks


def test_importance_does_not_depend_on_the_accumulation_split(tiny_llama, token_dataset, training_args):
    # the same 4 examples per optimizer step, as one batch of 4 or two micro-batches of 2 (the signed gradient is
    # summed over micro-batches before |.|): identical masks, at calibration and at the re-selection
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance",
                                importance_steps=2, mask_update_interval=3)
    masks = []
    for accumulation in (1, 2):
        model = get_peft_model(tiny_llama(), config)
        lisa = LisaAdapterCallback()
        args = training_args(max_steps=6, per_device_train_batch_size=4 // accumulation,
                             gradient_accumulation_steps=accumulation, learning_rate=0.0)
        _train(model, args, token_dataset(), [lisa])
        assert [(u["step"], u["kind"]) for u in lisa.mask_updates] == [(0, "calibration"), (5, "reselection")]
        masks.append({n: m.get_mask("default") for n, m in _lisa_layers(model)})
    for name in masks[0]:
        assert torch.equal(masks[0][name], masks[1][name]), name


def test_new_block_bonus_protects_cells_switched_on_at_the_previous_update(tiny_llama):
    config = hf_lisa.LisaConfig(r=2, target_modules=["q_proj"], sparsity=0.5, mask_init="magnitude",
                                mask_update_interval=4, importance_steps=2, new_block_bonus=0.5)
    model = get_peft_model(tiny_llama(num_layers=1), config)
    scheduler = MaskScheduler(model)
    (name, layer), = scheduler.layers
    grid0 = layer.get_mask("default")[::2, ::2].clone()
    gen = torch.Generator().manual_seed(0)

    scheduler.mask_keep_learned = 0.0  # B = 0 here anyway; score by the importance alone
    scheduler.fresh[name] = False  # a re-selection, not the first calibration
    first = torch.rand(grid0.shape, generator=gen)
    scheduler.importance[name] = first.clone()
    scheduler.select(4, [name])
    grid1 = layer.get_mask("default")[::2, ::2].clone()
    new1 = grid1 & ~grid0
    assert torch.equal(scheduler.new_cells[name], new1) and new1.any()

    second = torch.rand(grid0.shape, generator=gen)
    scheduler.importance[name] = second.clone()
    scheduler.select(8, [name])
    boosted = M.add_new_block_bonus(M.reselection_scores(second, torch.zeros_like(second), 0.0), grid1, new1, 0.5)
    assert torch.equal(layer.get_mask("default"), M.select_mask(boosted, "block", 0.5, (2, 2), pooled=True))
    without_bonus = M.select_mask(second, "block", 0.5, (2, 2), pooled=True)[::2, ::2]
    kept_new = layer.get_mask("default")[::2, ::2] & new1
    assert kept_new.sum() > (without_bonus & new1).sum()  # the bonus kept cells that plain scores would drop


def test_adapter_callback_guard_rails(tiny_llama, token_dataset, training_args):
    with pytest.raises(ValueError, match="PeftModel with a LisaConfig"):
        _train(tiny_llama(), training_args(max_steps=1), token_dataset(), [LisaAdapterCallback()])
    model = get_peft_model(tiny_llama(), hf_lisa.LisaConfig(r=2, lisa_activated_layers=2))
    with pytest.raises(ValueError, match=r"lisa_activated_layers \(γ\)=5 is larger"):
        _train(model, training_args(max_steps=1), token_dataset(), [LisaAdapterCallback(lisa_activated_layers=5)])
    sparse = get_peft_model(tiny_llama(), hf_lisa.LisaConfig(r=2, sparsity=0.5, mask_update_interval=8))
    with pytest.raises(ValueError, match="mask_update_interval=2 is shorter than the importance window"):
        _train(sparse, training_args(max_steps=1), token_dataset(),
               [LisaAdapterCallback(mask_update_interval=2, importance_steps=4)])
    for kwargs, field in [
        ({"lisa_interval_steps": 0}, "lisa_interval_steps"),
        ({"lisa_sampling": "x"}, "lisa_sampling"),
        ({"lisa_activated_layers": -1}, "lisa_activated_layers"),
        ({"importance_steps": 0}, "importance_steps"),
    ]:
        with pytest.raises(ValueError, match=field):
            LisaAdapterCallback(**kwargs)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_calibration_gives_the_same_mask_under_activation_checkpointing(
    tiny_llama, token_dataset, training_args, use_reentrant
):
    # the importance hook sits on M ⊙ (B A) in the forward; checkpointing recomputes that forward in backward (and the
    # reentrant variant runs the first forward without grad): the hook must still see every step's gradient once
    config = dict(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, importance_steps=2, mask_update_interval=3)
    masks = []
    for checkpointing in (False, True):
        model = get_peft_model(tiny_llama(), hf_lisa.LisaConfig(**config))
        args = training_args(max_steps=6, learning_rate=0.0, gradient_checkpointing=checkpointing,
                             gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        lisa = LisaAdapterCallback()
        _train(model, args, token_dataset(), [lisa])
        assert [u["step"] for u in lisa.mask_updates] == [0, 5]
        masks.append([layer.get_mask("default") for _, layer in lisa.mask_scheduler.layers])
    assert all(torch.equal(a, b) for a, b in zip(*masks))


# -- calibration outside the training steps (issue 22, item 3) ---------------------------------------------------------
class _Steps(TrainerCallback):
    """Per optimizer step: the learning rate it used, every parameter before and after, and the gradients applied."""

    def __init__(self, model):
        self.model, self.lrs, self.before, self.after, self.grads = model, [], [], [], []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.before.append(_snapshot(self.model))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append(_snapshot(self.model))

    def moved(self, step, keyword):
        return any(not torch.equal(self.after[step][n], v) for n, v in self.before[step].items() if keyword in n)


def test_a_fresh_sparse_adapter_trains_from_the_first_step_with_a_learning_rate_and_follows_warmup(
    tiny_llama, token_dataset, training_args
):
    # before: the first importance_steps = 4 optimizer steps calibrated the masks with B held at 0, so the adapter
    # first moved at step 4, at the end of the warmup (lr 0.8 of the peak) with fresh optimizer state; warmup_steps had
    # no effect. Now the masks are calibrated before step 0 and B moves at every step whose lr is > 0.
    peak, warmup = 0.1, 5
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance",
                                importance_steps=4, mask_update_interval=0)
    model = get_peft_model(tiny_llama(), config)
    lisa, steps = LisaAdapterCallback(), _Steps(model)
    args = training_args(max_steps=7, optim="sgd", learning_rate=peak, lr_scheduler_type="linear",
                         warmup_steps=warmup, max_grad_norm=0.0)
    _train(model, args, token_dataset(), [lisa, steps])

    assert [(u["step"], u["kind"]) for u in lisa.mask_updates] == [(0, "calibration")]
    assert steps.lrs[:warmup] == pytest.approx([peak * t / warmup for t in range(warmup)])
    assert [steps.moved(t, ".lisa_B.") for t in range(7)] == [False] + [True] * 6  # lr(0) = 0 under linear warmup
    for t in range(1, 7):  # SGD: each update is exactly lr(t) times the gradient, B's included
        for name, grad in steps.grads[t].items():
            expected = steps.before[t][name] - steps.lrs[t] * grad
            torch.testing.assert_close(steps.after[t][name], expected, rtol=0, atol=1e-7, msg=name)
        assert any(".lisa_B." in name for name in steps.grads[t])


def test_a_block_sampled_later_trains_for_its_whole_first_period(tiny_llama, token_dataset, training_args):
    # before: a block sampled for the first time spent the first min(importance_steps, K // 2) steps of its period
    # calibrating with its update withheld. Now every fresh sparse layer is calibrated before step 0.
    config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance",
                                importance_steps=4, mask_update_interval=0, lisa_activated_layers=1,
                                lisa_interval_steps=4, lisa_sampling="cyclic")
    model = get_peft_model(tiny_llama(num_layers=2), config)
    lisa, steps = LisaAdapterCallback(seed=0), _Steps(model)
    _train(model, training_args(max_steps=8), token_dataset(), [lisa, steps])

    first, second = (blocks for _, blocks in lisa.layer_scheduler.history)
    assert first != second  # cyclic: the second period's block trains for the first time
    assert [(u["step"], u["kind"], u["layers_updated"]) for u in lisa.mask_updates] == [(0, "calibration", 4)]
    for t in range(8):
        (block,) = first if t < 4 else second
        assert steps.moved(t, f".layers.{block}.self_attn.q_proj.lisa_B."), t
    assert not lisa.mask_scheduler.withheld


# -- clipping and the logged grad_norm see only the gradients applied (issue 22, item 4) ------------------------------
class _ClipReference(TrainerCallback):
    """After each step, recomputes the update by hand: the step's batch from the parameters before it, the gradients
    the schedule applies (no withheld, no stray ones; the interpolation penalty's 2λβ added), clipped by
    ``torch.nn.utils.clip_grad_norm_``, times the (constant, SGD) learning rate."""

    def __init__(self, model, lisa, stray_blocks=()):
        self.model, self.lisa, self.stray_blocks = model, lisa, stray_blocks
        self.batches, self.norms, self.mismatches, self.clipped = [], [], [], []
        self._handle = model.get_base_model().register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self.batches.append({k: kwargs[k].clone() for k in ("input_ids", "labels")})

    def _stray(self, name):
        return any(f".layers.{b}." in name for b in self.stray_blocks) and ".lisa_" in name

    def on_step_begin(self, args, state, control, **kwargs):
        self.batches.clear()  # the LISA callback (first in the list) has calibrated by now
        for name, p in self.model.named_parameters():  # re-enabled behind the schedule: these get stray gradients
            if self._stray(name):
                p.requires_grad_(True)
        self.before = _snapshot(self.model)

    def on_step_end(self, args, state, control, **kwargs):
        model, masks = self.model, self.lisa.mask_scheduler
        withheld = {id(p) for p in masks.withheld} if masks is not None else set()
        applied = {n: p for n, p in model.named_parameters()
                   if p.requires_grad and id(p) not in withheld and not self._stray(n)}
        after = _snapshot(model)
        tracking = [masks.is_tracking(layer) for _, layer in masks.layers] if masks is not None else []
        if masks is not None:
            masks.set_tracking(False)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self.before.items():
                params[name].copy_(value)
        model.zero_grad(set_to_none=True)
        (batch,) = self.batches
        model(**batch).loss.backward()
        grads = {n: p.grad.clone() for n, p in applied.items() if p.grad is not None}
        tuner = model.base_model
        if "default" in getattr(tuner, "lisa_interp_beta", {}):
            lam = tuner.peft_config["default"].interpolation_beta_l2
            name = next(n for n, p in params.items() if p is tuner.lisa_interp_beta["default"])
            grads[name] = grads[name] + 2 * lam * self.before[name]
        copies = {n: torch.nn.Parameter(v.clone()) for n, v in self.before.items() if n in grads}
        for n, p in copies.items():
            p.grad = grads[n]
        norm = float(torch.nn.utils.clip_grad_norm_(list(copies.values()), args.max_grad_norm))
        self.norms.append(norm)
        self.clipped.append(norm > args.max_grad_norm)
        for n, p in copies.items():
            expected = self.before[n] - args.learning_rate * p.grad
            if not torch.allclose(after[n], expected, rtol=1e-5, atol=1e-8):
                self.mismatches.append((state.global_step - 1, n))
        for n in params:
            if n not in copies and not torch.equal(after[n], self.before[n]):
                self.mismatches.append((state.global_step - 1, f"{n} moved"))
        with torch.no_grad():
            for name, value in after.items():
                params[name].copy_(value)
        model.zero_grad(set_to_none=True)
        for (name, layer), flag in zip(masks.layers if masks is not None else [], tracking):
            masks.track(name, layer, flag)


CLIP_CASES = {
    # the mixed recipe: sparse q/v (calibrating), dense FFN adapters and a modules_to_save head training meanwhile
    "mixed-calibration": dict(
        config=dict(target_modules=["q_proj", "v_proj", "up_proj"], sparsity=0.5, sparsity_pattern={"up_proj": 0.0},
                    importance_steps=3, mask_update_interval=0, modules_to_save=["lm_head"]),
        stray_blocks=()),
    # the interpolation penalty's gradient 2λβ is part of the step's gradient
    "interpolation-penalty": dict(
        config=dict(target_modules=["q_proj"], layer_interpolation=True, interpolation_beta_l2=0.05), stray_blocks=()),
    # gradients that reach a frozen block behind the schedule are dropped, so they must not count
    "stray-gradients": dict(
        config=dict(target_modules=["q_proj", "v_proj"], lisa_activated_layers=1, lisa_interval_steps=8,
                    lisa_sampling="cyclic"), stray_blocks=(1,)),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clipping_and_the_logged_grad_norm_cover_exactly_the_gradients_applied(
    tiny_llama, token_dataset, training_args, case
):
    # before: the LISA callback withheld calibration gradients, dropped stray ones and added the penalty's at
    # on_pre_optimizer_step, after the Trainer had clipped and measured the norm
    spec = CLIP_CASES[case]
    model = get_peft_model(tiny_llama(num_layers=2), hf_lisa.LisaConfig(r=4, **spec["config"]))
    if case == "interpolation-penalty":
        with torch.no_grad():
            model.base_model.lisa_interp_beta["default"].copy_(torch.tensor([1.5, -2.0]))
    lisa = LisaAdapterCallback(seed=0)
    reference = _ClipReference(model, lisa, spec["stray_blocks"])
    args = training_args(max_steps=3, optim="sgd", learning_rate=0.1, lr_scheduler_type="constant",
                         max_grad_norm=0.05)
    trainer = _train(model, args, token_dataset(), [lisa, reference])

    assert all(reference.clipped), reference.norms  # the clip binds in every step
    assert not reference.mismatches, reference.mismatches
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged == pytest.approx(reference.norms, rel=1e-5)
