"""The private transformers API hf-lisa relies on exists in the installed transformers, and each use is named.

A private ``Trainer`` method that transformers renames would make an override or a wrapper silently stop taking
effect (checkpoints no longer staged, gradients clipped before the schedule completed them): fail here instead.
"""

from __future__ import annotations

import inspect

from transformers import Trainer

from hf_lisa.train.trainer import PRIVATE_OVERRIDES, LisaTrainer
from hf_lisa.trainer_callbacks.setup import GRADIENT_READERS


def test_every_private_override_of_lisa_trainer_is_named_with_its_reason():
    overridden = {name for name, value in vars(LisaTrainer).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)}
    assert overridden == set(PRIVATE_OVERRIDES), "a private Trainer override without a stated reason, or a stale one"
    assert all(len(reason) > 20 for reason in PRIVATE_OVERRIDES.values())


def test_the_private_trainer_methods_used_exist_with_the_signatures_called():
    for name in (*PRIVATE_OVERRIDES, *GRADIENT_READERS):
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


def test_the_training_loop_reads_gradients_through_the_wrapped_methods():
    """The wrapper of ``trainer_callbacks.setup.complete_gradients_before_clipping`` only helps if the loop calls
    these methods on the instance; the loop's source says so (a rename upstream fails here, not in a loss curve)."""
    source = inspect.getsource(Trainer)
    for name in GRADIENT_READERS:
        assert f"self.{name}(" in source, name
