"""The joint trace's dropout computes eager's bits (patch ``eager_dropout``).

Each test traces dropout's forward and backward as the joint trace does (Python dispatcher on:
``aten.dropout``'s decomposition runs) and runs the graph against eager under one seed.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from torch import nn

from autoparallel import patches
from autoparallel.eager_dropout import (
    PATCH,
    PATCH_IN_PLACE,
    dropout_as_eager,
    dropout_in_place,
    eager_dropout,
    fused_kernel_acceptable,
    in_place_dropout_as_one_op,
)
from autoparallel.mesh import fake_world
from autoparallel.planner.graph import trace_planning_graph
from autoparallel.planner.strategies import is_undroppable_random
from verify.parity.random_ops import RandomOpError, graph_without_random_ops, random_nodes

aten = torch.ops.aten

P_GRID = [i / 20 for i in range(1, 20)]


def _step(x, g, p):
    x = x.detach().requires_grad_()
    y = F.dropout(x, p, True)
    (gx,) = torch.autograd.grad(y, x, g)
    return y, gx


def _traced(x, g, p):
    with enable_python_dispatcher(), dropout_as_eager():
        return make_fx(lambda x, g: _step(x, g, p))(x, g)


def _mismatches(dtype) -> list[float]:
    bad = []
    for i, p in enumerate(P_GRID):
        gen = torch.Generator().manual_seed(i)
        x, g = (torch.randn(512, generator=gen).to(dtype) for _ in range(2))
        gm = _traced(x, g, p)
        torch.manual_seed(i)
        want = _step(x, g, p)
        torch.manual_seed(i)
        got = gm(x, g)
        if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
            bad.append(p)
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_traced_dropout_is_eager_bitwise_for_every_p_and_dtype(dtype):
    assert _mismatches(dtype) == []


def test_upstream_decomposition_differs_from_eager_in_bf16_and_fp32():
    """The negative side: without the patch the trace emits native_dropout, whose CPU backward
    scales by the unrounded 1 / (1 - p) (bf16) and whose fp32 scale is float(1 / (1 - p))."""
    with patches.disabled(PATCH):
        assert len(_mismatches(torch.bfloat16)) > len(P_GRID) // 2
        assert _mismatches(torch.float32), "fp32: some probabilities differ in the last bit"


def test_cpu_trace_draws_like_eager_and_restores_upstream():
    x = torch.randn(8)
    gm = _traced(x, x, 0.3)
    targets = {n.target for n in gm.graph.nodes}
    assert aten.native_dropout.default not in targets and aten.bernoulli_.float in targets  # eager's draw, in x's dtype
    assert aten.dropout.default.py_kernels[torch._C.DispatchKey.CompositeImplicitAutograd] is not eager_dropout
    with enable_python_dispatcher():  # restored: upstream's decomposition again
        gm = make_fx(lambda x, g: _step(x, g, 0.3))(x, x)
    assert aten.native_dropout.default in {n.target for n in gm.graph.nodes}


def test_the_fused_kernel_devices_keep_native_dropout():
    """ATen's is_fused_kernel_acceptable: CUDA (and XPU, lazy) with 0 < p < 1 run native_dropout
    in eager too, so the trace keeps it there."""
    cuda = types.SimpleNamespace(device=torch.device("cuda"), numel=lambda: 4)
    assert fused_kernel_acceptable(cuda, 0.1)
    assert not fused_kernel_acceptable(cuda, 0.0) and not fused_kernel_acceptable(cuda, 1.0)
    assert not fused_kernel_acceptable(torch.empty(4), 0.1)


@pytest.mark.parametrize("p, train", [(0.0, True), (0.5, False), (1.0, True)])
def test_edge_probabilities_match_eager(p, train):
    x = torch.randn(16, dtype=torch.bfloat16)
    with enable_python_dispatcher(), dropout_as_eager():
        gm = make_fx(lambda x: F.dropout(x, p, train))(x)
    torch.manual_seed(0)
    want = F.dropout(x, p, train)
    torch.manual_seed(0)
    assert torch.equal(gm(x), want)


# --- the planner's trace: an in-place dropout is one native_dropout (patch in_place_dropout) ---------


class InPlaceDropoutHead(nn.Module):
    """mobilenet's classifier in small: pooled features, ``nn.Dropout(inplace=True)``, a Linear;
    and a functional in-place dropout on the hidden activation (a Linear's output: nothing saves it)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5, inplace=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = F.dropout(self.mid(torch.relu(self.up(x))), 0.25, self.training, inplace=True)
        return self.head(self.drop(h.mean(1)))


def _planning_gm():
    model = InPlaceDropoutHead()
    with fake_world("dp=2") as mesh:
        return trace_planning_graph(model, mesh, [torch.randn(4, 8, 16), torch.randint(0, 4, (4,))],
                                    F.cross_entropy, block_container=None).gm


def test_planner_trace_keeps_an_in_place_dropout_one_native_dropout():
    """Both in-place dropouts trace as native_dropout (forward and backward), the op the planner
    places as a dropout and the oracle switches off: no random op is left for either to keep on."""
    gm = _planning_gm()
    targets = [n.target for n in random_nodes(gm)]
    assert targets == [aten.native_dropout.default] * 2
    assert sum(n.target is aten.native_dropout_backward.default for n in gm.graph.nodes) == 2
    assert not any(is_undroppable_random(t) for t in targets)
    off = random_nodes(graph_without_random_ops(gm))  # none refused, every draw switched off
    assert [n.args[1:] for n in off] == [(0.0, False)] * 2


def test_without_the_patch_an_in_place_dropout_is_a_random_op_no_switch_knows():
    """The negative side: ATen's dropout_ traces as its composite, whose bernoulli_ is no dropout
    to the planner or the oracle (it stayed on in the ranks' dropout-off program: 13c)."""
    with patches.disabled(PATCH_IN_PLACE):
        gm = _planning_gm()
    targets = [n.target for n in random_nodes(gm)]
    assert targets == [aten.bernoulli.p] * 2  # empty_like(x).bernoulli_(1 - p), functionalized
    assert all(is_undroppable_random(t) for t in targets)
    with pytest.raises(RandomOpError, match="is not a dropout"):
        graph_without_random_ops(gm)


def _in_place_step(x, g, p):
    x = x.detach().requires_grad_()
    h = x * 2  # dropout_ may not write into a leaf that requires grad
    y = F.dropout(h, p, True, inplace=True)
    (gx,) = torch.autograd.grad(y, x, g)
    return y, gx


def test_in_place_dropout_traces_as_the_out_of_place_one_and_restores_aten():
    """Under one seed the traced in-place dropout computes the out-of-place trace's bits (the same
    native_dropout draw, copied back), forward and backward; on exit aten.dropout_ has no kernel of ours."""
    x, g = torch.randn(64), torch.randn(64)
    with enable_python_dispatcher(), in_place_dropout_as_one_op():
        gm = make_fx(lambda x, g: _in_place_step(x, g, 0.3))(x, g)
    with enable_python_dispatcher():
        out_of_place = make_fx(lambda x, g: _step(x * 2, g, 0.3))(x, g)
    torch.manual_seed(0)
    got = gm(x, g)
    torch.manual_seed(0)
    y, gx = out_of_place(x, g)
    assert torch.equal(got[0], y) and torch.equal(got[1], 2 * gx)
    assert dropout_in_place not in aten.dropout_.default.py_kernels.values()
