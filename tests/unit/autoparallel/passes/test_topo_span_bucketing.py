"""Topo-span-bounded FSDP bucketing on hand-built FX graphs (the eight behaviours of #481, plus
cycle safety across keys, the scoped installation, the CPU overlap scheduler and bad input).

The greedy and primary-group tests call upstream's module attributes inside
``topo_span_bucketing_installed``, so they test what Inductor's overlap scheduler would call.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch._inductor.fx_passes.bucketing as bucketing_mod
import torch._inductor.fx_passes.fsdp as fsdp_mod
from torch import fx

from autoparallel.fx_utils import ALL_GATHER, REDUCE_SCATTER
from autoparallel.mesh import fake_world
from autoparallel.passes.topo_span_bucketing import (
    TopoSpanConfig,
    fsdp_all_gathers,
    greedy_bucket_collective_by_mb,
    identify_fsdp_groups,
    plan_buckets,
    topo_span_bucketing_installed,
)
from verify.strategies import GraphBuilder, mesh_groups

aten = torch.ops.aten
MB = 1024 * 1024
H = 64  # hidden size of the hand-built graphs: an f32 [r, 64] shard gathers to r * gs * 256 B


@pytest.fixture
def mesh():
    with fake_world("dp=4,tp=2") as m:
        yield m


def _fsdp_graph(mesh, labels, *, ag_bytes=1024, gap=0, chain=False):
    """One parameter all-gather per label (in order), ``gap`` relu nodes before each, each
    gathered weight added into a running activation. ``chain``: each all-gather's input depends
    on the previous gathered weight (so each is a descendant of the previous one)."""
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (1, H), role="input:0")
    acc = x
    prev = None
    for label in labels:
        gs = b.group(label)[1]
        rows = ag_bytes // (4 * H * gs)
        assert rows * 4 * H * gs == ag_bytes, "pick ag_bytes divisible by 4*H*group size"
        for _ in range(gap):
            acc = b.call(aten.relu.default, acc)
        src = b.param((rows, H))
        if chain and prev is not None:
            src = b.call(aten.add.Tensor, src, b.call(aten.sum.dim_IntList, prev, [0], True))
        w = b.all_gather(src, label)
        prev = w
        acc = b.call(aten.add.Tensor, acc, b.call(aten.sum.dim_IntList, w, [0], True))
    return b.output([b.call(aten.sum.default, acc)], ["loss"])


def _ags(gm):
    return [n for n in gm.graph.nodes if n.target is ALL_GATHER]


def _call_greedy(gm, cap_mb):
    return bucketing_mod.greedy_bucket_collective_by_mb(
        gm, lambda _i: cap_mb, bucketing_mod.is_all_gather_into_tensor, bucketing_mod._ag_group_key
    )


# --- identify_fsdp_groups ---------------------------------------------------------------------


def test_identify_fsdp_groups_picks_primary_group(mesh):
    gm = _fsdp_graph(mesh, ["dp", "tp", "dp", "dp", "tp", "dp", "dp"])
    with topo_span_bucketing_installed():
        groups, size = fsdp_mod.identify_fsdp_groups(gm)
    assert list(groups) == [mesh.group_name("dp")], (
        "only the group with the most FSDP all-gathers (dp: 5 vs tp: 2) may be bucketed"
    )
    assert size == 4


def test_identify_fsdp_groups_handles_no_fsdp_ags(mesh):
    gm = GraphBuilder(mesh_groups(mesh))
    x = gm.placeholder("x", (2, 2), role="input:0")
    gm = gm.output([gm.call(aten.relu.default, x)], ["loss"])
    with topo_span_bucketing_installed():
        groups, size = fsdp_mod.identify_fsdp_groups(gm)
    assert list(groups) == [] and size is None


def test_identify_fsdp_groups_ties_pick_one(mesh):
    gm = _fsdp_graph(mesh, ["tp", "dp", "dp", "tp"])
    with topo_span_bucketing_installed():
        groups, size = fsdp_mod.identify_fsdp_groups(gm)
    assert len(groups) == 1, f"a tie must still pick exactly one group, got {list(groups)}"
    assert list(groups) == [mesh.group_name("tp")] and size == 2, "ties go to the group seen first"


def test_fsdp_all_gather_detection_matches_upstream(mesh):
    """The bitset detection agrees with upstream's per-node BFS (exactly one placeholder)."""
    b = GraphBuilder(mesh_groups(mesh))
    p, q = b.param((1, H)), b.param((1, H))
    both = b.all_gather(b.call(aten.add.Tensor, p, q), "dp")  # two placeholder ancestors
    one = b.all_gather(b.call(aten.relu.default, p), "dp")
    gm = b.output(
        [b.call(aten.sum.default, both), b.call(aten.sum.default, one)], ["loss", "output:1"]
    )
    ours = set(fsdp_all_gathers(gm.graph))
    theirs = {n for n in _ags(gm) if fsdp_mod.is_fsdp_all_gather(n)}
    assert ours == theirs and len(ours) == 1


