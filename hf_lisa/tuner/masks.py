"""Structured masks for LISA's sparse low-rank deltas, as plain tensor-in, tensor-out functions.

A mask ``M`` has the shape of the adapted weight in ``(out_features, in_features)`` layout and is ``True`` where the
delta ``s * M * (B @ A)`` may be non-zero. Sparsity ``rho`` is the fraction of ``False`` entries.

Three structures are supported:

* ``"block"``: the weight is tiled into ``b_out x b_in`` blocks (default 2x2); whole blocks are on or off.
* ``"n:m"``: in every group of ``m`` consecutive entries along the input dimension exactly ``n`` are kept (2:4 is
  the pattern Ampere sparse tensor cores run). The sparsity is therefore ``1 - n/m``.
* ``"unstructured"``: the top ``(1 - rho)`` entries.

Selection always keeps the highest scores. Scores are importance values (``|dL/dW|`` accumulated over batches,
``|W|`` magnitude, or random numbers); :func:`pool_scores` reduces entry scores to the structure's selection grid.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SPARSITY_STRUCTURES = ("block", "n:m", "unstructured")


def check_structure_fits(
    shape: tuple[int, int], structure: str, block_size: tuple[int, int], n_m: tuple[int, int]
) -> Optional[str]:
    """Return a human readable reason why ``structure`` cannot tile a weight of ``shape``, or ``None`` if it can."""
    out_f, in_f = shape
    if structure == "block":
        bo, bi = block_size
        if out_f % bo or in_f % bi:
            return f"block_size={bo}x{bi} does not divide the weight shape (out={out_f}, in={in_f})"
    elif structure == "n:m":
        n, m = n_m
        if in_f % m:
            return f"n_m={n}:{m} needs in_features divisible by {m}, got in_features={in_f}"
    elif structure != "unstructured":
        return f"unknown sparsity_structure {structure!r}; allowed: {SPARSITY_STRUCTURES}"
    return None


def grid_shape(shape: tuple[int, int], structure: str, block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the selection grid: one cell per block for ``"block"``, one per entry otherwise."""
    if structure == "block":
        return shape[0] // block_size[0], shape[1] // block_size[1]
    return tuple(shape)


