"""A random draw nobody reads survives the partitions (patch ``kept_random_draws``).

Hand-built joint graphs of dropout draws (``bernoulli.p`` on ``empty_like(x)``, as ATen's dropout
decomposes), some of them dead; the forward is extracted from the outputs as AOT's partitioners
do. Under one seed, the forward after :func:`restore_dropped_random_ops` computes bitwise what
the joint graph computes; without the patch, every draw after a dead one gets its predecessor's
numbers. Then a model of our own with a dead dropout, through every stage on gloo.
"""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn
from torch._functorch.partitioners import _extract_graph_with_inputs_outputs

from autoparallel import patches
from autoparallel import pipeline as P
from autoparallel.passes.kept_random_draws import PATCH, DroppedDrawError, read_dead_draws, restore_dropped_random_ops
from autoparallel.passes.random_order import random_ops
from verify.check import check_model
from verify.model_case import ModelCase
from verify.parity.runs import EAGER, compare_with_eager, run_stage_parity
from verify.stages.scenario import Scenario
from verify.zoo import mse_loss

aten = torch.ops.aten


def _joint(live: list[bool], shapes: list[int]) -> fx.GraphModule:
    """x -> for each draw: mask = bernoulli(empty_like(x[:, :n]), 0.5); a live one is added to the
    output, a dead one is read by nothing."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    out = None
    for i, (keep, n) in enumerate(zip(live, shapes, strict=True)):
        src = g.call_function(aten.slice.Tensor, (x, 1, 0, n))
        src.meta["val"] = torch.empty(4, n)
        e = g.call_function(aten.empty_like.default, (src,))
        e.meta["val"] = torch.empty(4, n)
        b = g.call_function(aten.bernoulli.p, (e, 0.5), name=f"draw{i}")
        b.meta["val"] = torch.empty(4, n)
        if keep:
            s = g.call_function(aten.sum.default, (b,))
            out = s if out is None else g.call_function(aten.add.Tensor, (out, s))
    g.output((out,))
    return fx.GraphModule(nn.Module(), g)


def _extract(joint: fx.GraphModule, inputs, outputs) -> fx.GraphModule:
    """The partitioners' extraction, as it runs inside AOT: under a tracing context, where FX's
    dead-code elimination drops a random op nobody reads (unless fallback_random is set)."""
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        return fx.GraphModule(joint, _extract_graph_with_inputs_outputs(joint.graph, inputs, outputs, outputs))


def _forward(joint: fx.GraphModule) -> fx.GraphModule:
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    return _extract(joint, placeholders, list(next(iter(joint.graph.find_nodes(op="output"))).args[0]))


def _run(gm: fx.GraphModule) -> torch.Tensor:
    torch.manual_seed(7)
    return gm(torch.randn(4, 8))[0]


def _empty_backward() -> fx.GraphModule:
    g = fx.Graph()
    g.output(())
    return fx.GraphModule(nn.Module(), g)


def test_a_dead_dropout_is_drawn_again_where_the_joint_graph_drew_it():
    joint = _joint([True, False, True], [8, 8, 8])
    fw = _forward(joint)
    assert [n.name for n in random_ops(fw.graph)] == ["draw0", "draw2"]  # the partition dropped draw1
    assert not torch.equal(_run(fw), _run(joint))                        # draw2 got draw1's numbers
    assert restore_dropped_random_ops(joint, fw, _empty_backward()) == ["draw1"]
    assert [n.target for n in random_ops(fw.graph)] == [aten.bernoulli.p] * 3
    assert torch.equal(_run(fw), _run(joint))


def test_with_the_patch_off_nothing_is_restored():
    joint = _joint([True, False, True], [8, 8, 8])
    fw = _forward(joint)
    with patches.disabled(PATCH):
        assert restore_dropped_random_ops(joint, fw, _empty_backward()) == []
    assert not torch.equal(_run(fw), _run(joint))


def test_a_dropped_draw_reads_no_dead_computation():
    """The dead draw's ``empty_like`` reads only a layout: no slice of x is copied for it."""
    joint = _joint([False, True], [3, 8])
    fw = _forward(joint)
    before = sum(n.target is aten.slice.Tensor for n in fw.graph.nodes)
    restore_dropped_random_ops(joint, fw, _empty_backward())
    assert sum(n.target is aten.slice.Tensor for n in fw.graph.nodes) == before
    assert any(n.target is aten.empty_strided.default for n in fw.graph.nodes)
    assert torch.equal(_run(fw), _run(joint))


def test_a_dropped_draw_on_a_value_the_forward_cannot_have_is_an_error():
    g = fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("tangent")
    g.call_function(aten.bernoulli.p, (g.call_function(aten.mul.Tensor, (t, 2)), 0.5), name="draw")
    g.output((g.call_function(aten.sum.default, (x,)),))
    joint = fx.GraphModule(nn.Module(), g)
    fw = _extract(joint, [x], [list(g.nodes)[-2]])
    with pytest.raises(DroppedDrawError, match="'tangent'"):
        restore_dropped_random_ops(joint, fw, _empty_backward())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8)), min_size=1, max_size=6).filter(lambda d: any(k for k, _ in d)))