# --- greedy_bucket_collective_by_mb -------------------------------------------------------------


def test_greedy_bucket_merges_within_caps(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 4, ag_bytes=4096)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=1000)):
        buckets = _call_greedy(gm, 10)
    assert [len(b) for b in buckets] == [4]
    assert buckets.metrics.num_buckets == 1 and buckets.metrics.closed_by_bytes == 0


def test_greedy_bucket_splits_on_bytes_cap(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 6, ag_bytes=5 * MB)
    with topo_span_bucketing_installed():
        buckets = _call_greedy(gm, 10)
    assert len(buckets) >= 2
    assert all(len(b) == 2 for b in buckets), [len(b) for b in buckets]
    assert buckets.metrics.closed_by_bytes == 2 and buckets.metrics.closed_by_span == 0


def test_greedy_bucket_splits_on_span_cap(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 4, ag_bytes=4096, gap=50)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=80)):
        buckets = _call_greedy(gm, 10)
    assert len(buckets) >= 2, (
        "all-gathers ~57 topological positions apart with max_topo_span=80 must not all share "
        f"one bucket; got buckets of sizes {[len(b) for b in buckets]}"
    )
    assert all(len(b) <= 2 for b in buckets)
    m = buckets.metrics
    assert m.closed_by_span >= 1 and m.closed_by_bytes == 0 and m.max_observed_span <= 80


def test_greedy_bucket_span_cap_none_disables_span(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 4, ag_bytes=4096, gap=50)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=None)):
        buckets = _call_greedy(gm, 10)
    assert [len(b) for b in buckets] == [4]
    assert buckets.metrics.max_observed_span > 80


def test_greedy_bucket_skips_descendant_collectives(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 3, ag_bytes=4096, chain=True)
    with topo_span_bucketing_installed():
        buckets = _call_greedy(gm, 10)
    ag = _ags(gm)
    for bucket in buckets:
        assert not (ag[0] in bucket and ag[1] in bucket), (
            "AG2 consumes wait(AG1): never co-bucketed"
        )
        assert not (ag[1] in bucket and ag[2] in bucket)


def test_greedy_bucket_merges_non_adjacent_same_key(mesh):
    """dp and tp all-gathers interleave (as FSDP and TP collectives do): upstream only buckets
    adjacent same-key collectives and finds nothing; grouping by key buckets both groups."""
    gm = _fsdp_graph(mesh, ["dp", "tp", "dp", "tp", "dp", "tp"], ag_bytes=4096)
    with topo_span_bucketing_installed():
        buckets = _call_greedy(gm, 10)
    assert sorted(len(b) for b in buckets) == [3, 3]
    for bucket in buckets:
        assert len({n.args[2] for n in bucket}) == 1


def test_buckets_never_close_a_cycle_across_keys(mesh):
    """a(dp) b(tp) c(dp, reads wait(b)) d(tp, reads wait(a)): {a,c} and {b,d} are each
    dependency-free, but merging both closes a cycle. Only one of them may be formed."""
    b = GraphBuilder(mesh_groups(mesh))
    pa, pb = b.param((1, H)), b.param((1, H))
    wa = b.all_gather(pa, "dp")
    wb = b.all_gather(pb, "tp")
    pc = b.call(aten.add.Tensor, b.param((2, H)), b.call(aten.sum.dim_IntList, wb, [0], True))
    wc = b.all_gather(pc, "dp")
    pd = b.call(aten.add.Tensor, b.param((4, H)), b.call(aten.sum.dim_IntList, wa, [0], True))
    wd = b.all_gather(pd, "tp")
    gm = b.output(
        [b.call(aten.sum.default, w) for w in (wa, wb, wc, wd)], ["loss", "o1", "o2", "o3"]
    )
    a, bb, c, d = _ags(gm)
    buckets = greedy_bucket_collective_by_mb(
        gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: n.args[2]
    )
    assert [set(x) for x in buckets] == [{a, c}]
    assert buckets.metrics.skipped_dependent == 1
    bucketing_mod.merge_all_gather(gm, list(buckets))
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(gm.graph)
    gm.graph.lint()


