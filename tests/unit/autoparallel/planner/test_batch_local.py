"""A convolution planned with the batch split over both mesh dims (``[S(0), S(0)]``) is lowered as
its local op (``autoparallel.planner.batch_local``, patch ``batch_local_convolution``).

DTensor's convolution strategy allows that placement, and the planner takes it (mobilevitv2's
plan on dp=2,tp=2 did, for a depthwise convolution's backward), but DTensor's convolution handler
reads the spec's ``dim_map``, which refuses it: plan="auto" was REFUSED. A small conv net of our
own (``verify.zoo.StridedDepthwiseConv``) pinned to that placement, planned and lowered on a fake
dp=2,tp=2 world; its gloo parity and oracle are in tests/parity/test_planned_fallbacks_parity.py
(slow step).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import JOINT, run_pipeline
from autoparallel.planner.batch_local import PATCH, hybrid, runs_batch_local
from autoparallel.planner.solution import parse_placement
from verify.zoo import HYBRID_BATCH_PINS, StridedDepthwiseConv, conv_batch, label_smoothing_loss

aten = torch.ops.aten
CONV, CONV_BWD = aten.convolution.default, aten.convolution_backward.default
S0S0, S0R, RR = (Shard(0), Shard(0)), (Shard(0), Replicate()), (Replicate(), Replicate())
PP = (Partial(), Partial())


def _lower(pins):
    with fake_world("dp=2,tp=2") as mesh:
        with torch.device("meta"):
            model = StridedDepthwiseConv()
        return run_pipeline(model, label_smoothing_loss, conv_batch(8), ParallelPlan.auto(pins=pins), mesh,
                            until=JOINT, trace=None)


def test_a_convolution_with_the_batch_on_both_mesh_dims_is_lowered():
    run = _lower(HYBRID_BATCH_PINS)
    plan, report = run.planned.solution, run.stage(JOINT).report
    for key, want in HYBRID_BATCH_PINS.items():
        assert plan.nodes[key].ins[0] == {"dp": "S(0)", "tp": "S(0)"}, key  # the pin held: the hybrid placement
        assert tuple(parse_placement(p) for p in plan.nodes[key].out[0].values()) == S0S0
    assert report.batch_local == 2  # the depthwise convolution's forward and backward
    # Each rank convolves its quarter of the batch: the lowered ops take 8 / 4 = 2 rows.
    graph = run.joint.gm.graph
    depthwise = [n for n in graph.find_nodes(op="call_function", target=CONV) if n.args[-1] == 8]  # groups=8
    backward = [n for n in graph.find_nodes(op="call_function", target=CONV_BWD) if n.args[-2] == 8]
    assert len(depthwise) == 1 and len(backward) == 1
    assert depthwise[0].args[0].meta["val"].shape[0] == 2 and depthwise[0].meta["val"].shape[0] == 2
    assert backward[0].args[0].meta["val"].shape[0] == 2 and backward[0].args[1].meta["val"].shape[0] == 2


def test_disabled_the_hybrid_convolution_is_refused_by_dtensor():
    """What the sweep saw before the fix (the patch's mutation): DTensor's handler refuses."""
    with patches.disabled(PATCH), pytest.raises(ValueError, match="hybrid sharding strategies"):
        _lower(HYBRID_BATCH_PINS)


def test_only_a_batch_split_over_several_mesh_dims_runs_locally():
    assert hybrid(S0S0) and not hybrid(S0R) and not hybrid((Shard(0), Shard(1)))
    assert runs_batch_local(CONV, [S0S0, RR, RR], [S0S0])
    assert runs_batch_local(CONV_BWD, [S0S0, S0S0, RR], [S0S0, PP, PP])
    # DTensor runs these itself: the batch on one mesh dim, or nothing sharded
    assert not runs_batch_local(CONV, [S0R, RR, RR], [S0R])
    assert not runs_batch_local(CONV, [RR, RR], [RR])
    # the same placement on an op whose DTensor dispatch holds it is DTensor's
    assert not runs_batch_local(aten.mm.default, [S0S0, RR], [S0S0])
    with patches.disabled(PATCH):
        assert not runs_batch_local(CONV, [S0S0, RR, RR], [S0S0])


def test_a_convolution_sharding_more_than_the_batch_is_not_run_locally():
    """Negative: a spatial dim split (a halo exchange's case) or a sharded weight is no local
    call, whatever else the placement holds: DTensor's to run or refuse."""
    spatial = (Shard(0), Shard(3))
    assert not runs_batch_local(CONV, [S0S0, RR], [(Shard(3), Shard(0))])
    assert not runs_batch_local(CONV, [S0S0, RR], [spatial])
    assert not runs_batch_local(CONV, [S0S0, (Shard(0), Replicate())], [S0S0])  # the weight's out-channels split
    assert not runs_batch_local(CONV_BWD, [S0S0, S0S0, (Replicate(), Shard(1))], [S0S0, PP, PP])
    assert not runs_batch_local(CONV, [S0S0], [S0S0])  # no weight input: not a convolution's placement

