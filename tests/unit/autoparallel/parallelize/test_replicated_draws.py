"""Patch replicated_draws: a scalar random draw in forward is one draw for the whole batch, every
data-parallel rank taking rank 0's (autoparallel/parallelize/replicated_draws.py), and a layer drop
it decides is traced with the eager run's branch and guarded (value_guards)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.parallelize.replicated_draws import PATCH, ReplicatedDraws, first_slice_draws, is_scalar_draw
from autoparallel.passes.value_guards import ValueGuardError
from autoparallel.runtime.steps import joint_graph_executor
from autoparallel.validate import DataDependentError


@pytest.mark.parametrize("call, scalar", [
    (lambda: torch.rand([]), True), (lambda: torch.randn(()), True), (lambda: torch.randint(0, 9, ()), True),
    (lambda: torch.normal(0.0, 1.0, size=()), True), (lambda: torch.rand(3), False),
    (lambda: torch.rand(2, 1), False), (lambda: torch.zeros(()), False),
])
def test_a_scalar_draw_is_a_random_factory_with_a_0_dim_result(call, scalar):
    seen = []
    with ReplicatedDraws(lambda t: seen.append(t) or t):
        call()
    assert bool(seen) is scalar


def test_a_draw_from_a_tensor_is_not_a_scalar_draw():
    x = torch.ones(())
    assert not is_scalar_draw(torch.rand_like, (x,), {}, torch.rand_like(x))
    assert not is_scalar_draw(F.dropout, (x, 0.5), {}, x)


def test_the_generator_advances_as_in_eager_and_the_draw_is_shared():
    torch.manual_seed(0)
    eager = [torch.rand([]), torch.rand(2)]
    torch.manual_seed(0)
    with ReplicatedDraws(lambda t: t * 0 + 7):
        shared = [torch.rand([]), torch.rand(2)]
    assert shared[0].item() == 7 and torch.equal(shared[1], eager[1])  # the second draw is eager's


def test_every_rank_takes_the_first_ranks_scalar_draw():
    """The reference's slices, as the ranks: slice 1 draws its own (its generator advances) and
    takes slice 0's scalar; its other draws stay its own."""
    one_slice = first_slice_draws()
    got = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with one_slice():
            got.append((torch.rand([]), torch.rand(2)))
    torch.manual_seed(2)
    own = (torch.rand([]), torch.rand(2))
    assert torch.equal(got[1][0], got[0][0]) and not torch.equal(own[0], got[0][0])
    assert torch.equal(got[1][1], own[1])
    with pytest.raises(RuntimeError, match="draws more scalars"):
        with one_slice():
            torch.rand([]), torch.rand([])


class LayerDrop(nn.Module):
    """Skips its first layer on a draw (m2m_100's ``if dropout_probability < self.layerdrop``)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x, mask):
        drop = torch.rand([])
        if drop < self.p:
            x = self.first(x)
        return self.second(x)


LINE = LayerDrop.forward.__code__.co_firstlineno + next(
    i for i, line in enumerate(inspect.getsource(LayerDrop.forward).splitlines()) if "drop < self.p" in line)
BATCH = (torch.randn(2, 4), torch.ones(2, 4, dtype=torch.bool), torch.randn(2, 4))


def _step(model, trace_seed: int, run_seed: int):
    """Trace under ``trace_seed`` (the eager run's draw), run the joint graph under ``run_seed``."""
    plan = ParallelPlan.fsdp()
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, F.mse_loss)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        inputs = split_batch(BATCH, plan, mesh.spec, mesh.coordinate())
        torch.manual_seed(trace_seed)
        with build_joint_graph(model, plan, mesh, BATCH, F.mse_loss) as joint:
            run = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
            torch.manual_seed(run_seed)
            loss, grads = run(params, inputs)
    return joint, loss, grads


def _eager(model, seed):
    model.zero_grad()
    torch.manual_seed(seed)
    loss = F.mse_loss(model(*BATCH[:-1]), BATCH[-1])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_layer_drop_is_traced_with_the_eager_draw_and_bitwise():
    torch.manual_seed(0)
    model = LayerDrop()  # seed 0 draws 0.50 (kept at p=0.6 below), seed 1 draws 0.76 (dropped)
    for p, seed, kept in ((0.6, 0, True), (0.6, 1, False)):
        model.p = p
        joint, loss, grads = _step(model, seed, seed)
        want_loss, want = _eager(model, seed)
        assert torch.equal(loss, want_loss)
        assert all((g is None and want[n] is None) or torch.equal(g, want[n]) for n, g in grads.items())
        assert (grads["first.weight"] is not None) is kept  # a dropped layer has no gradient, as in eager
        (read,) = joint.specialised_reads
        assert read == (f"{__file__}:{LINE} (if drop < self.p:) (a random draw decides it: aten::rand at "
                        f"{__file__}:{LINE - 1} (drop = torch.rand([])), replicated over the data-parallel ranks): "
                        f"traced with {kept}")


def test_a_step_whose_draw_takes_the_other_branch_raises_naming_line_and_values():
    torch.manual_seed(0)
    model = LayerDrop(0.6)
    with pytest.raises(ValueGuardError, match=rf"test_replicated_draws.py:{LINE} \(if drop < self.p:\) \(a random draw "
                       r"decides it: .*: traced with True; this batch gives False"):
        _step(model, trace_seed=0, run_seed=1)


def test_without_the_patch_a_read_a_draw_decides_is_refused():
    torch.manual_seed(0)
    with patches.disabled(PATCH), pytest.raises(DataDependentError, match="a random draw decides"):
        _step(LayerDrop(0.6), 0, 0)
