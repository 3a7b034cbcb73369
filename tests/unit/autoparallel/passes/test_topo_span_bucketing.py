"""Topo-span-bounded FSDP bucketing on hand-built FX graphs (the eight behaviours of #481, plus
cycle safety across keys and bad input). The planner underneath has its own tests
(test_bucket_plan.py), and so has the scheduler run (test_overlap_scheduling.py).

The greedy and primary-group tests call upstream's module attributes inside
``topo_span_bucketing_installed``, so they test what Inductor's overlap scheduler would call.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.fx_passes.bucketing as bucketing_mod
import torch._inductor.fx_passes.fsdp as fsdp_mod
from torch import fx

from autoparallel.fx_utils import ALL_GATHER
from autoparallel.passes.overlap_scheduling import topo_span_bucketing_installed
from autoparallel.passes.topo_span_bucketing import (
    TopoSpanConfig,
    fsdp_all_gathers,
    greedy_bucket_collective_by_mb,
    identify_fsdp_groups,
)
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
MB = 1024 * 1024
H = 64  # hidden size of the hand-built graphs: an f32 [r, 64] shard gathers to r * gs * 256 B


def _ags(gm):
    return [n for n in gm.graph.nodes if n.target is ALL_GATHER]


def _group_key(n):
    return n.args[2]


def _call_greedy(gm, cap_mb):
    return bucketing_mod.greedy_bucket_collective_by_mb(
        gm, lambda _i: cap_mb, bucketing_mod.is_all_gather_into_tensor, bucketing_mod._ag_group_key
    )


# --- identify_fsdp_groups ---------------------------------------------------------------------


def test_identify_fsdp_groups_picks_primary_group(mesh, fsdp_graph):
    gm = fsdp_graph(["dp", "tp", "dp", "dp", "tp", "dp", "dp"])
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


def test_identify_fsdp_groups_ties_pick_one(mesh, fsdp_graph):
    gm = fsdp_graph(["tp", "dp", "dp", "tp"])
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


def test_greedy_bucket_merges_within_caps(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 4, ag_bytes=4096)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=1000)):
        buckets = _call_greedy(gm, 10)
    assert [len(b) for b in buckets] == [4]
    assert buckets.metrics.num_buckets == 1 and buckets.metrics.closed_by_bytes == 0


def test_greedy_bucket_splits_on_bytes_cap(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 6, ag_bytes=5 * MB)
    with topo_span_bucketing_installed():
        buckets = _call_greedy(gm, 10)
    assert len(buckets) >= 2
    assert all(len(b) == 2 for b in buckets), [len(b) for b in buckets]
    assert buckets.metrics.closed_by_bytes == 2 and buckets.metrics.closed_by_span == 0


def test_greedy_bucket_splits_on_span_cap(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 4, ag_bytes=4096, gap=50)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=80)):
        buckets = _call_greedy(gm, 10)
    assert len(buckets) >= 2, (
        "all-gathers ~57 topological positions apart with max_topo_span=80 must not all share "
        f"one bucket; got buckets of sizes {[len(b) for b in buckets]}"
    )
    assert all(len(b) <= 2 for b in buckets)
    m = buckets.metrics
    assert m.closed_by_span >= 1 and m.closed_by_bytes == 0 and m.max_observed_span <= 80


def test_greedy_bucket_span_cap_none_disables_span(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 4, ag_bytes=4096, gap=50)
    with topo_span_bucketing_installed(TopoSpanConfig(max_topo_span=None)):
        buckets = _call_greedy(gm, 10)
    assert [len(b) for b in buckets] == [4]
    assert buckets.metrics.max_observed_span > 80


def test_greedy_bucket_skips_descendant_collectives(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 3, ag_bytes=4096, chain=True)
    with topo_span_bucketing_installed():
        buckets = _call_greedy(gm, 10)
    ag = _ags(gm)
    for bucket in buckets:
        assert not (ag[0] in bucket and ag[1] in bucket), (
            "AG2 consumes wait(AG1): never co-bucketed"
        )
        assert not (ag[1] in bucket and ag[2] in bucket)


def test_greedy_bucket_merges_non_adjacent_same_key(mesh, fsdp_graph):
    """dp and tp all-gathers interleave (as FSDP and TP collectives do): upstream only buckets
    adjacent same-key collectives and finds nothing; grouping by key buckets both groups."""
    gm = fsdp_graph(["dp", "tp", "dp", "tp", "dp", "tp"], ag_bytes=4096)
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


def test_metrics_are_returned_and_logged(mesh, caplog, fsdp_graph):
    gm = fsdp_graph(["dp"] * 4, ag_bytes=4096, gap=50)
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


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_process_group_names_the_node(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 2)
    ag = _ags(gm)[1]
    ag.args = (ag.args[0], ag.args[1], "no_such_group")
    with pytest.raises(ValueError, match=rf"{ag.name}.*unknown process group 'no_such_group'"):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )


@pytest.mark.parametrize("cap", [0, -1.0])
def test_bucket_cap_must_be_positive(mesh, cap, fsdp_graph):
    gm = fsdp_graph(["dp"] * 2)
    with pytest.raises(
        ValueError, match=rf"bucket cap of bucket 0 must be a number of MB > 0, got {cap}"
    ):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: cap, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MB > 0"):
        TopoSpanConfig(bucket_cap_mb=cap)


def test_negative_span_is_rejected(mesh, fsdp_graph):
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -1"):
        TopoSpanConfig(max_topo_span=-1)
    gm = fsdp_graph(["dp"] * 2)
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -5"):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: 0, max_topo_span=-5
        )
    with pytest.raises(ValueError, match="max_compute_pre_fetch"):
        TopoSpanConfig(max_compute_pre_fetch=-1)


def test_missing_val_names_the_node(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 2)
    ag = _ags(gm)[0]
    del ag.meta["val"]
    with pytest.raises(ValueError, match=rf"node '{ag.name}'.*has no meta\['val'\]"):
        greedy_bucket_collective_by_mb(
            gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, lambda n: 0
        )


def test_identify_fsdp_groups_accepts_graphs(mesh, fsdp_graph):
    gm = fsdp_graph(["dp", "dp"])
    assert identify_fsdp_groups(gm.graph) == identify_fsdp_groups(gm)
    assert isinstance(gm.graph, fx.Graph)


# --- greedy candidates --------------------------------------------------------------------------


def test_greedy_accepts_a_plain_graph(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 3, ag_bytes=4096)
    buckets = greedy_bucket_collective_by_mb(
        gm.graph, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, _group_key
    )
    assert [list(b) for b in buckets] == [_ags(gm)]


def test_greedy_filter_wait_node_skips_only_that_collective(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 4, ag_bytes=4096)
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


def test_identify_fsdp_groups_counts_per_group(mesh, fsdp_graph):
    gm = fsdp_graph(["tp", "dp", "dp"])
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


def test_greedy_default_span_is_1500(mesh, fsdp_graph):
    gm = fsdp_graph(["dp"] * 2)
    buckets = greedy_bucket_collective_by_mb(
        gm, lambda _i: 10, bucketing_mod.is_all_gather_into_tensor, _group_key
    )
    assert buckets.metrics.max_topo_span == 1500 == TopoSpanConfig().max_topo_span
