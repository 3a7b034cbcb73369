"""build_joint_graph on what users bring: tied weights, buffers that the model updates, rowwise
biases, and parameters without a gradient (frozen, or the loss does not reach them), and
bad input that must be named (loss, dtypes, fake tensors).

Small hand-written models on a fake world of two ranks; each trace takes about a second.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from autoparallel import roles
from autoparallel.fx_utils import group_of
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, build_joint_graph
from autoparallel.parallelize.program import ParallelProgram
from autoparallel.partition import apply_placement

_c10d = torch.ops._c10d_functional
COLLECTIVES = {_c10d.all_gather_into_tensor.default: "all_gather", _c10d.reduce_scatter_tensor.default: "reduce_scatter",
               _c10d.all_reduce.default: "all_reduce"}


class TiedLM(nn.Module):
    """Embedding and output head share one weight (GPT-2's tying)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def mse(out, target):
    return ((out - target) ** 2).mean()


TOKENS = (torch.randint(0, 8, (2, 3)), torch.randint(0, 8, (2, 3)))
DENSE = (torch.randn(4, 4), torch.randn(4, 4))


def _collectives(jg) -> Counter:
    dims = jg.group_dims
    return Counter((COLLECTIVES[n.target], dims[group_of(n)]) for n in jg.gm.graph.nodes if n.target in COLLECTIVES)


@pytest.mark.parametrize("plan, collectives", [
    (ParallelPlan.fsdp(), {("all_gather", "dp"): 2, ("reduce_scatter", "dp"): 2}),
    (ParallelPlan.ddp(), {("all_reduce", "dp"): 2}),
])
def test_a_tied_weight_is_one_input_with_one_gradient_and_one_collective(plan, collectives):
    """It used to be two inputs (param:emb.weight, param:head.weight) with two gradients, and
    apply_placement silently made head.weight a separate, uninitialised tensor."""
    with fake_world("dp=2") as mesh, build_joint_graph(TiedLM(), plan, mesh, TOKENS, token_loss) as jg:
        assert roles.names_of(jg.input_roles, roles.PARAM) == ["emb.weight", "mix.weight", "mix.bias"]
        assert roles.names_of(jg.output_roles, roles.GRAD) == ["emb.weight", "mix.weight", "mix.bias"]
        # emb.weight gathered (or reduced) once, mix.weight and mix.bias once each: 3 per kind...
        expected = Counter({k: v + 1 for k, v in collectives.items()})
        assert _collectives(jg) == expected


def test_the_eager_program_holds_a_tied_weight_once():
    with fake_world("dp=2") as mesh:
        program = ParallelProgram(TiedLM(), ParallelPlan.fsdp(), mesh, token_loss)
        assert list(program.local_parameters()) == ["emb.weight", "mix.weight", "mix.bias"]
        assert program.model.head.weight is not None  # read through its holder


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_buffer_updates_are_labelled_outputs_and_the_loss_is_found_by_role():
    """AOT returns BatchNorm's running-stat updates before the loss; they were labelled by their
    descriptor class and the joint executor took running_mean for the loss."""
    with fake_world("dp=2") as mesh, build_joint_graph(BNNet(), ParallelPlan.fsdp(), mesh, DENSE, mse) as jg:
        assert jg.output_roles[:4] == [
            roles.mutated("bn.running_mean"), roles.mutated("bn.running_var"), roles.mutated("bn.num_batches_tracked"), roles.LOSS,
        ]
        assert jg.num_fwd_outputs == 4


class RegionNet(nn.Module):
    def __init__(self, scale_after: bool):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.scale_after = scale_after

    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))
        return out * 2 if self.scale_after else out


class Outer(nn.Module):
    def __init__(self, scale_after: bool):
        super().__init__()
        self.block = RegionNet(scale_after)

    def forward(self, x):
        return x + self.block(x)


TP_PLAN = ParallelPlan.fsdp_tp(tp_rules={"block.up.weight": "colwise", "block.down.weight": "rowwise"}, tp_regions=("block",))


def test_a_rowwise_bias_is_added_once_after_the_region_all_reduce():
    with fake_world("dp=1,tp=2") as mesh, build_joint_graph(Outer(False), TP_PLAN, mesh, DENSE, mse) as jg:
        assert jg.shardings["block.down.bias"].rowwise_bias_of == "block.down"
        fwd = [n for n in jg.gm.graph.nodes if n.target is _c10d.all_reduce.default][0]
        # the forward all-reduce's result (through its wait) feeds the add of the gathered bias
        wait = next(iter(fwd.users))
        assert any(u.target is torch.ops.aten.add.Tensor for u in wait.users)