def test_metrics_are_returned_and_logged(mesh, caplog):
    gm = _fsdp_graph(mesh, ["dp"] * 4, ag_bytes=4096, gap=50)
    with caplog.at_level(logging.INFO, logger="autoparallel.passes.topo_span_bucketing"):
        with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=80)) as inst:
            buckets = _call_greedy(gm, 10)
    assert inst.calls == [buckets.metrics]
    m = buckets.metrics
    assert (m.num_candidates, m.num_buckets, m.max_topo_span) == (4, len(buckets), 80)
    text = caplog.text
    assert (
        f"{m.num_buckets} buckets" in text
        and "max_span=" in text
        and "closed (bytes=0, span=" in text
    )


# --- scoped installation ------------------------------------------------------------------------


def test_installation_is_scoped_and_restored_on_error(mesh):
    up_identify = fsdp_mod.identify_fsdp_groups
    up_greedy = bucketing_mod.greedy_bucket_collective_by_mb
    with pytest.raises(RuntimeError, match="boom"):
        with topo_span_bucketing_installed() as inst:
            assert inst.patches == ("primary_fsdp_group", "topo_span_bucketing")
            assert fsdp_mod.identify_fsdp_groups is not up_identify
            assert bucketing_mod.greedy_bucket_collective_by_mb is not up_greedy
            raise RuntimeError("boom")
    assert fsdp_mod.identify_fsdp_groups is up_identify
    assert bucketing_mod.greedy_bucket_collective_by_mb is up_greedy


def test_importing_the_pass_patches_nothing():
    import importlib

    import autoparallel.passes.topo_span_bucketing as mod

    up = (fsdp_mod.identify_fsdp_groups, bucketing_mod.greedy_bucket_collective_by_mb)
    importlib.reload(mod)
    assert (fsdp_mod.identify_fsdp_groups, bucketing_mod.greedy_bucket_collective_by_mb) == up
    assert up[0].__module__ == "torch._inductor.fx_passes.fsdp"


def test_overlap_scheduler_runs_on_cpu_through_topo_span_bucketing(mesh, caplog):
    import torch._inductor.fx_passes.overlap_scheduling as sched

    from autoparallel.passes.overlap_estimator import schedule_overlap_on_cpu

    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (8, H), role="input:0")
    acc = x
    grads = []
    for _ in range(4):
        w = b.all_gather(b.param((16, H)), "dp")  # [64, 64]
        acc = b.call(aten.mm.default, b.call(aten.mm.default, acc, b.call(aten.t.default, w)), w)
        grads.append(
            b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp")
        )
    gm = b.output(
        [b.call(aten.sum.default, acc), *grads], ["loss"] + [f"grad:g{i}" for i in range(4)]
    )
    estimate = sched.estimate_roofline_runtime_ms
    with caplog.at_level(logging.INFO, logger="autoparallel.passes"):
        res = schedule_overlap_on_cpu(gm, TopoSpanConfig(bucket_cap_mb=1.0))
    assert sched.estimate_roofline_runtime_ms is estimate
    assert "triton" not in sys.modules
    assert res.primary_groups == [([mesh.group_name("dp")], 4)]
    assert res.bucketing_calls and res.bucketing_calls[0].num_buckets == 1  # the 4 all-gathers
    kinds = [n.target for n in res.gm.graph.nodes if n.op == "call_function"]
    assert kinds.count(ALL_GATHER) == 0 and kinds.count(REDUCE_SCATTER) == 1
    assert "max_consec_compute_between_rs=" in caplog.text


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_process_group_names_the_node(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    ag = _ags(gm)[1]
    ag.args = (ag.args[0], ag.args[1], "no_such_group")
    with pytest.raises(ValueError, match=rf"{ag.name}.*unknown process group 'no_such_group'"):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )


@pytest.mark.parametrize("cap", [0, -1.0])
def test_bucket_cap_must_be_positive(mesh, cap):
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    with pytest.raises(
        ValueError, match=rf"bucket cap of bucket 0 must be a number of MB > 0, got {cap}"
    ):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: cap, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MB > 0"):
        TopoSpanConfig(bucket_cap_mb=cap)