def test_restored_forward_draws_as_the_joint_graph_does(draws):
    live, shapes = [k for k, _ in draws], [n for _, n in draws]
    joint = _joint(live, shapes)
    fw = _forward(joint)
    restore_dropped_random_ops(joint, fw, _empty_backward())
    assert len(random_ops(fw.graph)) == len(draws)
    assert torch.equal(_run(fw), _run(joint))


class DeadDropout(nn.Module):
    """One dropout's output is read by nothing (a stream the head skips); eager still draws it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.a(x))
        self.drop(self.b(x))
        return self.head(self.drop(torch.tanh(h)))


def _batch(n: int):
    return torch.randn(n, 16), torch.randn(n, 4)


@pytest.mark.xdist_group("kept-random-draws")
def test_a_model_with_a_dead_dropout_is_bitwise_after_the_partition():
    scenario = Scenario(case=ModelCase("dead_dropout", DeadDropout, mse_loss, _batch, batch_per_rank=2), plan="fsdp", mesh="dp=2")
    ranks = run_stage_parity(scenario, 1, executors=(EAGER, "first_partition", "second_compile"))
    for executor in ("first_partition", "second_compile"):
        compare_with_eager(ranks, executor).assert_bitwise()


def test_a_dead_draw_copied_into_the_backward_is_removed_and_a_live_one_kept():
    """With fallback_random set, the backward's extraction keeps a dead draw it can compute (its
    input saved): eager draws it once, in the forward."""
    g = fx.Graph()
    saved = g.placeholder("saved")
    dead = g.call_function(aten.bernoulli.p, (g.call_function(aten.empty_like.default, (saved,)), 0.5), name="draw0")
    live = g.call_function(aten.bernoulli.p, (saved, 0.5), name="draw1")
    g.output((g.call_function(aten.mul.Tensor, (saved, live)),))
    bw = fx.GraphModule(nn.Module(), g)
    joint = _joint([True], [8])
    fw = _forward(joint)
    restore_dropped_random_ops(joint, fw, bw)
    assert [n.name for n in random_ops(bw.graph)] == ["draw1"]
    assert dead not in bw.graph.nodes and not any(n.target is aten.empty_like.default for n in bw.graph.nodes)


def _dead_native_dropout() -> fx.GraphModule:
    """x -> native_dropout twice (plan="auto" keeps dropout one op): the first read, the second
    read by nothing (its getitems removed by dead-code elimination), and a dead bernoulli."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    pair = (torch.empty(4, 8), torch.empty(4, 8, dtype=torch.bool))
    live = g.call_function(aten.native_dropout.default, (x, 0.5, True), name="live")
    dead = g.call_function(aten.native_dropout.default, (x, 0.5, True), name="dead")
    single = g.call_function(aten.bernoulli.p, (x, 0.5), name="single")
    for n, v in ((live, pair), (dead, pair), (single, torch.empty(4, 8))):
        n.meta["val"] = v
    out = g.call_function(operator.getitem, (live, 0))
    g.output((out,))
    return fx.GraphModule(nn.Module(), g)


def test_a_dead_draw_with_two_outputs_is_read_for_the_partitioner_and_nothing_else_is():
    """Only the dead multi-output draw gets a getitem (output 0, its value): a live one has its
    getitems, a single-tensor one is a tensor to the partitioner already; the patch disabled, none."""
    joint = _dead_native_dropout()
    with patches.disabled(PATCH):
        assert read_dead_draws(joint) == []
    assert read_dead_draws(joint) == ["dead"]
    nodes = {n.name: n for n in joint.graph.nodes}
    (item,) = nodes["dead"].users
    assert item.target is operator.getitem and item.args == (nodes["dead"], 0) and not nodes["single"].users
    assert item.meta["val"].shape == (4, 8) and item.meta["val"].dtype == torch.float32
    assert read_dead_draws(joint) == []  # read now: nothing more to do
    joint.graph.lint()


def test_a_dead_dropout_under_auto_is_partitioned_and_drawn_in_order():
    """plan="auto" keeps dropout as native_dropout: the dead one reached AOT's default partitioner
    without users ("Expected native_dropout_1 to be a tensor", pegasus_x's class); now the forward
    draws every dropout the joint graph draws, in its order."""
    with torch.device("meta"):
        model = DeadDropout()
    run = P.run_pipeline(model, mse_loss, _batch(4), "auto", "dp=2,tp=2", P.PipelineOptions(), until="first_partition", trace=None)
    joint = run.stage(P.JOINT).graphs
    fw, bw = run.stage("first_partition").graphs
    def draws(g):  # (op, whether anything reads it) in drawing order; a restored node may be renamed
        return [(n.target, bool(n.users)) for n in random_ops(g.graph)]

    dropout = aten.native_dropout.default
    assert draws(joint) == [(dropout, True)] * 3  # the dead one's getitems are still there
    assert draws(fw) == [(dropout, True), (dropout, False), (dropout, True)] and not random_ops(bw.graph)


@pytest.mark.xdist_group("planned-parity")
def test_a_model_with_a_dead_dropout_under_auto_is_bitwise_and_within_the_oracle():
    case = ModelCase("dead_dropout", DeadDropout, mse_loss, _batch, batch_per_rank=2)
    result = check_model(case, plan="auto", mesh="dp=2,tp=2", steps=1)
    assert result.failures() == [] and result.parity and all(rep.bitwise for rep in result.parity.values())
