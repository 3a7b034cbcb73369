"""Inductor's overlap scheduler run on a CPU (autoparallel/passes/overlap_scheduling.py): the
scoped installations restore upstream (also on error, and importing patches nothing), the roofline
is routed through our estimator, and the scheduler runs through topo-span bucketing.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch
import torch._inductor.fx_passes.bucketing as bucketing_mod
import torch._inductor.fx_passes.fsdp as fsdp_mod
import torch._inductor.fx_passes.overlap_scheduling as sched

import autoparallel.passes.topo_span_bucketing as topo_span_module
from autoparallel.fx_utils import ALL_GATHER, REDUCE_SCATTER, max_consec_compute_between_rs
from autoparallel.passes import overlap_scheduling
from autoparallel.passes.overlap_estimator import RooflineConfig, RooflineEstimator
from autoparallel.passes.overlap_scheduling import (
    cpu_runtime_estimation_installed,
    estimation_tables_only_when_traced,
    schedule_overlap_on_cpu,
    topo_span_bucketing_installed,
)
from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 64
# 2 TFLOP/s f32 at 50 % and 100 GB/s: an f32 [32, 64] x [64, 16] mm is memory bound, 14336 B
# in 1.4336e-4 ms.
CFG = RooflineConfig(peak_tflops={torch.float32: 2.0}, mem_gbps=100.0, efficiency=0.5)
EST = RooflineEstimator(CFG)


@pytest.fixture
def b(mesh):
    return GraphBuilder(mesh_groups(mesh))


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
    up = (fsdp_mod.identify_fsdp_groups, bucketing_mod.greedy_bucket_collective_by_mb)
    importlib.reload(topo_span_module)
    importlib.reload(overlap_scheduling)
    assert (fsdp_mod.identify_fsdp_groups, bucketing_mod.greedy_bucket_collective_by_mb) == up
    assert up[0].__module__ == "torch._inductor.fx_passes.fsdp"


def test_overlap_scheduler_runs_on_cpu_through_topo_span_bucketing(mesh, caplog):
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


def _fsdp_like_graph(b):
    x = b.placeholder("x", (8, H), role="input:0")
    acc, grads = x, []
    for _ in range(2):
        acc = b.call(aten.mm.default, acc, b.all_gather(b.param((16, H)), "dp"))
        grads.append(b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp"))
    return b.output([b.call(aten.sum.default, acc), *grads], ["loss", "grad:a", "grad:b"])


ESTIMATES_ARTIFACT = "fx_compute_nodes_runtime_estimation"


def test_the_estimates_table_is_built_only_for_a_structured_trace(b, monkeypatch):
    """Upstream builds it (FLOPs of every compute node on fake tensors) on every run; without a
    trace handler nobody reads it, so nothing may count FLOPs."""
    from torch._inductor import fx_utils
    from torch._logging._internal import trace_log

    def no_flop_count(node):
        raise AssertionError("the estimates table was built with no structured-trace handler")

    monkeypatch.setattr(trace_log, "handlers", [])
    monkeypatch.setattr(fx_utils, "count_flops_fx", no_flop_count)
    schedule_overlap_on_cpu(_fsdp_like_graph(b))


def test_a_structured_trace_still_gets_the_estimates_table(b, structured_trace):
    schedule_overlap_on_cpu(_fsdp_like_graph(b))
    tables = [p for _, p in structured_trace.artifacts(ESTIMATES_ARTIFACT)]
    # one row per compute node, with its FLOPs: an [8, 64] x [64, 64] mm is 2 * 8 * 64 * 64
    assert tables and all("mm_default f32(8, 64) f32(64, 64)," in t and t.rstrip().endswith(",65536") for t in tables), tables


def test_the_estimates_switch_is_scoped_and_restored_on_error():
    import torch._inductor.fx_passes.node_runtime_estimation as estimation

    up = estimation._log_compute_estimations
    with pytest.raises(RuntimeError, match="boom"):
        with estimation_tables_only_when_traced():
            assert estimation._log_compute_estimations is not up
            raise RuntimeError("boom")
    assert estimation._log_compute_estimations is up


def test_installation_routes_the_scheduler_roofline_and_restores_it(b):
    up = sched.estimate_roofline_runtime_ms
    x, w = b.placeholder("x", (32, 64)), b.placeholder("w", (64, 16))
    mm = b.call(aten.mm.default, x, w)
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_runtime_estimation_installed(EST) as est:
            assert est is EST
            assert sched.estimate_roofline_runtime_ms(mm) == pytest.approx(1.4336e-4, rel=1e-12, abs=0.0)
            raise RuntimeError("boom")
    assert sched.estimate_roofline_runtime_ms is up


@pytest.mark.parametrize("explicit", [True, False])
def test_schedule_overlap_on_cpu_uses_both_configs(b, mesh, monkeypatch, caplog, explicit):
    made = []

    class Spy(RooflineEstimator):
        def __init__(self, config=None):
            made.append(config)
            super().__init__(config)

    monkeypatch.setattr(overlap_scheduling, "RooflineEstimator", Spy)

    def no_alignment(*args, **kwargs):  # analytical estimates need no cross-rank median
        raise AssertionError("the scheduler aligned its estimates across ranks")

    monkeypatch.setattr(torch.distributed, "all_gather_object", no_alignment)
    x = b.placeholder("x", (8, 64), role="input:0")
    acc, grads = x, []
    for _ in range(3):
        w = b.all_gather(b.param((16, 64)), "dp")  # [64, 64]
        acc = b.call(aten.mm.default, acc, w)
        mm = b.call(aten.mm.default, b.call(aten.t.default, acc), acc)
        grads.append(b.reduce_scatter(mm, "dp"))
    gm = b.output([b.call(aten.sum.default, acc), *grads], ["loss", "grad:a", "grad:b", "grad:c"])
    args = (TopoSpanConfig(max_topo_span=0), CFG) if explicit else ()
    with caplog.at_level(logging.INFO, logger=overlap_scheduling.__name__):
        res = overlap_scheduling.schedule_overlap_on_cpu(gm, *args)
    assert made == [CFG if explicit else None]
    assert res.patches == ("primary_fsdp_group", "topo_span_bucketing")
    span = 0 if explicit else 1500
    assert res.bucketing_calls and all(m.max_topo_span == span for m in res.bucketing_calls)
    # a span of 0 merges nothing; the default bucket holds the three all-gathers
    assert res.bucketing_calls[0].num_bucketed == (0 if explicit else 3)
    assert res.primary_groups == [([mesh.group_name("dp")], 4)]
    n = max_consec_compute_between_rs(res.gm.graph)
    assert res.max_consec_compute_between_rs == n
    msgs = [r.getMessage() for r in caplog.records if r.name == overlap_scheduling.__name__]
    assert msgs == [f"overlap scheduling: max_consec_compute_between_rs={n}"]
