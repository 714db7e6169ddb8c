"""The memory options of a training job: ``--optim_step_in_backward``, ``--optim_8bit_embeddings``, ``--cpu_allocator``
and ``--chunked_loss``.

* ``--optim_step_in_backward``: AdamW stepped inside the backward pass, one parameter at a time, its gradient freed at
  once ([`hf_lisa.optim.in_backward.AdamWInBackward`]: plain AdamW's groups, state and update, so the LR
  schedule, LISA's state dropping, layer-wise LR decay and checkpoints work as with ``--optim adamw_torch``, and a run
  follows the plain one step for step). What it gives up is everything that needs all gradients before the update:
  see :func:`check_step_in_backward`. With ``--optim adamw_bnb_8bit`` the optimizer is bitsandbytes' 8-bit AdamW
  stepped the same way ([`hf_lisa.optim.adamw_8bit.AdamW8bitInBackward`]).
* bitsandbytes' 8-bit AdamW (``--optim adamw_bnb_8bit``), with or without the step in backward, is
  [`hf_lisa.optim.adamw_8bit.SlicedAdamW8bit`]: its CPU update a slice at a time, bit for bit the
  same, without five fp32 copies of the parameter beside it. ``--optim_8bit_embeddings`` keeps the embedding's state
  (a tied E/H) in 8 bits too, where transformers keeps it in 32 (:func:`configure_embedding_state`).
* ``--cpu_allocator``: on CPU, the C allocator decides how much freed memory the process keeps. glibc's ``malloc``
  raises its mmap threshold each time it frees a large block (up to 32 MiB), so after the first step every activation
  and gradient is carved from the heap, whose freed fragments stay resident: on SmolLM2-135M, full-parameter LISA
  peaked ~250 MiB (20% of its floor) above the tensors alive at any moment, at the start of the backward pass (the
  forward pass's temporaries are freed fragments by then) and in the embedding's backward (the blocks' activations
  are). ``trim`` (:class:`HeapTrim`) calls glibc's ``malloc_trim(0)`` at exactly those two points of every training
  step, returning the free pages inside the heap to the system; ``lean`` fixes the mmap threshold at glibc's default
  (:func:`apply_cpu_allocator`), so every block of 128 KiB and more is returned when freed, at a page fault per page
  of each new one. Measured on SmolLM2-135M, cpu-small batches, 2 cores (``benchmarks/study.py --config
  benchmarks/configs/bench.json --set cpu_allocator=...``; then ``benchmarks/compare.py --cpu-allocator``):
  ``trim`` gave full-parameter LISA 0.90× the peak RSS (1.11× its floor instead of 1.28×) at 1.17× the step time
  (16 steps); ``lean`` 0.90× at 1.34×, and full fine-tuning 0.90× at 1.49×. Both are opt-in.
* ``--chunked_loss``: the causal-LM loss without its vocabulary-sized temporaries (:mod:`hf_lisa.optim.chunked_loss`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
from dataclasses import field
from typing import Any, Optional

import torch

from ..errors import UsageError
from ..methods import get_method, method_names
from .in_backward import IN_BACKWARD_OPTIMS, AdamWInBackward, check_in_backward_arguments

#: the methods that use the option (full-parameter updates, where gradients are the size of the weights that train)
STEP_IN_BACKWARD_METHODS = method_names(lambda m: m.trains_weights)
#: ``--optim`` values whose update the step in backward reproduces
STEP_IN_BACKWARD_OPTIMS = IN_BACKWARD_OPTIMS
OPTION = "optim_step_in_backward"
#: ``--cpu_allocator`` values
CPU_ALLOCATORS = ("default", "trim", "lean")
#: the mmap threshold ``lean`` fixes: glibc's own default, which glibc otherwise raises as large blocks are freed
LEAN_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
#: preloaded allocators that replace glibc's malloc (then ``lean`` does nothing)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

logger = logging.getLogger("hf_lisa.train")


#: the help of ``LisaTrainer``'s settings (the fields of :class:`hf_lisa.trainer.LisaTrainingArguments`, options of
#: ``hf-lisa train``)
MEMORY_HELP = {
    "layerwise_lr_decay": "Layer-wise LR decay d in (0, 1]: block l of N trains at lr * d^(N-1-l), embeddings at "
    "lr * d^N, head and other parameters at lr. 1 disables.",
    OPTION: "Update each parameter with AdamW as soon as its gradient is complete in the backward pass, and free "
    "that gradient at once (PyTorch's 'optimizer step in backward'): the trainable set's gradients never all "
    "live at once, and the step's temporaries are one parameter's. The same updates as --optim adamw_torch / "
    "adamw_torch_fused / adamw_bnb_8bit without it (the 8-bit one a slice at a time on CPU). Needs "
    "--max_grad_norm 0 (no global-norm clipping), gradient_accumulation_steps 1, one process, AdamW, no fp16; "
    "not with --lisa_sampling importance.",
    "optim_8bit_embeddings": "With a bitsandbytes 8-bit --optim (e.g. adamw_bnb_8bit): keep the AdamW state of the "
    "embedding (and so of a tied LM head) in 8 bits too. transformers' Trainer keeps nn.Embedding weights in 32-bit "
    "state for stability; for full-parameter LISA the tied embedding/head is most of what trains, so its state is "
    "most of the optimizer's memory (SmolLM2-135M: 216 of 270 MiB at 32 bits).",
    "cpu_allocator": "CPU training with glibc (Linux): what happens to the memory each step frees. 'default' keeps "
    "glibc's behaviour (freed fragments stay resident in the heap); 'trim' returns the heap's free pages to the "
    "system (malloc_trim) at the start of each backward pass and before the embedding's backward, where the peak "
    "forms (0.9x the peak RSS on SmolLM2-135M, at up to 1.17x the step time); 'lean' fixes malloc's mmap "
    "threshold at 128 KiB, so every tensor of 128 KiB or more goes back to the system when freed: 0.9x the peak "
    "RSS at 1.3-1.5x the step time (each large tensor's pages are faulted in and zeroed anew). Nothing is "
    "changed on GPU or with jemalloc/tcmalloc/mimalloc preloaded; 'lean' also leaves MALLOC_* variables as set.",
    "chunked_loss": "Compute a causal LM's loss a few hundred tokens at a time: no log-softmax over the whole "
    "vocabulary is kept for the backward pass, and its gradient is written chunk by chunk, so the logits "
    "and their gradient are the only vocabulary-sized tensors (each tokens x vocabulary x 4 bytes). The "
    "same loss and gradients to float rounding. Models whose loss is not transformers' causal-LM loss "
    "keep theirs.",
    "progress_check_steps": "Stop the run (exit status 1, NothingTrainedError) when this many optimizer steps at the "
    "start, and after each evaluation, change no trainable parameter with a nonzero gradient (learning-rate warmup "
    "steps at 0 do not count). 0 turns the check off.",
}


def _optim_name(training_args) -> str:
    optim = getattr(training_args, "optim", "adamw_torch")
    return getattr(optim, "value", optim)


def check_memory_options(lisa_args, training_args) -> None:
    """Check ``--optim_8bit_embeddings`` against ``--optim``, and ``--optim_step_in_backward``
    (:func:`check_step_in_backward`); each value's own rule is checked where the arguments are built."""
    optim = _optim_name(training_args)
    if getattr(training_args, "optim_8bit_embeddings", False) and not _is_bnb_8bit(optim):
        raise UsageError(
            f"--optim_8bit_embeddings=True keeps the embedding's optimizer state in 8 bits, so it needs a bitsandbytes "
            f"8-bit optimizer; --optim={optim!r} is not one. Allowed with it: --optim adamw_bnb_8bit (or another "
            "bitsandbytes '..._8bit' optimizer)."
        )
    check_step_in_backward(lisa_args, training_args)


