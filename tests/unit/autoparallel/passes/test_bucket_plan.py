"""The bucket planner (autoparallel/passes/bucket_plan.py) on hand-built FX graphs: byte caps
per bucket index, the topological-span bound, dependent collectives kept apart (also through
buckets already contracted), visiting order, metrics, and bad input.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER
from autoparallel.passes import bucket_layout
from autoparallel.passes.bucket_plan import (
    BucketingMetrics,
    Buckets,
    check_cap_mb,
    plan_buckets,
    topological_order,
)
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
MB = 1024 * 1024
H = 64


def _ags(gm):
    return [n for n in gm.graph.nodes if n.target is ALL_GATHER]


def _group_key(n):
    return n.args[2]


def _cap(units, nbytes=4096):
    return units * nbytes / MB


def test_bucket_caps_are_asked_per_bucket_index(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 7, ag_bytes=4096)
    ags = _ags(gm)
    caps = {0: _cap(2), 1: _cap(3), 2: _cap(10)}
    asked = []

    def cap(idx):
        asked.append(idx)
        return caps[idx]

    buckets = plan_buckets(gm.graph, ags, _group_key, cap, None)
    assert [list(b) for b in buckets] == [ags[:2], ags[2:5], ags[5:]]
    assert asked == [0, 1, 2]  # each index asked once
    m = buckets.metrics
    assert (m.num_candidates, m.num_buckets, m.num_bucketed, m.closed_by_bytes) == (7, 3, 7, 2)


def test_bucket_records_name_members_bytes_cap_span_and_closure(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 7, ag_bytes=4096, gap=2)
    ags = _ags(gm)
    ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
    caps = {0: _cap(2), 1: _cap(10)}
    span_bound = ranks[ags[5]] - ranks[ags[2]]  # bucket 1 ends on span before ags[6]
    buckets = plan_buckets(gm.graph, ags, _group_key, caps.__getitem__, span_bound)
    recs = buckets.metrics.buckets
    assert [r.members for r in recs] == [tuple(n.name for n in b) for b in buckets]
    assert [len(r.members) for r in recs] == [2, 4]
    assert [r.closed_by for r in recs] == ["bytes", "span"]
    assert [r.cap_bytes for r in recs] == [2 * 4096, 10 * 4096]
    assert recs[0].member_bytes == (4096, 4096) and recs[1].nbytes == 4 * 4096
    assert recs[1].span == ranks[ags[5]] - ranks[ags[2]]
    assert {r.group for r in recs} == {ags[0].args[2]}
    tail = plan_buckets(gm.graph, ags[:3], _group_key, lambda _i: 10, None)
    assert [r.closed_by for r in tail.metrics.buckets] == ["end"]


def test_span_bound_is_inclusive_and_observed_span_is_exact(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 3, ag_bytes=4096, gap=3)
    ags = _ags(gm)
    ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
    d1, d2 = ranks[ags[1]] - ranks[ags[0]], ranks[ags[2]] - ranks[ags[0]]
    assert 0 < d1 < d2
    whole = plan_buckets(gm.graph, ags, _group_key, lambda _i: 10, d2)
    assert [list(b) for b in whole] == [ags]
    assert whole.metrics.max_observed_span == d2 and whole.metrics.closed_by_span == 0
    cut = plan_buckets(gm.graph, ags, _group_key, lambda _i: 10, d2 - 1)
    assert [list(b) for b in cut] == [ags[:2]]
    assert cut.metrics.max_observed_span == d1 and cut.metrics.closed_by_span == 1


def test_every_span_closure_is_counted(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 3, ag_bytes=4096, gap=3)
    buckets = plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, 0)
    assert list(buckets) == [] and buckets.metrics.closed_by_span == 2
    assert buckets.metrics.max_topo_span == 0 and buckets.metrics.num_buckets == 0


def test_every_dependent_skip_is_counted(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 3, ag_bytes=4096, chain=True)
    buckets = plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, None)
    assert list(buckets) == [] and buckets.metrics.skipped_dependent == 2


def test_a_skipped_dependent_does_not_end_the_scan(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    w0 = b.all_gather(b.param((1, H)), "dp")
    p1 = b.call(aten.add.Tensor, b.param((1, H)), b.call(aten.sum.dim_IntList, w0, [0], True))
    w1 = b.all_gather(p1, "dp")  # depends on the first
    w2 = b.all_gather(b.param((1, H)), "dp")
    w3 = b.all_gather(b.param((1, H)), "dp")
    outs = [b.call(aten.sum.default, w) for w in (w0, w1, w2, w3)]
    gm = b.output(outs, ["loss", "o1", "o2", "o3"])
    a0, a1, a2, a3 = _ags(gm)
    buckets = plan_buckets(gm.graph, [a0, a1, a2, a3], _group_key, lambda _i: 10, None)
    assert [list(x) for x in buckets] == [[a0, a2, a3]]
    assert buckets.metrics.skipped_dependent == 1


def test_candidates_are_visited_in_rank_order(mesh, fsdp_graph):
    """``ranks`` (a snapshot from before upstream's merges reordered the graph) decides the
    visiting order and the order of the returned buckets, not the graph's current list order;
    inside a bucket the members are listed by the parameter each reads (bucket_layout), and in
    visiting order with that patch off."""
    gm = fsdp_graph(["dp", "dp", "tp", "tp"], ag_bytes=4096)
    a0, a1, b0, b1 = _ags(gm)
    ranks = {b1: 0, b0: 1, a1: 2, a0: 3}
    buckets = plan_buckets(gm.graph, [a0, a1, b0, b1], _group_key, lambda _i: 10, None, ranks)
    assert [list(x) for x in buckets] == [[b0, b1], [a0, a1]]
    with patches.disabled(bucket_layout.PATCH):
        buckets = plan_buckets(gm.graph, [a0, a1, b0, b1], _group_key, lambda _i: 10, None, ranks)
    assert [list(x) for x in buckets] == [[b1, b0], [a1, a0]]


def test_buckets_are_ordered_by_their_first_member(mesh, fsdp_graph):
    gm = fsdp_graph(["dp", "tp", "tp", "dp"], ag_bytes=4096)
    a0, b1, b2, a3 = _ags(gm)
    buckets = plan_buckets(gm.graph, [a3, b2, b1, a0], _group_key, lambda _i: 10, None)
    assert [list(x) for x in buckets] == [[a0, a3], [b1, b2]]


def test_dependency_on_an_earlier_visited_descendant(mesh, fsdp_graph):
    """Visiting a descendant before its ancestor (ranks not in graph order): still dependent."""
    gm = fsdp_graph(["dp"] * 2, ag_bytes=4096, chain=True)
    a0, a1 = _ags(gm)
    buckets = plan_buckets(gm.graph, [a0, a1], _group_key, lambda _i: 10, None, {a1: 0, a0: 1})
    assert list(buckets) == [] and buckets.metrics.skipped_dependent == 1


def test_contraction_keeps_other_descendants(mesh):
    """y(tp) feeds a(dp) and w(tp); a and c(dp) merge. w still depends on y's open bucket."""
    b = GraphBuilder(mesh_groups(mesh))
    wy = b.all_gather(b.param((1, H)), "tp")
    ysum = b.call(aten.sum.dim_IntList, wy, [0], True)
    wa = b.all_gather(b.call(aten.add.Tensor, b.param((1, H)), ysum), "dp")
    wc = b.all_gather(b.param((1, H)), "dp")
    ww = b.all_gather(b.call(aten.mul.Tensor, b.param((1, H)), ysum), "tp")
    gm = b.output([b.call(aten.sum.default, w) for w in (wa, wc, ww)], ["loss", "o1", "o2"])
    y, a, c, w = _ags(gm)
    buckets = plan_buckets(gm.graph, [y, a, c, w], _group_key, lambda _i: 10, None)
    assert [list(x) for x in buckets] == [[a, c]]
    assert buckets.metrics.skipped_dependent == 1


def test_contraction_keeps_other_ancestors(mesh):
    """u(flat) and a(dp) feed x(tp); a+c(dp) merge, then x+v(tp) merge; t(flat) reads v.
    Through the merged x+v, t depends on u: they must not share a bucket."""
    b = GraphBuilder(mesh_groups(mesh))
    wu = b.all_gather(b.param((1, H)), "dp*tp")
    wa = b.all_gather(b.param((1, H)), "dp")
    wc = b.all_gather(b.param((1, H)), "dp")
    mix = b.call(
        aten.add.Tensor,
        b.call(aten.sum.dim_IntList, wa, [0], True),
        b.call(aten.sum.dim_IntList, wu, [0], True),
    )
    wx = b.all_gather(b.call(aten.add.Tensor, b.param((1, H)), mix), "tp")
    wv = b.all_gather(b.param((1, H)), "tp")
    vsum = b.call(aten.sum.dim_IntList, wv, [0], True)
    wt = b.all_gather(b.call(aten.add.Tensor, b.param((1, H)), vsum), "dp*tp")
    outs = [b.call(aten.sum.default, v) for v in (wc, wx, wt)]
    gm = b.output(outs, ["loss", "o1", "o2"])
    u, a, c, x, v, t = _ags(gm)
    buckets = plan_buckets(gm.graph, [u, a, c, x, v, t], _group_key, lambda _i: 10, None)
    assert [list(bk) for bk in buckets] == [[a, c], [x, v]]
    assert buckets.metrics.skipped_dependent == 1


@pytest.mark.parametrize("bad", [True, "3", 1.5, -1])
def test_plan_buckets_rejects_bad_spans(mesh, bad, fsdp_graph):
    gm = fsdp_graph(["dp"] * 2)
    with pytest.raises(
        ValueError, match=rf"max_topo_span must be None or an int >= 0, got {bad!r}"
    ):
        plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, bad)


