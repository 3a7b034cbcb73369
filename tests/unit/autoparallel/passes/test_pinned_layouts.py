"""Patch ``pinned_layouts``: an op whose operands have mixed layouts keeps the traced layout.

``aten.softplus_backward(grad, x)`` with ``grad`` transposed is transposed on CPU and contiguous
on fake tensors (its Python decomposition reads ``x`` first), so the trace turns a ``reshape`` of
its output into a ``view`` that the real tensor cannot take. The unit tests trace that on a small
FX graph; the guards trace a small model of our own (a softplus gate read transposed, as doge's
dynamic mask does) through the joint trace and run the joint graph on real tensors.

Patch ``kernel_strides`` now gives the trace the kernel's layout for these ops, so the pin is the
safety net for ops its probe cannot run; every test here runs with ``kernel_strides`` off, the
situation the pin exists for.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import patches
from autoparallel.kernel_strides import PATCH as KERNEL_STRIDES
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.passes.pinned_layouts import COPY_STRIDED, PATCH, mixed_layouts, pin_mixed_layouts
from autoparallel.runtime.steps import joint_graph_executor

aten = torch.ops.aten
B, T, H = 2, 8, 2


@pytest.fixture(autouse=True)
def _without_kernel_strides():
    with patches.disabled(KERNEL_STRIDES):
        yield


def _grad_of_softplus(g, x):
    """The gradient path of doge's gate: softplus_backward of a transposed gradient, reshaped."""
    return aten.softplus_backward.default(g.transpose(1, 2), x, 1.0, 20.0).reshape(B * T, H)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, H, T, generator=gen), torch.randn(B, T, H, generator=gen)


def test_fake_and_real_strides_of_softplus_backward_differ():
    """The premise: the kernel keeps the gradient's layout, the fake tensor takes x's. If this
    fails, upstream fixed its decomposition and the patch is no longer needed."""
    g, x = _inputs()
    gm = make_fx(_grad_of_softplus, tracing_mode="fake")(g, x)
    sb = next(n for n in gm.graph.nodes if n.target == aten.softplus_backward.default)
    assert sb.meta["val"].stride() == (16, 2, 1)
    assert aten.softplus_backward.default(g.transpose(1, 2), x, 1.0, 20.0).stride() == (16, 1, 8)
    assert [u.target for u in sb.users] == [aten.view.default]  # the reshape became a view


def test_traced_graph_fails_unpinned_and_matches_eager_pinned():
    g, x = _inputs()
    gm = make_fx(_grad_of_softplus, tracing_mode="fake")(g, x)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(g, x)
    report = pin_mixed_layouts(gm)
    assert report.acted == 1 and "softplus_backward" in report.pinned[0]
    assert torch.equal(gm(g, x), _grad_of_softplus(g, x))


@pytest.mark.parametrize("transpose", [False, True])
def test_operands_of_one_layout_are_not_pinned(transpose):
    """Negative side: both operands contiguous, or both transposed, leave the graph alone."""

    def f(g, x):
        if transpose:
            g, x = g.transpose(1, 2), x.transpose(1, 2)
        return aten.softplus_backward.default(g, x, 1.0, 20.0).sum(0)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(B, T, H), torch.randn(B, T, H))
    assert not any(mixed_layouts(n) for n in gm.graph.nodes)
    assert pin_mixed_layouts(gm).acted == 0


def test_broadcast_operand_and_views_are_not_mixed():
    """An operand of another shape (broadcast) is not a layout vote, and a view op is never pinned."""

    def f(a, b):
        return (a.transpose(0, 1) * b).t()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 4), torch.randn(3))
    assert not any(mixed_layouts(n) for n in gm.graph.nodes)


def test_pinned_value_has_the_traced_strides_on_real_tensors():
    """The property the patch gives: after the pin, the real tensor's strides are the fake one's,
    for every mix of operand layouts."""
    for perm_g in ((0, 1, 2), (0, 2, 1), (2, 1, 0)):
        for perm_x in ((0, 1, 2), (1, 0, 2), (0, 2, 1)):
            g = torch.randn(B, T, H).permute(perm_g).contiguous().permute(*_inverse(perm_g))
            x = torch.randn(B, T, H).permute(perm_x).contiguous().permute(*_inverse(perm_x))
            gm = make_fx(lambda g, x: aten.softplus_backward.default(g, x, 1.0, 20.0), tracing_mode="fake")(g, x)
            pin_mixed_layouts(gm)
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            got = gm(g, x)
            assert got.stride() == out.meta["val"].stride(), (perm_g, perm_x)
            assert torch.equal(got, aten.softplus_backward.default(g, x, 1.0, 20.0))
            assert (out.target == COPY_STRIDED) == (g.stride() != x.stride())


def _inverse(perm):
    return sorted(range(len(perm)), key=perm.__getitem__)


class SoftplusGate(nn.Module):
    """A softplus gate per head, read transposed (heads before time): its gradient comes back
    transposed into softplus_backward while softplus's input is the linear's contiguous output."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, H)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        gate = F.softplus(self.gate(x)).transpose(1, 2)  # [b, H, t]
        v = self.proj(x).view(b, t, H, 8 // H).transpose(1, 2)  # [b, H, t, 4]
        return (gate.unsqueeze(-1) * v).sum(1)


def _mse(out, target):
    return F.mse_loss(out, target)


def _joint_step():
    """Trace the model's joint graph on one rank (dp=1) and run it on real tensors: loss and grads."""
    torch.manual_seed(0)
    model, plan = SoftplusGate(), ParallelPlan.fsdp()
    batch = (torch.randn(B, T, 8), torch.randn(B, T, 4))
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        inputs = split_batch(batch, plan, mesh.spec, mesh.coordinate())
        with build_joint_graph(model, plan, mesh, batch, _mse) as joint:
            run = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
            loss, grads = run(params, inputs)
    model.zero_grad()
    _mse(model(*batch[:-1]), batch[-1]).backward()
    return joint.gm, loss, grads, model


def test_traced_joint_graph_of_mixed_layout_softplus_runs():
    gm, loss, grads, model = _joint_step()
    want = dict(model.named_parameters())
    assert set(grads) == set(want)
    for name, grad in grads.items():
        assert torch.equal(grad, want[name].grad), name


def test_joint_graph_pins_the_mixed_layout_op():
    gm = _joint_step()[0]
    pins = [n for n in gm.graph.nodes if n.target == COPY_STRIDED]
    assert aten.softplus_backward.default in [p.args[0].target for p in pins]


def test_without_the_patch_the_joint_graph_fails():
    """The negative side: with the patch off the joint graph has no pin and its view of
    softplus_backward's output fails on the real tensor."""
    with patches.disabled(PATCH), pytest.raises(RuntimeError, match="view size is not compatible"):
        _joint_step()