def test_a_region_that_does_not_return_its_rowwise_linear_output_is_named():
    with fake_world("dp=1,tp=2") as mesh, pytest.raises(ValueError, match=r"TP region 'block' does not return the output of its rowwise Linear 'block.down'"):
        build_joint_graph(Outer(True), TP_PLAN, mesh, DENSE, mse).close()


@pytest.mark.parametrize("loss_fn, message", [
    (lambda out, t: (out - t) ** 2, r"must return a scalar \(0-dim\) tensor, got shape \(2, 4\)"),
    (lambda out, t: (mse(out, t), out), r"loss_fn returned a tuple of 2; it must return the loss alone"),
    (lambda out, t: (out - t).abs().sum().long(), r"floating-point scalar, got dtype torch.int64"),
])
def test_a_loss_that_is_not_a_floating_scalar_is_named(loss_fn, message):
    with fake_world("dp=2") as mesh, pytest.raises(ValueError, match=message):
        build_joint_graph(nn.Linear(4, 4), ParallelPlan.fsdp(), mesh, DENSE, loss_fn).close()


def test_float64_inputs_to_a_float32_model_are_named_and_float64_models_work():
    with fake_world("dp=2") as mesh:
        with pytest.raises(ValueError, match=r"example input 0 has dtype torch.float64 but the model computes in torch.float32"):
            build_joint_graph(nn.Linear(4, 4), ParallelPlan.fsdp(), mesh, tuple(t.double() for t in DENSE), mse).close()
        with build_joint_graph(nn.Linear(4, 4).double(), ParallelPlan.fsdp(), mesh, tuple(t.double() for t in DENSE), mse) as jg:
            assert jg.gm.graph.find_nodes(op="placeholder")[0].meta["val"].dtype == torch.float64


class Unused(nn.Module):
    """``pooled`` is computed and dropped (a pooler the LM loss skips); ``idle`` is never read."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.pooled = nn.Linear(4, 4)
        self.idle = nn.Linear(4, 4)

    def forward(self, x):
        self.pooled(x)
        return self.used(x)


class Frozen(nn.Module):
    """A frozen base (requires_grad=False) under a trainable head."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


UNUSED = ["pooled.weight", "pooled.bias", "idle.weight", "idle.bias"]


@pytest.mark.parametrize("plan, reduce", [(ParallelPlan.fsdp(), "reduce_scatter"), (ParallelPlan.ddp(), "all_reduce")])
def test_a_parameter_the_loss_does_not_reach_gets_no_gradient_and_no_collective(plan, reduce):
    """It used to be refused (and before that failed in the executor with a strict-zip error).
    Now it is what eager gives: its gradient output is None and nothing reduces it."""
    with fake_world("dp=2") as mesh, build_joint_graph(Unused(), plan, mesh, DENSE, mse) as jg:
        assert sorted(jg.params_without_grad) == sorted(UNUSED) and jg.frozen_params == ()
        grads = dict(zip(jg.output_roles, jg.gm.graph.output_node().args[0], strict=True))
        assert all(grads.get(roles.grad(f)) is None for f in UNUSED)
        assert all(grads[roles.grad(f)] is not None for f in ("used.weight", "used.bias"))
        assert _collectives(jg)[(reduce, "dp")] == 2  # used.weight, used.bias only


@pytest.mark.parametrize("plan, reduce", [(ParallelPlan.fsdp(), "reduce_scatter"), (ParallelPlan.ddp(), "all_reduce")])
def test_a_frozen_parameter_is_sharded_and_gets_no_gradient(plan, reduce):
    with fake_world("dp=2") as mesh, build_joint_graph(Frozen(), plan, mesh, DENSE, mse) as jg:
        assert jg.frozen_params == ("base.weight", "base.bias") and jg.params_without_grad == jg.frozen_params
        assert jg.shardings["base.weight"].local_shape == ((2, 4) if plan.fsdp_dim else (4, 4))
        counts = _collectives(jg)
        assert counts[(reduce, "dp")] == 2  # head.weight, head.bias only
        if plan.fsdp_dim:
            assert counts[("all_gather", "dp")] == 4  # the frozen base is gathered like the rest


def test_tensors_made_between_trace_and_placement_are_real_and_fake_shards_are_named():
    """The export's fake mode stayed entered until apply_placement: a tensor the caller made in
    between was silently fake, and apply_placement took fake shards for real ones."""
    with fake_world("dp=2") as mesh:
        jg = build_joint_graph(nn.Linear(4, 4), ParallelPlan.fsdp(), mesh, DENSE, mse)
        made = torch.randn(3)
        assert type(made) is torch.Tensor and made.abs().sum() > 0
        with jg.fake_mode:
            fake = torch.empty(2, 4)
        with pytest.raises(ValueError, match=r"local parameter 'weight' given to apply_placement is a FakeTensor"):
            apply_placement(jg, {"weight": fake})
