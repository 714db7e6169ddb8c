"""A LISA adapter whose settings need the schedule refuses to train without it (issue 22, item 5).

``hf_lisa.tuner.schedule_guard``: layerwise sampling, mask calibration / re-selection and layer interpolation take
effect only through ``LisaAdapterCallback``. A plain ``Trainer`` (or TRL's trainers) without it used to train such an
adapter with those settings silently ignored; now its first training forward raises and says how to add the callback.
Schedule-free configs, frozen (inference) adapters, evaluation and ``no_grad`` forwards are untouched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import Trainer

import hf_lisa
from hf_lisa.trainer_callbacks import LisaAdapterCallback
from hf_lisa.tuner.schedule_guard import attach_schedule, detach_schedule, schedule_attached

#: 4-block tiny llama: γ=1 samples; every config here needs the schedule
NEEDS_SCHEDULE = {
    "gamma": ({"lisa_activated_layers": 1, "lisa_interval_steps": 2}, "lisa_activated_layers=1"),
    "calibration": ({"sparsity": 0.5, "mask_init": "importance", "mask_update_interval": 0, "importance_steps": 1},
                    "mask_init='importance' on a fresh adapter"),
    "reselection": ({"sparsity": 0.5, "mask_init": "magnitude", "mask_update_interval": 2, "importance_steps": 1},
                    "mask_update_interval=2"),
    "interpolation": ({"layer_interpolation": True}, "layer_interpolation=True"),
}
SCHEDULE_FREE = {
    "dense": {},
    "every_block": {"lisa_activated_layers": 4, "lisa_interval_steps": 2},
    "fixed_mask": {"sparsity": 0.5, "mask_init": "magnitude", "mask_update_interval": 0},
}


def _model(tiny_llama, **config):
    return get_peft_model(tiny_llama(), hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], **config))


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lisa_" in n}


def _moved(model, before):
    return sorted(n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n]))


@pytest.mark.parametrize("case", list(NEEDS_SCHEDULE))
def test_plain_trainer_refuses_settings_that_need_the_schedule(tiny_llama, token_dataset, training_args, case):
    config, setting = NEEDS_SCHEDULE[case]
    model = _model(tiny_llama, **config)
    before = _snapshot(model)
    trainer = Trainer(model=model, args=training_args(max_steps=3), train_dataset=token_dataset())
    with pytest.raises(RuntimeError, match="without its schedule") as err:
        trainer.train()
    message = str(err.value)
    assert setting in message
    assert "transformers.Trainer(..., callbacks=[LisaAdapterCallback()])" in message
    assert "SFTTrainer(..., peft_config=config, callbacks=[LisaAdapterCallback()])" in message
    assert "lisa_activated_layers=0" in message
    assert _moved(model, before) == []  # refused at the first forward, before any update
    # the same model trains with the callback, and the schedule acts (γ=1: only the sampled block's B moves)
    lisa = LisaAdapterCallback(seed=0)
    Trainer(model=model, args=training_args(max_steps=2), train_dataset=token_dataset(), callbacks=[lisa]).train()
    moved = _moved(model, before)
    assert moved
    if case == "gamma":
        assert {n.split(".layers.")[1].split(".")[0] for n in moved if ".lisa_B." in n} == {
            str(b) for b in lisa.layer_scheduler.history[0][1]}
    # on_train_end takes the declaration back: a later plain training forward is refused again, except once the
    # calibration is done (B != 0, no re-selection): then nothing is left to schedule
    assert not schedule_attached(model)
    model.train()
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    if case == "calibration":
        assert model(**batch).loss.requires_grad
    else:
        with pytest.raises(RuntimeError, match="without its schedule"):
            model(**batch)


@pytest.mark.parametrize("case", list(SCHEDULE_FREE))
def test_schedule_free_configs_train_without_the_callback(tiny_llama, token_dataset, training_args, case):
    model = _model(tiny_llama, **SCHEDULE_FREE[case])
    before = _snapshot(model)
    Trainer(model=model, args=training_args(max_steps=2), train_dataset=token_dataset()).train()
    moved = _moved(model, before)
    assert sum(".lisa_B." in n for n in moved) == 8  # q and v of all 4 blocks
    # the callback's own "nothing to schedule" warning follows the same rule
    with pytest.warns(UserWarning, match="nothing to schedule"):
        Trainer(model=model, args=training_args(max_steps=1), train_dataset=token_dataset(),
                callbacks=[LisaAdapterCallback()]).train()


def test_callback_does_not_warn_when_there_is_something_to_schedule(tiny_llama, token_dataset, training_args):
    model = _model(tiny_llama, **NEEDS_SCHEDULE["reselection"][0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=training_args(max_steps=1), train_dataset=token_dataset(),
                callbacks=[LisaAdapterCallback()]).train()
    assert not [w for w in caught if "nothing to schedule" in str(w.message)]


def test_evaluation_inference_and_no_grad_forwards_are_never_refused(tiny_llama, token_dataset, training_args):
    model = _model(tiny_llama, lisa_activated_layers=1, layer_interpolation=True)
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    model.eval()
    assert model(**batch).loss.requires_grad  # eval mode with autograd on: not training
    model.train()
    with torch.no_grad():
        model(**batch)
    with torch.inference_mode():
        model(**batch)
    metrics = Trainer(model=model, args=training_args(), eval_dataset=token_dataset(8)).evaluate()
    assert metrics["eval_loss"] > 0


def test_trained_sparse_adapter_reloaded_without_recalibration_trains_without_the_callback(
    tiny_llama, token_dataset, training_args, tmp_path
):
    # mask_init="importance" needs the schedule only while the masks wait for their calibration (B = 0); an adapter
    # that has trained (B != 0) keeps its masks, and with mask_update_interval=0 nothing else would change them
    model = _model(tiny_llama, sparsity=0.5, mask_update_interval=0, importance_steps=1)
    lisa = LisaAdapterCallback()
    Trainer(model=model, args=training_args(max_steps=3), train_dataset=token_dataset(), callbacks=[lisa]).train()
    assert [u["kind"] for u in lisa.mask_updates] == ["calibration"]
    model.save_pretrained(tmp_path / "adapter")
    # loaded for inference (frozen): a training-mode forward with autograd trains nothing of the adapter
    frozen = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").train()
    assert torch.is_grad_enabled()
    frozen(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    trainable = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter", is_trainable=True)
    before = _snapshot(trainable)
    Trainer(model=trainable, args=training_args(max_steps=2), train_dataset=token_dataset()).train()
    assert any(".lisa_B." in n for n in _moved(trainable, before))


def test_a_custom_loop_declares_that_it_runs_the_schedule(tiny_llama):
    model = _model(tiny_llama, lisa_activated_layers=1)
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    model.train()
    with pytest.raises(RuntimeError, match=r"adapter 'default': lisa_activated_layers=1 \(the adapters of 1 of the 4"):
        model(**batch)
    owner = object()
    assert attach_schedule(torch.nn.ModuleList([model]), owner) == 1  # found inside a wrapper too
    model(**batch).loss.backward()
    detach_schedule(model, owner)
    with pytest.raises(RuntimeError, match="without its schedule"):
        model(**batch)
    # unloading the adapters removes the guard with them
    base = model.unload()
    base.train()(**batch)
    assert "_lisa_schedule_owners" not in base.__dict__


def test_a_copy_of_a_model_in_training_starts_without_the_declaration(tiny_llama, token_dataset, training_args):
    import copy

    model = _model(tiny_llama, lisa_activated_layers=1)
    attach_schedule(model, LisaAdapterCallback())
    clone = copy.deepcopy(model).train()  # e.g. a reference or EMA copy taken during training
    assert schedule_attached(model) and not schedule_attached(clone)
    with pytest.raises(RuntimeError, match="without its schedule"):
        clone(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    # adapters disabled: nothing of them runs, so the forward is admitted, and the check is asked again afterwards
    with clone.disable_adapter():
        clone(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match="without its schedule"):
        clone(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
