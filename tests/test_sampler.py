"""LayerSampler: strategies, determinism, exportable state, validation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_lisa.scheduler.sampler import LayerSampler
from hf_lisa.scheduler.state import load_schedule, save_schedule


@pytest.mark.parametrize("strategy", ["uniform", "importance", "cyclic"])
def test_draws_are_sorted_distinct_blocks_of_size_gamma(strategy):
    sampler = LayerSampler(num_layers=7, lisa_activated_layers=3, lisa_sampling=strategy, seed=1)
    for _ in range(50):
        blocks = sampler.sample()
        assert blocks == sorted(set(blocks)) and len(blocks) == 3
        assert all(0 <= b < 7 for b in blocks)
    assert sampler.num_draws == 50
    assert not hasattr(sampler, "current")  # it proposes; the scheduler's ActiveSet holds the active blocks


def test_uniform_visits_every_block_about_equally():
    sampler = LayerSampler(num_layers=6, lisa_activated_layers=2, seed=0)
    counts = Counter(b for _ in range(3000) for b in sampler.sample())
    # expected 1000 each; 6 sigma of the binomial count is ~155
    assert set(counts) == set(range(6))
    assert all(abs(c - 1000) < 155 for c in counts.values()), counts


def test_cyclic_trains_every_block_once_per_cycle():
    sampler = LayerSampler(num_layers=8, lisa_activated_layers=2, lisa_sampling="cyclic", seed=3)
    for _ in range(5):  # five cycles of four draws
        cycle = [b for _ in range(4) for b in sampler.sample()]
        assert sorted(cycle) == list(range(8))


def test_cyclic_with_gamma_not_dividing_n_still_covers_all_blocks_each_cycle():
    sampler = LayerSampler(num_layers=5, lisa_activated_layers=2, lisa_sampling="cyclic", seed=0)
    drawn = [b for _ in range(25) for b in sampler.sample()]  # 50 picks = 10 cycles
    assert Counter(drawn) == {b: 10 for b in range(5)}


def test_importance_prefers_blocks_with_large_gradient_norm_and_keeps_a_floor():
    sampler = LayerSampler(num_layers=4, lisa_activated_layers=1, lisa_sampling="importance", seed=0, importance_floor=0.1)
    assert torch.allclose(sampler.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))
    sampler.observe({0: 10.0, 1: 1.0, 2: 1.0, 3: 1.0})
    probs = sampler.probabilities()
    assert probs.sum().item() == pytest.approx(1.0)
    assert probs[0].item() == pytest.approx(0.9 * 10 / 13 + 0.025)
    assert probs[1].item() == pytest.approx(0.9 * 1 / 13 + 0.025)
    counts = Counter(sampler.sample()[0] for _ in range(2000))
    assert counts[0] > 1200 and min(counts[b] for b in (1, 2, 3)) > 50


def test_importance_scores_unseen_blocks_optimistically_and_averages_observations():
    sampler = LayerSampler(num_layers=3, lisa_activated_layers=1, lisa_sampling="importance", seed=0, importance_decay=0.5)
    sampler.observe({0: 4.0})
    sampler.observe({0: 2.0, 1: 1.0})
    assert sampler.scores == [3.0, 1.0, None]  # EMA 0.5*4 + 0.5*2; block 2 never measured
    probs = sampler.probabilities()
    assert probs[2].item() == pytest.approx(probs[0].item())  # unseen block scored at the max observed
    sampler.observe({1: float("nan")})
    assert sampler.scores[1] == 1.0


def test_observe_is_ignored_by_non_importance_strategies():
    sampler = LayerSampler(num_layers=3, lisa_activated_layers=1, lisa_sampling="uniform", seed=0)
    sampler.observe({0: 5.0})
    assert sampler.scores == [None, None, None]


@pytest.mark.parametrize("strategy", ["uniform", "importance", "cyclic"])
def test_same_seed_same_sequence_and_different_seed_differs(strategy):
    def run(seed):
        s = LayerSampler(num_layers=10, lisa_activated_layers=3, lisa_sampling=strategy, seed=seed)
        out = []
        for i in range(20):
            out.append(s.sample())
            s.observe({b: float(b + i) for b in out[-1]})
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("strategy", ["uniform", "importance", "cyclic"])
def test_state_roundtrip_through_the_checkpoint_format_continues_the_exact_sequence(strategy, tmp_path):
    sampler = LayerSampler(num_layers=9, lisa_activated_layers=2, lisa_sampling=strategy, seed=11)
    for i in range(7):  # stop mid-cycle for "cyclic"
        sampler.observe({b: 1.0 + i * b for b in sampler.sample()})
    save_schedule(str(tmp_path), sampler.state_dict())  # JSON values + safetensors, no pickle
    restored = LayerSampler(num_layers=9, lisa_activated_layers=2, lisa_sampling=strategy, seed=0)
    restored.load_state_dict(load_schedule(str(tmp_path)))
    assert restored.num_draws == sampler.num_draws and restored.scores == sampler.scores
    assert [restored.sample() for _ in range(15)] == [sampler.sample() for _ in range(15)]


def test_load_state_dict_refuses_a_different_configuration():
    state = LayerSampler(num_layers=6, lisa_activated_layers=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="lisa_activated_layers"):
        LayerSampler(num_layers=6, lisa_activated_layers=3, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="lisa_sampling"):
        LayerSampler(num_layers=6, lisa_activated_layers=2, lisa_sampling="cyclic", seed=0).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_layers": 4, "lisa_activated_layers": 0}, "lisa_activated_layers"),
        ({"num_layers": 4, "lisa_activated_layers": 5}, "lisa_activated_layers"),
        ({"num_layers": 4, "lisa_activated_layers": -1}, "lisa_activated_layers"),
        ({"num_layers": 0, "lisa_activated_layers": 1}, "num_layers"),
        ({"num_layers": 4, "lisa_activated_layers": 2, "lisa_sampling": "random"}, "lisa_sampling"),
        ({"num_layers": 4, "lisa_activated_layers": 2, "seed": 1.5}, "seed"),
        ({"num_layers": 4, "lisa_activated_layers": 2, "importance_floor": 0.0}, "importance_floor"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LayerSampler(**kwargs)


def test_gamma_equal_to_n_always_draws_every_block():
    sampler = LayerSampler(num_layers=4, lisa_activated_layers=4, seed=0)
    assert all(sampler.sample() == [0, 1, 2, 3] for _ in range(5))