def test_buckets_default_metrics():
    assert Buckets().metrics == BucketingMetrics() and list(Buckets()) == []
    m = BucketingMetrics(num_candidates=2)
    assert Buckets([[1, 2]], m).metrics is m


def test_topological_order_reports_a_cycle():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.relu.default, (x,), name="a")
    b = g.call_function(aten.add.Tensor, (a, a), name="b")
    c = g.call_function(aten.relu.default, (b,), name="c")
    b.args = (a, c)  # b <-> c
    prev = c
    for name in "defgh":
        prev = g.call_function(aten.relu.default, (prev,), name=name)
    with pytest.raises(
        ValueError,
        match=r"^the graph has a cycle \(nodes \['b', 'c', 'd', 'e', 'f'\] never become ready\)$",
    ):
        topological_order(g)


def test_check_cap_mb():
    assert check_cap_mb(2) == 2.0 and isinstance(check_cap_mb(2), float)
    assert check_cap_mb(0.25) == 0.25
    for bad in (True, "1", 0, -1):
        with pytest.raises(
            ValueError, match=rf"^bucket cap must be a number of MB > 0, got {bad!r}$"
        ):
            check_cap_mb(bad)


def _reads(b, wait, label):
    """A fresh parameter plus ``sum(wait)`` (the wait's value first), all-gathered on ``label``."""
    dep = b.call(aten.add.Tensor, b.call(aten.sum.dim_IntList, wait, [0], True), b.param((1, H)))
    return b.all_gather(dep, label)


