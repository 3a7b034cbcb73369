"""The composed collective passes (autoparallel/passes/collective.py) on hand-built FX graphs:
which passes run for which config, the per-graph metrics they return, and bad input.

The forward graph has two parameter all-gathers on ``dp`` and one ``dp -> tp`` chain (fusable);
the backward graph has two gradient reduce-scatters on ``dp`` and one gradient all-reduce on
``tp``. Counts below are worked out by hand from that shape.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import fx

from autoparallel import meta as M
from autoparallel.fx_utils import ALL_GATHER, ALL_GATHER_OUT, group_of
from autoparallel.passes import collective
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.collective import (
    CollectivePassesConfig,
    GraphPassMetrics,
    PipelineMetrics,
    bucket_fw_bw,
    bucket_joint,
    tag_joint,
)
from autoparallel.passes.overlap_estimator import RooflineConfig
from autoparallel.passes.overlap_scheduling import OverlapResult
from autoparallel.passes.pre_overlap_bucketing import (
    TAG_FSDP_AG,
    TAG_GRAD_AR,
    TAG_GRAD_RS,
    PreOverlapConfig,
    PreOverlapResult,
)
from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 8
ZERO = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


MESH = "dp=2,tp=2"  # the mesh fixture's world (tests/conftest.py)


def _fw(mesh) -> fx.GraphModule:
    """p0, p1 -> all_gather(dp); p2 -> all_gather(dp) -> all_gather(tp) (a fusable chain)."""
    b = GraphBuilder(mesh_groups(mesh))
    w0 = b.all_gather(b.param((3, H)), "dp")  # [6, H]
    w1 = b.all_gather(b.param((3, H)), "dp")
    w2 = b.all_gather(b.all_gather(b.param((3, H)), "dp"), "tp")  # [12, H]
    return b.output([w0, w1, w2], ["output:0", "output:1", "output:2"])


def _bw(mesh) -> fx.GraphModule:
    """Two gradient reduce-scatters on dp and one gradient all-reduce on tp."""
    b = GraphBuilder(mesh_groups(mesh))
    a = b.placeholder("a", (4, H), role="input:0")

    def grad():
        return b.call(aten.mm.default, b.call(aten.t.default, a), a)  # [H, H]

    g0 = b.reduce_scatter(grad(), "dp")
    g1 = b.reduce_scatter(grad(), "dp")
    g2 = b.all_reduce(grad(), "tp")
    return b.output([g0, g1, g2], ["grad:p0", "grad:p1", "grad:p2"])


def _tagged(mesh):
    fw, bw = _fw(mesh), _bw(mesh)
    tag_joint(fw)
    tag_joint(bw)
    return fw, bw


def _ag_groups(gm):
    """Process groups of the all-gathers (a merged bucket is an ``_out`` all-gather)."""
    return sorted(group_of(n) for n in gm.graph.nodes if n.target in (ALL_GATHER, ALL_GATHER_OUT))


# --- tag_joint --------------------------------------------------------------------------------


def test_tag_joint_tags_param_all_gathers_and_gradient_collectives(mesh):
    fw, bw = _fw(mesh), _bw(mesh)
    c = tag_joint(fw)
    # both all-gathers of the chain read only parameter-derived values
    assert c.tagged == {TAG_FSDP_AG: 4, TAG_GRAD_RS: 0, TAG_GRAD_AR: 0}
    assert (c.untagged, c.total) == (0, 4)
    assert [M.bucket_tag(n) for n in fw.graph.nodes if n.target is ALL_GATHER] == [TAG_FSDP_AG] * 4
    c = tag_joint(bw)
    assert c.tagged == {TAG_FSDP_AG: 0, TAG_GRAD_RS: 2, TAG_GRAD_AR: 1}
    assert (c.untagged, c.total) == (0, 3)


def test_tag_joint_needs_output_roles(mesh):
    fw = _fw(mesh)
    del fw.graph.output_node().meta[M.ROLE]
    with pytest.raises(ValueError, match=r"output node 'output' has no meta\['ap_role'\]"):
        tag_joint(fw)


# --- bucket_fw_bw -----------------------------------------------------------------------------


def test_default_config_runs_fusion_then_bucketing(mesh):
    fw, bw = _tagged(mesh)
    fw2, bw2, metrics = bucket_fw_bw(fw, bw)
    assert isinstance(metrics, PipelineMetrics) and list(metrics.graphs) == ["fw", "bw"]
    # without the overlap scheduler the passes work in place
    assert fw2 is fw and bw2 is bw
    f, b = metrics.graphs["fw"], metrics.graphs["bw"]
    assert f.before == {**ZERO, "all_gather": 4}
    # chain fused (dp + tp -> dp*tp), then the two dp all-gathers merged into one bucket
    assert f.after == {**ZERO, "all_gather": 2}
    assert f.fused_chains == 1 and b.fused_chains == 0
    assert _ag_groups(fw) == sorted([mesh.group_name("dp"), mesh.group_name("dp*tp")])
    assert fw.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)  # the merged bucket
    assert b.before == {"all_gather": 0, "reduce_scatter": 2, "all_reduce": 1}
    assert b.after == {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 1}
    assert isinstance(f.pre_overlap, PreOverlapResult) and f.pre_overlap.enabled
    assert f.pre_overlap.metrics["all_gather"].num_bucketed == 2
    assert b.pre_overlap.metrics["reduce_scatter"].num_bucketed == 2
    assert f.overlap_bucketing == [] and f.max_consec_compute_between_rs is None
    assert metrics.counts == {
        "fw": {"all_gather": (4, 2), "reduce_scatter": (0, 0), "all_reduce": (0, 0)},
        "bw": {"all_gather": (0, 0), "reduce_scatter": (2, 1), "all_reduce": (1, 1)},
    }
    assert metrics.summary() == (
        "fw: all_gather 4->2, reduce_scatter 0->0, all_reduce 0->0; fused chains 1\n"
        "bw: all_gather 0->0, reduce_scatter 2->1, all_reduce 1->1; fused chains 0"
    )
    fw.graph.lint()
    bw.graph.lint()


def test_passes_log_counts_per_graph(mesh, caplog):
    fw, bw = _tagged(mesh)
    with caplog.at_level(logging.INFO, logger="autoparallel.passes.collective"):
        bucket_fw_bw(fw, bw)
    msgs = [r.getMessage() for r in caplog.records if r.name == "autoparallel.passes.collective"]
    assert msgs == [
        "collective passes on fw: "
        "{'all_gather': (4, 2), 'reduce_scatter': (0, 0), 'all_reduce': (0, 0)}",
        "collective passes on bw: "
        "{'all_gather': (0, 0), 'reduce_scatter': (2, 1), 'all_reduce': (1, 1)}",
    ]


def test_fusion_off_buckets_the_unfused_chain(mesh):
    fw, bw = _tagged(mesh)
    _, _, metrics = bucket_fw_bw(fw, bw, CollectivePassesConfig(fuse_chained_allgathers=False))
    f = metrics.graphs["fw"]
    assert f.fused_chains == 0
    # the three dp all-gathers share a bucket; the tp one (reads the chain's dp wait) stays
    assert f.after["all_gather"] == 2 and f.pre_overlap.metrics["all_gather"].num_bucketed == 3
    assert _ag_groups(fw) == sorted([mesh.group_name("dp"), mesh.group_name("tp")])


def test_fusion_off_needs_no_group_map(mesh):
    fw, bw = _tagged(mesh)
    del fw.meta[M.GM_GROUP_DIMS], bw.meta[M.GM_GROUP_DIMS]
    _, _, metrics = bucket_fw_bw(fw, bw, CollectivePassesConfig(fuse_chained_allgathers=False))
    assert metrics.counts["fw"]["all_gather"] == (4, 2)


def test_fusion_reads_the_group_map_from_the_graph(mesh):
    fw, bw = _tagged(mesh)
    del fw.meta[M.GM_GROUP_DIMS]
    with pytest.raises(ValueError, match="needs the graph's group-name -> mesh-dim map"):
        bucket_fw_bw(fw, bw)


def test_bucketing_off_only_fuses(mesh):
    fw, bw = _tagged(mesh)
    _, _, metrics = bucket_fw_bw(fw, bw, CollectivePassesConfig(pre_overlap_bucketing=False))
    f, b = metrics.graphs["fw"], metrics.graphs["bw"]
    assert f.pre_overlap is None and b.pre_overlap is None
    assert (f.fused_chains, f.after) == (1, {**ZERO, "all_gather": 3})
    assert b.after == b.before == {"all_gather": 0, "reduce_scatter": 2, "all_reduce": 1}
    assert not fw.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)


def test_everything_off_leaves_graphs_alone(mesh):
    fw, bw = _tagged(mesh)
    before = [str(fw.graph), str(bw.graph)]
    cfg = CollectivePassesConfig(fuse_chained_allgathers=False, pre_overlap_bucketing=False)
    fw2, bw2, metrics = bucket_fw_bw(fw, bw, cfg)
    assert [str(fw2.graph), str(bw2.graph)] == before
    assert metrics.counts == {
        "fw": {"all_gather": (4, 4), "reduce_scatter": (0, 0), "all_reduce": (0, 0)},
        "bw": {"all_gather": (0, 0), "reduce_scatter": (2, 2), "all_reduce": (1, 1)},
    }
    assert metrics.summary().splitlines()[0].endswith("; fused chains 0")


def test_pre_overlap_config_is_passed_through(mesh):
    fw, bw = _tagged(mesh)
    cap = 1.5 * 6 * H * 4 / 2**20  # room for one gathered [6, H] f32 weight, not two
    cfg = CollectivePassesConfig(pre_overlap=PreOverlapConfig(bucket_cap_mb=cap))
    _, _, metrics = bucket_fw_bw(fw, bw, cfg)
    f = metrics.graphs["fw"]
    assert f.after["all_gather"] == 3
    assert f.pre_overlap.metrics["all_gather"].closed_by_bytes == 1


def test_untagged_graphs_are_not_bucketed(mesh):
    fw, bw = _fw(mesh), _bw(mesh)
    _, _, metrics = bucket_fw_bw(fw, bw)
    assert metrics.counts["fw"]["all_gather"] == (4, 3)  # fused only
    assert metrics.counts["bw"]["reduce_scatter"] == (2, 2)


def test_schedule_overlap_gets_its_configs_and_keeps_graph_meta(mesh, monkeypatch):
    """The scheduler returns a new module: the pipeline returns it, with the input's meta."""
    fw, bw = _tagged(mesh)
    calls = []
    bm = BucketingMetrics(num_candidates=7)

    def fake_schedule(gm, config, roofline):
        calls.append((gm, config, roofline))
        new = fx.GraphModule(torch.nn.Module(), fx.Graph())
        new.graph.output(())
        return OverlapResult(new, [bm], [], 5, ())

    monkeypatch.setattr(collective, "schedule_overlap_on_cpu", fake_schedule)
    topo, roof = TopoSpanConfig(max_topo_span=3), RooflineConfig(link_gbps=1.0)
    cfg = CollectivePassesConfig(schedule_overlap=True, topo_span=topo, roofline=roof)
    fw2, bw2, metrics = bucket_fw_bw(fw, bw, cfg)
    assert [c[0] for c in calls] == [fw, bw]
    assert all(c[1] is topo and c[2] is roof for c in calls)
    assert fw2 is not fw and bw2 is not bw
    assert fw2.meta[M.GM_GROUP_DIMS] == fw.meta[M.GM_GROUP_DIMS] == mesh.group_dims
    f = metrics.graphs["fw"]
    assert f.overlap_bucketing == [bm] and f.max_consec_compute_between_rs == 5
    assert f.after == ZERO  # counted on the scheduler's graph
    assert f.before == {**ZERO, "all_gather": 4}


