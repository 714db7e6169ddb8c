"""The monitoring callback: its scalars reach TensorBoard's event files, and gradient plateaus are reported."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from conftest import TokenDataset, build_tiny_llama, build_training_args
from transformers import Trainer

from hf_lisa.trainer_callbacks import LisaCallback
from hf_lisa.trainer_callbacks.monitoring import GradientPlateauWarning, TrainingMonitorCallback


def _read_scalars(output_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(str(output_dir), "runs", "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no TensorBoard event file under {output_dir}"
    scalars: dict[str, list] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def test_monitor_scalars_are_written_to_tensorboard(tmp_path):
    model = build_tiny_llama(num_layers=4)
    args = build_training_args(tmp_path / "out", max_steps=6, logging_steps=2, report_to=["tensorboard"],
                               learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(32),
                      callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=0)])
    monitor = TrainingMonitorCallback(num_block_groups=2).attach(trainer)
    trainer.train()
    scalars = _read_scalars(tmp_path / "out")

    for tag in ("grad_norm", "grad_norm_applied", "active_blocks", "trainable_params", "optimizer_state_bytes",
                "update_ratio/embeddings", "update_ratio/blocks_00-01", "update_ratio/blocks_02-03",
                "update_ratio/head"):
        assert f"train/monitor/{tag}" in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars["train/monitor/grad_norm"]] == [2, 4, 6]
    # γ = 1: one active block at every logged step; the untied embeddings and head train throughout
    assert all(v == 1.0 for _, v in scalars["train/monitor/active_blocks"])
    assert all(v > 0 for _, v in scalars["train/monitor/update_ratio/embeddings"])
    assert all(v > 0 for _, v in scalars["train/monitor/update_ratio/head"])
    # one block group holds the active block, the other is frozen and did not move
    for step in (2, 4, 6):
        ratios = [dict(scalars[f"train/monitor/update_ratio/{g}"])[step] for g in ("blocks_00-01", "blocks_02-03")]
        assert sorted(r > 0 for r in ratios) == [False, True], (step, ratios)
    # optimizer state: AdamW holds two fp32 moments (+ a step scalar) for the trainable parameters only
    trainable = dict(scalars["train/monitor/trainable_params"])[6]
    state_bytes = dict(scalars["train/monitor/optimizer_state_bytes"])[6]
    assert 8 * trainable <= state_bytes < 8 * trainable + 4096
    assert trainable < sum(p.numel() for p in model.parameters())
    # the pre-clipping norm is the Trainer's own measurement
    assert dict(scalars["train/monitor/grad_norm"]) == pytest.approx(dict(scalars["train/grad_norm"]))
    assert monitor.plateau_warnings == 0


def test_plateau_warning_after_n_small_gradient_steps():
    model = build_tiny_llama(num_layers=2)
    monitor = TrainingMonitorCallback(plateau_grad_norm=1e-5, plateau_steps=3)

    class Args:
        logging_first_step, logging_steps = False, 1000

    class State:
        global_step, logging_steps = 0, 1000

    monitor.on_train_begin(Args, State, None, model=model)

    def step(scale: float):
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        monitor.on_pre_optimizer_step(Args, State, None, model=model)
        State.global_step += 1

    with pytest.warns(GradientPlateauWarning, match="below 1e-05 for 3 steps"):
        for _ in range(3):
            step(1e-9)
    step(1e-9)  # still the same plateau: no second warning
    assert monitor.plateau_warnings == 1
    step(1.0)  # gradients recover: the counter resets
    assert monitor.plateau_count == 0
    for _ in range(2):
        step(1e-9)
    assert monitor.plateau_warnings == 1
    assert monitor.last_grad_norm == pytest.approx(1e-9 * sum(p.numel() for p in model.parameters()) ** 0.5, rel=1e-3)


def test_invalid_monitor_settings_are_rejected():
    with pytest.raises(ValueError, match="plateau_steps=0 is invalid"):
        TrainingMonitorCallback(plateau_steps=0)
    with pytest.raises(ValueError, match="plateau_grad_norm=-1"):
        TrainingMonitorCallback(plateau_grad_norm=-1)