def test_negative_span_is_rejected(mesh):
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -1"):
        TopoSpanConfig(max_topo_span=-1)
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -5"):
        plan_buckets(gm.graph, _ags(gm), lambda n: 0, lambda _i: 10, -5)
    with pytest.raises(ValueError, match="max_compute_pre_fetch"):
        TopoSpanConfig(max_compute_pre_fetch=-1)


def test_missing_val_names_the_node(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    ag = _ags(gm)[0]
    del ag.meta["val"]
    with pytest.raises(ValueError, match=rf"node '{ag.name}'.*has no meta\['val'\]"):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )


def test_identify_fsdp_groups_accepts_graphs(mesh):
    gm = _fsdp_graph(mesh, ["dp", "dp"])
    assert identify_fsdp_groups(gm.graph) == identify_fsdp_groups(gm)
    assert isinstance(gm.graph, fx.Graph)


# --- plan_buckets in detail ---------------------------------------------------------------------


def _group_key(n):
    return n.args[2]


def _cap(units, nbytes=4096):
    return units * nbytes / MB


def test_bucket_caps_are_asked_per_bucket_index(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 7, ag_bytes=4096)
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


def test_bucket_records_name_members_bytes_cap_span_and_closure(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 7, ag_bytes=4096, gap=2)
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


def test_span_bound_is_inclusive_and_observed_span_is_exact(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 3, ag_bytes=4096, gap=3)
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


def test_every_span_closure_is_counted(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 3, ag_bytes=4096, gap=3)
    buckets = plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, 0)
    assert list(buckets) == [] and buckets.metrics.closed_by_span == 2
    assert buckets.metrics.max_topo_span == 0 and buckets.metrics.num_buckets == 0


def test_every_dependent_skip_is_counted(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 3, ag_bytes=4096, chain=True)
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


def test_candidates_are_visited_in_rank_order(mesh):
    """``ranks`` (a snapshot from before upstream's merges reordered the graph) decides the
    visiting order and the order of the returned buckets, not the graph's current list order."""
    gm = _fsdp_graph(mesh, ["dp", "dp", "tp", "tp"], ag_bytes=4096)
    a0, a1, b0, b1 = _ags(gm)
    ranks = {b1: 0, b0: 1, a1: 2, a0: 3}
    buckets = plan_buckets(gm.graph, [a0, a1, b0, b1], _group_key, lambda _i: 10, None, ranks)
    assert [list(x) for x in buckets] == [[b1, b0], [a1, a0]]


def test_buckets_are_ordered_by_their_first_member(mesh):
    gm = _fsdp_graph(mesh, ["dp", "tp", "tp", "dp"], ag_bytes=4096)
    a0, b1, b2, a3 = _ags(gm)
    buckets = plan_buckets(gm.graph, [a3, b2, b1, a0], _group_key, lambda _i: 10, None)
    assert [list(x) for x in buckets] == [[a0, a3], [b1, b2]]


def test_dependency_on_an_earlier_visited_descendant(mesh):
    """Visiting a descendant before its ancestor (ranks not in graph order): still dependent."""
    gm = _fsdp_graph(mesh, ["dp"] * 2, ag_bytes=4096, chain=True)
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
def test_plan_buckets_rejects_bad_spans(mesh, bad):
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    with pytest.raises(
        ValueError, match=rf"max_topo_span must be None or an int >= 0, got {bad!r}"
    ):
        plan_buckets(gm.graph, _ags(gm), _group_key, lambda _i: 10, bad)


def test_buckets_default_metrics():
    from autoparallel.passes.topo_span_bucketing import BucketingMetrics, Buckets

    assert Buckets().metrics == BucketingMetrics() and list(Buckets()) == []
    m = BucketingMetrics(num_candidates=2)
    assert Buckets([[1, 2]], m).metrics is m


# --- greedy candidates --------------------------------------------------------------------------


def test_greedy_accepts_a_plain_graph(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 3, ag_bytes=4096)
    buckets = greedy_bucket_collective_by_mb(
        gm.graph, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, _group_key
    )
    assert [list(b) for b in buckets] == [_ags(gm)]


