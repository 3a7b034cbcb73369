"""A value the model reads into Python must not change with state its own forward updates: the
graph holds one value per read (ibert's QuantAct initialises its activation range on the first
step only, ``if self.x_min.min() > -1.1e-5 ...``, and the next step took the other branch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph
from autoparallel.parallelize.traced_values import Read, reads_stay
from autoparallel.passes.value_guards import ValueGuardError
from autoparallel.runtime.steps import joint_graph_executor
from autoparallel.validate import DataDependentError


class RangeOnce(nn.Module):
    """Scales by an activation range kept in a buffer, set on the first forward only (the branch
    reads the buffer into Python), and widened in place afterwards when ``widen``."""

    def __init__(self, widen: bool = True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.widen = widen
        self.register_buffer("x_max", torch.zeros(()))

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            if self.x_max > 0:  # initialised yet?
                if self.widen:
                    self.x_max.copy_(torch.maximum(self.x_max, h.abs().max()))
            else:
                self.x_max.copy_(h.abs().max())
        return h / self.x_max


class ReadsAStat(RangeOnce):
    """Reads its buffer's value too, but the buffer is set at construction: the branch never flips."""

    def __init__(self):
        super().__init__()
        self.x_max.fill_(1.0)


def _mse(out, target):
    return F.mse_loss(out, target)


def _trace(model):
    torch.manual_seed(0)
    batch = torch.randn(4, 4), torch.randn(4, 4)
    with fake_world("dp=2") as mesh, build_joint_graph(model, ParallelPlan.fsdp(), mesh, batch, _mse) as joint:
        return joint.specialised_reads


def test_a_branch_on_state_the_forward_updates_is_refused_naming_the_read():
    with pytest.raises(DataDependentError, match=r"one graph for every step: .*if self.x_max > 0.* reads False on the first step "
                                                 r"and True on the same step run again"):
        _trace(RangeOnce())


def test_without_the_check_the_next_step_fails_its_guard(monkeypatch):
    """The refusal is what the run would find: traced anyway, the graph's first step initialises
    the range (the buffer updated in place) and the second fails its guard."""
    monkeypatch.setattr("autoparallel.parallelize.traced_values.reads_stay", lambda first, second: None)
    torch.manual_seed(0)
    model, batch = RangeOnce(), (torch.randn(2, 4), torch.randn(2, 4))
    plan = ParallelPlan.fsdp()
    with fake_world("dp=1") as mesh:
        params = {k: v.detach().clone() for k, v in ParallelProgram(model, plan, mesh, _mse).local_parameters().items()}
        with build_joint_graph(model, plan, mesh, batch, _mse) as joint:
            buffers = {"x_max": torch.zeros(())}
            run = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, buffers)
            run(params, batch)
            assert buffers["x_max"] > 0
            with pytest.raises(ValueGuardError, match=r"if self.x_max > 0.*traced with False; this batch gives True"):
                run(params, batch)


def test_a_branch_on_state_that_stays_is_traced_and_guarded():
    reads = _trace(ReadsAStat())
    assert [r.rsplit(": ", 1)[1] for r in reads] == ["traced with True"]


def test_reads_stay_names_the_first_difference():
    first = [Read("m.py:3 (if t:)", True)]
    reads_stay(first, first)
    with pytest.raises(DataDependentError, match=r"the two runs make different reads \(read 0"):
        reads_stay(first, [])
    with pytest.raises(DataDependentError, match=r"m.py:3 .* reads True on the first step and False"):
        reads_stay(first, [Read("m.py:3 (if t:)", False)])
