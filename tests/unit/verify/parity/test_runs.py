"""verify.parity.runs: what the parity runners share, and the oracle side of parameters without a
gradient (None gathered as None, unchanged:<fqn>)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from autoparallel.runtime.steps import StepTrace
from verify.model_case import ModelCase
from verify.parity.runs import (
    EAGER,
    RankParity,
    gather_full_grads,
    no_recompile,
    single_device_reference,
    unchanged_checks,
)
from verify.stages.scenario import Scenario


def test_a_compiled_module_that_recompiles_inside_is_refused():
    """Both parity runners run the module their pipeline compiled; a compile inside the scope
    means the run tests other graphs than those, and must say so."""
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    torch._dynamo.reset()
    try:
        f(torch.ones(3))  # compiled outside: nothing new inside
        with no_recompile("the kept graphs"):
            f(torch.ones(3))
        with pytest.raises(RuntimeError, match="recompiled the module in the rank: the parity run would not test the kept graphs"):
            with no_recompile("the kept graphs"):
                f(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: a new graph
    finally:
        torch._dynamo.reset()


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.base(x))


def _frozen_scenario():
    case = ModelCase("frozen", _Frozen, lambda o, t: ((o - t) ** 2).mean(), lambda n: (torch.randn(n, 4), torch.randn(n, 4)))
    return Scenario(case=case, plan="fsdp", mesh="dp=2")


def _rank(coord, grads, params):
    return RankParity((coord,), {EAGER: StepTrace([torch.tensor(1.0)], [grads], params=params)})


def test_gradients_without_a_value_on_every_rank_stay_none_and_a_rank_alone_without_one_is_named():
    scenario = _frozen_scenario()
    model = scenario.model()
    shards = {fqn: p.detach().chunk(2) for fqn, p in model.named_parameters()}
    ranks = [_rank(r, {"base.weight": None, "base.bias": None, "head.weight": shards["head.weight"][r],
                       "head.bias": shards["head.bias"][r]}, {f: s[r] for f, s in shards.items()}) for r in range(2)]
    full = gather_full_grads(scenario, ranks, EAGER)
    assert full["base.weight"] is None and torch.equal(full["head.weight"], model.head.weight.detach())
    ref = single_device_reference(scenario)
    assert ref.grads["base.weight"] is None and ref.grads["head.weight"] is not None
    checks = unchanged_checks(scenario, ranks, EAGER, ref)
    assert [c.name for c in checks] == ["unchanged:base.bias", "unchanged:base.weight"] and all(c.passed for c in checks)
    ranks[1].traces[EAGER].params["base.bias"] = shards["base.bias"][1] + 1  # a frozen shard moved on one rank
    assert [c.name for c in unchanged_checks(scenario, ranks, EAGER, ref) if not c.passed] == ["unchanged:base.bias"]
    ranks[1].traces[EAGER].grads[0]["base.weight"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"base.weight: ranks \[\(0,\)\] have no gradient but the others have one"):
        gather_full_grads(scenario, ranks, EAGER)
