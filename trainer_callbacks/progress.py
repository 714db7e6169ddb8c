"""The safety net: a run whose first optimizer steps train nothing stops, with exit status 1 under ``hf-lisa train``.

A run can do every step, log a loss and exit 0 while no weight moves, or moves by less than the weights' precision: a
bitsandbytes 4-bit base repacked into its inference-only layout by an evaluation before training (no backward: every
gradient zero), a loss that does not depend on what trains, a learning rate too small for the weights' precision,
parameters frozen by a library after the optimizer was built. :class:`TrainingProgressGuard` checks the first
``check_steps`` optimizer steps (and again the first ``check_steps`` after each evaluation, which is what repacks a
4-bit base) and raises :class:`~hf_lisa.errors.NothingTrainedError` out of ``trainer.train()`` when none of them
trained.

What counts:

* A step **changed weights** when some trainable parameter changed across the optimizer step *and* its gradient was
  nonzero (weight decay alone moves weights whose gradients are zero). With an optimizer that steps in the backward
  pass the gradients are gone by then: its hooks' gradient norm stands for them. Under DeepSpeed (gradients in its
  own buffers) a changed weight is enough.
* It **trained** when, besides, the update was large enough for the weights: ``||ΔW|| / ||W||``, the trainable
  values' change across the step against their size, all trainable tensors pooled (a tensor that is all zeros before
  the step, LoRA's or the LISA adapter's B, counts at the mean size of the others: B leaving 0 by 1e-12 is measured
  against the A it multiplies; single values that are exactly 0 are left out), is at least ``warn_update``. The
  size is judged at the full learning rate only (at least half the scheduler's peak, ``initial_lr``): a warmup's
  first steps move bf16 weights by less than their precision, legitimately.
* Only **checked** steps count: the learning rate is above 0 (a warmup that starts at 0 is skipped), the step was not
  skipped (an fp16 loss scaler's inf/NaN step), not everything trainable was deliberately withheld (a fresh sparse
  adapter's mask calibration, :class:`~hf_lisa.scheduler.MaskScheduler`: the check waits until calibration ends), and
  below the full learning rate only steps whose gradients were all zero or absent.
* After ``check_steps`` checked steps none of which trained: below ``min_update`` in every one the run stops; between
  ``min_update`` and ``warn_update`` it goes on with one warning (measured figure, what to do).

The thresholds come from real ``hf-lisa train`` runs, ``benchmarks/progress_threshold.py`` (first 3 steps at a
constant rate; the first judged step of a run that trains, the largest of 3 otherwise; ``bf16`` = bfloat16 weights,
``--torch_dtype bfloat16``; SmolLM2 = the embedded SmolLM2-135M-Instruct; tiny = a 2-block llama of hidden size 64
with its tokenizer; the tests' model = ``tests/train_fixtures.py``'s, hidden size 32, 128 characters; both at their
initial weights, std 0.02):

========================================================  =================  ================  =======
run (model, method, weights, learning rate)               ||ΔW|| / ||W||     values changed    verdict
========================================================  =================  ================  =======
1e-5 to 1e-3: full, lisa, lora, lisa-adapter; fp32, bf16  5.1e-6 to 4.5e-2   0.9-100%          passes
  smallest: SmolLM2, lisa, bf16 weights, 1e-5             5.1e-6             0.91%             passes
  SmolLM2, full, bf16 / fp32 weights, 1e-5                8.3e-6 / 4.9e-5    1.6% / 98%        passes
  SmolLM2, lora / lisa-adapter, 1e-5 (both)               2.6e-4 / 2.5e-4    40% / 36%         passes
  tests' model, full, bf16 / fp32 weights, 1e-5           5.9e-5 / 1.2e-4    14% / 87%         passes
SmolLM2, full, bf16 weights, 1e-6 / 1e-7                  3.3e-7 / 9.2e-9    0.32% / 0.18%     warns
tests' model, full, bf16 weights, 1e-7                    4.8e-8             0.11%             warns
SmolLM2, full, fp32, 1e-7 / 1e-8                          4.8e-7 / 5.1e-8    89% / 68%         warns
SmolLM2, lora / lisa-adapter, bf16 base, 1e-8             3.1e-7 / 2.8e-7    68% / 60%         warns
tests' model, full, fp32, 1e-8; lora, bf16 base, 1e-8     1.2e-7; 6.8e-8     87%; 47%          warns
SmolLM2, full / lisa, bf16 weights, 1e-8 (the issue's)    7.7e-10 / 5.3e-10  0.17% / 0.55%     stops
tests' model / tiny, full, bf16 weights, 1e-8             2.0e-9 / 5.2e-10   0.015% / 0.0001%  stops
SmolLM2, lora / lisa-adapter, 1e-12 (B leaves 0)          3.1e-11 / 2.8e-11  40% / 36%         stops
tests' model / tiny, lora, 1e-12                          6.8e-12 / 1.1e-11  43% / 43%         stops
SmolLM2 / tests' model, full, fp32, 1e-10                 5.3e-11 / 3.6e-10  0.9% / 6.8%       stops
========================================================  =================  ================  =======

``MIN_UPDATE`` = 4e-9 lies between the largest clearly-not-moving run (2.0e-9, the tests' model at 1e-8 in bf16)
and the smallest that still moves (9.2e-9, bf16 weights at 1e-7, which keep 0.2% of their updates); the same rate
measures up to 4x apart on different models, so a run near it may warn where it could stop, or stop with bf16 weights
at 1e-7. A hundred thousand steps at 4e-9 change the weights by less than 0.04% of their size. ``WARN_UPDATE`` = 1e-6
sits 5x below the smallest run at a rate people train at (bf16 weights at 1e-5 keep only 1% of their updates and still
pass). The band between holds rates that do move the weights, but too little to learn in a usual number of steps: a
warning, not an error, since a deliberate setting (a DPO stage at 5e-7 to 1e-7) can sit there.
"values changed" is reported, not judged: with bf16 weights the values near 0 change at any rate (and SmolLM2's
weights, dequantized from GGUF, are 0.24% exactly 0), so it hardly falls with the rate.

A change is seen in a fingerprint per parameter, taken before and after the step: a float64 sum, computed a slice at
a time (8 MiB of temporaries at most), and ``sample_size`` evenly spaced values, from which the update's size is
estimated. Nothing the size of the model is copied; the cost is a read of the trainable weights twice per checked
step until one changed, then the samples alone until a step at the full rate is judged, then nothing. Under FSDP2
each rank fingerprints its own shards and the ranks agree on the verdict (an all-reduce or two per checked step).
Under DeepSpeed ZeRO-3 (parameters partitioned away) the guard is off, with a warning.

``hf-lisa train`` and ``LisaTrainer`` run one with ``check_steps=3``; the LISA callbacks add one to a Trainer they
are handed (:func:`add_progress_guard`, through ``prepare_trainer``), and in a Trainer they are not handed, each
runs one itself (``run_by``). To change or turn it off, pass your own, which stands:
``Trainer(callbacks=[LisaCallback(...), TrainingProgressGuard(check_steps=0)])``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from hf_lisa.errors import NothingTrainedError
from hf_lisa.optim.in_backward import check_in_backward_arguments, steps_in_backward

logger = logging.getLogger(__name__)

#: the guards of each run, by ``id`` of its ``TrainerState`` (the object every callback of a Trainer is handed; not
#: hashable), kept while the state lives: a guard run by a LISA callback stands back for one the Trainer holds
_RUNNING: dict[int, list] = {}


def _register(state, guard) -> None:
    if id(state) not in _RUNNING:
        _RUNNING[id(state)] = []
        weakref.finalize(state, _RUNNING.pop, id(state), None)
    _RUNNING[id(state)].append(guard)

__all__ = ["TrainingProgressGuard", "add_progress_guard"]

#: values per slice of the float64 checksum (8 MiB of float64 temporaries)
_SLICE = 1 << 20
#: causes named in the message, most likely first
LIKELY_CAUSES = (
    "a quantized base in an inference-only layout (bitsandbytes 4-bit after model.eval(): an evaluation or a "
    "generation before training; such a base has no backward)",
    "a loss that does not depend on the trainable parameters (every gradient zero)",
    "a learning rate too small to change the weights at their precision (e.g. bf16 weights)",
    "parameters frozen by a library (requires_grad=False) after the optimizer was built",
)


#: ||ΔW|| / ||W|| at the full learning rate below which, in every checked step, the run stops (the table above)
MIN_UPDATE = 4e-9
#: below this (and at or above MIN_UPDATE) the run goes on with a warning
WARN_UPDATE = 1e-6
#: the smallest ||ΔW|| / ||W|| measured at a learning rate people train at (the table), quoted in the message
TRAINING_RUNS_MEASURE = 5e-6
#: share of the scheduler's peak ("initial_lr") at which a step counts as at the full learning rate
FULL_RATE = 0.5
#: what to do about updates too small for the weights
FIX = "raise the learning rate (--learning_rate)"
FIX_PRECISION = (", or keep the bf16/fp16 weights in float32 (hf-lisa train: --torch_dtype float32, with --bf16 for "
                 "mixed precision), whose precision registers smaller updates")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (an FSDP2 ``DTensor``'s local shard; no collective)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Fingerprint:
    """A float64 sum of a tensor (computed a slice at a time; skipped with ``total=False``) and ``k`` evenly spaced
    values of it (this rank's shard of it; an empty shard never differs)."""

    __slots__ = ("total", "sample", "numel")

    def __init__(self, tensor: torch.Tensor, k: int, total: bool = True) -> None:
        flat = _local(tensor.detach()).reshape(-1)
        self.total = None
        if total:
            self.total = torch.zeros((), dtype=torch.float64, device=flat.device)
            for part in flat.split(_SLICE):
                self.total += part.sum(dtype=torch.float64)
        # integer positions: a float32 linspace rounds numel - 1 up past the end for large tensors (28311551 of a
        # 49152 x 576 embedding became 28311552)
        n = self.numel = flat.numel()
        index = (torch.arange(min(k, n), device=flat.device, dtype=torch.int64) * (n - 1)) // max(min(k, n) - 1, 1)
        self.sample = flat[index].clone()

    def differs(self, other: "_Fingerprint") -> bool:
        return bool(self.total != other.total) or not torch.equal(self.sample, other.sample)


def _update_size(pairs: list[tuple["_Fingerprint", "_Fingerprint"]], device: Any) -> Optional[tuple[float, float]]:
    """``(||ΔW|| / ||W||, share of values changed)`` of the trainable values pooled (every rank's shards summed),
    estimated from each tensor's sampled values weighted by its size; ``None`` when every value is 0 (no size).

    A tensor that is all zeros before the step (LoRA's and the LISA adapter's B) has no size of its own: it counts at
    the mean size of the others, so that B leaving 0 by 1e-12 is measured against the A it multiplies."""
    sums = torch.zeros(5, dtype=torch.float64)
    for before, after in pairs:
        if not before.numel:
            continue
        b = before.sample.to(torch.float64)
        d = after.sample.to(torch.float64) - b
        mean_square = b.square().mean()
        nonzero = (mean_square > 0).to(torch.float64)
        # a value that is exactly 0 in a tensor that is not (a padding row, a pruned weight, 0.24% of SmolLM2's
        # dequantized weights) moves by the learning rate itself, in bf16 too: it is left out of ||dW||
        moved = torch.where(nonzero > 0, (d.square() * (b != 0)).mean(), d.square().mean())
        one = torch.ones((), dtype=torch.float64, device=b.device)
        row = torch.stack([moved, mean_square, nonzero, one, (d != 0).to(torch.float64).mean()])
        sums += (row * before.numel).cpu()
    sums = _all_sum(sums, device)
    moved_square, size_square, sized, values, changed = sums.tolist()
    if size_square <= 0 or values <= 0:
        return None
    return (moved_square / (size_square * values / sized)) ** 0.5, changed / values


class TrainingProgressGuard(TrainerCallback):
    """Stop a run whose first optimizer steps train nothing (see the module docstring).

    Args:
        check_steps (`int`, defaults to `3`): stop after this many checked steps (learning rate above 0, updates not
            all withheld) in which nothing trained; checked again for this many steps after each evaluation. `0`
            turns the guard off.
        sample_size (`int`, defaults to `1024`): values per parameter compared besides its float64 sum, from which
            the update's size against the weights' is estimated.
        min_update (`float`, defaults to `MIN_UPDATE`): below this ``||ΔW|| / ||W||`` at the full learning rate, in
            every checked step, the run stops; `0` judges only whether weights changed at all.
        warn_update (`float`, defaults to `WARN_UPDATE`): below this (and at or above ``min_update``) the run goes on
            with a warning.

    Attributes:
        passed_at (`int` or `None`): the optimizer step (1-based) at which a step last trained and the check ended.
        checked (`int`): checked steps without training since the check was (re)armed.
        update_size (`float` or `None`): the ``||ΔW|| / ||W||`` of the step that ended the check (the largest of
            the checked steps when they all fell short).

    Raises:
        hf_lisa.errors.NothingTrainedError: out of ``trainer.train()``, naming what was expected to train, what was
            seen (no gradient, zero gradients, unchanged weights, updates too small for the weights) and the likely
            causes.
    """

    def __init__(self, check_steps: int = 3, sample_size: int = 1024, min_update: Optional[float] = None,
                 warn_update: Optional[float] = None, run_by: Any = None) -> None:
        if not isinstance(check_steps, int) or isinstance(check_steps, bool) or check_steps < 0:
            raise ValueError(f"check_steps={check_steps!r} is invalid; allowed: an integer >= 0 (0 turns it off).")
        if not isinstance(sample_size, int) or isinstance(sample_size, bool) or sample_size < 1:
            raise ValueError(f"sample_size={sample_size!r} is invalid; allowed: an integer >= 1.")
        min_update = MIN_UPDATE if min_update is None else min_update
        warn_update = max(WARN_UPDATE, min_update) if warn_update is None else warn_update
        if not (isinstance(min_update, (int, float)) and 0 <= min_update <= warn_update):
            raise ValueError(f"min_update={min_update!r}, warn_update={warn_update!r} are invalid; allowed: numbers "
                             "with 0 <= min_update <= warn_update.")
        self.check_steps = check_steps
        self.sample_size = sample_size
        self.min_update, self.warn_update = float(min_update), float(warn_update)
        self.passed_at: Optional[int] = None
        self.checked = 0
        self.update_size: Optional[float] = None
        self._armed = False
        self._moving = False  # a step changed weights below the full rate (warmup): only their size is left to judge
        self._first_checked: Optional[int] = None
        self._run_by = run_by  # the LISA callback that runs this guard itself (its Trainer was not handed over)
        self._grads_visible = True  # False under DeepSpeed (gradients in its own buffers)
        self._snapshot: Optional[dict[int, tuple[str, torch.nn.Parameter, _Fingerprint]]] = None
        self._hooks_norm: Optional[float] = None
        self._seen: dict[str, Any] = {}
        self._rates: list[float] = []  # learning rates of the checked steps

    # -- arming --------------------------------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._armed, self.checked, self._first_checked, self._snapshot = self.check_steps > 0, 0, None, None
        self._moving, self.update_size, self._seen, self._rates = False, None, {}, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from hf_lisa.distributed import detect_engine

        if steps_in_backward(optimizer) is not None:  # a plain Trainer given such an optimizer: the command's rules
            check_in_backward_arguments(args, check_optim=False)
        _register(state, self)
        deepspeed = bool(args.deepspeed) or detect_engine(model, optimizer) == "deepspeed"
        self._grads_visible = not deepspeed
        self._arm()
        if self._armed and model is not None and any(hasattr(p, "ds_tensor") for p in model.parameters()):
            self._armed = False
            logger.warning("TrainingProgressGuard is off for this run: DeepSpeed ZeRO-3 partitions the parameters, "
                           "so their values cannot be compared across a step here.")

    def on_evaluate(self, args, state, control, **kwargs):
        # model.eval() can change what trains (a 4-bit base repacked for inference): check the next steps again
        if self.check_steps and self.passed_at is not None:
            self._arm()

    def on_train_end(self, args, state, control, **kwargs):
        running = _RUNNING.get(id(state), [])
        if self in running:
            running.remove(self)
        if self._armed and self.checked and self._seen.get("size") is not None:  # ended before the check did
            logger.warning("TrainingProgressGuard: %s, and the run ended before %d steps were checked. %s.",
                           self._size_evidence(self.warn_update), self.check_steps, "R" + self._fix()[1:])
        elif self._armed and self.checked == 0 and self.passed_at is None and state.global_step:
            what = ("the learning rate never reached its full value, so the updates' size was not judged"
                    if self._moving else "learning rate 0, or every update withheld, at every step")
            logger.info("TrainingProgressGuard: no step of this run could be checked (%s), so nothing was verified "
                        "to train.", what)
        self._armed, self._snapshot = False, None

    # -- per step ------------------------------------------------------------------------------------------------------
    def _candidates(self, model, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
        """Parameters that train or may train this step: those that require a gradient, and the optimizer's."""
        held = set()
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad or id(p) in held]

    def _stands_back(self, state) -> bool:
        """A guard run by a LISA callback stands back for a guard the Trainer holds (a user's choice stands), and for
        the guard of another LISA callback of the same run that started first."""
        if self._run_by is None:
            return False
        running = _RUNNING.get(id(state), [])
        own = [g for g in running if g._run_by is not None]
        return any(g._run_by is None for g in running) or (bool(own) and own[0] is not self)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._armed and self._stands_back(state):
            self._armed = False
        if not self._armed or model is None:
            return
        self._hooks_norm = None
        candidates = self._candidates(model, optimizer)
        total = not self._moving  # once weights were seen to change, only samples are compared (their size)
        self._snapshot = {id(p): (n, p, _Fingerprint(p, self.sample_size, total)) for n, p in candidates}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        stepping = steps_in_backward(optimizer)
        if self._snapshot is not None and stepping is not None:  # its hooks applied (and freed) the gradients
            self._hooks_norm = stepping.grad_norm()

    def _withheld(self, model) -> set[int]:
        """What the LISA schedules run on ``model`` withhold in this step (sparse layers calibrating in training)."""
        from hf_lisa.tuner.schedule_guard import schedule_owners

        owners = [self._run_by] if self._run_by is not None else []
        owners += schedule_owners(model) if model is not None else []
        ids = set()
        for owner in owners:
            scheduler = getattr(owner, "mask_scheduler", None)
            ids.update(id(p) for p in getattr(scheduler, "withheld", None) or ())
        return ids

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        snapshot, self._snapshot = self._snapshot, None
        if not self._armed or snapshot is None or getattr(optimizer, "step_was_skipped", False):
            return
        withheld = self._withheld(kwargs.get("model"))
        trainable = [(n, p) for n, p, _ in snapshot.values() if p.requires_grad and id(p) not in withheld]
        if withheld and not trainable:  # every update deliberately withheld (mask calibration): wait
            return
        ids = {id(p) for _, p in trainable}
        # the groups of what trains (all of them where the optimizer holds copies: DeepSpeed's flat partitions)
        all_groups = optimizer.param_groups if optimizer is not None else []
        groups = [g for g in all_groups if any(id(p) in ids for p in g["params"])] or all_groups
        if groups and not any(float(g["lr"]) > 0 for g in groups):  # e.g. a warmup's first step at lr 0
            return
        step = state.global_step + 1  # global_step counts this step after on_optimizer_step
        after = {id(p): _Fingerprint(p, self.sample_size, not self._moving) for _, p in trainable}
        grads = {id(p): _local(p.grad) for _, p in trainable if p.grad is not None}
        nonzero = {i for i, g in grads.items() if not self._moving and bool(g.any())}
        changed = set()
        if self._moving:  # weights changed in an earlier step: only the updates' size is left to judge
            trained = True
        else:
            changed = {i for i in after if snapshot[i][2].differs(after[i])}
            if self._hooks_norm is not None:  # stepped in the backward pass: the hooks measured the gradients
                trained = bool(changed) and self._hooks_norm > 0
            elif self._grads_visible:
                trained = bool(changed & nonzero)
            else:
                trained = bool(changed)
            trained = _any_rank(trained, args.device)
        lr = max(float(g["lr"]) for g in groups) if groups else None
        # a warmup's steps move weights by less than the full rate will: their size is judged at the full rate
        full_rate = not groups or any(float(g["lr"]) >= FULL_RATE * float(g.get("initial_lr", g["lr"])) for g in groups)
        size = None
        if not trained and not full_rate:
            # below the full rate (a warmup) unchanged weights may only be too small to move yet: such a step counts
            # only when its gradients were zero or absent, which no learning rate changes
            if self._hooks_norm is not None:
                grads_zero = self._hooks_norm == 0
            else:
                grads_zero = self._grads_visible and not nonzero
            if _any_rank(not grads_zero, args.device):
                return
        if trained:
            self._moving = True  # weights change: from now on only their updates' size is judged
            if not full_rate:
                logger.debug("TrainingProgressGuard: step %d changed weights at learning rate %g, below the full "
                             "rate; their size is judged at the full rate.", step, lr)
                return
            size = _update_size([(snapshot[i][2], after[i]) for i in after], args.device)
            if size is not None:
                logger.debug("TrainingProgressGuard: step %d at learning rate %g: ||dW||/||W|| = %.3g, %.4g%% of the "
                             "sampled trainable values changed.", step, lr, size[0], 100 * size[1])
                self.update_size = max(self.update_size or 0.0, size[0])
            if size is None or size[0] >= self.warn_update:
                self._armed, self.passed_at = False, step
                logger.debug("TrainingProgressGuard: step %d trained; the check ends.", step)
                return
        self.checked += 1
        self._first_checked = self._first_checked or step
        self._rates += [lr] if lr is not None else []
        self._seen = {"step": step, "candidates": [n for n, _, _ in snapshot.values()], "trainable": trainable,
                      "grads": len(grads), "nonzero": len(nonzero), "changed": len(changed),
                      "hooks_norm": self._hooks_norm, "size": size}
        if self.checked < self.check_steps:
            return
        if self.update_size is not None and self.update_size >= self.min_update:
            self._armed, self.passed_at = False, step
            logger.warning("TrainingProgressGuard: %s; the run goes on. If its loss does not fall, %s.",
                           self._size_evidence(self.warn_update), self._fix())
            return
        raise NothingTrainedError(self._message())

    # -- the message ---------------------------------------------------------------------------------------------------
    def _steps(self) -> str:
        step = self._seen["step"]
        return f"step {step}" if self._first_checked == step else f"steps {self._first_checked}-{step}"

    def _fix(self) -> str:
        low = any(p.dtype in (torch.bfloat16, torch.float16) for _, p in self._seen["trainable"])
        return FIX + (FIX_PRECISION if low else "")

    def _size_evidence(self, limit: float) -> str:
        seen = self._seen
        dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in seen["trainable"]})
        moved = f"; {100 * seen['size'][1]:.2g}% of their sampled values changed at all" if seen["size"] else ""
        rates = sorted({f"{lr:.3g}" for lr in self._rates}, key=float)
        lr = "unknown" if not rates else rates[0] if len(rates) == 1 else f"{rates[0]} to {rates[-1]}"
        return (f"the updates were too small for the weights in {self._steps()} at learning rate {lr}: the trainable "
                f"values ({'/'.join(dtypes)}) moved by {self.update_size or 0.0:.2g} of their size at most "
                f"(||dW||/||W||, all trainable tensors pooled{moved}), below {limit:g}; runs at the learning rates "
                f"people train at measured {TRAINING_RUNS_MEASURE:g} or more (docs/training.md)")

    def _evidence(self) -> str:
        seen = self._seen
        if seen["size"] is not None:
            return self._size_evidence(self.min_update)
        if not seen["trainable"]:
            return (f"none of the {len(seen['candidates'])} parameter tensors the optimizer holds requires a gradient "
                    "any more")
        if seen["hooks_norm"] is not None:
            if seen["hooks_norm"] == 0:
                return "the gradient norm the in-backward optimizer's hooks measured was 0"
            return "their gradients were nonzero but no weight changed"
        if not self._grads_visible:
            return "no weight changed"
        if not seen["grads"]:
            return "no gradient reached any of them (all absent)"
        if not seen["nonzero"]:
            what = "; weights moved by weight decay alone" if seen["changed"] else ""
            return f"every gradient was zero ({seen['grads']} tensors){what}"
        return f"{seen['nonzero']} had nonzero gradients but no weight changed"

    def _message(self) -> str:
        seen = self._seen
        names = [n for n, _ in seen["trainable"]] or seen["candidates"]
        values = sum(p.numel() for _, p in seen["trainable"])
        what = f"{len(names)} parameter tensor(s)" + (f" ({values:,} values)" if values else "")
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        causes = f"To fix: {self._fix()}" if seen["size"] is not None else f"Likely causes: {'; '.join(LIKELY_CAUSES)}"
        rate = "at the full learning rate" if seen["size"] is not None else "with a learning rate above 0"
        return (
            f"nothing trained in {self.checked} optimizer step(s) {rate} ({self._steps()}): "
            f"expected to train {what}{_where(names)}, e.g. {shown}; {self._evidence()}. {causes}. "
            f"The run was stopped by TrainingProgressGuard(check_steps={self.check_steps}, "
            f"min_update={self.min_update:g}); TrainingProgressGuard(check_steps=0) turns the check off."
        )


