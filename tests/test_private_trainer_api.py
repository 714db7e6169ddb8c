"""The private transformers API hf-lisa relies on exists in the installed transformers, and each use is named.

A private ``Trainer`` method that transformers renames would make an override or a wrapper silently stop taking
effect (checkpoints no longer staged, gradients clipped before the schedule completed them): fail here instead.
"""

from __future__ import annotations

import inspect

from transformers import Trainer

from hf_lisa.trainer.lisa_trainer import PRIVATE_OVERRIDES, LisaTrainer


def test_every_private_override_of_lisa_trainer_is_named_with_its_reason():
    overridden = {name for name, value in vars(LisaTrainer).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)}
    assert overridden == set(PRIVATE_OVERRIDES), "a private Trainer override without a stated reason, or a stale one"
    assert all(len(reason) > 20 for reason in PRIVATE_OVERRIDES.values())


def test_the_private_trainer_methods_used_exist_with_the_signatures_called():
    for name in PRIVATE_OVERRIDES:
        assert callable(getattr(Trainer, name, None)), f"transformers.Trainer.{name} is gone"
    signatures = {
        "_get_grad_norm": ["self", "model", "grad_norm"],
        "_get_output_dir": ["self", "trial"],
        "_save_checkpoint": ["self", "model", "trial"],
        "_push_from_checkpoint": ["self", "checkpoint_folder"],
        "_save": ["self", "output_dir", "state_dict"],
    }
    for name, params in signatures.items():
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == params, name


def test_the_lisa_callbacks_patch_no_method_onto_the_trainer(tiny_llama, token_dataset, training_args):
    """Public hooks only (issue 34): after the LISA callbacks prepared and ran a plain ``Trainer``, the instance
    carries no method of its own (the gradient edits are tensor hooks, :mod:`hf_lisa.trainer_callbacks.gradients`)."""
    from hf_lisa.trainer_callbacks import LisaCallback

    trainer = Trainer(model=tiny_llama(num_layers=2), args=training_args(max_steps=2), train_dataset=token_dataset(),
                      callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=1, seed=0)])
    trainer.train()
    patched = sorted(name for name, value in vars(trainer).items() if callable(value) and hasattr(Trainer, name))
    assert patched == []
