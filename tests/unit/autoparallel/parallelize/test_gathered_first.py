"""Parameters some ranks read and others do not, gathered first on every rank with a zero gradient
(autoparallel/parallelize/gathered_first.py): FSDP2's ``set_reduce_scatter_unused_params``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph
from autoparallel.parallelize.gathered_first import ZeroGrads

EXPERT_1 = ("experts.1.weight", "experts.1.bias")


class SkippingMoE(nn.Module):
    """Runs only the experts some row reaches (switch_transformers' ``for expert_idx in
    expert_hit``); a row goes to expert 0 when its first feature is positive, else to expert 1."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        expert = (x[:, 0] <= 0).long()
        order = expert.argsort(stable=True)
        sizes = torch.stack([(expert == e).sum() for e in range(2)]).tolist()
        parts = x.index_select(0, order).split(sizes)
        out = torch.cat([e(p) if n else p for e, p, n in zip(self.experts, parts, sizes, strict=True)])
        return torch.empty_like(out).index_copy(0, order, out)


def _batch():
    """Both data-parallel slices of dp=2: slice 0 reaches expert 0 only, slice 1 both."""
    x = torch.randn(4, 4)
    x[:, 0] = torch.tensor([1.0, 2.0, 1.0, -1.0])
    return x, torch.randn(4, 4)


def _collectives(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_zero_grads_keeps_the_loss_and_gives_each_input_a_zero_gradient():
    loss, w = torch.tensor(1.5, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    out = ZeroGrads.apply(loss * 2, w)
    assert out.item() == 3.0
    out.backward()
    assert loss.grad.item() == 2.0 and torch.equal(w.grad, torch.zeros(3, 2))


@pytest.mark.parametrize("first", [(), EXPERT_1])
def test_rank_0_gathers_and_reduce_scatters_expert_1_only_when_gathered_first(first):
    """Rank 0's slice never reaches expert 1: without ``gather_first`` its graph neither gathers
    nor reduce-scatters expert 1 (rank 1's does: the ranks' collectives differ); with it, it does
    both, the gradient it reduces being zeros."""
    torch.manual_seed(0)
    with fake_world("dp=2", rank=0) as mesh, build_joint_graph(
            SkippingMoE(), ParallelPlan.fsdp(), mesh, _batch(), F.mse_loss, reads_per_rank=True, gather_first=first) as joint:
        gathers, scatters = _collectives(joint.gm, "all_gather"), _collectives(joint.gm, "reduce_scatter")
        without = set(joint.params_without_grad)
    assert (gathers, scatters) == ((2, 2) if not first else (4, 4))  # expert 0 (+ expert 1)
    assert without == (set(EXPERT_1) if not first else set())


def test_the_eager_program_gives_a_parameter_gathered_first_a_zero_gradient_and_keeps_the_loss():
    """Under DDP (its all-reduce leaves a value as it is on the fake world): the loss bitwise
    unchanged, expert 1's gradient zeros with ``gather_first``, None without."""
    torch.manual_seed(0)
    model, (x, y) = SkippingMoE(), _batch()
    x, y = x[:2], y[:2]  # expert 0 only
    with fake_world("dp=2") as mesh:
        plain = ParallelProgram(model, ParallelPlan.ddp(), mesh, F.mse_loss)
        first = ParallelProgram(model, ParallelPlan.ddp(), mesh, F.mse_loss, gather_first=EXPERT_1)
        a, b = plain(x, y), first(x, y)
        a.backward()
        b.backward()
    assert torch.equal(a, b)
    grads = {fqn: p.grad for fqn, p in first.local_parameters().items()}
    assert all(torch.equal(grads[f], torch.zeros_like(grads[f])) for f in EXPERT_1)
    assert all(p.grad is None for f, p in plain.local_parameters().items() if f in EXPERT_1)


def test_an_unknown_parameter_to_gather_first_is_named():
    with fake_world("dp=2") as mesh:
        program = ParallelProgram(SkippingMoE(), ParallelPlan.ddp(), mesh, F.mse_loss, gather_first=("experts.7.weight",))
        with pytest.raises(ValueError, match=r"gather_first: the model has no parameter 'experts.7.weight'"):
            program(*_batch())
