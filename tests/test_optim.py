"""Layer-wise learning-rate decay: the per-block rates of the formula, read back from the Trainer's optimizer."""

from __future__ import annotations

import pytest
import torch
from conftest import TokenDataset, build_tiny_llama, build_training_args

from hf_lisa.scheduler.param_groups import assign_param_groups, layerwise_lr, layerwise_lr_decay_param_groups
from hf_lisa.trainer import LisaTrainer


def _group_lrs(optimizer) -> dict[str, float]:
    return {group["name"]: group["lr"] for group in optimizer.param_groups}


def test_trainer_optimizer_has_the_formula_rates_per_block(tmp_path):
    lr, decay, n = 1e-3, 0.5, 4
    model = build_tiny_llama(num_layers=n)
    trainer = LisaTrainer(
        model=model, args=build_training_args(tmp_path, learning_rate=lr, weight_decay=0.1),
        train_dataset=TokenDataset(8), layerwise_lr_decay=decay,
    )
    optimizer = trainer.create_optimizer()
    lrs = _group_lrs(optimizer)
    # lr_l = lr * d^(N-1-l) for block l; embeddings lr * d^N; head (lm_head, final norm) lr
    assert lrs["embeddings"] == pytest.approx(lr * 0.5**4)
    for block in range(n):
        assert lrs[f"block.{block}"] == pytest.approx(lr * 0.5 ** (n - 1 - block))
    assert lrs["head"] == pytest.approx(lr)
    # norms and biases keep the Trainer's no-weight-decay rule, at their block's rate
    assert lrs["block.0/no_decay"] == pytest.approx(lrs["block.0"])
    decays = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decays["block.0"] == 0.1 and decays["block.0/no_decay"] == 0.0
    # every parameter is in exactly one group
    in_groups = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(in_groups) == sorted(id(p) for p in model.parameters())


def test_scheduler_keeps_the_ratios_between_blocks(tmp_path):
    model = build_tiny_llama(num_layers=3)
    trainer = LisaTrainer(
        model=model,
        args=build_training_args(tmp_path, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine"),
        train_dataset=TokenDataset(16), layerwise_lr_decay=0.8,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    for _ in range(4):  # past warmup, into the cosine decay
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    lrs = _group_lrs(trainer.optimizer)
    assert 0 < lrs["head"] < 1e-3
    assert lrs["block.0"] / lrs["block.2"] == pytest.approx(0.8**2)
    assert lrs["embeddings"] / lrs["head"] == pytest.approx(0.8**3)
    # the head group comes first: the Trainer logs the first group's rate as `learning_rate`
    assert trainer.optimizer.param_groups[0]["name"] == "head"
    assert trainer._get_learning_rate() == pytest.approx(lrs["head"])


def test_full_parameter_lisa_keeps_every_block_in_the_optimizer(tmp_path):
    from hf_lisa.trainer_callbacks import LisaCallback

    model = build_tiny_llama(num_layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=1, lisa_sampling="cyclic", seed=0)
    trainer = LisaTrainer(
        model=model, args=build_training_args(tmp_path, learning_rate=1e-2, max_steps=4),
        train_dataset=TokenDataset(16), callbacks=[callback], layerwise_lr_decay=0.9,
    )
    trainer.train()
    names = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert names == {id(p) for p in model.parameters()}
    # cyclic sampling with K=1 visits every block once in 4 steps: every block moved, at its own rate
    for block in range(4):
        weight = f"model.layers.{block}.self_attn.q_proj.weight"
        assert not torch.equal(before[weight], model.get_parameter(weight).detach()), weight


def test_assignment_through_a_peft_wrapper_puts_adapters_in_their_block():
    import hf_lisa
    from peft import get_peft_model

    model = get_peft_model(build_tiny_llama(num_layers=2), hf_lisa.LisaConfig(r=2))
    assignment, n = assign_param_groups(model)
    assert n == 2
    lisa_names = [name for name in assignment if "lisa_A" in name]
    assert lisa_names and all(assignment[name].startswith("block.") for name in lisa_names)
    groups = layerwise_lr_decay_param_groups(model, lr=1.0, decay=0.5)
    assert {g["name"]: g["lr"] for g in groups} == {"block.0": 0.5, "block.1": 1.0}


def test_formula_helper_and_invalid_decay():
    assert layerwise_lr(2.0, 0.5, 3, "block.0") == 0.5
    assert layerwise_lr(2.0, 0.5, 3, "embeddings") == 0.25
    with pytest.raises(ValueError, match=r"layerwise_lr_decay=1.5 is invalid; allowed: a float in \(0, 1\]"):
        layerwise_lr_decay_param_groups(build_tiny_llama(num_layers=2), lr=1e-3, decay=1.5)
