"""reused_bucket_traces: a bucket like an earlier one reuses its merge's trace, and the graph is the
one upstream builds, each node with a fake value of its own (autoparallel/passes/reused_bucket_traces.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._inductor.fx_passes import bucketing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.passes.collective import CollectivePassesConfig, bucket_joint
from autoparallel.passes.pre_overlap_bucketing import PreOverlapConfig
from autoparallel.passes.reused_bucket_traces import PATCH, reusing_bucket_traces, trace_key
from verify.graphs.generators import GraphBuilder, mesh_groups
from verify.graphs.invariants import check_same_graph_and_values

aten = torch.ops.aten
H = 16
SHARD_BYTES = 2 * H * 4  # one (2, H) fp32 shard


def _layers(mesh, widths=(H, H, H)):
    """One block per width: two parameter all-gathers of (2, width) shards (one bucket: the cap
    holds two gathered shards of width H) and a gradient reduce-scatter of a full bucket's bytes
    (alone in its bucket: nothing to merge); blocks of one width make all-gather buckets of one signature."""
    b = GraphBuilder(mesh_groups(mesh))
    acc = b.placeholder("x", (8, 8), role="input:0")  # (8, 8) through every block
    y = b.placeholder("y", (16, 16), role="input:1")
    grads = []
    for w in widths:
        first, second = (b.all_gather(b.param((2, w)), "dp") for _ in range(2))
        acc = b.call(aten.mm.default, b.call(aten.mm.default, acc, first), b.call(aten.t.default, second))
        grads.append(b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, y), y), "dp"))
    return b.output([b.call(aten.sum.default, acc), *grads], ["loss", *(f"grad:g{i}" for i in range(len(grads)))])


def _bucketed(traces, widths=(H, H, H), disable=False):
    """The graph bucketed, and the trace key of every merge traced (``traces``: the fixture's list)."""
    config = CollectivePassesConfig(fuse_chained_allgathers=False, schedule_overlap=False,
                                    pre_overlap=PreOverlapConfig(bucket_cap_mb=2 * 4 * SHARD_BYTES / 2**20))
    traces.clear()
    with fake_world("dp=4,tp=2") as mesh:
        gm = _layers(mesh, widths)
        with patches.disabled(PATCH) if disable else contextlib.nullcontext():
            gm, metrics = bucket_joint(gm, config)
    assert None not in traces, "every bucket's arguments have a key"
    return gm, list(traces), metrics.graphs["joint"].after["all_gather"]


def test_a_repeated_bucket_is_traced_once(bucket_traces):
    _, traced, buckets = _bucketed(bucket_traces)
    assert buckets == 3, "one all-gather bucket per block"
    assert len(traced) == len(set(traced)) == 1, "the three blocks' buckets are alike: one trace"


def test_the_graph_is_the_one_upstream_builds(bucket_traces):
    reused, traced, _ = _bucketed(bucket_traces)
    upstream, upstream_traced, _ = _bucketed(bucket_traces, disable=True)
    assert len(upstream_traced) == 3 and len(traced) == 1
    assert check_same_graph_and_values(upstream, reused) == []


def test_reused_buckets_get_values_of_their_own(bucket_traces):
    """A value shared between two buckets' nodes would make them alias one storage (the overlap
    scheduler's memory estimate would count one buffer for both)."""
    gm, _, _ = _bucketed(bucket_traces)
    made = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor_out.default]
    assert len(made) == 3
    storages = {id(n.meta[M.VAL].untyped_storage()) for n in made}
    assert len(storages) == 3, "each bucket's all-gather output is a buffer of its own"


def test_a_bucket_of_another_signature_is_traced(bucket_traces):
    widths = (H, H // 2, H // 2, H)  # the two narrow blocks share a bucket of four shards
    reused, traced, buckets = _bucketed(bucket_traces, widths)
    upstream, upstream_traced, _ = _bucketed(bucket_traces, widths, disable=True)
    assert buckets == 3 and len(upstream_traced) == 3 and upstream_traced[2] == upstream_traced[0]
    assert traced == upstream_traced[:2], "the four-shard bucket traced; the last block reuses the first's"
    assert check_same_graph_and_values(upstream, reused) == []


def test_arguments_without_value_equality_are_not_reused():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        plain = torch.empty(4, 2)
        assert trace_key(len, [[plain], "0", 4]) == trace_key(len, [[torch.empty(4, 2)], "0", 4])
        assert trace_key(len, [[plain], "0", 4]) != trace_key(len, [[torch.empty(4, 2, dtype=torch.bfloat16)], "0", 4])
        assert trace_key(len, [[plain.t()], "0", 4]) != trace_key(len, [[plain.t().contiguous()], "0", 4])
        assert trace_key(len, [[plain], "0", 4]) != trace_key(abs, [[plain], "0", 4]), "another merge function"
        assert trace_key(len, [[plain], object()]) is None, "an opaque argument"
        assert trace_key(len, [{"a": plain}]) is None, "a dict is not compared"
    symbolic = mode.from_tensor(torch.empty(4, 2), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC]))
    assert trace_key(len, [[symbolic]]) is None, "a symbolic size"


def test_the_scope_restores_upstreams_trace_when_a_pass_raises():
    upstream = bucketing._trace
    with pytest.raises(RuntimeError, match="pass failed"):
        with reusing_bucket_traces():
            assert bucketing._trace is not upstream or not patches.enabled(PATCH)
            raise RuntimeError("pass failed")
    assert bucketing._trace is upstream


def test_disabled_the_scope_leaves_upstreams_trace():
    upstream = bucketing._trace
    with patches.disabled(PATCH), reusing_bucket_traces() as counts:
        assert bucketing._trace is upstream
    assert counts == {"traced": 0, "reused": 0}