def test_greedy_filter_wait_node_skips_only_that_collective(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 4, ag_bytes=4096)
    ags = _ags(gm)
    first_wait = next(iter(ags[0].users))
    buckets = greedy_bucket_collective_by_mb(
        gm,
        lambda _i: 10,
        bucketing_mod.is_all_gather_into_tensor,
        _group_key,
        lambda w: w is not first_wait,
    )
    assert [list(b) for b in buckets] == [ags[1:]]
    assert buckets.metrics.num_candidates == 3


def test_greedy_needs_a_wait_user(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    name, size = b.group("dp")
    raw = [b.call(ALL_GATHER, b.param((1, H)), size, name) for _ in range(2)]  # no wait
    gm = b.output([b.call(aten.relu.default, r) for r in raw], ["loss", "o1"])
    buckets = greedy_bucket_collective_by_mb(
        gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, _group_key
    )
    assert list(buckets) == [] and buckets.metrics.num_candidates == 0


# --- group sizes, primary group, config ---------------------------------------------------------


def test_group_size_of(mesh):
    from autoparallel.fx_utils import ALL_REDUCE
    from autoparallel.passes.topo_span_bucketing import group_size_of

    b = GraphBuilder(mesh_groups(mesh))
    ag = b.all_gather(b.param((1, H)), "dp").args[0]
    assert group_size_of(ag) == 4
    ag.args = (ag.args[0], 1, ag.args[2])  # the argument wins over the world's size
    assert group_size_of(ag) == 1
    ag.args, ag.kwargs = (ag.args[0],), {"group_size": 3, "group_name": ag.args[2]}
    assert group_size_of(ag) == 3
    ar = b.all_reduce(b.param((1, H)), "tp").args[0]
    assert ar.target is ALL_REDUCE and group_size_of(ar) == 2  # no argument: the world's
    relu = b.call(aten.relu.default, b.param((1, H)))
    with pytest.raises(ValueError, match="node 'relu_default' is not a _c10d_functional"):
        group_size_of(relu)


def test_identify_fsdp_groups_counts_per_group(mesh):
    gm = _fsdp_graph(mesh, ["tp", "dp", "dp"])
    groups, size = identify_fsdp_groups(gm)
    assert list(groups) == [mesh.group_name("dp")] and size == 4


def test_fsdp_all_gather_of_a_later_parameter(mesh):
    """Bits of placeholders other than the first: one parameter through a relu is still FSDP."""
    b = GraphBuilder(mesh_groups(mesh))
    b.placeholder("x", (1, H), role="input:0")
    p = b.param((1, H))
    w = b.all_gather(b.call(aten.relu.default, p), "dp")
    gm = b.output([b.call(aten.sum.default, w)], ["loss"])
    assert fsdp_all_gathers(gm.graph) == _ags(gm)


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
    from autoparallel.passes.topo_span_bucketing import topological_order

    with pytest.raises(
        ValueError,
        match=r"^the graph has a cycle \(nodes \['b', 'c', 'd', 'e', 'f'\] never become ready\)$",
    ):
        topological_order(g)


@pytest.mark.parametrize("field", ["max_topo_span", "max_compute_pre_fetch"])
def test_topo_span_config_bounds(field):
    assert getattr(TopoSpanConfig(**{field: 0}), field) == 0
    assert getattr(TopoSpanConfig(**{field: 7}), field) == 7
    what = {
        "max_topo_span": "max_topo_span must be None or an int >= 0",
        "max_compute_pre_fetch": "max_compute_pre_fetch must be an int >= 0",
    }[field]
    for bad in (True, "3", 2.0, -1):
        with pytest.raises(ValueError, match=rf"^{what}, got {bad!r}$"):
            TopoSpanConfig(**{field: bad})


def test_check_cap_mb():
    from autoparallel.passes.topo_span_bucketing import check_cap_mb

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


def test_greedy_default_span_is_1500(mesh):
    gm = _fsdp_graph(mesh, ["dp"] * 2)
    buckets = greedy_bucket_collective_by_mb(
        gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, _group_key
    )
    assert buckets.metrics.max_topo_span == 1500 == TopoSpanConfig().max_topo_span


def test_group_size_of_a_python_function_node():
    import operator

    from autoparallel.passes.topo_span_bucketing import group_size_of

    g = fx.Graph()
    x = g.placeholder("x")
    with pytest.raises(ValueError, match="node 'add' is not a _c10d_functional collective"):
        group_size_of(g.call_function(operator.add, (x, x)))