def pool_scores(scores: torch.Tensor, structure: str, block_size: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """Reduce entry scores of shape ``(out, in)`` to the selection grid (sum over each block for ``"block"``)."""
    if structure != "block":
        return scores
    bo, bi = block_size
    out_f, in_f = scores.shape
    return scores.reshape(out_f // bo, bo, in_f // bi, bi).sum(dim=(1, 3))


def expand_grid(grid: torch.Tensor, structure: str, block_size: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """Inverse of the pooling layout: a block grid becomes a full ``(out, in)`` mask."""
    if structure != "block":
        return grid
    bo, bi = block_size
    return grid.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)


def _topk_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    flat = scores.reshape(-1)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    if keep > 0:
        # stable ordering: ties broken by position, so every rank and every run picks the same entries
        idx = torch.argsort(flat, descending=True, stable=True)[:keep]
        mask[idx] = True
    return mask.reshape(scores.shape)


def num_kept(numel: int, sparsity: float) -> int:
    """Number of cells kept at sparsity ``rho``: ``round((1 - rho) * numel)``, at least one."""
    return max(1, min(numel, int(round((1.0 - sparsity) * numel))))


def select_block_mask(
    scores: torch.Tensor, sparsity: float, block_size: tuple[int, int] = (2, 2), pooled: bool = False
) -> torch.Tensor:
    """Keep the top ``(1 - sparsity)`` blocks of ``scores``; returns a full ``(out, in)`` boolean mask.

    Example:
        >>> m = select_block_mask(torch.arange(16.).reshape(4, 4), 0.5)
        >>> m.float().mean().item()
        0.5
    """
    grid = scores if pooled else pool_scores(scores, "block", block_size)
    return expand_grid(_topk_mask(grid, num_kept(grid.numel(), sparsity)), "block", block_size)


def select_nm_mask(scores: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Keep the ``n`` highest of every ``m`` consecutive entries along the input (last) dimension."""
    out_f, in_f = scores.shape
    groups = scores.reshape(out_f, in_f // m, m)
    # stable sort so ties resolve by position deterministically
    idx = torch.argsort(groups, dim=-1, descending=True, stable=True)[..., :n]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(out_f, in_f)


def select_unstructured_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep the top ``(1 - sparsity)`` entries of ``scores``."""
    return _topk_mask(scores, num_kept(scores.numel(), sparsity))


def select_mask(
    scores: torch.Tensor,
    structure: str,
    sparsity: float,
    block_size: tuple[int, int] = (2, 2),
    n_m: tuple[int, int] = (2, 4),
    pooled: bool = False,
) -> torch.Tensor:
    """Dispatch to the selector for ``structure``. ``sparsity == 0`` gives the all-ones (dense) mask."""
    if sparsity == 0:
        shape = expand_grid(scores, structure, block_size).shape if pooled else scores.shape
        return torch.ones(shape, dtype=torch.bool, device=scores.device)
    if structure == "block":
        return select_block_mask(scores, sparsity, block_size, pooled=pooled)
    if structure == "n:m":
        return select_nm_mask(scores, *n_m)
    if structure == "unstructured":
        return select_unstructured_mask(scores, sparsity)
    raise ValueError(f"sparsity_structure={structure!r} is not one of {SPARSITY_STRUCTURES}")


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """``|W|`` in float32."""
    return weight.detach().abs().float()


def random_scores(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Uniform random scores from a private generator, so that every process draws the same mask."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen)


def reselection_scores(importance: torch.Tensor, learned: torch.Tensor, keep_learned: float = 1.0) -> torch.Tensor:
    """Selection score from the gradient importance and the magnitude of what the adapter has learned.

    ``importance / mean(importance) + keep_learned * learned / mean(learned)``, on the selection grid. Each term is
    normalised by its own mean, so neither the loss scale nor the size of ``ΔW`` decides the balance;
    ``keep_learned = 0`` scores by the gradient alone (seed 000), which drops much of ``ΔW`` at every re-selection.

    Example:
        >>> reselection_scores(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]), 1.0)
        tensor([2., 2.])
    """

    def unit_mean(t: torch.Tensor) -> torch.Tensor:
        mean = t.mean()
        return t / mean if mean > 0 else torch.zeros_like(t)

    scores = unit_mean(importance.float())
    if keep_learned > 0:
        scores = scores + keep_learned * unit_mean(learned.float())
    return scores


def add_new_block_bonus(
    scores: torch.Tensor, previous_mask: torch.Tensor, activated_at_last_update: torch.Tensor, bonus: float
) -> torch.Tensor:
    """Raise the scores of cells switched on at the previous update by ``bonus`` times the mean kept score.

    Seed 000: "raise the importance of newly activated parameters", so a block just switched on is not dropped again
    before its weights have had a chance to grow. All tensors are on the selection grid.
    """
    if bonus == 0 or not bool(activated_at_last_update.any()):
        return scores
    kept = scores[previous_mask]
    scale = kept.mean() if kept.numel() else scores.mean()
    return scores + bonus * scale * activated_at_last_update.to(scores.dtype)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor into ``uint8`` bits (8 cells per byte), flattening it."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.reshape(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def packed_size(shape: tuple[int, ...]) -> int:
    """Number of bytes :func:`pack_mask` produces for a mask of ``shape``: one bit per cell, rounded up to a byte."""
    return -(-math.prod(shape) // 8)


def unpack_mask(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`."""
    numel = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].bool().reshape(shape)


def mask_sparsity(mask: torch.Tensor) -> float:
    """Fraction of ``False`` cells."""
    return 1.0 - mask.float().mean().item()