def test_dependency_through_the_first_input_of_an_op(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    w0 = b.all_gather(b.param((1, H)), "dp")
    w1 = _reads(b, w0, "dp")  # add(sum(w0), p): the dependency is the add's first input
    gm = b.output([b.call(aten.sum.default, w) for w in (w0, w1)], ["loss", "o1"])
    buckets = plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, None)
    assert list(buckets) == [] and buckets.metrics.skipped_dependent == 1


def test_contraction_makes_group_ancestors_reach_its_descendants(mesh):
    """u(flat) feeds c(dp), a(dp) feeds x(tp), v(tp) feeds t(flat). After a+c and x+v merge,
    u reaches t (u -> c=a -> x=v -> t): u and t must not share a bucket."""
    b = GraphBuilder(mesh_groups(mesh))
    wu = b.all_gather(b.param((1, H)), "dp*tp")
    wa = b.all_gather(b.param((1, H)), "dp")
    wc = _reads(b, wu, "dp")
    wx = _reads(b, wa, "tp")
    wv = b.all_gather(b.param((1, H)), "tp")
    wt = _reads(b, wv, "dp*tp")
    gm = b.output([b.call(aten.sum.default, w) for w in (wc, wx, wt)], ["loss", "o1", "o2"])
    u, a, c, x, v, t = _ags(gm)
    buckets = plan_buckets(gm.graph, [u, a, c, x, v, t], _group_key, lambda _i: 10, None)
    assert [list(bk) for bk in buckets] == [[a, c], [x, v]]
    assert buckets.metrics.skipped_dependent == 1


def test_bucket_opened_by_a_bytes_closure_contracts_all_its_members(mesh):
    """u(flat) feeds k(dp); k1(dp) feeds t(flat). a0 (8 kB) fills dp bucket 0 alone, so k opens
    bucket 1 and k1 joins it; merged, k=k1 makes t depend on u."""
    b = GraphBuilder(mesh_groups(mesh))
    wu = b.all_gather(b.param((1, H)), "dp*tp")
    w0 = b.all_gather(b.param((8, H)), "dp")  # 8 kB; the others gather 1 kB (dp), 2 kB (flat)
    wk = _reads(b, wu, "dp")
    wk1 = b.all_gather(b.param((1, H)), "dp")
    wt = _reads(b, wk1, "dp*tp")
    gm = b.output([b.call(aten.sum.default, w) for w in (w0, wk, wt)], ["loss", "o1", "o2"])
    u, a0, k, k1, t = _ags(gm)
    caps = {0: 9000 / MB, 1: 1.0}  # bucket 0 of each key: u+t fit, a0+k do not
    buckets = plan_buckets(gm.graph, [u, a0, k, k1, t], _group_key, caps.__getitem__, None)
    assert [list(bk) for bk in buckets] == [[k, k1]]
    m = buckets.metrics
    assert (m.closed_by_bytes, m.skipped_dependent) == (1, 1)
