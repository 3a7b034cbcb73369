"""A buffer the model reassigns in forward (ibert's activation ranges: ``self.x_max = ...``) is
updated as eager PyTorch updates it, by the eager parallel program and by the traced graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph
from autoparallel.parallelize import program as program_module
from autoparallel.runtime.steps import eager_program_executor, joint_graph_executor


class RangeTracker(nn.Module):
    """Tracks the running max of its activations by reassigning a buffer."""

    def __init__(self, grow: bool = False):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("x_max", torch.zeros(1))
        self.grow = grow

    def forward(self, x):
        y = self.proj(x)
        new = torch.maximum(self.x_max, y.detach().max())
        self.x_max = torch.cat([new, new]) if self.grow else new
        return y


def _mse(out, target):
    return F.mse_loss(out, target)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)


def _eager_x_max(model, batch):
    ref = RangeTracker()
    ref.load_state_dict(model.state_dict())
    _mse(ref(batch[0]), batch[1]).backward()
    return ref.x_max


def _steps(model, batch):
    """The eager parallel program's and the joint graph's buffer after one step (dp=1)."""
    plan = ParallelPlan.fsdp()
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        eager = eager_program_executor(program)
        eager(params, batch)
        with build_joint_graph(model, plan, mesh, batch, _mse) as joint:
            buffers = {"x_max": torch.zeros(1)}
            joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, buffers)(params, batch)
    return eager.buffers["x_max"], buffers["x_max"]


def test_a_reassigned_buffer_is_updated_as_eager_updates_it():
    torch.manual_seed(0)
    model, batch = RangeTracker(), _batch()
    want = _eager_x_max(model, batch)
    assert want.item() > 0
    eager, joint = _steps(model, batch)
    assert torch.equal(eager, want) and torch.equal(joint, want)


def test_without_the_in_place_update_the_buffer_keeps_its_old_value(monkeypatch):
    """The class: the executor's buffer and the graph's miss the update (the old behaviour)."""
    import contextlib

    torch.manual_seed(0)
    model, batch = RangeTracker(), _batch()
    monkeypatch.setattr(program_module, "buffers_updated_in_place", lambda model: contextlib.nullcontext())
    eager, joint = _steps(model, batch)
    assert eager.item() == 0 and joint.item() == 0 and _eager_x_max(model, batch).item() > 0


def test_a_reassignment_of_another_shape_is_refused_naming_it():
    torch.manual_seed(0)
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(RangeTracker(grow=True), ParallelPlan.fsdp(), mesh, _mse)
        with pytest.raises(ValueError, match=r"RangeTracker.x_max: forward replaces a buffer of shape \(1,\)"):
            program(*_batch())
