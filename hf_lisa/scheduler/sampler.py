"""``LayerSampler``: which γ of the N transformer blocks train during the next period of K optimizer steps.

The sampler only *proposes*: :meth:`LayerSampler.sample` returns the next draw, and the scheduler that applies it holds
the active set (:class:`hf_lisa.scheduler.active_set.ActiveSet`).

The sampler owns a private, seeded ``torch.Generator``. Every rank of a distributed run builds the same sampler with
the same seed and therefore draws the same blocks without communicating (the global NumPy/torch RNGs differ per rank
and are consumed by dropout and data shuffling, so they must never be used here). Its whole state, generator
included, is exportable as plain Python data plus tensors (see :mod:`hf_lisa.scheduler.state`).

Strategies:

* ``"uniform"``: γ distinct blocks uniformly at random, the published LISA (Pan et al., 2024).
* ``"cyclic"``: the blocks are visited in random permutations, γ at a time, so that every block trains once per cycle
  (BAdam's order, randomised). When γ does not divide N, a block drawn twice within one draw is postponed to the next.
* ``"importance"``: probability proportional to a running **gradient norm** per block (exponential moving average of
  ``‖∂L/∂θ_block‖``, fed by :meth:`LayerSampler.observe` while the block trains), mixed with a uniform floor.

  Why the gradient norm and not the paper's weight-norm ratio: the weight norms of a pretrained model are nearly
  equal across blocks and move little during fine-tuning, so they give almost uniform probabilities; the gradient
  norm measures how much loss a block can remove *now* (first-order decrease per step is ∝ ‖g‖²), and it is free
  because the active blocks' gradients exist at every optimizer step anyway. Only trained blocks can be measured, so
  blocks never measured are scored optimistically (at the largest observed score, so each block is tried early) and
  the uniform floor ``importance_floor / N`` keeps every block reachable however stale its score.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from ..tuner.config import LAYER_SAMPLING_STRATEGIES, is_int, check_lisa_settings
from ..renamed import RenamedAttribute, renamed_keywords

__all__ = ["LAYER_SAMPLING_STRATEGIES", "LayerSampler"]


class LayerSampler:
    """Draw the active blocks of each LISA period from a private, seeded generator.

    Args:
        num_layers: N, the number of blocks to choose from.
        lisa_activated_layers: γ, the number of blocks active at a time, ``1 <= γ <= N`` (``num_active`` before 0.3).
        lisa_sampling: ``"uniform"``, ``"importance"`` or ``"cyclic"`` (see the module docstring; ``strategy`` before
            0.3).
        seed: seed of the private generator; the same seed gives the same sequence in every process.
        importance_decay: decay of the running gradient-norm average of the ``"importance"`` strategy.
        importance_floor: share of the probability mass spread uniformly over all blocks (``"importance"`` only).

    Example:
        >>> sampler = LayerSampler(num_layers=8, lisa_activated_layers=2, lisa_sampling="cyclic", seed=0)
        >>> blocks = [b for _ in range(4) for b in sampler.sample()]
        >>> sorted(blocks)  # one cycle: every block exactly once
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    num_active = RenamedAttribute("lisa_activated_layers")
    strategy = RenamedAttribute("lisa_sampling")

    @renamed_keywords("num_active", "strategy")
    def __init__(
        self,
        num_layers: int,
        lisa_activated_layers: int,
        lisa_sampling: str = "uniform",
        seed: int = 0,
        importance_decay: float = 0.9,
        importance_floor: float = 0.1,
    ) -> None:
        if not is_int(num_layers) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r} is invalid; the model must have at least one block.")
        # γ <= N is checked here, where N is known, by the rules every other LISA setting follows
        check_lisa_settings(
            {"lisa_activated_layers": lisa_activated_layers, "lisa_sampling": lisa_sampling},
            where="LayerSampler ",
            allow_every_block=False,
            num_blocks=num_layers,
        )
        if not is_int(seed):
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer.")
        if not 0.0 <= importance_decay < 1.0:
            raise ValueError(f"importance_decay={importance_decay!r} is invalid; allowed: a float in [0, 1).")
        if not 0.0 < importance_floor <= 1.0:
            raise ValueError(f"importance_floor={importance_floor!r} is invalid; allowed: a float in (0, 1].")
        self.num_layers = num_layers
        self.lisa_activated_layers = lisa_activated_layers
        self.lisa_sampling = lisa_sampling
        self.seed = seed
        self.importance_decay = importance_decay
        self.importance_floor = importance_floor
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.num_draws = 0
        self._queue: list[int] = []  # cyclic: the rest of the current permutation(s)
        self.scores: list[Optional[float]] = [None] * num_layers  # importance: running gradient norm per block

    # -- drawing -------------------------------------------------------------------------------------------------------
    def sample(self) -> list[int]:
        """Propose the blocks of the next period: sorted, distinct block indices. The caller decides and holds them."""
        if self.lisa_sampling == "uniform":
            chosen = torch.randperm(self.num_layers, generator=self.generator)[: self.lisa_activated_layers].tolist()
        elif self.lisa_sampling == "cyclic":
            chosen = self._sample_cyclic()
        else:
            chosen = torch.multinomial(
                self.probabilities(), self.lisa_activated_layers, replacement=False, generator=self.generator
            ).tolist()
        self.num_draws += 1
        return sorted(int(b) for b in chosen)

    def _sample_cyclic(self) -> list[int]:
        chosen: list[int] = []
        while len(chosen) < self.lisa_activated_layers:
            pick = next((i for i, b in enumerate(self._queue) if b not in chosen), None)
            if pick is None:  # queue empty, or it only holds blocks already in this draw: start the next cycle
                self._queue.extend(torch.randperm(self.num_layers, generator=self.generator).tolist())
                continue
            chosen.append(self._queue.pop(pick))
        return chosen

    def probabilities(self) -> torch.Tensor:
        """Per-block sampling probabilities of one draw (float64). Uniform for ``"uniform"``/``"cyclic"``."""
        n = self.num_layers
        known = [s for s in self.scores if s is not None]
        if self.lisa_sampling != "importance" or not known or max(known) <= 0:
            return torch.full((n,), 1.0 / n, dtype=torch.float64)
        optimistic = max(known)
        scores = torch.tensor([optimistic if s is None else s for s in self.scores], dtype=torch.float64)
        return (1.0 - self.importance_floor) * scores / scores.sum() + self.importance_floor / n

    def observe(self, grad_norms: Mapping[int, float]) -> None:
        """Feed the gradient norm of trained blocks (``{block_index: norm}``) into the running average.

        Called once per optimizer step for the active blocks by the scheduler when ``strategy == "importance"``;
        ignored otherwise. Non-finite values (an overflowing fp16 step) are skipped.
        """
        if self.lisa_sampling != "importance":
            return
        for index, value in grad_norms.items():
            if not 0 <= int(index) < self.num_layers:
                raise IndexError(f"block index {index} out of range [0, {self.num_layers})")
            value = float(value)
            if not math.isfinite(value):
                continue
            old = self.scores[int(index)]
            decay = self.importance_decay
            self.scores[int(index)] = value if old is None else decay * old + (1 - decay) * value

    # -- state ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact same sequence: settings, generator state, counters, scores.

        The active set is not part of it: the scheduler that holds it saves it (``"active"``). The keys are the
        format's (``num_active`` is γ, ``strategy`` the sampling), unchanged since 0.1 so that every state loads.
        """
        return {
            "num_layers": self.num_layers,
            "num_active": self.lisa_activated_layers,
            "strategy": self.lisa_sampling,
            "seed": self.seed,
            "importance_decay": self.importance_decay,
            "importance_floor": self.importance_floor,
            "generator": self.generator.get_state(),
            "num_draws": self.num_draws,
            "queue": list(self._queue),
            "scores": list(self.scores),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The block count, γ and strategy must match this sampler's.

        States written by hf-lisa 0.1 also carry ``"current"``, a copy of the scheduler's active set; it is ignored.
        """
        for key, name in (("num_layers", "num_layers"), ("num_active", "lisa_activated_layers"),
                          ("strategy", "lisa_sampling")):
            if state[key] != getattr(self, name):
                raise ValueError(
                    f"Cannot restore the layer sampler: the checkpoint has {name}={state[key]!r} but this run has "
                    f"{name}={getattr(self, name)!r}. Resume with the settings of the checkpointed run, or start a "
                    "new run."
                )
        self.seed = state["seed"]
        self.importance_decay = state["importance_decay"]
        self.importance_floor = state["importance_floor"]
        self.generator.set_state(torch.as_tensor(state["generator"], dtype=torch.uint8))
        self.num_draws = int(state["num_draws"])
        self._queue = [int(b) for b in state["queue"]]
        self.scores = [None if s is None else float(s) for s in state["scores"]]

    def __repr__(self) -> str:
        return (
            f"LayerSampler(num_layers={self.num_layers}, lisa_activated_layers={self.lisa_activated_layers}, "
            f"lisa_sampling={self.lisa_sampling!r}, seed={self.seed}, num_draws={self.num_draws})"
        )