def test_schedule_overlap_runs_the_cpu_scheduler(mesh):
    fw, bw = _fw(mesh), _bw(mesh)
    cfg = CollectivePassesConfig(
        schedule_overlap=True,
        pre_overlap_bucketing=False,
        topo_span=TopoSpanConfig(max_topo_span=0),
    )
    fw2, _, metrics = bucket_fw_bw(fw, bw, cfg)
    f = metrics.graphs["fw"]
    assert fw2.meta[M.GM_GROUP_DIMS] == mesh.group_dims
    assert f.overlap_bucketing and f.overlap_bucketing[0].max_topo_span == 0
    assert f.overlap_bucketing[0].num_buckets == 0  # a span of 0 keeps every collective alone
    assert f.max_consec_compute_between_rs == 0
    assert metrics.graphs["bw"].max_consec_compute_between_rs == 1  # mm between the two RS
    assert f.after == {**ZERO, "all_gather": 3}


def test_graph_pass_metrics_defaults():
    m = GraphPassMetrics(before=dict(ZERO))
    assert (m.after, m.fused_chains, m.pre_overlap, m.overlap_bucketing) == ({}, 0, None, [])
    assert m.max_consec_compute_between_rs is None
    cfg = CollectivePassesConfig()
    assert (cfg.fuse_chained_allgathers, cfg.pre_overlap_bucketing, cfg.schedule_overlap) == (
        True,
        True,
        False,
    )
    assert cfg.pre_overlap == PreOverlapConfig() and cfg.topo_span == TopoSpanConfig()
    assert PipelineMetrics().summary() == "" and PipelineMetrics().counts == {}


