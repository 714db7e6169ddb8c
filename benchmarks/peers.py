"""LISA's peers in the benchmark: BAdam and GaLore, each from its own package, driven as its own docs say.

Neither is re-implemented here. This module only builds what their docs tell a ``transformers.Trainer`` user to
build, and measures it:

* **BAdam** (``badam`` on the package index): ``badam.BlockOptimizer`` wraps a torch AdamW and is handed to a plain
  ``transformers.Trainer`` as ``optimizers=(BlockOptimizer(...), None)``. One transformer block trains at a time;
  the embeddings and the head stay frozen (its defaults, ``include_embedding=False``, ``include_lm_head=False``); every
  ``switch_block_every`` steps it moves to the next block of a random order and drops the AdamW state. It keeps an fp32
  copy of the active block and steps that copy ("BAdam expects fp16/bf16 weights"; the benchmark's weights are the
  preset's dtype for every method, so on fp32 weights the copy is a second fp32 copy of one block).
* **GaLore** (``galore-torch``): transformers' own integration, ``TrainingArguments(optim="galore_adamw",
  optim_target_modules=[r".*.attn.*", r".*.mlp.*"], optim_args="rank=..., update_proj_gap=..., scale=...")``, the
  example of transformers' optimizer docs. Every parameter trains; the attention and MLP linears get Adam moments of
  their gradient projected onto a rank-r subspace, recomputed by SVD every ``update_proj_gap`` steps; the rest
  (embeddings, norms) get plain AdamW moments in the same optimizer.

Settings shared with LISA where there is a counterpart (:func:`peer_settings`):

* BAdam's ``switch_block_every`` = LISA's K (``lisa_interval_steps``): both are the steps between two changes of what
  trains. ``switch_mode="random"`` (random reshuffling, the mode of BAdam's own example) is the closest to LISA's
  uniform sampling. BAdam trains one block at a time (its documented partition, ``block_prefix_list`` one prefix per
  transformer layer); LISA trains E+H and γ blocks, so the two differ in what trains, not in how often it changes.
* GaLore's ``rank`` = the adapters' r (``lora_r``), the usual GaLore-vs-LoRA comparison at equal rank, and
  ``update_proj_gap`` = K, the steps between two changes of the trained subspace. ``scale`` = 1.0: GaLore's α
  multiplies the learning rate of the projected weights, and 1.0 gives them the full-parameter learning rate that
  ``full``, ``lisa`` and ``badam`` use (transformers' default 0.25 pairs with GaLore's pre-training rate of 1e-2).
* Both: the preset's full-parameter learning rate, constant, no weight decay, AdamW's betas; the same model, data,
  seed, batch, steps and evaluation as every other method.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: GaLore's target modules, as in transformers' optimizer docs: the attention and MLP linears of every block
GALORE_TARGET_MODULES = (r".*.attn.*", r".*.mlp.*")
#: GaLore's α (see the module docstring: 1.0 keeps the full-parameter learning rate on the projected weights)
GALORE_SCALE = 1.0
#: the package that provides each peer, for the results
PEER_PACKAGES = {"badam": "badam", "galore": "galore-torch"}


def peer_settings(peer: str, preset) -> dict[str, Any]:
    """The peer's own settings under ``preset`` (recorded in the results)."""
    if peer == "badam":
        return {"switch_block_every": preset.lisa_interval_steps, "switch_mode": "random", "verbose": 1,
                "include_embedding": False, "include_lm_head": False, "block_prefix_list": "one per block",
                "base_optimizer": "torch.optim.AdamW"}
    if peer == "galore":
        return {"optim": "galore_adamw", "optim_target_modules": list(GALORE_TARGET_MODULES),
                "optim_args": f"rank={preset.lora_r}, update_proj_gap={preset.lisa_interval_steps}, "
                              f"scale={GALORE_SCALE:g}"}
    raise ValueError(f"peer={peer!r} is invalid; allowed: {', '.join(PEER_PACKAGES)}.")


def package_version(peer: str) -> Optional[str]:
    try:
        return importlib.metadata.version(PEER_PACKAGES[peer])
    except importlib.metadata.PackageNotFoundError:
        return None


