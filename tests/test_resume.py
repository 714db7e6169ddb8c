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

from conftest import build_training_args

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
        callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=k, lisa_sampling=sampling, seed=9)],
    )
    uninterrupted.train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-4")  # 4 % K != 0: mid-interval

    resumed_model = tiny_llama(seed=1)  # different init: everything must come from the checkpoint
    original_callback = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=k, lisa_sampling=sampling, seed=9)
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
    # every block calibrates before step 0 (nothing trained); K = 2 caps the re-selection window at 1 step: blocks 0
    # and 3 (active from 4) are re-selected at 5, block 2 (active from 6) at 7, inside the interval [4, 8)
    assert [(u["step"], u["kind"]) for u in lisa_first.mask_updates] == [
        (0, "calibration"), (5, "reselection"), (7, "reselection")
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


def test_resume_from_a_folder_outside_output_dir_is_found_through_the_arguments_never_guessed(
    tiny_llama, token_dataset, training_args, tmp_path
):
    # issue 34: the callbacks no longer read train()'s argument out of the training loop's stack frame. A folder
    # outside output_dir is found through TrainingArguments(resume_from_checkpoint=...); without it, the same-step
    # checkpoint of another run in output_dir is refused by its save id (before: it was not looked at at all)
    def trainer(args, seed):
        return Trainer(model=tiny_llama(seed=0), args=args, train_dataset=token_dataset(),
                       callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=3, seed=seed)])

    run_a = trainer(training_args(max_steps=4, save_strategy="steps", save_steps=2), seed=1)
    run_a.train()
    moved = str(tmp_path / "elsewhere" / "checkpoint-2")
    shutil.copytree(os.path.join(run_a.args.output_dir, "checkpoint-2"), moved)

    other = build_training_args(tmp_path / "run-b", max_steps=4, save_strategy="steps", save_steps=2)
    trainer(other, seed=2).train()  # run B: its own checkpoint-2 with another schedule
    with pytest.raises(RuntimeError, match=r"none of .*run-b/checkpoint-2/lisa_state.safetensors.*\(resume_from_checkpoint="):
        trainer(other, seed=1).train(resume_from_checkpoint=moved)

    resumed = trainer(build_training_args(tmp_path / "run-b", max_steps=4, save_strategy="no",
                                          resume_from_checkpoint=moved), seed=1)
    resumed.train(resume_from_checkpoint=moved)
    expected = run_a.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[name]), name

    shutil.rmtree(str(tmp_path / "run-b"))
    with pytest.raises(FileNotFoundError, match=r"run-b/checkpoint-2/lisa_state.safetensors: .* is missing.*"
                                                r"TrainingArguments\(resume_from_checkpoint"):
        trainer(other, seed=1).train(resume_from_checkpoint=moved)


def test_resume_refuses_a_missing_or_older_schedule_with_a_clear_error(tiny_llama, token_dataset, training_args):
    args = training_args(max_steps=2, save_strategy="steps", save_steps=1)

    def trainer():
        return Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(),
                       callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2)])

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


# -- LisaTrainer: checkpoints appear only when complete; train_loss over the whole run; no token in the pickle --------
def _lisa_trainer(tiny_llama, token_dataset, args, **kwargs):
    from hf_lisa.trainer import LisaTrainer

    return LisaTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset(),
                       callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=3, seed=9)], **kwargs)


def test_lisa_trainer_writes_each_checkpoint_whole_before_naming_it(tiny_llama, token_dataset, training_args,
                                                                    monkeypatch):
    from transformers.trainer_utils import get_last_checkpoint

    import hf_lisa.trainer_callbacks.state as callback_state

    written = []
    real = callback_state.write_state_file

    def spy(directory, tensors, **metadata):
        # while the schedule's tensors are written, no checkpoint of that step exists under its final name yet
        written.append((directory, os.path.isdir(os.path.join(args.output_dir, os.path.basename(directory)))))
        return real(directory, tensors, **metadata)

    monkeypatch.setattr(callback_state, "write_state_file", spy)
    args = training_args(max_steps=6, save_strategy="steps", save_steps=2, hub_token="hf_never_on_disk")
    trainer = _lisa_trainer(tiny_llama, token_dataset, args)
    trainer.train()

    assert [os.path.basename(d) for d, _ in written] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all(".partial-checkpoint-" in d and not published for d, published in written)
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # no staging left
    assert get_last_checkpoint(args.output_dir) == os.path.join(args.output_dir, "checkpoint-6")
    for step in (2, 4, 6):
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{step}")
        expected = {LISA_STATE_FILE, "trainer_state.json", "model.safetensors", "optimizer.pt"}
        assert expected <= set(os.listdir(checkpoint))
        # the pickled arguments are written without the Hub token (nothing reads them on resume), the run keeps it
        saved = torch.load(os.path.join(checkpoint, "training_args.bin"), weights_only=False)
        assert saved.hub_token is None and trainer.args.hub_token == "hf_never_on_disk"
        for name in os.listdir(checkpoint):
            with open(os.path.join(checkpoint, name), "rb") as f:
                assert b"hf_never_on_disk" not in f.read(), name

    resumed = _lisa_trainer(tiny_llama, token_dataset, training_args(max_steps=8, save_strategy="no"))
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-6"))
    assert resumed.state.global_step == 8


