"""Patch ``kernel_strides``: fake tensors take the CPU kernel's strides for mixed-layout operands.

The premise, the rule on single ops (hand-picked and drawn by hypothesis), the scope restored on
exit, and the guard: a gated decay of our own (a softplus gate with a per-head bias, read
transposed, as the gated delta rule of qwen3_5 / qwen3_next reads it), whose joint graph gives
gradients bitwise equal to eager autograd with the patch, and not without it (the bias gradient
sums the transposed softplus gradient in another order once the pin has made it contiguous).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autoparallel import patches
from autoparallel.kernel_strides import PATCH, kernel_strides, layout, strides_as_kernels
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.runtime.steps import joint_graph_executor

aten = torch.ops.aten


def _fake_strides(op, *args):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return op(*fake).stride()


def _mixed():
    g = torch.randn(2, 2, 8).transpose(1, 2)  # (2, 8, 2), strides (16, 1, 8)
    return g, torch.randn(2, 8, 2)


CASES = [
    (aten.softplus_backward.default, lambda g, x: (g, x, 1.0, 20.0)),
    (aten.softplus_backward.default, lambda g, x: (x, g, 1.0, 20.0)),
    (aten.hardswish_backward.default, lambda g, x: (g, x)),
]


@pytest.mark.parametrize("op, args", CASES)
def test_the_decomposition_alone_gives_other_strides_than_the_kernel(op, args):
    """The premise (if upstream fixes these decompositions, this fails and the patch can go)."""
    a = args(*_mixed())
    with patches.disabled(PATCH), strides_as_kernels():
        assert _fake_strides(op, *a) != op(*a).stride()


@pytest.mark.parametrize("op, args", CASES)
def test_fake_strides_of_mixed_layout_ops_are_the_kernel_strides(op, args):
    a = args(*_mixed())
    with strides_as_kernels():
        assert _fake_strides(op, *a) == op(*a).stride()


def test_the_scope_restores_every_decomposition_and_forgets_its_cached_outputs():
    from torch._decomp import decomposition_table

    before = dict(decomposition_table)
    with strides_as_kernels() as wrapped:
        assert wrapped > 0 and decomposition_table[aten.softplus_backward.default] is not before[aten.softplus_backward.default]
        _fake_strides(aten.softplus_backward.default, *CASES[0][1](*_mixed()))
    assert decomposition_table == before
    g, x = _mixed()  # outside: the decomposition's own layout again, not a cached kernel layout
    assert _fake_strides(aten.softplus_backward.default, g, x, 1.0, 20.0) != aten.softplus_backward.default(g, x, 1.0, 20.0).stride()


def test_kernel_strides_lay_out_the_real_sizes_in_the_probes_dimension_order():
    probe = torch.empty(2, 2, 2).permute(0, 2, 1)  # dims ordered 0, 2, 1 (outermost first)
    assert kernel_strides(torch.Size([3, 5, 7]), probe) == [35, 1, 5]


OPS = [
    lambda a, b: aten.mul.Tensor(a, b),
    lambda a, b: aten.softplus_backward.default(a, b, 1.0, 20.0),
    lambda a, b: aten.hardswish_backward.default(a, b),
    lambda a, b: aten.sigmoid_backward.default(a, b),
    lambda a, b: aten.threshold_backward.default(a, b, 0.0),
]


def _laid_out(shape, order, expand_dim):
    t = torch.randn([shape[i] for i in order]).permute([order.index(i) for i in range(len(shape))])
    if expand_dim is not None and shape[expand_dim] > 1:
        t = t.narrow(expand_dim, 0, 1).expand(shape)
    return t


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    data=st.data(),
    op=st.sampled_from(OPS),
)
def test_inside_the_scope_fake_and_real_layouts_agree(shape, data, op):
    n = len(shape)
    a = _laid_out(shape, data.draw(st.permutations(range(n))), data.draw(st.one_of(st.none(), st.integers(0, n - 1))))
    b = _laid_out(shape, data.draw(st.permutations(range(n))), None)
    with strides_as_kernels():
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(a), mode.from_tensor(b))
    real = op(a, b)
    assert layout(fake) == layout(real)


class GatedDecay(nn.Module):
    """A per-head decay ``softplus(a(x) + dt_bias)`` read transposed (heads before time)."""

    def __init__(self, d: int = 8, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.a = nn.Linear(d, heads)
        self.dt_bias = nn.Parameter(torch.rand(heads))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        g = F.softplus(self.a(x) + self.dt_bias).transpose(1, 2)  # [b, heads, t]
        v = self.proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        return (g.unsqueeze(-1) * v).sum(1)


def _mse(out, target):
    return F.mse_loss(out, target)


def _grads_equal_to_eager() -> dict[str, bool]:
    torch.manual_seed(0)
    model, plan = GatedDecay(), ParallelPlan.fsdp()
    batch = (torch.randn(2, 8, 8), torch.randn(2, 8, 2))
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        inputs = split_batch(batch, plan, mesh.spec, mesh.coordinate())
        with build_joint_graph(model, plan, mesh, batch, _mse) as joint:
            _, grads = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})(params, inputs)
    model.zero_grad()
    _mse(model(*batch[:-1]), batch[-1]).backward()
    want = dict(model.named_parameters())
    return {name: torch.equal(g, want[name].grad) for name, g in grads.items()}


def test_joint_graph_of_a_transposed_softplus_gate_is_eager_bitwise():
    assert all(_grads_equal_to_eager().values())


def test_without_the_patch_the_gate_bias_gradient_is_not_bitwise():
    with patches.disabled(PATCH):
        equal = _grads_equal_to_eager()
    assert not equal["dt_bias"]
