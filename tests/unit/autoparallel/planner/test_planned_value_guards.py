"""plan="auto" on a model that reads a tensor's value into Python (``if pad.any():``) or takes a
mask's count (``h[marked]``): the planning trace takes the value from a real run of the whole batch
and guards it (patch value_guards); the planner places each guard, and each op whose output size is
a mask's count, as a replicated fallback (``strategies.reads_data``), costed with the gathers into
it; the lowered graph holds the guards. Small models of our own, planned on fake worlds; the run on
a one-rank world is bitwise with eager, and a batch that takes the other branch raises the guard.
A gloo dp=2,tp=2 world of the same models: tests/parity/test_value_guards_parity.py (slow step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.passes.value_guards import GUARD, GUARD_ROWS, ValueGuardError
from autoparallel.pipeline import run_pipeline
from autoparallel.planner.auto import plan_for_pipeline
from autoparallel.planner.strategies import DATA_DEPENDENT, NO_STRATEGY
from autoparallel.runtime.steps import joint_graph_executor
from autoparallel.validate import DataDependentError
from verify.parity.plan_check import check_plan, traced_graph

MESH = "dp=2,tp=2"
REPLICATED = {"dp": "R", "tp": "R"}


class PaddedMean(nn.Module):
    """Masks padding out only when the batch has padding (fsmt's ``if not padding_mask.any():``)."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, pad):
        h = torch.tanh(self.proj(x))
        if pad.any():
            h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        return self.head(h.sum(1))


class PickedPositions(nn.Module):
    """Keeps the marked positions by a boolean mask (an output whose size is the mask's count)."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, marked):
        return self.head(torch.tanh(self.proj(x))[marked].sum(0, keepdim=True)).expand(x.shape[0], -1)


def mse(out, target):
    return nn.functional.mse_loss(out, target)


def _batch(n, padded=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(n, 6, dtype=torch.bool)
    pad[:, -2:] = padded
    return torch.randn(n, 6, 8, generator=g), pad, torch.randn(n, 4, generator=g)


def _model(cls, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return cls()


def _planned(cls, batch, mesh):
    planned = plan_for_pipeline(_model(cls), mse, batch, mesh, ParallelPlan.auto())
    planned.pg.joint.close()
    return planned


@pytest.mark.parametrize("cls, guard", [(PaddedMean, GUARD), (PickedPositions, GUARD_ROWS)])
def test_each_guard_and_counted_op_is_a_replicated_fallback_costed_and_checked(cls, guard):
    with fake_world(MESH) as mesh:
        planned = _planned(cls, _batch(4), mesh)
    plan, pg = planned.solution, planned.pg  # the plan with its solver context (explain)
    guards = [pg.keys[n.name] for n in pg.gm.graph.find_nodes(op="call_function", target=guard)]
    assert len(guards) == 1
    data = sorted(k for k, why in plan.fallbacks.items() if why == DATA_DEPENDENT)
    assert guards[0] in data and NO_STRATEGY not in plan.fallbacks.values()
    if cls is PickedPositions:  # x[marked] and its backward's index_put count the mask too
        assert any("aten.index.Tensor" in k for k in data) and any("index_put" in k for k in data)
    for key in data:
        assert all(i == REPLICATED for i in plan.nodes[key].ins), key
        assert f"the replicated fallback: {DATA_DEPENDENT}" in plan.explain(key)
    ctx = plan._context
    pn = next(n for n in ctx.graph.nodes if n.key == guards[0])
    assert pn.fallback == DATA_DEPENDENT and len(pn.candidates) == 1  # one way to run it: placed trivially
    check = check_plan(plan, *traced_graph(plan))
    assert not check.violations, check


def test_a_read_on_a_model_without_values_is_refused_naming_the_line():
    """The planning trace takes the value from a real run: a model on meta cannot make one."""
    with fake_world(MESH) as mesh, pytest.raises(DataDependentError, match=r"if pad\.any\(\)"):
        plan_for_pipeline(_model(PaddedMean, "meta"), mse, _batch(4), mesh, ParallelPlan.auto())


def _lowered_step(cls, traced, run_on):
    """plan="auto" on a one-rank world, traced on ``traced``; the lowered joint graph run on
    ``run_on``: (joint, loss, grads)."""
    model = _model(cls)
    with fake_world("dp=1") as mesh:
        joint = run_pipeline(model, mse, traced, ParallelPlan.auto(), mesh, until="joint", trace=None).joint  # closed by the run
        step = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
        loss, grads = step({k: v.detach().clone() for k, v in model.named_parameters()}, run_on)
    return joint, loss, grads


def _eager(cls, batch):
    model = _model(cls)
    loss = mse(model(*batch[:-1]), batch[-1])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [PaddedMean, PickedPositions])
def test_the_lowered_graph_holds_the_guard_and_is_bitwise_with_eager(cls):
    traced, again = _batch(2), _batch(2, seed=1)  # another batch with the same branch and count
    joint, loss, grads = _lowered_step(cls, traced, again)
    (read,) = joint.specialised_reads
    assert read.endswith("traced with True" if cls is PaddedMean else "nonzero traced with size 4")
    assert any(n.target in (GUARD, GUARD_ROWS) for n in joint.gm.graph.nodes)
    want_loss, want = _eager(cls, again)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[k], want[k]) for k in want)


@pytest.mark.parametrize("cls, match", [(PaddedMean, r"if pad\.any\(\).*traced with True; this batch gives False"),
                                        (PickedPositions, r"nonzero traced with size 4; this batch gives 0")])
def test_a_batch_that_takes_the_other_branch_raises_the_guard(cls, match):
    with pytest.raises(ValueGuardError, match=match):
        _lowered_step(cls, _batch(2), _batch(2, padded=False))