# --- bucket_joint -----------------------------------------------------------------------------


def _joint(mesh):
    """Forward all-gathers and backward reduce-scatters in one graph, untagged."""
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (4, H), role="input:0")
    acc = x
    grads = []
    for _ in range(2):
        w = b.all_gather(b.param((4, H)), "dp")  # [8, H]
        acc = b.call(aten.mm.default, acc, b.call(aten.t.default, w))  # [4, 8]
        acc = b.call(aten.mm.default, acc, w)  # [4, H]
        grads.append(
            b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp")
        )
    return b.output([b.call(aten.sum.default, acc), *grads], ["loss", "grad:p0", "grad:p1"])


def test_bucket_joint_tags_then_buckets(mesh):
    gm = _joint(mesh)
    gm2, metrics = bucket_joint(gm)
    assert gm2 is gm and list(metrics.graphs) == ["joint"]
    assert metrics.counts == {
        "joint": {"all_gather": (2, 1), "reduce_scatter": (2, 1), "all_reduce": (0, 0)}
    }
    assert metrics.summary() == (
        "joint: all_gather 2->1, reduce_scatter 2->1, all_reduce 0->0; fused chains 0"
    )
    gm.graph.lint()


def test_bucket_joint_uses_the_given_config(mesh, caplog):
    gm = _joint(mesh)
    with caplog.at_level(logging.INFO, logger="autoparallel.passes.collective"):
        _, metrics = bucket_joint(gm, CollectivePassesConfig(pre_overlap_bucketing=False))
    assert metrics.counts["joint"]["all_gather"] == (2, 2)
    assert metrics.graphs["joint"].pre_overlap is None
    assert "collective passes on joint: " in caplog.text


