"""Optimizers and the memory tricks of a training step, in one wing (below the scheduler: they know parameters,
gradients and optimizer state, not blocks or schedules).

* :mod:`.in_backward`: :class:`AdamWInBackward`, AdamW whose update of each parameter runs in the backward pass, and
  :func:`check_in_backward_arguments`, the one set of rules every entry point runs for it;
* :mod:`.adamw_8bit`: :class:`SlicedAdamW8bit` (bitsandbytes' 8-bit AdamW updated a slice at a time on CPU) and
  :class:`AdamW8bitInBackward`;
* :mod:`.state`: the optimizer state of parameters that stop training: find the real optimizer, measure, drop;
* :mod:`.memory`: the memory options of ``hf-lisa train`` (``--optim_step_in_backward``, ``--optim_8bit_embeddings``,
  ``--cpu_allocator``) and the optimizers ``LisaTrainer`` builds for them;
* :mod:`.chunked_loss`: ``--chunked_loss``, the causal-LM loss a few hundred tokens at a time.

Layer-wise learning-rate decay groups stay with the scheduler (:mod:`hf_lisa.scheduler.param_groups`): they are made
from its block index. One test file each: ``tests/test_step_in_backward.py``, ``tests/test_step_in_backward_8bit.py``,
``tests/test_optim_state.py``, ``tests/test_cpu_allocator.py`` (memory), ``tests/test_chunked_loss.py``.

bitsandbytes is imported only by :mod:`.adamw_8bit`, when it is used.
"""

from __future__ import annotations

from .chunked_loss import install_chunked_loss
from .in_backward import AdamWInBackward, StepsInBackward, check_in_backward_arguments, steps_in_backward
from .memory import HeapTrim, apply_cpu_allocator, heap_trim
from .state import drop_optimizer_state, optimizer_state_bytes, unwrap_optimizer

__all__ = [
    "AdamWInBackward",
    "HeapTrim",
    "StepsInBackward",
    "apply_cpu_allocator",
    "check_in_backward_arguments",
    "drop_optimizer_state",
    "heap_trim",
    "install_chunked_loss",
    "optimizer_state_bytes",
    "steps_in_backward",
    "unwrap_optimizer",
]
