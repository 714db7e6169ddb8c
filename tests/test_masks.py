"""The structured masks satisfy their definitions."""

import pytest
import torch

from hf_lisa.tuner import masks as M


@pytest.mark.parametrize("shape", [(8, 16), (32, 64), (6, 24)])
@pytest.mark.parametrize("n_m", [(2, 4), (1, 4), (2, 8)])
def test_nm_mask_keeps_exactly_n_in_every_group_along_input_dim(shape, n_m):
    n, m = n_m
    scores = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    mask = M.select_mask(scores, "n:m", 1 - n / m, n_m=n_m)
    groups = mask.reshape(shape[0], shape[1] // m, m)
    assert torch.all(groups.sum(-1) == n)
    # the kept entries are the n largest of each group
    kept_min = torch.where(groups, scores.reshape(groups.shape), torch.inf).amin(-1)
    dropped_max = torch.where(~groups, scores.reshape(groups.shape), -torch.inf).amax(-1)
    assert torch.all(kept_min >= dropped_max)


@pytest.mark.parametrize("block_size", [(2, 2), (4, 2), (1, 8)])
@pytest.mark.parametrize("sparsity", [0.1, 0.4, 0.75, 0.9])
def test_block_mask_is_whole_blocks_at_requested_sparsity(block_size, sparsity):
    shape = (16, 32)
    scores = torch.rand(shape, generator=torch.Generator().manual_seed(1))
    mask = M.select_mask(scores, "block", sparsity, block_size=block_size)
    bo, bi = block_size
    blocks = mask.reshape(shape[0] // bo, bo, shape[1] // bi, bi)
    per_block = blocks.sum(dim=(1, 3))
    assert torch.all((per_block == 0) | (per_block == bo * bi)), "every block is entirely on or off"
    n_blocks = per_block.numel()
    # requested sparsity within one block's rounding
    assert abs(M.mask_sparsity(mask) - sparsity) <= 1 / n_blocks + 1e-9
    # the kept blocks are those with the largest pooled scores
    pooled = M.pool_scores(scores, "block", block_size)
    on = per_block > 0
    assert pooled[on].min() >= pooled[~on].max()


@pytest.mark.parametrize("sparsity", [0.05, 0.4, 0.99])
def test_unstructured_mask_sparsity_and_top_entries(sparsity):
    scores = torch.rand((10, 30), generator=torch.Generator().manual_seed(2))
    mask = M.select_mask(scores, "unstructured", sparsity)
    assert abs(M.mask_sparsity(mask) - sparsity) <= 1 / scores.numel() + 1e-9
    assert scores[mask].min() >= scores[~mask].max()


def test_zero_sparsity_is_dense():
    assert M.select_mask(torch.rand(4, 8), "block", 0.0).all()


def test_pack_unpack_round_trip_and_size():
    mask = torch.rand((37, 19), generator=torch.Generator().manual_seed(3)) > 0.5
    packed = M.pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (37 * 19 + 7) // 8
    assert torch.equal(M.unpack_mask(packed, (37, 19)), mask)


def test_new_block_bonus_lifts_recently_activated_cells():
    scores = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    previous = torch.tensor([[False, True], [True, True]])
    new = torch.tensor([[False, True], [False, False]])
    boosted = M.add_new_block_bonus(scores, previous, new, bonus=1.0)
    mean_kept = (2 + 3 + 4) / 3
    assert torch.allclose(boosted, scores + mean_kept * new.float())
    assert torch.equal(M.add_new_block_bonus(scores, previous, new, bonus=0.0), scores)


def test_structure_fit_reasons():
    assert M.check_structure_fits((8, 8), "block", (2, 2), (2, 4)) is None
    assert "does not divide" in M.check_structure_fits((8, 9), "block", (2, 2), (2, 4))
    assert "divisible by 4" in M.check_structure_fits((8, 10), "n:m", (2, 2), (2, 4))
    assert "unknown" in M.check_structure_fits((8, 8), "diagonal", (2, 2), (2, 4))


def test_random_scores_are_seeded():
    assert torch.equal(M.random_scores((4, 4), 7), M.random_scores((4, 4), 7))
    assert not torch.equal(M.random_scores((4, 4), 7), M.random_scores((4, 4), 8))