# --- upstream's INFO lines --------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_upstream_info_lines_stay_quiet_unless_asked(mesh):
    """Upstream's bucketing and fsdp modules set their loggers to INFO on import and printed a line
    per bucket and rank ("pre_bucket_fsdp_collectives: ...") on every report; the passes run with
    them at WARNING unless upstream_info_logs() (the report's -v) asks, and put the levels back."""
    loggers = [logging.getLogger(importlib.import_module(name).__name__) for name in collective.UPSTREAM_INFO_LOGGERS]
    assert [lg.level for lg in loggers] == [logging.INFO] * 2, "upstream no longer sets INFO on import"
    handler = _Records()
    for lg in loggers:
        lg.addHandler(handler)
    levels = [lg.level for lg in loggers]
    config = CollectivePassesConfig(schedule_overlap=True)
    try:
        bucket_fw_bw(*_tagged(mesh), config)
        assert [r for r in handler.records if r.levelno < logging.WARNING] == []
        assert [lg.level for lg in loggers] == levels
        with collective.upstream_info_logs():
            bucket_fw_bw(*_tagged(mesh), config)
        shown = [r.getMessage() for r in handler.records if r.levelno == logging.INFO]
        assert any("pre_bucket_fsdp_collectives" in m for m in shown), shown
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
