"""The one place that decides what trains: LISA's layerwise schedule and the sparse-mask re-selection.

Everything about *which* parameters train, *when* that changes and *what happens to the optimizer state* lives here,
in the spirit of BAdam's ``block_optim.py``. The Trainer callbacks in ``hf_lisa.trainer_callbacks`` only call these classes at
the right events.

Modules:

* :mod:`.layerwise`: :class:`LayerwiseScheduler` (full-parameter and adapter form): every K optimizer steps, γ
  blocks train; the always-trainable set (embeddings, LM head, final norm, or all non-block adapter parameters) trains
  throughout.
* :mod:`.mask_schedule`: :class:`MaskScheduler` (sparse LISA adapters): selects the element mask ``M`` from
  ``|∂L/∂W|`` accumulated over ``importance_steps`` batches, at train begin and every ``mask_update_interval`` steps.
* :mod:`.active_set`: :class:`BlockIndex`, the model's blocks and parameter groups, built once per model and read by
  every consumer (schedule, LLRD, monitor, summary, FSDP2), and :class:`ActiveSet`, the one record of the active blocks;
* :mod:`.sampler`: :class:`LayerSampler`, which γ blocks come next (uniform, importance, cyclic): it proposes only;
* :mod:`hf_lisa.optim.state` (below the scheduler): what happens to the optimizer state of blocks that leave the
  active set;
* :mod:`.param_groups`: layer-wise learning-rate decay groups;
* :mod:`.state`: the schedule's state on disk (``lisa_state.safetensors``, no pickle);
* :mod:`.common`: the state format version and the adapter-config lookup they share.

Choices made here, and why:

* The optimizer must be built over **every** candidate parameter *before* freezing (LMFlow #726: an optimizer built
  after freezing never sees layers sampled later). The schedulers are constructed from the parameters that are
  trainable when training begins and only toggle ``requires_grad`` inside that set.
* A switch happens exactly when ``global_step % K == 0`` and at most once per step, so there is no double switch at
  steps 0 and 1 (axolotl, ms-swift).
* Deactivated parameters are frozen (``requires_grad=False``, ``grad=None``), never given zero gradients: a zero grad
  still moves a parameter under Adam (momentum, weight decay).
* Their optimizer state is dropped by default (LMFlow #768, ms-swift #4522; the paper restarted the optimizer every
  period). Blocks that stay active across a switch keep their state, so γ = N is exactly full fine-tuning.
* At a mask re-selection the function changes abruptly: entries dropped from ``M`` vanish at once and new entries
  start from the current ``B A``. The loss on a fixed batch just before and after is measured and logged.
* Nothing here depends on a distributed engine: whoever prepares the run (the callbacks, or a custom loop) calls
  :func:`hf_lisa.distributed.check_layer_switching_supported` once, before the first freeze.
"""

from __future__ import annotations

from .active_set import ActiveSet, BlockIndex
from .common import SCHEDULER_STATE_VERSION, lisa_config_of
from .layerwise import ALWAYS_TRAINABLE_KEYWORDS, DEFAULT_ALWAYS_TRAINABLE, LayerwiseScheduler
from .mask_schedule import MaskScheduler
from ..optim.state import OPTIMIZER_STATE_POLICIES, optimizer_state_bytes
from .sampler import LayerSampler
from .state import load_schedule, save_schedule

__all__ = [
    "ALWAYS_TRAINABLE_KEYWORDS",
    "DEFAULT_ALWAYS_TRAINABLE",
    "OPTIMIZER_STATE_POLICIES",
    "SCHEDULER_STATE_VERSION",
    "ActiveSet",
    "BlockIndex",
    "LayerSampler",
    "LayerwiseScheduler",
    "MaskScheduler",
    "lisa_config_of",
    "load_schedule",
    "optimizer_state_bytes",
    "save_schedule",
]
