"""Each golden scenario shows what it was added for (so a golden regenerated after a regression
cannot quietly stop covering it): the split scenario really splits buckets, by bytes and by
topological span; DDP all-reduces and its gradients are bucketed; bf16 gathers bf16 and reduces
fp32. Pipeline runs are shared with the golden tests of the same scenario (one xdist worker)."""

from __future__ import annotations

import pytest
import torch

from autoparallel import meta as M
from autoparallel.fx_utils import ALL_GATHER, REDUCE_SCATTER
from verify.goldens.catalog import GOLDEN_SCENARIOS, golden_run
from verify.graphs.stats import graph_stats


def _grouped(sid):
    return pytest.mark.xdist_group(sid)


@_grouped("tiny-fsdp-dp4-split")
def test_split_scenario_splits_buckets_by_bytes_and_by_span(shared_pipeline_runs):
    run = golden_run("tiny-fsdp-dp4-split")
    unbucketed = graph_stats(run.stage("second_compile").graphs[0]).collective_count("all_gather", "dp")
    # each pass alone on the second compile's graphs: what the scenario's graph goldens show
    for stage in ("pre_overlap_bucketing", "topo_span_bucketing"):
        fw = run.alternative(stage).graphs[0]
        count = graph_stats(fw).collective_count("all_gather", "dp")
        assert 1 < count < unbucketed, f"{stage}: {count} forward all-gathers of {unbucketed}: no split"
    pre = run.alternative("pre_overlap_bucketing").report.graphs["fw"].pre_overlap.metrics["all_gather"]
    assert pre.closed_by_bytes > 0 and pre.closed_by_span == 0, pre.summary()
    topo = run.alternative("topo_span_bucketing").report.graphs["fw"].overlap_bucketing
    assert sum(m.closed_by_span for m in topo) > 0, [m.summary() for m in topo]
    assert sum(m.closed_by_bytes for m in topo) == 0  # the span, not the cap, split these


@_grouped("tiny-ddp-dp8")
def test_ddp_scenario_all_reduces_and_buckets_gradients(shared_pipeline_runs):
    run = golden_run("tiny-ddp-dp8")
    joint = graph_stats(run.stage("joint").graphs)
    assert joint.collective_count("all_reduce", "dp") == 21
    assert joint.collective_count("all_gather") == joint.collective_count("reduce_scatter") == 0
    bw = run.stage("pre_overlap_bucketing").graphs[1]
    assert graph_stats(bw).collective_count("all_reduce", "dp") == 1  # the tagged grad_ar bucket


@_grouped("tiny-fsdp-bf16-dp8")
def test_bf16_scenario_gathers_bf16_and_reduces_fp32(shared_pipeline_runs):
    fw, bw = golden_run("tiny-fsdp-bf16-dp8").stage("second_compile").graphs
    gathers = [n for g in (fw, bw) for n in g.graph.nodes if n.target is ALL_GATHER]
    scatters = [n for n in bw.graph.nodes if n.target is REDUCE_SCATTER]
    assert len(gathers) == 41 and len(scatters) == 21
    assert {n.meta[M.VAL].dtype for n in gathers} == {torch.bfloat16}
    assert {n.args[0].meta[M.VAL].dtype for n in scatters} == {torch.float32}


@_grouped("tiny-fsdp-dp3-uneven")
def test_uneven_scenario_pads_every_shard_and_counts_the_padding(shared_pipeline_runs):
    """dp=3 divides no dim 0 of the tiny LLaMA: every all-gather is narrowed, every reduce-scatter
    reads a padded gradient, and the stats show the padding (known answer: 5656 B, e.g. 2 rows of
    64 fp32 for tok_embeddings.weight's 256 rows, 2 rows of 256 for w2's 64)."""
    sc = GOLDEN_SCENARIOS["tiny-fsdp-dp3-uneven"]
    shardings = sc.plan_obj().resolve(sc.model(device="meta"), sc.mesh_spec)
    assert all(s.padded for s in shardings.values())
    want = sum(s.padding_rows * torch.Size(s.local_shape[1:]).numel() * 4 for s in shardings.values())
    assert want == 5656
    run = golden_run("tiny-fsdp-dp3-uneven")
    joint = graph_stats(run.stage("joint").graphs)
    for kind in ("all_gather", "reduce_scatter"):
        assert joint.padding[kind]["dp"].count == len(shardings) and joint.padding_bytes(kind, "dp") == want
    fw, bw = run.stage("topo_span_bucketing").graphs  # bucketed: the padding is still found and counted
    assert graph_stats(fw).padding_bytes("all_gather", "dp") == want
    assert graph_stats(bw).padding_bytes("reduce_scatter", "dp") == want
