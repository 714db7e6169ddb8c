"""What a benchmark run measures while it trains: process memory (RSS), and a Trainer callback that records
step time, optimizer-state bytes (against the formula), the active blocks and the eval loss at every step."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional, Sequence

from benchmarks.presets import METHODS, MethodSpec


# ----------------------------------------------------------------------------------------------------------------------
# Process memory
# ----------------------------------------------------------------------------------------------------------------------
def current_rss_bytes() -> Optional[int]:
    """Resident set size of this process now (Linux ``/proc``); ``None`` elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss``; KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux ``clear_refs`` 5); False where unsupported.

    After a reset, ``ru_maxrss`` measures the peak from this point on, so loading the model does not count as training.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_pythonpath(current: Optional[str]) -> str:
    """``PYTHONPATH`` of a benchmark's child process: the parent's, with the checkout added after it where missing
    (so that ``benchmarks`` imports, and a folder laid out as the installed package ahead of it keeps its place)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entries = [p for p in (current or "").split(os.pathsep) if p]
    return os.pathsep.join(entries if root in entries else entries + [root])


def load_average() -> Optional[float]:
    """The machine's 1-minute load average (other processes beside a timed run); ``None`` where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------------------------------------------
# The method, as hf-lisa train builds it (public API: hf_lisa.trainer.methods.setup_method)
# ----------------------------------------------------------------------------------------------------------------------
#: the run-level settings of the LISA methods that are keywords of setup_method, not LisaConfig settings
RUN_LEVEL_SETTINGS = ("lisa_always_trainable", "lisa_optimizer_state_policy")


def setup_benchmarked_method(model, method: str, seed: int, settings: dict):
    """``(model, callbacks)`` for ``method``, as ``hf-lisa train`` builds it: a preset's settings are shared by every
    method it compares, so each method is given the ones it uses (``method_settings``); the run-level ones go to the
    methods that use them."""
    from hf_lisa.methods import get_method
    from hf_lisa.trainer.methods import method_settings, setup_method

    from hf_lisa.methods import LISA_ADAPTER

    spec = get_method(method)
    unknown = sorted(set(settings) - method_settings(LISA_ADAPTER.name) - set(RUN_LEVEL_SETTINGS))  # every LisaConfig
    if unknown:
        raise TypeError(f"benchmark settings {unknown} are neither LisaConfig settings nor {RUN_LEVEL_SETTINGS}")
    used = {name: value for name, value in settings.items() if name in method_settings(method)}
    extra = {name: settings[name] for name in RUN_LEVEL_SETTINGS if name in settings}
    if "lisa_always_trainable" in extra:
        always = [v for v in extra["lisa_always_trainable"] if str(v).lower() != "none"]
        extra["lisa_always_trainable"] = tuple(always)
    if not spec.samples_base_blocks:
        extra.pop("lisa_always_trainable", None)
    if not spec.samples_layers:
        extra.pop("lisa_optimizer_state_policy", None)
    return setup_method(model, method, seed=seed, **extra, **used)


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one method, one process
# ----------------------------------------------------------------------------------------------------------------------
def state_kind(method: "str | MethodSpec", lisa_extra: Sequence[tuple[str, Any]] = ()) -> str:
    """The :func:`benchmarks.theory.expected_state_bytes` kind of ``method`` (a :class:`MethodSpec`, or a name of
    ``bench.json``'s methods) with the preset's ``lisa_extra``."""
    spec = METHODS[method] if isinstance(method, str) else method
    if spec.naive:
        return "lisa-naive"
    if spec.peer:  # BAdam, GaLore: their own state layouts (benchmarks/peers.py)
        return spec.peer
    kind = {"full": "full", "lisa": "lisa", "lora": "lora", "dora": "lora",
            "lisa-adapter": "lisa-adapter"}[spec.train_method]
    always = dict(lisa_extra).get("lisa_always_trainable")
    if kind == "lisa" and always is not None and all(str(v).lower() == "none" for v in always):
        return "lisa-blocks"
    return kind


