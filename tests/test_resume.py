"""Resuming from a mid-interval ``checkpoint-N`` follows the uninterrupted run exactly (CPU, fp32: bit for bit).

The schedule's small values are in ``trainer_state.json``, its tensors in ``checkpoint-N/lisa_state.safetensors``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import Trainer

import hf_lisa
from hf_lisa.tuner.layer import LisaLayer
from hf_lisa.scheduler import SCHEDULER_STATE_VERSION
from hf_lisa.scheduler.state import LISA_STATE_FILE
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback


def _per_step(trainer, key):
    return {h["step"]: h[key] for h in trainer.state.log_history if "loss" in h and key in h}


def _lisa_callback(trainer, cls):
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)]
    return callback


@pytest.mark.parametrize(
    "sampling, restore_flag", [("uniform", True), ("importance", False), ("cyclic", False)]
)
def test_full_parameter_resume_from_mid_interval_checkpoint_matches_uninterrupted_run(
    tiny_llama, token_dataset, training_args, sampling, restore_flag
):
    k, steps = 3, 10
    args = training_args(
        max_steps=steps, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=restore_flag
    )
    uninterrupted_model = tiny_llama(seed=0)
    uninterrupted = Trainer(
        model=uninterrupted_model, args=args, train_dataset=token_dataset(),
        callbacks=[LisaCallback(activated_layers=1, interval_steps=k, sampling=sampling, seed=9)],
    )
    uninterrupted.train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-4")  # 4 % K != 0: mid-interval

    resumed_model = tiny_llama(seed=1)  # different init: everything must come from the checkpoint
    original_callback = LisaCallback(activated_layers=1, interval_steps=k, sampling=sampling, seed=9)
    resumed = Trainer(model=resumed_model, args=args, train_dataset=token_dataset(), callbacks=[original_callback])
    resumed.train(resume_from_checkpoint=checkpoint)

    lisa = _lisa_callback(resumed, LisaCallback)
    assert (lisa is not original_callback) == restore_flag  # the Trainer rebuilds ExportableState callbacks
    first = _lisa_callback(uninterrupted, LisaCallback).layer_scheduler
    assert [s for s, _ in lisa.layer_scheduler.history] == [6, 9]  # no spurious draw at the resume step
    assert lisa.layer_scheduler.history == first.history[-2:]
    assert _per_step(resumed, "lisa/active_blocks") == _per_step(uninterrupted, "lisa/active_blocks")
    assert len(_per_step(resumed, "lisa/active_blocks")) == steps
    if sampling == "importance":
        assert lisa.layer_scheduler.sampler.scores == first.sampler.scores
    for (name, a), (_, b) in zip(uninterrupted_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name


def _adapter_weights_and_masks(model):
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lisa_" in n}
    masks = {n: m.get_mask("default").clone() for n, m in model.named_modules() if isinstance(m, LisaLayer)}
    return weights, masks


def _stored_schedule(checkpoint: str, name: str) -> dict:
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        return json.load(f)["stateful_callbacks"][name]["attributes"]["resume_state"]


def _tensor_refs(tree) -> set:
    if isinstance(tree, dict):
        return {tree["__tensor__"]} if "__tensor__" in tree else set().union(*map(_tensor_refs, tree.values()))
    return set().union(*map(_tensor_refs, tree)) if isinstance(tree, list) else set()


@pytest.mark.parametrize("restore_flag", [True, False], ids=["restore-callback-states", "from-trainer-state"])
def test_adapter_resume_mid_importance_window_matches_uninterrupted_run(
    tiny_llama, token_dataset, training_args, restore_flag
):
    config = hf_lisa.LisaConfig(
        r=4, target_modules=["q_proj", "v_proj"], sparsity=0.5, mask_init="importance", mask_update_interval=4,
        importance_steps=2, new_block_bonus=0.5, lisa_activated_layers=2, lisa_interval_steps=2,
        layer_interpolation=True,
    )
    # checkpoint-3: mid layer period (3 % 2) and inside the importance window [2, 4) of the re-selection at step 4
    args = training_args(max_steps=9, save_strategy="steps", save_steps=3,
                         restore_callback_states_from_checkpoint=restore_flag)
    first_model = get_peft_model(tiny_llama(seed=0), config)
    first = Trainer(
        model=first_model, args=args, train_dataset=token_dataset(), callbacks=[LisaAdapterCallback(seed=3)]
    )
    first.train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-3")
    # small values in trainer_state.json, every tensor (sampler generator, new-cell grids) in lisa_state.safetensors
    stored = _stored_schedule(checkpoint, "LisaAdapterCallback")
    assert stored["version"] == SCHEDULER_STATE_VERSION and stored["global_step"] == 3
    tensors = load_file(os.path.join(checkpoint, LISA_STATE_FILE))
    assert _tensor_refs(stored) == set(tensors) and "layers/sampler/generator" in tensors
    assert any(key.startswith("masks/new_cells/") for key in tensors)
    assert not [f for f in os.listdir(checkpoint) if f.endswith(".tmp")]  # written atomically

    resumed_model = get_peft_model(tiny_llama(seed=0), config)
    resumed = Trainer(
        model=resumed_model, args=args, train_dataset=token_dataset(), callbacks=[LisaAdapterCallback(seed=3)]
    )
    resumed.train(resume_from_checkpoint=checkpoint)

    lisa_first = _lisa_callback(first, LisaAdapterCallback)
    lisa = _lisa_callback(resumed, LisaAdapterCallback)
    # K = 2 caps the importance window at 1 step: blocks 2, 3 calibrate at step 0 (selected at 1), block 0 at its first
    # active step 4; blocks 3 and 2 are re-selected once in the interval [4, 8), while active
    assert [(u["step"], u["kind"]) for u in lisa_first.mask_updates] == [
        (1, "calibration"), (5, "calibration"), (5, "reselection"), (7, "reselection")
    ]
    assert lisa.mask_updates == [u for u in lisa_first.mask_updates if u["step"] > 3]  # same changes, same jumps
    assert lisa.layer_scheduler.history == lisa_first.layer_scheduler.history[-3:]
    assert _per_step(resumed, "lisa/active_blocks") == _per_step(first, "lisa/active_blocks")
    weights_a, masks_a = _adapter_weights_and_masks(first_model)
    weights_b, masks_b = _adapter_weights_and_masks(resumed_model)
    for name in masks_a:
        assert torch.equal(masks_a[name], masks_b[name]), name
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name


def test_resume_refuses_a_missing_or_older_schedule_with_a_clear_error(tiny_llama, token_dataset, training_args):
    args = training_args(max_steps=2, save_strategy="steps", save_steps=1)

    def trainer():
        return Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(),
                       callbacks=[LisaCallback(activated_layers=1, interval_steps=2)])

    trainer().train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-1")
    assert os.path.isfile(os.path.join(args.output_dir, "checkpoint-2", LISA_STATE_FILE))

    # the tensor file of another checkpoint: written at another step
    state_file = os.path.join(checkpoint, LISA_STATE_FILE)
    shutil.copy(os.path.join(args.output_dir, "checkpoint-2", LISA_STATE_FILE), state_file)
    with pytest.raises(RuntimeError, match="written at step 2 but training resumes at step 1"):
        trainer().train(resume_from_checkpoint=checkpoint)

    os.remove(state_file)
    with pytest.raises(FileNotFoundError, match=f"{LISA_STATE_FILE} is missing"):
        trainer().train(resume_from_checkpoint=checkpoint)

    # hf-lisa 0.1 (state version 2) kept the tensors inside trainer_state.json
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path) as f:
        trainer_state = json.load(f)
    stored = trainer_state["stateful_callbacks"]["LisaCallback"]["attributes"]["resume_state"]
    del stored["version"]
    stored["layers"]["version"] = 2
    with open(path, "w") as f:
        json.dump(trainer_state, f)
    with pytest.raises(ValueError, match=f"version 2 of its state .* reads version {SCHEDULER_STATE_VERSION}"):
        trainer().train(resume_from_checkpoint=checkpoint)