def _where(names: list[str]) -> str:
    """`` in blocks 0, 2 and outside the blocks`` from parameter names (``.layers.N.``/``.h.N.`` and the like)."""
    import re

    blocks, outside = set(), False
    for name in names:
        found = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", name)
        if found:
            blocks.add(int(found.group(1)))
        else:
            outside = True
    parts = []
    if blocks:
        parts.append("block" + ("s " if len(blocks) > 1 else " ") + ", ".join(str(b) for b in sorted(blocks)))
    if outside:
        parts.append("outside the blocks")
    return f" in {' and '.join(parts)}" if parts else ""


def _all_sum(values: torch.Tensor, device: Any) -> torch.Tensor:
    """``values`` summed over the ranks (one all-reduce when several processes run)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    values = values.to(device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values.cpu()


def _any_rank(flag: bool, device: Any) -> bool:
    """``flag`` on any rank (one all-reduce when several processes run), so that every rank reaches one verdict."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def add_progress_guard(trainer, check_steps: int = 3) -> TrainingProgressGuard:
    """The Trainer's :class:`TrainingProgressGuard`: the one it holds (a user's choice stands), else a new one with
    ``check_steps``, added to its callbacks."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TrainingProgressGuard):
            return callback
    guard = TrainingProgressGuard(check_steps=check_steps)
    trainer.callback_handler.add_callback(guard)
    return guard
