"""The joint trace records ops that have an ATen kernel as that kernel (patch ``eager_kernels``).

Bilinear interpolation's Python decomposition (gathers, products, index_put accumulation in the
backward) rounds otherwise than eager's ``upsample_bilinear2d`` kernels; the tests trace it as the
joint trace does and compare bits, on ``F.interpolate`` alone and on a small conv model of our own
that upsamples its feature map (as mobilevit does when its patch size does not divide it), and
through the second compile, whose re-trace must record the same ops (patch ``eager_kernels_retrace``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import patches
from autoparallel.eager_kernels import KEYS, PATCH, RETRACE_PATCH, decomposed_kernels, kernels_as_eager
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.pipeline import SECOND_COMPILE, PipelineOptions, run_pipeline
from autoparallel.runtime.steps import joint_graph_executor

aten = torch.ops.aten


def _step(x, g):
    x = x.detach().requires_grad_()
    y = F.interpolate(x, size=(6, 6), mode="bilinear", align_corners=False)
    (gx,) = torch.autograd.grad(y, x, g)
    return y, gx


def _traced_bits_equal() -> bool:
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 6, 6, generator=gen)
    with enable_python_dispatcher(), kernels_as_eager():
        gm = make_fx(_step)(x, g)
    return all(torch.equal(a, b) for a, b in zip(_step(x, g), gm(x, g), strict=True))


def test_traced_interpolate_is_eager_bitwise():
    assert _traced_bits_equal()


def test_upstream_decomposition_is_not_bitwise():
    """The negative side: without the patch the trace's gathers round otherwise than eager."""
    with patches.disabled(PATCH):
        assert not _traced_bits_equal()


def test_the_lifted_ops_are_restored_and_batch_norm_is_kept():
    ops = decomposed_kernels()
    names = {op.name() for op in ops}
    assert {"aten::upsample_bilinear2d", "aten::upsample_nearest2d"} <= names
    assert "aten::native_batch_norm" not in names
    before = {op: dict(op.py_kernels) for op in ops}
    with kernels_as_eager() as lifted:
        assert lifted and all(not set(op.py_kernels) & set(KEYS) for op in lifted)
    assert {op: dict(op.py_kernels) for op in ops} == before


class Upsampler(nn.Module):
    """A conv whose 3x3 feature map is upsampled to 4x4 before the head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        y = F.interpolate(self.conv(x), size=(4, 4), mode="bilinear", align_corners=False)
        return self.head(y.flatten(1))


def _mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("enabled", [True, False])
def test_joint_graph_of_an_upsampling_model_is_eager_bitwise(enabled):
    torch.manual_seed(0)
    model, plan = Upsampler(), ParallelPlan.fsdp()
    batch = (torch.randn(2, 2, 3, 3), torch.randn(2, 3))
    with patches.disabled(*([] if enabled else [PATCH])), fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        inputs = split_batch(batch, plan, mesh.spec, mesh.coordinate())
        with build_joint_graph(model, plan, mesh, batch, _mse) as joint:
            loss, grads = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})(params, inputs)
    _mse(model(*batch[:-1]), batch[-1]).backward()
    same = all(torch.equal(g, dict(model.named_parameters())[n].grad) for n, g in grads.items())
    assert same == enabled


@pytest.mark.parametrize("enabled", [True, False])
def test_second_compile_of_an_upsampling_model_is_eager_bitwise(enabled):
    """The second compile re-traces the first partition's graphs, which hold upsample_bilinear2d
    and its backward; without patch ``eager_kernels_retrace`` that re-trace runs the Python
    decomposition again (mobilevit: joint bitwise, second_compile NOT bitwise)."""
    torch.manual_seed(0)
    model, plan = Upsampler(), ParallelPlan.fsdp()
    batch = (torch.randn(2, 2, 3, 3), torch.randn(2, 3))
    options = PipelineOptions(keep_compiled=True, alternatives=False)
    with patches.disabled(*([] if enabled else [RETRACE_PATCH])):
        run = run_pipeline(model, _mse, batch, plan, "dp=1", options, until=SECOND_COMPILE)
    try:
        with fake_world("dp=1") as mesh:
            run.compiled(*split_batch(batch, plan, mesh.spec, mesh.coordinate())).backward()
    finally:
        torch._dynamo.reset()
    _mse(model(*batch[:-1]), batch[-1]).backward()
    compiled = dict(run.module.named_parameters())
    same = all(torch.equal(compiled[f"model.{n}"].grad, p.grad) for n, p in model.named_parameters())
    assert same == enabled
