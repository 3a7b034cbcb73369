"""A parameter first read under ``torch.no_grad()`` and again with grad on, in one forward.

Recurrent models that backpropagate through their last iterations only (Hugging Face's HRM:
the earlier ones run under ``torch.no_grad()`` to bound activation memory) read each weight
first with grad off. The parallel program gathers a parameter once per forward and caches it;
gathered under no_grad, the cached tensor was cut from its shard, so the later reads gave the
shard no gradient: every stage agreed bitwise (they share the program) and only the independent
oracle saw it ("missing in the parallel run"). ``WarmupRecurrence`` is that class in a few lines.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoparallel import roles
from autoparallel.parallelize import program
from verify.model_case import ModelCase
from verify.parity.runs import EAGER, JOINT, compare_with_eager, oracle_check, run_stage_parity
from verify.stages.scenario import Scenario
from verify.zoo import mse_loss

pytestmark = pytest.mark.xdist_group("no-grad-first-read")


class WarmupRecurrence(nn.Module):
    """Two warm-up steps of ``cell`` under no_grad, then one step that backpropagates."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.cell = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        with torch.no_grad():
            for _ in range(2):
                h = torch.tanh(self.cell(h + x))
        return self.head(torch.tanh(self.cell(h + x)))


def _batch(n: int):
    return torch.randn(n, 16), torch.randn(n, 4)


SCENARIO = Scenario(case=ModelCase("warmup_recurrence", WarmupRecurrence, mse_loss, _batch, batch_per_rank=2),
                    plan="fsdp", mesh="dp=2")


def test_a_weight_first_read_under_no_grad_gets_its_gradient_at_every_stage():
    ranks = run_stage_parity(SCENARIO, 1, executors=(EAGER, JOINT))
    compare_with_eager(ranks, JOINT).assert_bitwise()
    for r in ranks:
        assert r.traces[EAGER].grads[0]["cell.weight"] is not None
    report = oracle_check(SCENARIO, ranks)
    print(report.summary())
    assert report.passed, report.summary()


def test_a_gather_cached_under_no_grad_loses_the_gradient_and_the_oracle_says_so(monkeypatch):
    """The program before the fix (the gather run in the caller's grad mode)."""
    monkeypatch.setattr(program._GatherParam, "forward", program._GatherParam._gather)
    ranks = run_stage_parity(SCENARIO, 1, executors=(EAGER,))
    report = oracle_check(SCENARIO, ranks)
    print(report.summary())
    failing = {c.name: c for c in report.failures()}
    assert roles.grad("cell.weight") in failing
    assert "missing in the parallel run" in failing[roles.grad("cell.weight")].note
