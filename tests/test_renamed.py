"""One name per setting (issue 34, item 3): every public surface that takes a LISA setting takes it by its ``lisa_*``
name (the ``LisaConfig`` field and the ``hf-lisa train`` option); the names before 0.3 keep working for one release
with a ``FutureWarning`` naming the new one; a 0.2 checkpoint resumes and a 0.2 ``training_summary.json`` renders."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import pytest
import torch
from transformers import Trainer

import hf_lisa
from hf_lisa.distributed.fsdp2 import fully_shard_blocks
from hf_lisa.hub import TrainingSummary, render_model_card
from hf_lisa.renamed import RENAMED, REMOVED_IN
from hf_lisa.scheduler import LayerwiseScheduler, MaskScheduler
from hf_lisa.scheduler.param_groups import assign_param_groups, layerwise_lr_decay_param_groups
from hf_lisa.scheduler.sampler import LayerSampler
from hf_lisa.trainer import LisaTrainer
from hf_lisa.train.parsing.arguments import LisaArguments
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback
from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

#: every public callable that takes a LISA setting, and the settings it takes
SURFACES = {
    LisaCallback.__init__: {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling", "lisa_always_trainable",
                            "lisa_optimizer_state_policy", "lisa_layers_attribute"},
    LisaAdapterCallback.__init__: {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling",
                                   "lisa_optimizer_state_policy", "mask_update_interval", "importance_steps",
                                   "new_block_bonus", "recalibrate_masks"},
    LayerwiseScheduler.__init__: {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling",
                                  "lisa_always_trainable", "lisa_optimizer_state_policy", "lisa_layers_attribute"},
    LayerwiseScheduler.for_adapter: {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling",
                                     "lisa_optimizer_state_policy", "lisa_layers_attribute"},
    LayerSampler.__init__: {"lisa_activated_layers", "lisa_sampling"},
    MaskScheduler.__init__: {"mask_update_interval", "importance_steps", "new_block_bonus", "mask_init",
                             "mask_keep_learned", "lisa_interval_steps", "recalibrate_masks"},
    TrainingMonitorCallback.__init__: {"lisa_layers_attribute"},
    LisaTrainer.__init__: {"lisa_layers_attribute"},
    fully_shard_blocks: {"lisa_layers_attribute"},
    assign_param_groups: {"lisa_layers_attribute"},
    layerwise_lr_decay_param_groups: {"lisa_layers_attribute"},
}


@pytest.mark.parametrize("surface", list(SURFACES), ids=lambda f: f.__qualname__)
def test_every_surface_takes_the_one_name_of_each_setting(surface):
    parameters = set(inspect.signature(surface).parameters)
    assert SURFACES[surface] <= parameters
    assert not parameters & set(RENAMED), "an old name is still in the signature"


def test_the_names_are_those_of_lisaconfig_and_the_cli():
    config_fields = {f.name for f in dataclasses.fields(hf_lisa.LisaConfig)}
    cli_fields = {f.name for f in dataclasses.fields(LisaArguments)}
    for new in set(RENAMED.values()) - {"recalibrate_masks"}:  # the callback's own switch, in neither
        assert new in config_fields | cli_fields, new
    assert "lisa_always_trainable" in cli_fields and "lisa_optimizer_state_policy" in cli_fields


@pytest.mark.parametrize(
    "build, old, new, value",
    [
        (LisaCallback, "activated_layers", "lisa_activated_layers", 3),
        (LisaCallback, "interval_steps", "lisa_interval_steps", 7),
        (LisaCallback, "sampling", "lisa_sampling", "cyclic"),
        (LisaCallback, "always_trainable", "lisa_always_trainable", ("lm_head",)),
        (LisaCallback, "optimizer_state_policy", "lisa_optimizer_state_policy", "keep"),
        (LisaCallback, "layers_attribute", "lisa_layers_attribute", "model.layers"),
        (LisaAdapterCallback, "activated_layers", "lisa_activated_layers", 1),
        (LisaAdapterCallback, "interval_steps", "lisa_interval_steps", 9),
        (LisaAdapterCallback, "sampling", "lisa_sampling", "importance"),
        (LisaAdapterCallback, "optimizer_state_policy", "lisa_optimizer_state_policy", "keep"),
        (TrainingMonitorCallback, "layers_attribute", "lisa_layers_attribute", "model.layers"),
    ],
)
def test_an_old_keyword_works_with_a_futurewarning_naming_the_new_one(build, old, new, value):
    with pytest.warns(FutureWarning, match=rf"{build.__name__}: the keyword '{old}' is renamed '{new}'.*until "
                                           rf"hf-lisa {REMOVED_IN}") as caught:
        obj = build(**{old: value})
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert getattr(obj, new) == value
    with pytest.warns(FutureWarning, match=rf"the attribute '{old}' is renamed '{new}'"):
        assert getattr(obj, old) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(build(**{new: value}), new) == value  # the new name: no warning


def test_both_names_at_once_are_refused():
    with pytest.raises(TypeError, match="activated_layers=3 and lisa_activated_layers=2.*give lisa_activated_layers"):
        LisaCallback(activated_layers=3, lisa_activated_layers=2)
    with pytest.raises(TypeError, match="num_active=2 and lisa_activated_layers=2"):
        LayerSampler(4, num_active=2, lisa_activated_layers=2)


def test_the_schedulers_old_names_give_the_same_schedule():
    with pytest.warns(FutureWarning) as caught:
        old = LayerSampler(num_layers=8, num_active=2, strategy="cyclic", seed=3)
    assert ["'num_active' is renamed 'lisa_activated_layers'" in str(w.message) for w in caught] == [True, False]
    assert "'strategy' is renamed 'lisa_sampling'" in str(caught[1].message)
    new = LayerSampler(num_layers=8, lisa_activated_layers=2, lisa_sampling="cyclic", seed=3)
    assert [old.sample() for _ in range(8)] == [new.sample() for _ in range(8)]
    assert repr(new).startswith("LayerSampler(num_layers=8, lisa_activated_layers=2, lisa_sampling='cyclic'")


def test_an_unknown_keyword_is_still_a_type_error():
    with pytest.raises(TypeError, match="activated_layer"):
        LisaCallback(activated_layer=2)


@pytest.mark.parametrize("restore", [False, True], ids=["callback-state-read", "callback-rebuilt"])
def test_a_checkpoint_written_by_0_2_resumes_the_same_schedule(restore, tiny_llama, token_dataset, training_args,
                                                               tmp_path):
    """A 0.2 checkpoint stores the callback's short keyword names in ``trainer_state.json``; with
    ``restore_callback_states_from_checkpoint`` the Trainer rebuilds the callback from them. Rewritten to them, the
    resumed run ends on the weights of the run that resumed from the file as written now."""

    def run():
        torch.manual_seed(0)
        return Trainer(model=tiny_llama(), args=training_args(max_steps=6, save_strategy="steps", save_steps=3,
                                                              restore_callback_states_from_checkpoint=restore),
                       train_dataset=token_dataset(),
                       callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=5)])

    first = run()
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    stored = state["stateful_callbacks"]["LisaCallback"]["args"]
    assert set(stored) >= {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling"}
    resumed_now = run()
    resumed_now.train(resume_from_checkpoint=str(checkpoint))
    now = {k: v.clone() for k, v in resumed_now.model.state_dict().items()}

    old_args = {({v: k for k, v in RENAMED.items() if k not in ("num_active", "strategy")}).get(k, k): v
                for k, v in stored.items()}
    assert "activated_layers" in old_args and "lisa_activated_layers" not in old_args
    state["stateful_callbacks"]["LisaCallback"]["args"] = old_args
    state_file.write_text(json.dumps(state))
    resumed_old = run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed_old.train(resume_from_checkpoint=str(checkpoint))
    renamed = [str(w.message) for w in caught if "is renamed" in str(w.message)]
    assert bool(renamed) == restore and all("LisaCallback: the keyword" in m for m in renamed)
    for name, value in resumed_old.model.state_dict().items():
        assert torch.equal(value, now[name]), name


def test_a_0_2_training_summary_renders_the_same_card():
    old = {"method": "lisa", "lisa": {"activated_layers": 2, "interval_steps": 5, "sampling": "cyclic",
                                      "optimizer_state_policy": "drop", "always_trainable": ["lm_head"]}}
    new = {"method": "lisa", "lisa": {"lisa_activated_layers": 2, "lisa_interval_steps": 5, "lisa_sampling": "cyclic",
                                      "lisa_optimizer_state_policy": "drop", "lisa_always_trainable": ["lm_head"]}}
    assert TrainingSummary.from_dict(old) == TrainingSummary.from_dict(new)
    cards = [str(render_model_card("me/x", "merged", summary=TrainingSummary.from_dict(s)))
             for s in (old, new)]
    assert cards[0] == cards[1]
    assert "γ = 2 blocks active at a time, switched every K = 5" in cards[1]