def _is_bnb_8bit(optim: str) -> bool:
    """Whether ``--optim`` builds a bitsandbytes optimizer with 8-bit state (transformers' own test)."""
    return "8bit" in optim and "torchao" not in optim


def _glibc() -> Optional[ctypes.CDLL]:
    """glibc's ``libc.so.6`` when this process allocates through it (Linux, no preloaded allocator), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # musl has no such symbol


class HeapTrim:
    """``--cpu_allocator trim``: glibc's ``malloc_trim(0)`` where a training step's peak forms.

    Two points of each backward pass: its start (a hook on the loss, :meth:`trim_before_backward_of`: the forward
    pass's temporaries are freed fragments between the activations by then) and the gradient of the input embeddings'
    output (a hook that :meth:`attach` places: the blocks' activations are freed, and the embedding's weight-sized
    gradient is next).
    ``malloc_trim`` returns every free page inside the heap to the system (``madvise``), not only its top. The hooks
    pass gradients through unchanged, and do nothing outside a backward pass. :attr:`calls` counts the trims.
    """

    def __init__(self, libc: ctypes.CDLL):
        self._malloc_trim = libc.malloc_trim
        self.calls = 0

    def __call__(self, grad: torch.Tensor) -> None:  # a tensor hook: the gradient passes unchanged
        self._malloc_trim(0)
        self.calls += 1

    def trim_before_backward_of(self, tensor: torch.Tensor) -> None:
        """Trim when the backward pass reaches ``tensor`` (the loss: when the backward pass starts)."""
        if torch.is_grad_enabled() and tensor.requires_grad:
            tensor.register_hook(self)

    def attach(self, model: torch.nn.Module):
        """Trim before the backward pass of ``model``'s input embeddings; returns the hook's handle (``None`` when the
        model has no input embeddings)."""
        try:
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return None
        if not isinstance(embeddings, torch.nn.Module):
            return None
        return embeddings.register_forward_hook(self._on_embeddings_output)

    def _on_embeddings_output(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self.trim_before_backward_of(output)


def heap_trim(policy: str, on_cpu: bool) -> Optional[HeapTrim]:
    """A :class:`HeapTrim` for ``--cpu_allocator trim`` on a CPU with glibc, else ``None``."""
    if policy not in CPU_ALLOCATORS:
        raise ValueError(f"cpu_allocator={policy!r} is invalid; allowed: {', '.join(CPU_ALLOCATORS)}.")
    libc = _glibc() if policy == "trim" and on_cpu else None
    return HeapTrim(libc) if libc is not None else None


def apply_cpu_allocator(policy: str, on_cpu: bool) -> Optional[str]:
    """Apply ``--cpu_allocator`` to this process's ``malloc``; returns what was done (for the log), else ``None``.

    ``lean`` calls glibc's ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``: any explicit setting turns off the dynamic threshold
    (see ``mallopt(3)``), so each block of 128 KiB or more is mapped on its own and unmapped when freed, and the RSS
    follows the live tensors instead of the heap's high-water mark; then ``malloc_trim(0)`` returns what the heap
    already holds. The cost is a page fault per page of each new large block. Nothing happens off CPU, off glibc,
    under a preloaded allocator, or when the user set ``MALLOC_*`` variables or glibc malloc tunables (their choice
    stands).
    """
    if policy not in CPU_ALLOCATORS:
        raise ValueError(f"cpu_allocator={policy!r} is invalid; allowed: {', '.join(CPU_ALLOCATORS)}.")
    if policy != "lean" or not on_cpu or not sys.platform.startswith("linux"):
        return None
    user_set = [k for k in os.environ if k.startswith("MALLOC_")]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        user_set.append("GLIBC_TUNABLES")
    preloaded = [name for name in _OTHER_ALLOCATORS if name in os.environ.get("LD_PRELOAD", "")]
    if user_set or preloaded:
        logger.info("--cpu_allocator lean: left as set by %s.", ", ".join(sorted(user_set) + preloaded))
        return None
    libc = _glibc()
    if libc is None:
        return None
    if libc.mallopt(_M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD) != 1:
        return None
    libc.malloc_trim(0)
    return f"glibc malloc: mmap threshold fixed at {LEAN_MMAP_THRESHOLD // 1024} KiB (--cpu_allocator lean)"


def check_step_in_backward(lisa_args, training_args) -> None:
    """Refuse what cannot work when every gradient is applied, and freed, the moment it is complete.

    Raises:
        UsageError: with ``--optim_step_in_backward``: gradient accumulation (each micro-batch would step),
            ``--max_grad_norm`` > 0 (global-norm clipping needs every gradient first), ``--fp16`` (its gradient scaler
            unscales and checks after the backward pass), an ``--optim`` other than AdamW, more than one process or
            DeepSpeed/FSDP (gradients are reduced across ranks after the local backward), or ``--lisa_sampling
            importance`` (it reads the gradients after the backward pass).
    """
    if not getattr(training_args, OPTION, False):
        return
    check_in_backward_arguments(training_args, cli=True)  # the rules LisaTrainer and the callbacks run too
    flag = f"--{OPTION}"
    if get_method(lisa_args.method).samples_layers and getattr(lisa_args, "lisa_sampling", "uniform") == "importance":
        raise UsageError(
            f"{flag} frees every gradient as it is applied, so --lisa_sampling=importance (which reads the "
            "gradients after the backward pass) cannot see them; allowed with it: uniform, cyclic."
        )


def step_in_backward_optimizer(trainer, model: Optional[torch.nn.Module] = None) -> tuple[type, dict]:
    """``(class, kwargs)`` for ``trainer``'s arguments: the keyword arguments ``Trainer.create_optimizer`` would use
    for ``--optim adamw_torch[_fused]`` or ``adamw_bnb_8bit``, with the class replaced by
    :class:`~hf_lisa.optim.in_backward.AdamWInBackward` or
    :class:`~hf_lisa.optim.adamw_8bit.AdamW8bitInBackward`.

    Raises:
        ValueError: the Trainer was given another optimizer (``optimizers=`` or ``optimizer_cls_and_kwargs=``), its
            ``--optim`` is not one of those, or it runs on more than one process, DeepSpeed or FSDP.
    """
    from .in_backward import StepsInBackward

    args = trainer.args
    if trainer.accelerator.num_processes > 1 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError(
            f"{OPTION}=True runs one process only (gradients are reduced across ranks after the local backward "
            "pass); this Trainer is distributed. Drop the option for distributed training."
        )
    given = trainer.optimizer_cls_and_kwargs
    if given is not None and not (isinstance(given[0], type) and issubclass(given[0], StepsInBackward)):
        raise ValueError(
            f"{OPTION}=True builds its own optimizer (AdamWInBackward), but the Trainer was given "
            f"optimizer_cls_and_kwargs with {getattr(given[0], '__name__', given[0])!r}; pass one or the other."
        )
    if given is not None:
        return given
    optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
    if optimizer_cls is torch.optim.AdamW:
        return AdamWInBackward, dict(kwargs)
    if _is_bnb_adamw_8bit(optimizer_cls, kwargs):
        from .adamw_8bit import AdamW8bitInBackward

        return AdamW8bitInBackward, dict(kwargs)
    raise ValueError(
        f"{OPTION}=True reproduces AdamW's update, so optim={_optim_name(args)!r} (which builds "
        f"{getattr(optimizer_cls, '__name__', optimizer_cls)}) cannot be used with it; allowed: "
        f"{', '.join(STEP_IN_BACKWARD_OPTIMS)}."
    )


def _is_bnb_adamw_8bit(optimizer_cls: Any, kwargs: dict) -> bool:
    """Whether the Trainer's choice is bitsandbytes' (non-paged) AdamW with 8-bit state."""
    module = getattr(optimizer_cls, "__module__", "") or ""
    return (module.startswith("bitsandbytes") and getattr(optimizer_cls, "__name__", "") == "AdamW"
            and kwargs.get("optim_bits") == 8 and not kwargs.get("is_paged"))


def sliced_8bit_optimizer(trainer, model: Optional[torch.nn.Module] = None) -> Optional[tuple[type, dict]]:
    """``(SlicedAdamW8bit, kwargs)`` where the Trainer would build bitsandbytes' 8-bit AdamW (bit for bit the same
    update, without whole-parameter fp32 temporaries on CPU: :mod:`hf_lisa.optim.adamw_8bit`);
    ``None`` otherwise, or when the Trainer was given its optimizer."""
    if trainer.optimizer_cls_and_kwargs is not None or trainer.is_deepspeed_enabled:
        return None
    optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    if not _is_bnb_adamw_8bit(optimizer_cls, kwargs):
        return None
    from .adamw_8bit import SlicedAdamW8bit

    return SlicedAdamW8bit, dict(kwargs)


def configure_embedding_state(optimizer, model: torch.nn.Module, eight_bit: bool) -> Optional[str]:
    """For a bitsandbytes 8-bit ``optimizer``: the embeddings' state in 32 bits, as transformers' Trainer registers
    for the bitsandbytes classes it builds (our subclasses live outside its check), or in 8 bits with
    ``eight_bit``. Returns what was registered (for the log), ``None`` for other optimizers.

    Raises:
        ValueError: ``eight_bit`` with an optimizer whose state is not 8-bit.
    """
    from .state import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    bnb = sys.modules.get("bitsandbytes")  # an 8-bit optimizer exists only where bitsandbytes was imported
    is_8bit = (bnb is not None and isinstance(inner, bnb.optim.optimizer.Optimizer8bit)
               and getattr(inner.args, "optim_bits", None) == 8)
    if not is_8bit:
        if eight_bit:
            raise ValueError(f"optim_8bit_embeddings=True needs a bitsandbytes 8-bit optimizer; this Trainer's is "
                             f"{type(inner).__name__}. Use optim='adamw_bnb_8bit' or drop the option.")
        return None
    from .adamw_8bit import set_embedding_state_bits

    bits = 8 if eight_bit else 32
    count = set_embedding_state_bits(model, bits)
    return f"bitsandbytes: the optimizer state of {count} embedding weight(s) is kept in {bits} bits"
