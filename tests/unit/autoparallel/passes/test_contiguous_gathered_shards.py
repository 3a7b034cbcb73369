"""contiguous_gathered_shards on hand-built graphs, run on simulated ranks (verify.parity.differential):
a bucketed one-row parameter comes out contiguous and computes what the unbucketed one did;
without the patch, native_group_norm reads upstream's strided view as contiguous (wrong values)
and a view of it fails."""

import pytest
import torch

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.fx_utils import copy_graph_module
from autoparallel.passes.contiguous_gathered_shards import PATCH, make_gathered_shards_contiguous
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    tag_collectives_for_bucketing,
)
from verify.graphs.generators import GraphBuilder, GraphSpec, OpSpec, build_synthetic, mesh_groups
from verify.parity import differential as D

aten = torch.ops.aten
MESH = "dp=8"
CONFIG = PreOverlapConfig(bucket_cap_mb=25.0)


def _group_norm_graph(world):
    """x [2, 8, 4] -> group_norm with a gathered weight and bias of 8 channels (one row per rank
    on dp=8) and a gathered [8, 4] matrix beside them in the bucket; the loss sums it all."""
    b = GraphBuilder(mesh_groups(world))
    x = b.placeholder("x", (2, 8, 4), role=roles.input_(0))
    w, bias, m = b.param((1,)), b.param((1,)), b.param((1, 4))
    gw, gb, gm_ = b.all_gather(w, "dp"), b.all_gather(bias, "dp"), b.all_gather(m, "dp")
    normed = b.call(aten.native_group_norm.default, x, gw, gb, 2, 8, 4, 2, 1e-5)
    out = b.call(aten.add.Tensor, b.call(aten.sum.default, b.call(_getitem, normed, 0)),
                 b.call(aten.sum.default, b.call(aten.mul.Tensor, x, gm_)))
    return b.output([out], [roles.LOSS])


def _getitem(t, i):
    return t[i]


def _bucketed(before):
    after = copy_graph_module(before)
    tag_collectives_for_bucketing(before)
    tag_collectives_for_bucketing(after)
    bucket_tagged_collectives(after, CONFIG)
    return after


def test_one_row_shards_come_out_contiguous_and_compute_what_unbucketed_ones_do():
    with D.simulated_world(MESH) as world:
        before = _group_norm_graph(world)
        after = _bucketed(before)
        clones = [n for n in after.graph.nodes if n.target is aten.clone.default]
        assert len(clones) == 3, after.code  # w, bias and m: every member of the bucket has one row
        assert all(n.kwargs["memory_format"] is torch.contiguous_format for n in clones)
        check = D.compare_programs(PATCH, before, after, D.Feeds(8))
        assert check.equal, check.summary()
        with patches.disabled(PATCH):
            upstream = _bucketed(before)
        assert not [n for n in upstream.graph.nodes if n.target is aten.clone.default]
        wrong = D.compare_programs(PATCH, before, upstream, D.Feeds(8))
        assert not wrong.equal, "upstream's strided weight gave native_group_norm the right values"
        assert "native_group_norm" in wrong.summary()


def test_a_view_of_a_bucketed_one_row_parameter_runs():
    """Was the strict xfail of tests/property/test_differential_properties.py: a consumer that
    views the gathered one-row parameter failed at run time on upstream's strided slice."""
    spec = GraphSpec(16, 2, (OpSpec("param_ag", rows=1), OpSpec("param_ag", rows=4), OpSpec("grad_rs", a=0, b=1)))
    with D.simulated_world("dp=16") as world:
        before = build_synthetic(spec, mesh_groups(world)).gm
        gathered = next(n for n in before.graph.nodes if n.name == "wait_tensor_default")  # p0's all-gather, [16, 16]
        with before.graph.inserting_after(gathered):
            flat = before.graph.call_function(aten.view.default, (gathered, [-1]))
            flat.meta[M.VAL] = gathered.meta[M.VAL].view(-1)
        with before.graph.inserting_after(flat):
            back = before.graph.call_function(aten.view.default, (flat, [16, 16]))
            back.meta[M.VAL] = gathered.meta[M.VAL]
        gathered.replace_all_uses_with(back, delete_user_cb=lambda u: u is not flat)
        before.recompile()
        after = _bucketed(before)
        check = D.compare_programs(PATCH, before, after, D.Feeds(16))
        assert check.equal, check.summary()
        with patches.disabled(PATCH), pytest.raises(RuntimeError, match="view"):
            D.compare_programs(PATCH, before, _bucketed(before), D.Feeds(16))


def test_a_bucket_of_rows_or_a_single_gather_is_left_alone():
    """Shards of more than one row reshape with a copy (contiguous already: upstream traces the
    reshape as clone + _unsafe_view), and a lone all-gather is not merged: the patch adds nothing."""
    specs = [GraphSpec(16, 2, (OpSpec("param_ag", rows=2), OpSpec("param_ag", rows=4), OpSpec("grad_rs", a=0, b=1))),
             GraphSpec(16, 2, (OpSpec("param_ag", rows=1),))]
    with D.simulated_world("dp=16") as world:
        for spec in specs:
            before = build_synthetic(spec, mesh_groups(world)).gm
            after = _bucketed(before)
            with patches.disabled(PATCH):
                upstream = _bucketed(before)
            assert after.code == upstream.code
            assert make_gathered_shards_contiguous(after) == 0
