"""LISA on more than one device: DDP, FSDP2 and DeepSpeed ZeRO, with gradient compression.

LISA changes which parameters train every K steps. Each engine fixes something about the trainable set when it wraps
the model, so each needs its own treatment. This package holds all of it; the schedulers in :mod:`hf_lisa.scheduler`
stay engine-agnostic.

**DDP** (the mechanism, and why):

* Every candidate parameter must have ``requires_grad=True`` when DDP wraps the model. DDP registers its gradient
  hooks only for the parameters that require grad at wrap time; a parameter frozen then and unfrozen later is
  *silently never synchronised*. The Trainer wraps before ``on_train_begin``, where the LISA callbacks freeze, so
  this holds by construction.
* Freezing after the wrap needs ``find_unused_parameters=True``; without it DDP waits forever for the frozen
  parameters' gradients ("Expected to have finished reduction", axolotl #1474). The Trainer turns it off with gradient
  checkpointing; :func:`configure_trainer_for_lisa` turns it back on. Non-reentrant checkpointing (transformers'
  default since 5.0) works with it; reentrant checkpointing cannot ("Expected to mark a variable ready only once")
  and is refused.
* **Gradients of the active set only.** DDP all-reduces whole buckets, frozen parameters included (as zeros), so
  plain DDP communicates the whole model's gradients every step. :func:`lisa_allreduce_hook` is a DDP communication
  hook that packs the gradients of the parameters that currently require grad, all-reduces only those, and leaves the
  rest of the bucket alone (DDP does not write gradients of globally unused parameters back, so frozen parameters keep
  ``grad=None``). Every rank freezes the same parameters (the sampler's seeded generator), so every rank packs the
  same slices. The bytes per step drop from the whole model to E+H+γ blocks; :class:`GradientBytesMeter` counts them.
* Compression (``fp16``/``bf16``) is applied to the packed active set; PowerSGD runs through PyTorch's own hook on
  whole buckets, with a fresh Q each step (warm-started Qs go stale or NaN while a block is frozen) and, on gloo, its
  stages completed inside the hook (they otherwise race with DDP's unused-parameter all-reduce). Batched PowerSGD
  fails on every device (a non-orthogonalisable Q) and is refused; torch's ``bf16_compress_hook`` requires
  NCCL/XCCL and is refused on gloo when the active-set hook is off.

**FSDP2** (``fully_shard`` per transformer block, :func:`fully_shard_blocks`): sharding is per parameter, so freezing
inside a block is fine and frozen blocks do no reduce-scatter at all: the communicated gradient bytes follow the
active set without help. Two things need care:

* torch < 2.14.1 computes a parameter group's mixed-precision dtypes only over the parameters trainable at lazy init
  (pytorch#186998). A block frozen at the first forward and unfrozen later then reduce-scatters bf16 gradients into
  fp32 parameters and fails ("attempting to assign a gradient with dtype 'BFloat16' to a tensor with grad_dtype
  'Float'"). :func:`install_fsdp2_unfreeze_fix` recomputes them whenever the trainable set changes; without it,
  :func:`check_layer_switching_supported` refuses low-precision ``MixedPrecisionPolicy`` with switching.
* Optimizer checkpoints load strictly and torch initialises optimizer state only for parameters that require grad, so
  the saved active set must be re-applied *before* the optimizer state is loaded: :func:`load_fsdp2_checkpoint`.

**FSDP1** mixes trainable and frozen parameters inside one flat parameter only with ``use_orig_params=True``; without
it, it is refused.

**DeepSpeed ZeRO** builds its fp32 partitions and optimizer over the parameters trainable at ``deepspeed.initialize``
(DeepSpeed #5639): blocks frozen later keep moving under Adam and blocks unfrozen later never train. Fixed trainable
sets (LoRA, LISA adapters with ``lisa_activated_layers=0``, sparse-mask re-selection, which changes no
``requires_grad``) train normally. In a custom ``deepspeed.initialize`` loop, :class:`DeepSpeedLayerSwitcher`
makes layer switching exact under ZeRO-1/2/3 by rebuilding the ZeRO optimizer over the new trainable set at every
switch (state carried through DeepSpeed's ``safe_get/set_full_*`` API). Under the Trainer, layer switching is refused
with an error that names the switcher and FSDP2.

Modules: :mod:`.guards` (engine detection, the one support check), :mod:`.ddp`, :mod:`.fsdp2`, :mod:`.deepspeed`
(``DeepSpeedLayerSwitcher``), :mod:`.configure` (``configure_trainer_for_lisa``)."""

from __future__ import annotations

from .configure import configure_trainer_for_lisa
from .ddp import (
    COMM_HOOKS,
    ActiveSetCommState,
    GradientBytesMeter,
    LisaDDPKwargs,
    ddp_kwargs_for_lisa,
    ddp_training_arguments,
    gradient_bytes,
    lisa_allreduce_hook,
    register_lisa_comm_hook,
)
from .deepspeed import DeepSpeedLayerSwitcher
from .fsdp2 import (
    FSDP2_SCHEDULE_FILE,
    fully_shard_blocks,
    install_fsdp2_unfreeze_fix,
    load_fsdp2_checkpoint,
    save_fsdp2_checkpoint,
)
from .guards import (
    ENGINES,
    FSDP2_UNFREEZE_FIXED_IN,
    UnsupportedEngineError,
    check_layer_switching_supported,
    detect_engine,
    fsdp2_unfreeze_fix_needed,
)

__all__ = [
    "ActiveSetCommState",
    "COMM_HOOKS",
    "DeepSpeedLayerSwitcher",
    "ENGINES",
    "FSDP2_SCHEDULE_FILE",
    "FSDP2_UNFREEZE_FIXED_IN",
    "GradientBytesMeter",
    "LisaDDPKwargs",
    "UnsupportedEngineError",
    "check_layer_switching_supported",
    "configure_trainer_for_lisa",
    "ddp_kwargs_for_lisa",
    "ddp_training_arguments",
    "detect_engine",
    "fsdp2_unfreeze_fix_needed",
    "fully_shard_blocks",
    "gradient_bytes",
    "install_fsdp2_unfreeze_fix",
    "lisa_allreduce_hook",
    "load_fsdp2_checkpoint",
    "register_lisa_comm_hook",
    "save_fsdp2_checkpoint",
]
