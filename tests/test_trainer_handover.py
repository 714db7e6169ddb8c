"""The LISA callbacks never look for their Trainer (issue 34): what they need of it is handed over explicitly.

In a Trainer that does not hand itself over (``transformers.Trainer``, TRL's, a user's subclass), the callbacks run
through the objects the events carry and leave the Trainer as built: its callback list in its order, no attribute of
theirs. What needs the Trainer itself is said or refused: the reporting integrations do not receive ``lisa/*`` (a
warning naming ``prepare_trainer``), several processes are refused, the progress guard runs from the callback.
``prepare_trainer(trainer)`` (which ``LisaTrainer`` calls) hands it over: the log readers run after the LISA
callbacks, a ``TrainingProgressGuard`` joins the Trainer.
"""

from __future__ import annotations

import logging

import pytest
from transformers import Trainer
from transformers.integrations import TensorBoardCallback

from hf_lisa.trainer import LisaTrainer
from hf_lisa.trainer_callbacks import LisaCallback, TrainingProgressGuard, prepare_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(cls, tiny_llama, token_dataset, args):
    return cls(model=tiny_llama(num_layers=2), args=args, train_dataset=token_dataset(),
               callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=0)])


def test_a_trainer_not_handed_over_is_left_as_built(tiny_llama, token_dataset, training_args, caplog):
    trainer = _trainer(Trainer, tiny_llama, token_dataset, training_args(max_steps=3))
    built = list(trainer.callback_handler.callbacks)
    attributes = set(vars(trainer))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.callback_handler.callbacks == built  # same objects, same order: nothing added or moved
    assert not [a for a in set(vars(trainer)) - attributes if "lisa" in a.lower()]
    assert not any(isinstance(cb, TrainingProgressGuard) for cb in trainer.callback_handler.callbacks)
    lisa = [h for h in trainer.state.log_history if "lisa/active_blocks" in h]
    assert len(lisa) == 4 and {h["lisa/active_blocks"] for h in lisa[:3]} <= {"0", "1"}
    assert "reporting integrations" not in caplog.text  # report_to=[]: nothing to say


def test_without_the_trainer_the_integrations_miss_lisa_values_and_it_is_said(
    tiny_llama, token_dataset, training_args, caplog
):
    trainer = _trainer(Trainer, tiny_llama, token_dataset, training_args(max_steps=2, report_to=["tensorboard"]))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "TensorBoardCallback) run before it and do not receive its lisa/* values" in caplog.text
    assert "hf_lisa.trainer_callbacks.prepare_trainer(trainer)" in caplog.text


@pytest.mark.parametrize("hand_over", ["prepare_trainer", "LisaTrainer"])
def test_a_trainer_handed_over_runs_the_log_readers_after_the_lisa_callbacks(
    tiny_llama, token_dataset, training_args, caplog, hand_over
):
    cls = Trainer if hand_over == "prepare_trainer" else LisaTrainer
    trainer = _trainer(cls, tiny_llama, token_dataset, training_args(max_steps=2, report_to=["tensorboard"]))
    if hand_over == "prepare_trainer":
        (callback,) = prepare_trainer(trainer)
        assert prepare_trainer(trainer) == [callback]  # idempotent
    order = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert order.index(LisaCallback) < order.index(TensorBoardCallback)
    assert order.count(TrainingProgressGuard) == 1
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "do not receive its lisa/* values" not in caplog.text


def test_several_processes_without_the_trainer_are_refused(tiny_llama, token_dataset, training_args, monkeypatch):
    trainer = _trainer(Trainer, tiny_llama, token_dataset, training_args(max_steps=2))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher sets it; the Trainer was built before
    with pytest.raises(RuntimeError, match=r"was not handed its Trainer, so it could not prepare the Trainer's DDP "
                                           r"wrap.*prepare_trainer\(trainer\)"):
        trainer.train()
