"""bitsandbytes' 8-bit AdamW, updated a slice at a time on CPU, and stepped in the backward pass.

Two classes over ``bitsandbytes.optim.AdamW`` (what ``--optim adamw_bnb_8bit`` builds), with its groups, state,
overrides and update:

* :class:`SlicedAdamW8bit`: on CPU, bitsandbytes' blockwise 8-bit update dequantizes the whole of a parameter's two
  states to fp32, with a fp32 copy of the gradient and the denominator beside them: about five fp32 copies of the
  parameter at once. For a tied 49152 x 576 embedding that is some 540 MiB of temporaries, more than the 8-bit state
  saves. This class gives the same update a slice of at most ``slice_elements`` at a time. Slices start at multiples
  of the quantization block (256 values), and both the update (elementwise) and the quantization (per block) only
  read their own block, so the result is bit for bit the update of the whole tensor. On a GPU, and for parameters in
  32-bit state (under ``min_8bit_size``, or overridden), it is bitsandbytes' own update.
* :class:`AdamW8bitInBackward`: :class:`SlicedAdamW8bit` whose update of each parameter runs in the backward pass,
  as :class:`~hf_lisa.optim.in_backward.AdamWInBackward` does for torch's AdamW (same hooks, arming, and
  refusals).

transformers' Trainer keeps ``nn.Embedding`` weights (and so a tied embedding/LM head) in 32-bit state under a
bitsandbytes 8-bit optimizer; it recognises such an optimizer by its class's module. ``LisaTrainer`` registers the
same override for these classes itself (or 8 bits, with ``--optim_8bit_embeddings``):
:func:`set_embedding_state_bits`.

Both match bitsandbytes' per-parameter overrides to their own parameters by identity and keep them (bitsandbytes
keeps them in its process-global manager by position and ``id()``, where an earlier optimizer's entries leak into a
later one's: seen in this test suite as an embedding silently given 32-bit state).

Requires ``bitsandbytes`` (the ``quant`` extra).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch
from bitsandbytes import functional as F
from bitsandbytes.optim import AdamW as _BnbAdamW
from bitsandbytes.optim import GlobalOptimManager

from .in_backward import StepsInBackward

__all__ = ["AdamW8bitInBackward", "SlicedAdamW8bit", "set_embedding_state_bits", "QUANT_BLOCK"]

#: the blockwise quantization's block: bitsandbytes' optimizers use 256 values per absmax
QUANT_BLOCK = 256
#: values per slice of a CPU update (a multiple of ``QUANT_BLOCK``): 4 MiB of fp32 per temporary
DEFAULT_SLICE_ELEMENTS = 1 << 20
_NO_OVERRIDES = SimpleNamespace(index2config={}, pid2config={})


class SlicedAdamW8bit(_BnbAdamW):
    """``bitsandbytes.optim.AdamW`` (8-bit by default) whose CPU update of an 8-bit state runs a slice at a time.

    Args:
        params, *args, **kwargs: ``bitsandbytes.optim.AdamW``'s, with ``optim_bits=8`` unless given.
        slice_elements: values per slice; rounded down to a multiple of 256 (at least 256).
    """

    def __init__(self, params: Iterable[Any], *args: Any, slice_elements: int = DEFAULT_SLICE_ELEMENTS,
                 **kwargs: Any) -> None:
        kwargs.setdefault("optim_bits", 8)
        self._overrides: dict[tuple[int, int], dict] = {}
        super().__init__(params, *args, **kwargs)
        self.slice_elements = max(QUANT_BLOCK, slice_elements // QUANT_BLOCK * QUANT_BLOCK)

    def check_overrides(self) -> None:
        """Match the manager's module overrides to this optimizer's parameters, by identity, and keep them here.

        bitsandbytes stores the matches in its process-global manager, keyed by (group, index) and by ``id()``, and
        reads them back from there: entries an earlier optimizer left (another model, another Trainer in the same
        process) then apply to whichever parameter of a later optimizer sits at the same position or reuses the id,
        so a weight can silently get 32-bit state. Overrides set with ``GlobalOptimManager.override_config`` (by
        ``id()``) are not read, for the same reason; ``register_module_override`` is.
        """
        position = self._positions()  # ids of live parameters: the manager's modules hold their weights alive
        self._overrides = {position[id(weight)]: config for module, attr, config in self.mng.module_weight_config_triple
                           if id(weight := getattr(module, attr, None)) in position}

    def _positions(self) -> dict[int, tuple[int, int]]:
        """``id(parameter) -> (group index, index in the group)``, bitsandbytes' key for a parameter's config."""
        return {id(p): (gindex, pindex) for gindex, group in enumerate(self.param_groups)
                for pindex, p in enumerate(group["params"])}

    def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
        manager, self.mng = self.mng, _NO_OVERRIDES  # bitsandbytes' own fields, without its global lookups
        try:
            config = super().get_config(gindex, pindex, group)
        finally:
            self.mng = manager
        config.update(self._overrides.get((gindex, pindex), {}))
        return config

    @torch.no_grad()
    def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        state = self.state[p]
        if (p.device.type != "cpu" or state["state1"].dtype != torch.uint8 or p.numel() <= self.slice_elements
                or "unorm_vec" in state):
            return super().update_step(group, p, gindex, pindex)
        p.data = p.data.contiguous()  # as bitsandbytes' update_step: the slices are views of contiguous storage
        p.grad = p.grad.contiguous()
        config = self.get_config(gindex, pindex, group)
        state["step"] += 1
        flat = {name: t.view(-1) for name, t in (("p", p.data), ("g", p.grad), ("s1", state["state1"]),
                                                 ("s2", state["state2"]))}
        betas = config["betas"]
        for start in range(0, p.numel(), self.slice_elements):
            stop = min(start + self.slice_elements, p.numel())
            blocks = slice(start // QUANT_BLOCK, -(-stop // QUANT_BLOCK))
            F.optimizer_update_8bit_blockwise(
                self.optimizer_name, flat["g"][start:stop], flat["p"][start:stop], flat["s1"][start:stop],
                flat["s2"][start:stop], betas[0], betas[1], betas[2] if len(betas) >= 3 else 0.0,
                config.get("alpha", 0.0), config["eps"], state["step"], config["lr"], state["qmap1"],
                state["qmap2"], state["absmax1"][blocks], state["absmax2"][blocks], config["weight_decay"],
                gnorm_scale=1.0, skip_zeros=config["skip_zeros"],
            )


class AdamW8bitInBackward(StepsInBackward, SlicedAdamW8bit):
    """:class:`SlicedAdamW8bit` whose update of each parameter runs in the backward pass, as soon as its gradient is
    accumulated; the gradient is then set to ``None``. Hooks, arming and refusals are
    :class:`~hf_lisa.optim.in_backward.StepsInBackward`'s (see ``AdamWInBackward``).
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._index_of: dict[int, tuple[int, int]] = {}
        self._start_in_backward()

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        if not self.initialized:  # as bitsandbytes' step(): the registered overrides apply from the first update
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        if not self._index_of:
            self._index_of = self._positions()
        for p in params:
            self._before_update(p)
            gindex, pindex = self._index_of[id(p)]
            if not self.state[p]:
                self.init_state(group, p, gindex, pindex)
            self.prefetch_state(p)
            self.update_step(group, p, gindex, pindex)
            p.grad = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._index_of = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self._index_of = {}  # groups may change before the next step
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._index_of = {}


def set_embedding_state_bits(model: torch.nn.Module, bits: int) -> int:
    """Register ``optim_bits=bits`` for the weight of every ``nn.Embedding`` of ``model`` with bitsandbytes'
    optimizer manager (replacing an earlier override of the same weight, e.g. the Trainer's 32 bits); takes effect at
    the optimizer's first update. Returns the number of weights registered."""
    manager = GlobalOptimManager.get_instance()
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    ids = {id(m.weight) for m in embeddings}
    manager.module_weight_config_triple = [(m, a, c) for m, a, c in manager.module_weight_config_triple
                                           if id(getattr(m, a, None)) not in ids]
    for module in embeddings:
        manager.register_module_override(module, "weight", {"optim_bits": bits})
    return len(embeddings)
