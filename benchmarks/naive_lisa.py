"""The common "naive" LISA callback, kept as a benchmark baseline.

This reproduces the logic of the LISA callbacks in LMFlow and axolotl: every ``interval_steps`` it flips
``requires_grad`` so that ``n_layers`` random blocks train, and does nothing else. Two differences from hf-lisa's
``LisaCallback`` are the point of the comparison:

* the optimizer state of deactivated blocks is never freed, so it grows toward full fine-tuning's (LMFlow #768,
  ms-swift #4522);
* blocks are drawn from the global NumPy RNG, which is neither checkpointed nor guaranteed equal across ranks.

The optimizer is built over every parameter (the Trainer does this before the first ``on_step_begin``), which is the
*kinder* variant: LMFlow builds it after the first freeze, so later blocks never train at all (LMFlow #726).
"""

from __future__ import annotations

import numpy as np
from transformers import TrainerCallback

from hf_lisa import find_blocks


class NaiveLisaCallback(TrainerCallback):
    def __init__(self, n_layers: int = 2, interval_steps: int = 20, seed: int = 42):
        self.n_layers = n_layers
        self.interval_steps = interval_steps
        np.random.seed(seed)
        self.active: list[int] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.interval_steps == 0:
            blocks = find_blocks(model)
            for _, block in blocks:
                block.requires_grad_(False)
            self.active = sorted(np.random.choice(len(blocks), self.n_layers, replace=False).tolist())
            for index in self.active:
                blocks[index][1].requires_grad_(True)
