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

from autoparallel import patches
from autoparallel.eager_dropout import PATCH, dropout_as_eager, eager_dropout, fused_kernel_acceptable

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
