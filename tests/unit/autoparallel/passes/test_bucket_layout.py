"""A bucket's layout on hand-built graphs: two graphs that compute the same gradients (or gather the
same parameters) in other orders, as graphs traced per rank do, must lay their merged collective
out alike; a member without a role keeps graph order."""

from __future__ import annotations

import torch

from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER_OUT, REDUCE_SCATTER, wait_of
from autoparallel.mesh import fake_world
from autoparallel.passes.bucket_layout import PATCH, layout_keys, ordered_members
from autoparallel.passes.bucket_plan import plan_buckets
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    tag_collectives_for_bucketing,
)
from verify.graphs.bucket_members import bucket_members
from verify.graphs.generators import GraphBuilder, gradients_in_order, mesh_groups

aten = torch.ops.aten
H = 8


def _reduce_layout(gm):
    """What the merged reduce-scatter carries, piece by piece (the member check's reading)."""
    (rs,) = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
    return bucket_members(rs, "reduce_scatter")


def _bucketed(gm):
    tag_collectives_for_bucketing(gm)
    bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=64.0))
    gm.graph.lint()
    return gm


def test_graphs_computing_gradients_in_other_orders_lay_buckets_out_alike():
    with fake_world("dp=2") as mesh:
        first = _reduce_layout(_bucketed(gradients_in_order(mesh, [2, 1, 0])))
        second = _reduce_layout(_bucketed(gradients_in_order(mesh, [0, 2, 1])))
    assert first == second == ("grad:p0", "grad:p1", "grad:p2")


def test_with_the_patch_off_the_layout_follows_each_graphs_order():
    """The failure the patch guards: graph order, so the two ranks' buckets disagree."""
    with fake_world("dp=2") as mesh, patches.disabled(PATCH):
        first = _reduce_layout(_bucketed(gradients_in_order(mesh, [2, 1, 0])))
        second = _reduce_layout(_bucketed(gradients_in_order(mesh, [0, 2, 1])))
    assert first == ("grad:p2", "grad:p1", "grad:p0") and second == ("grad:p0", "grad:p2", "grad:p1")


def _gathers_in_order(mesh, order):
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (4, H), role="input:0")
    params = [b.param((2, H)) for _ in order]
    acc = x
    for i in order:
        w = b.all_gather(params[i], "dp")
        acc = b.call(aten.mm.default, b.call(aten.mm.default, acc, b.call(aten.t.default, w)), w)
    return b.output([b.call(aten.sum.default, acc)], ["loss"])


def _gather_layout(gm):
    (ag,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT]
    return bucket_members(ag, "all_gather")


def test_all_gathers_are_listed_by_the_parameter_they_read():
    with fake_world("dp=2") as mesh:
        first = _gather_layout(_bucketed(_gathers_in_order(mesh, [1, 2, 0])))
        second = _gather_layout(_bucketed(_gathers_in_order(mesh, [2, 0, 1])))
    assert first == second == ("param:p0", "param:p1", "param:p2")


def test_a_member_without_a_role_keeps_the_bucket_in_graph_order():
    """An activation all-reduce reaches no gradient output: nothing to order by, graph order kept."""
    with fake_world("dp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        x = b.placeholder("x", (4, H), role="input:0")
        r1 = b.all_reduce(b.call(aten.relu.default, x), "dp")
        r0 = b.all_reduce(b.call(aten.neg.default, x), "dp")
        gm = b.output([b.call(aten.sum.default, b.call(aten.add.Tensor, r1, r0))], ["loss"])
        colls = [wait.args[0] for wait in (r1, r0)]
        keys = layout_keys(gm.graph, colls)
    assert keys == dict.fromkeys(colls)
    assert ordered_members(colls, keys) == colls


def test_a_reduction_reaching_two_outputs_has_no_key():
    with fake_world("dp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        x = b.placeholder("x", (4, H), role="input:0")
        p = b.param((4, H))
        g = b.reduce_scatter(b.call(aten.cat.default, [p, p]), "dp")
        gm = b.output([b.call(aten.sum.default, x), g, b.call(aten.neg.default, g)], ["loss", "grad:p0", "grad:p1"])
        (rs,) = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
    assert layout_keys(gm.graph, [rs]) == {rs: None}
