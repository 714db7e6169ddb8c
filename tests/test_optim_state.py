"""``hf_lisa.optim.state``: the optimizer state of parameters that stop training, measured and dropped exactly."""

from __future__ import annotations

import pytest
import torch

from hf_lisa.optim.state import (
    drop_optimizer_state,
    exclude_from_weight_decay,
    optimizer_params,
    optimizer_state_bytes,
    params_with_state,
    unwrap_optimizer,
)


class _Wrapper:  # the shape of accelerate's AcceleratedOptimizer: the real optimizer in `.optimizer`
    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def _stepped_adamw(*sizes: int):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return params, optimizer


def test_unwrap_follows_wrappers_and_refuses_what_is_no_optimizer():
    _, optimizer = _stepped_adamw(3)
    assert unwrap_optimizer(_Wrapper(_Wrapper(optimizer))) is optimizer
    with pytest.raises(TypeError, match="Expected a torch.optim.Optimizer"):
        unwrap_optimizer(object())


def test_state_bytes_are_adams_two_moments_and_a_step_counter_per_parameter():
    params, optimizer = _stepped_adamw(10, 7)
    # per parameter: exp_avg and exp_avg_sq in float32 (4 bytes each) + a float32 step tensor
    assert optimizer_state_bytes(_Wrapper(optimizer)) == (2 * 10 * 4 + 4) + (2 * 7 * 4 + 4)
    assert {id(p) for p in params_with_state(optimizer)} == {id(p) for p in params}


def test_dropping_frees_exactly_the_state_of_the_given_parameters_and_a_restart_counts_from_one():
    (a, b), optimizer = _stepped_adamw(10, 7)
    assert drop_optimizer_state(optimizer, [a]) == 2 * 10 * 4 + 4
    assert optimizer_state_bytes(optimizer) == 2 * 7 * 4 + 4
    assert drop_optimizer_state(optimizer, [a]) == 0  # nothing left to free
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    optimizer.step()
    assert optimizer.state[a]["step"].item() == 1 and optimizer.state[b]["step"].item() == 2
    assert optimizer_params(optimizer) == {id(a), id(b)}


def test_exclude_from_weight_decay_moves_to_the_matching_no_decay_group_or_reports_what_is_stuck():
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    optimizer = torch.optim.AdamW([{"params": [a, b], "weight_decay": 0.1}, {"params": [c], "weight_decay": 0.0}])
    assert exclude_from_weight_decay(optimizer, [b]) == []
    assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [[id(a)], [id(c), id(b)]]
    lonely = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}])
    stuck = exclude_from_weight_decay(lonely, [a])
    assert [id(p) for p in stuck] == [id(a)] and lonely.param_groups[0]["params"][0] is a
