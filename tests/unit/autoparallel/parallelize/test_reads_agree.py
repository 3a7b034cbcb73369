"""A value the model reads into Python must be the same on every data-parallel slice of the traced
batch: every rank runs the graph traced on the first slice (jetmoe's ``expert_size.tolist()``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.parallelize import traced_values
from autoparallel.parallelize.traced_values import Read, reads_agree
from autoparallel.passes.value_guards import ValueGuardError
from autoparallel.runtime.steps import joint_graph_executor
from autoparallel.validate import DataDependentError


class TinyMoE(nn.Module):
    """Top-1 MoE as jetmoe routes it: rows sorted by expert, split by counts read with
    ``.tolist()``, each expert applied to its rows. The router sends a row to expert 0 when its
    first feature is positive."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]))
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        expert = self.router(x).argmax(-1)
        order = expert.argsort(stable=True)
        sizes = torch.stack([(expert == e).sum() for e in range(2)]).tolist()
        parts = x.index_select(0, order).split(sizes)
        out = torch.cat([e(p) for e, p in zip(self.experts, parts, strict=True)])
        return torch.empty_like(out).index_copy(0, order, out)


def _mse(out, target):
    return F.mse_loss(out, target)


def _batch(first_features):
    """Rows whose first feature is given (the router's choice), the rest random; and a target."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(first_features), 4, generator=g)
    x[:, 0] = torch.tensor(first_features)
    return x, torch.randn(len(first_features), 4, generator=g)


def _trace_dp2(model, batch):
    plan = ParallelPlan.fsdp()
    with fake_world("dp=2") as mesh, build_joint_graph(model, plan, mesh, batch, _mse) as joint:
        return joint.specialised_reads


def test_slices_that_route_differently_are_refused_naming_the_read():
    torch.manual_seed(0)
    batch = _batch([1.0, 1.0, 1.0, -1.0])  # slice 0: counts [2, 0]; slice 1: [1, 1]
    with pytest.raises(DataDependentError, match=r"tolist\(\).* reads 2 on data-parallel slice 0 and 1 on slice 1"):
        _trace_dp2(TinyMoE(), batch)


def test_slices_that_route_alike_trace_with_guarded_counts():
    torch.manual_seed(0)
    reads = _trace_dp2(TinyMoE(), _batch([1.0, -1.0, -1.0, 1.0]))  # [1, 1] on both slices
    assert [r.rsplit(": ", 1)[1] for r in reads] == ["traced with 1", "traced with 1"]


def test_without_the_check_the_other_rank_fails_its_guard(monkeypatch):
    """The refusal is what the run would find: with the check off the trace succeeds, and rank 1's
    slice, run through the graph traced on slice 0, fails its guard."""
    torch.manual_seed(0)
    model, batch = TinyMoE(), _batch([1.0, 1.0, 1.0, -1.0])
    monkeypatch.setattr(traced_values, "reads_agree", lambda first, others: None)
    monkeypatch.setattr("autoparallel.parallelize.joint.reads_agree", lambda first, others: None)
    plan = ParallelPlan.fsdp()
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        slice0, slice1 = batch[0][:2], batch[0][2:]
        with build_joint_graph(model, plan, mesh, (slice0, batch[1][:2]), _mse) as joint:
            run = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
            run(params, split_batch((slice0, batch[1][:2]), plan, mesh.spec, mesh.coordinate()))
            with pytest.raises(ValueGuardError, match=r"tolist\(\).*traced with 2; this batch gives 1"):
                run(params, (slice1, batch[1][2:]))


@pytest.mark.parametrize("other, match", [
    ([Read("m.py:3 (x.tolist())", 2), Read("m.py:3 (x.tolist())", 1)], r"m.py:3 .* reads 0 on data-parallel slice 0 and 1 on slice 2"),
    ([Read("m.py:3 (x.tolist())", 2)], r"slices 0 and 2 make different reads \(read 1: m.py:3 .*traced with 0 vs none\)"),
    ([Read("m.py:4 (if t:)", True), Read("m.py:3 (x.tolist())", 0)], r"slices 0 and 2 make different reads \(read 0"),
])
def test_reads_agree_names_the_first_difference(other, match):
    first = [Read("m.py:3 (x.tolist())", 2), Read("m.py:3 (x.tolist())", 0)]
    reads_agree(first, [first, first])  # the same reads on every slice: no error
    with pytest.raises(DataDependentError, match=match):
        reads_agree(first, [first, other])


def test_reads_per_rank_traces_each_rank_with_its_own_slice():
    """``reads_per_rank``: no refusal; rank r's graph holds slice r's counts (a parity world traces
    one per rank and compares their collectives: verify.parity.retrace)."""
    torch.manual_seed(0)
    model, batch = TinyMoE(), _batch([1.0, 1.0, 1.0, -1.0])  # slice 0: counts [2, 0]; slice 1: [1, 1]
    held = []
    for rank in (0, 1):
        with fake_world("dp=2", rank=rank) as mesh, \
                build_joint_graph(model, ParallelPlan.fsdp(), mesh, batch, _mse, reads_per_rank=True) as joint:
            held.append([r.rsplit(": ", 1)[1] for r in joint.specialised_reads])
            assert [r.value for r in joint.traced_reads] == ([2, 0] if rank == 0 else [1, 1])
    assert held == [["traced with 2", "traced with 0"], ["traced with 1", "traced with 1"]]