def _storage_bytes(value: Any, seen: set[int]) -> int:
    """Bytes of the storages behind ``value`` (tensors, GaLore projectors, lists), each storage once: a view that
    keeps a larger tensor alive (GaLore's ``U[:, :r]``) counts what it keeps."""
    import torch

    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, (list, tuple)):
        return sum(_storage_bytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(_storage_bytes(v, seen) for v in value.values())
    if hasattr(value, "ortho_matrix"):  # galore_torch.GaLoreProjector: the projection basis is optimizer state
        return _storage_bytes(value.ortho_matrix, seen)
    return 0


def state_storage_bytes(optimizer) -> int:
    """Bytes held by the optimizer's per-parameter state, counted by storage (see :func:`_storage_bytes`).

    Looks through accelerate's wrapper and through BAdam's ``BlockOptimizer`` (whose state lives in the AdamW it
    wraps, ``base_optimizer``); counts GaLore's projectors (``state["projector"].ortho_matrix``)."""
    from hf_lisa.optim import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    inner = getattr(inner, "base_optimizer", inner)
    seen: set[int] = set()
    return sum(_storage_bytes(state, seen) for state in inner.state.values())


# ----------------------------------------------------------------------------------------------------------------------
# Expected state, from shapes alone
# ----------------------------------------------------------------------------------------------------------------------
def badam_state_bytes(block_params) -> int:
    """BAdam's AdamW state for one block: torch AdamW on fp32 copies, ``Σ 2 · 4 · numel + 4`` (moments + step)."""
    return sum(8 * p.numel() + 4 for p in block_params)


def classification_heads(model) -> list[str]:
    """Names of a classification model's head modules (``score`` of ``*ForSequenceClassification`` decoders,
    ``classifier`` of encoders); none for a causal LM."""
    if not type(model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification")):
        return []
    return [name for name, _ in model.named_children() if name in ("score", "classifier")]


def galore_targets(model) -> set[int]:
    """``id`` of the weights GaLore projects: ``nn.Linear`` modules matching :data:`GALORE_TARGET_MODULES`, as
    transformers selects them (a regex must match the whole module name)."""
    from torch import nn

    return {id(module.weight) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(re.fullmatch(t, name) for t in GALORE_TARGET_MODULES)}


def galore_state_bytes(params, targets: set[int], rank: int) -> int:
    """galore-torch 1.0's AdamW state for ``params`` (no ``step`` tensor: a Python int).

    A target weight W (m × n) has its gradient projected to r × max(m, n): two moments of that size, and a projector
    whose basis is the first r columns (or rows) of the SVD factor of the smaller side. For fp32 gradients the basis is
    a view ``U[:, :r]`` that keeps the whole min(m, n)² factor alive; other dtypes copy r · min(m, n). Every other
    parameter: two moments of its own size.
    """
    total = 0
    for p in params:
        size = p.element_size()
        if id(p) not in targets:
            total += 2 * p.numel() * size
            continue
        m, n = p.shape
        r = min(rank, m, n)
        total += 2 * r * max(m, n) * size
        total += min(m, n) ** 2 * 4 if size == 4 else r * min(m, n) * size  # fp32: the whole factor
    return total


# ----------------------------------------------------------------------------------------------------------------------
# What run_method builds for a peer
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class PeerSetup:
    """A peer, ready for ``side_by_side.run_method``: the Trainer's ``optimizers``, the ``TrainingArguments`` it needs,
    and how the recorder measures it.

    Attributes:
        name: ``"badam"`` or ``"galore"``.
        optimizers: ``Trainer(optimizers=...)``: BAdam's ``(BlockOptimizer, None)``; GaLore's ``(None, None)``.
        training_overrides: ``TrainingArguments`` fields (GaLore's ``optim``, ``optim_target_modules``, ``optim_args``).
        settings: the peer's settings, for the results.
        activation_kind: :func:`benchmarks.theory.block_kinds_for` kind of its steps (BAdam: the active block only,
            E+H frozen; GaLore: every weight trains).
        head_trains: the LM head trains.
        state_formula: a note beside the formula of the optimizer-state table, or ``None``.
        expected_state: the optimizer-state bytes its shapes call for, given the blocks trained in the step.
        tracker: BAdam's :class:`BAdamTracker`; ``None`` for GaLore.
    """

    name: str
    optimizers: tuple
    training_overrides: dict
    settings: dict
    activation_kind: str
    head_trains: bool
    state_formula: Optional[str]
    expected_state: Callable[[list[int]], int] = field(repr=False, default=lambda active: 0)
    tracker: Any = None

    def schedule(self) -> Optional[list[int]]:
        """Blocks trained in the last step (BAdam), or ``None`` (every block: GaLore)."""
        return None if self.tracker is None else list(self.tracker.active_blocks)

    def measured_state_bytes(self, optimizer) -> int:
        """BAdam: the state right after its AdamW step, before a switch drops it; GaLore: the state now."""
        if self.tracker is not None:
            return self.tracker.state_bytes
        return state_storage_bytes(optimizer)

    def step_extra(self) -> dict:
        return {} if self.tracker is None else {"master_copy_bytes": self.tracker.master_bytes}


class BAdamTracker:
    """Reads BAdam's ``BlockOptimizer`` right after its AdamW step (a step post-hook on ``base_optimizer``), i.e.
    before ``switch_trainable_params`` drops the state: the active block, its state bytes, its fp32 copies' bytes."""

    def __init__(self, block_optimizer, block_names: list[str]) -> None:
        self.block_optimizer = block_optimizer
        self.index = {name + ".": i for i, name in enumerate(block_names)}
        self.active_blocks: list[int] = []
        self.state_bytes = 0
        self.master_bytes = 0
        block_optimizer.base_optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        opt = self.block_optimizer
        self.active_blocks = sorted(self.index[p] for p in opt.active_param_prefixs if p in self.index)
        self.state_bytes = state_storage_bytes(opt)
        self.master_bytes = sum(p.numel() * p.element_size() for p in opt.param_idx2hp.values())


def setup_peer(peer: str, model, inventory, preset, learning_rate: float, device_name: str) -> PeerSetup:
    """Build ``peer`` for ``model`` as its docs say (see the module docstring for the settings and why)."""
    settings = peer_settings(peer, preset)
    if peer == "badam":
        import torch
        from badam import BlockOptimizer

        # a classification model's fresh head (``score``/``classifier``) trains throughout, through BlockOptimizer's
        # own ``active_modules`` (the modules "always active during optimization"): frozen, it would stay random
        heads = classification_heads(model)
        settings["active_modules"] = heads
        # BlockOptimizer copies the active block's weights when built, on their device: the model goes to its device
        # first, as BAdam's examples load it (built on CPU, the copies stay there while the Trainer moves the model
        # to the GPU, and the first step fails: found by the first GPU run, 2026-12-04)
        model.to(device_name)

        base = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0,
                                 fused=device_name == "cuda" or None)
        with warnings.catch_warnings():  # "BAdam expect model to be loaded in fp16/bf16": said in the table instead
            warnings.filterwarnings("ignore", message="BAdam expect")
            optimizer = BlockOptimizer(
                base_optimizer=base,
                named_parameters_list=list(model.named_parameters()),
                block_prefix_list=[[name + "."] for name in inventory.block_names],
                switch_block_every=settings["switch_block_every"],
                switch_mode=settings["switch_mode"],
                verbose=settings["verbose"],
                include_embedding=settings["include_embedding"],
                include_lm_head=settings["include_lm_head"],
                active_modules=[name + "." for name in heads],
            )
        tracker = BAdamTracker(optimizer, inventory.block_names)
        head_params = [p for n, p in model.named_parameters() if any(n.startswith(h + ".") for h in heads)]
        return PeerSetup(
            name=peer, optimizers=(optimizer, None), training_overrides={}, settings=settings,
            activation_kind="lisa-blocks", head_trains=bool(heads), tracker=tracker,
            state_formula=None,
            expected_state=lambda active: sum(badam_state_bytes(inventory.block_base[b]) for b in set(active))
            + badam_state_bytes(head_params),
        )
    if peer == "galore":
        targets = galore_targets(model)
        fp32 = any(p.element_size() == 4 for p in inventory.all_params if id(p) in targets)
        return PeerSetup(
            name=peer, optimizers=(None, None),
            training_overrides={"optim": settings["optim"], "optim_target_modules": settings["optim_target_modules"],
                                "optim_args": settings["optim_args"]},
            settings=settings, activation_kind="full", head_trains=True,
            state_formula=("galore-torch keeps each fp32 basis as a view of the whole min(m, n)² SVD factor"
                           if fp32 else None),
            expected_state=lambda active: galore_state_bytes(inventory.all_params, targets, preset.lora_r),
        )
    raise ValueError(f"peer={peer!r} is invalid; allowed: {', '.join(PEER_PACKAGES)}.")


def peer_trainer_class():
    """A plain ``transformers.Trainer`` with the harness's two environment settings that every method shares:
    ``chunked_loss`` (the model's loss function; the same value) and ``cpu_allocator="trim"`` (heap trimming in the
    backward pass), as ``hf_lisa.trainer.LisaTrainer`` applies them. Nothing else of hf-lisa's Trainer."""
    from transformers import Trainer

    from hf_lisa.optim import install_chunked_loss
    from hf_lisa.optim import heap_trim

    class PeerTrainer(Trainer):
        def __init__(self, *args, chunked_loss: bool = True, cpu_allocator: str = "default", **kwargs):
            super().__init__(*args, **kwargs)
            self.chunked_loss = chunked_loss and install_chunked_loss(self.model)
            self.heap_trim = heap_trim(cpu_allocator, on_cpu=self.args.device.type == "cpu")
            if self.heap_trim is not None:
                self.heap_trim.attach(self.model)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            if self.heap_trim is not None and model.training:
                self.heap_trim.trim_before_backward_of(result[0] if return_outputs else result)
            return result

    return PeerTrainer