def make_recorder(
    inventory, kind: str, config, schedule, withheld, device, estimate_kwargs: dict, probe_step: int,
    state_bytes=None, peer=None,
):
    """The measuring callback: per-step time, tokens, optimizer state (measured and from shapes), memory.

    ``estimate_kwargs`` go to :func:`benchmarks.theory.activation_bytes`; in step ``probe_step`` the bytes autograd
    saves for the backward pass are measured too (that step is left out of the timing). ``state_bytes`` is the
    optimizer's state bytes for a list of parameters (default: :func:`benchmarks.theory.adamw_state_bytes`).
    ``peer`` (a :class:`benchmarks.peers.PeerSetup`) measures a peer's optimizer state and gives its formula instead.
    """
    import contextlib

    import torch
    from transformers import TrainerCallback

    from benchmarks.theory import activation_bytes, adamw_state_bytes, block_kinds_for, expected_state_bytes
    from hf_lisa.scheduler import optimizer_state_bytes

    state_bytes = state_bytes or adamw_state_bytes

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class BenchmarkRecorder(TrainerCallback):
        """Put first in the callback list: its ``on_step_begin`` runs before LISA's switch, so a switch is timed."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.evals: list[tuple[int, float]] = []
            self.train_loss: dict[int, float] = {}
            self.seen_blocks: set[int] = set()
            self.tokens = 0
            self.padded_tokens = 0
            self.peak_scope = "process"
            self.rss_train_begin: Optional[int] = None
            self.peak_rss_train: Optional[int] = None
            self.cuda_peak: dict[str, int] = {}
            self.t_train_begin = 0.0
            self.t_first_step: Optional[float] = None
            self.t_train_end = 0.0
            self._t_step = 0.0
            self._cpu_step = 0.0
            self.probe_step = probe_step
            self.probe: dict[str, Any] = {}
            self._probe_storages: dict[int, int] = {}

        @contextlib.contextmanager
        def saved_tensors_probe(self, model, global_step: int):
            """Sum the storages autograd saves during this micro-batch's forward pass, parameters excluded."""
            if global_step + 1 != self.probe_step:
                yield
                return
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            storages = self._probe_storages

            def pack(tensor):
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
                    return tensor
                if storage.data_ptr() not in params:
                    storages[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                yield

        def count_batch(self, inputs) -> None:
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            self.padded_tokens += int(ids.numel())
            self.tokens += int(mask.sum()) if mask is not None else int(ids.numel())

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self.peak_scope = "training" if reset_peak_rss() else "process"
            self.rss_train_begin = current_rss_bytes()
            self.t_train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._t_step = time.perf_counter()
            self._cpu_step = time.process_time()
            if self.t_first_step is None:
                self.t_first_step = self._t_step

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            sync()
            seconds = time.perf_counter() - self._t_step
            cpu_seconds = time.process_time() - self._cpu_step
            active = schedule()
            self.seen_blocks.update(active)
            trainable = [p for p in inventory.all_params if p.requires_grad]
            if peer is not None:
                measured, expected = peer.measured_state_bytes(optimizer), peer.expected_state(active)
            else:
                measured = optimizer_state_bytes(optimizer)
                expected = expected_state_bytes(inventory, kind, active=active, seen=sorted(self.seen_blocks),
                                                state_bytes=state_bytes)
                # sparse LISA adapters: factors still calibrating their mask get no update, hence no state yet
                expected -= state_bytes(withheld())
            kinds = block_kinds_for(peer.activation_kind if peer is not None else kind, len(inventory.block_names),
                                    active, sparse=estimate_kwargs["sparse"],
                                    interpolation=estimate_kwargs["interpolation"])
            estimate = activation_bytes(
                config, self.padded_tokens, kinds, act_bytes=estimate_kwargs["act_bytes"],
                adapter_rank=estimate_kwargs["adapter_rank"],
                sparse_delta_elements=estimate_kwargs["sparse_delta_elements"],
                interpolation=estimate_kwargs["interpolation"], head_trains=estimate_kwargs["head_trains"],
                padded=self.padded_tokens > self.tokens,
            )
            if state.global_step == self.probe_step and self._probe_storages:
                self.probe = {"step": state.global_step, "measured_bytes": sum(self._probe_storages.values()),
                              "estimate_bytes": estimate, "padded_tokens": self.padded_tokens}
                self._probe_storages = {}
            self.steps.append(
                {
                    "step": state.global_step,
                    "seconds": seconds,
                    "cpu_seconds": cpu_seconds,
                    "tokens": self.tokens,
                    "padded_tokens": self.padded_tokens,
                    "optimizer_state_bytes": measured,
                    "expected_state_bytes": expected,
                    "trainable_state_bytes": state_bytes(trainable),
                    "trainable_params": sum(p.numel() for p in trainable),
                    "grad_bytes": sum(p.numel() * p.element_size() for p in trainable),
                    "active_blocks": sorted(active),
                    "activation_bytes": estimate,
                    "rss_bytes": current_rss_bytes(),
                    **(peer.step_extra() if peer is not None else {}),
                }
            )
            self.tokens = self.padded_tokens = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.train_loss[state.global_step] = float(logs["loss"])

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if metrics and "eval_loss" in metrics:
                self.evals = [e for e in self.evals if e[0] != state.global_step]
                self.evals.append((state.global_step, float(metrics["eval_loss"])))

        def on_train_end(self, args, state, control, **kwargs):
            sync()
            self.t_train_end = time.perf_counter()
            self.peak_rss_train = peak_rss_bytes()
            if device.type == "cuda":
                self.cuda_peak = {
                    "max_allocated": int(torch.cuda.max_memory_allocated(device)),
                    "max_reserved": int(torch.cuda.max_memory_reserved(device)),
                }

    return BenchmarkRecorder()


def withheld_reader(callbacks: list) -> Any:
    """A function returning the parameters whose update the mask schedule withheld in the last step (calibrating)."""
    for cb in callbacks:
        if hasattr(cb, "mask_scheduler"):
            return lambda owner=cb: [] if owner.mask_scheduler is None else list(owner.mask_scheduler.withheld)
    return lambda: []


def schedule_reader(callbacks: list, inventory, peer=None) -> Any:
    """A function returning the indices (in ``inventory.block_names``) of the blocks active right now (for a
    ``peer``, those its last step trained)."""
    from benchmarks.naive_lisa import NaiveLisaCallback

    every = list(range(len(inventory.block_names)))
    if peer is not None:
        return lambda: every if peer.schedule() is None else peer.schedule()

    for cb in callbacks:
        if isinstance(cb, NaiveLisaCallback):
            return lambda: list(cb.active)  # indices of hf_lisa.find_blocks(model), as the inventory's
        scheduler_owner = cb if hasattr(cb, "layer_scheduler") else None
        if scheduler_owner is not None:

            def read(owner=scheduler_owner):
                scheduler = owner.layer_scheduler
                if scheduler is None:  # adapter form with γ = 0: every block trains
                    return list(range(len(inventory.block_names)))
                return [inventory.block_index(scheduler.block_names[b]) for b in scheduler.active]

            return read
    return lambda: list(range(len(inventory.block_names)))