def test_lisa_trainer_train_loss_after_resume_covers_the_whole_run(tiny_llama, token_dataset, training_args):
    # logging every 3 steps, checkpoints every 4: the checkpoint logs its own step, so the loss of steps 4 is kept
    args = training_args(max_steps=8, save_strategy="steps", save_steps=4, logging_steps=3)
    uninterrupted = _lisa_trainer(tiny_llama, token_dataset, args).train()

    resumed_trainer = _lisa_trainer(tiny_llama, token_dataset, args)
    resumed = resumed_trainer.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-4"))
    assert resumed.training_loss == pytest.approx(uninterrupted.training_loss, rel=1e-6)
    assert resumed.metrics["train_loss"] == resumed.training_loss
    assert [h["train_loss"] for h in resumed_trainer.state.log_history if "train_loss" in h] == [resumed.training_loss]
    # transformers alone would average steps 5-8 only
    session = [h["loss"] for h in resumed_trainer.state.log_history if "loss" in h and h["step"] > 4]
    assert resumed.training_loss != pytest.approx(sum(session) / len(session), rel=1e-3)


def test_lisa_trainer_best_checkpoint_is_the_published_folder(tiny_llama, token_dataset, training_args):
    args = training_args(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                         metric_for_best_model="loss", load_best_model_at_end=True, save_total_limit=1)
    trainer = _lisa_trainer(tiny_llama, token_dataset, args, eval_dataset=token_dataset(num_examples=8, seed=1))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert os.path.basename(best) in ("checkpoint-2", "checkpoint-4") and os.path.isdir(best)
    with open(os.path.join(best, "trainer_state.json")) as f:
        assert json.load(f)["best_model_checkpoint"] == best
    assert not [n for n in os.listdir(args.output_dir) if n.startswith(".")]


def test_lisa_trainer_pushes_a_checkpoint_from_its_final_place(tiny_llama, token_dataset, training_args, monkeypatch):
    # transformers uploads a pushed checkpoint in the background: it must read the published folder, not the staging one
    import huggingface_hub.constants as hf_constants
    import huggingface_hub.hf_api
    import transformers.utils.hub
    from hub_server import HubServer

    server = HubServer()
    server.add_token("hf_write_token", user="alice", write=True)
    try:
        monkeypatch.setattr(hf_constants, "ENDPOINT", server.url)
        # transformers shares one HfApi, built on first use with the endpoint of that moment: build it afresh here
        monkeypatch.setattr(transformers.utils.hub, "_hf_api", None, raising=False)  # absent in 5.6
        # transformers 5.3's Trainer calls huggingface_hub.create_repo, whose HfApi kept the endpoint of its import
        monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", server.url)
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        args = training_args(max_steps=2, save_strategy="steps", save_steps=2, push_to_hub=True,
                             hub_model_id="alice/tiny-lisa", hub_token="hf_write_token", hub_strategy="checkpoint")
        _lisa_trainer(tiny_llama, token_dataset, args).train()
        files = server.files("alice/tiny-lisa")
    finally:
        server.stop()
    assert {"last-checkpoint/trainer_state.json", f"last-checkpoint/{LISA_STATE_FILE}"} <= set(files)


def test_layer_schedule_refuses_a_different_k_on_resume():
    from hf_lisa.scheduler import LayerwiseScheduler

    from tiny_models import tiny_llama

    model = tiny_llama()
    saved = LayerwiseScheduler(model, lisa_activated_layers=1, lisa_interval_steps=5, seed=0).state_dict()
    other = LayerwiseScheduler(model, lisa_activated_layers=1, lisa_interval_steps=7, seed=0)
    with pytest.raises(ValueError, match=r"lisa_interval_steps \(K\)=5 but this run has 7"):
        other.load_state_dict(saved)
