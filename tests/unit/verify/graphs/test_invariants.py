"""verify.graphs.invariants on hand-built graphs: each law holds where it should and names what broke it.

(The laws on the pipeline's own graphs: tests/golden/test_pass_invariants.py.)
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import copy_graph_module
from autoparallel.mesh import fake_world
from autoparallel.passes.fuse_chained_allgathers import fuse_chained_allgathers
from verify.graphs import invariants as I
from verify.graphs.generators import GraphBuilder, GraphSpec, OpSpec, build_synthetic, mesh_groups
from verify.stages.registry import check_conservation

aten = torch.ops.aten


@pytest.fixture
def groups():
    with fake_world("dp=4,tp=2") as mesh:
        yield mesh_groups(mesh)


def _gathers(groups, rows=(1, 1), label="dp", recompute=None, tag=None):
    """One forward-looking graph: a parameter all-gathered per entry of ``rows``, summed."""
    b = GraphBuilder(groups)
    total = None
    for r in rows:
        w = b.all_gather(b.param((r, 8)), label)
        ag = w.args[0]
        if recompute is not None:
            ag.meta[M.RECOMPUTE] = recompute
        if tag is not None:
            ag.meta[M.PARTITIONER_TAG] = tag
        s = b.call(aten.sum.default, w)
        total = s if total is None else b.call(aten.add.Tensor, total, s)
    return b.output([total], [roles.LOSS])


def test_unchanged_names_a_lost_collective(groups):
    two, one = _gathers(groups), _gathers(groups, rows=(1,))
    assert I.unchanged("cleanup", two, copy_graph_module(two)) == []
    (problem,) = I.unchanged("cleanup", two, one)
    assert problem == "cleanup: collectives (count, bytes) changed: all_gather/dp (2, 256) -> (1, 128)"
    (problem,) = I.unchanged("second_compile", (two, two), (two, one))
    assert problem.startswith("second_compile backward: collectives (count, bytes) changed")


def test_merged_allows_merging_and_names_lost_bytes_more_launches_and_none_left(groups):
    two, one_big, one = _gathers(groups), _gathers(groups, rows=(2,)), _gathers(groups, rows=(1,))
    assert I.merged("pre_overlap_bucketing", (two, two), (one_big, two)) == []  # 2 launches -> 1, same bytes
    assert I.merged("pre_overlap_bucketing", (two, two), (one, two)) == [
        "pre_overlap_bucketing forward all_gather/dp: 256 B before, 128 B after (a collective was lost or duplicated)"
    ]
    assert I.merged("topo_span_bucketing", (one_big, one), (two, one)) == [
        "topo_span_bucketing forward all_gather/dp: 1 launches before, 2 after (bucketing only merges)"
    ]
    gone = I.merged("topo_span_bucketing", (one, one), (GraphBuilder(groups).output([], []), one))
    assert gone == ["topo_span_bucketing forward all_gather/dp: 128 B before, 0 B after (a collective was lost or "
                    "duplicated)", "topo_span_bucketing forward all_gather/dp: every launch is gone"]


def test_regrouped_keeps_chains_end_to_end_and_names_a_broken_one(groups):
    spec = GraphSpec(8, 2, (OpSpec("param_ag_chain", variant=0, rows=2), OpSpec("grad_rs", a=0, b=1)))
    chained = build_synthetic(spec, groups).gm
    assert I.gather_chains(chained) == {(64, 512, ("dp", "tp")): 1}
    fused = copy_graph_module(chained)
    assert fuse_chained_allgathers(fused) == 1
    assert I.gather_chains(fused) == I.gather_chains(chained)
    assert I.regrouped("fuse_chained_allgathers", (chained, chained), (fused, fused)) == []
    # A "fusion" that gathers over dp only: the chain loses its tp half.
    half = build_synthetic(GraphSpec(8, 2, (OpSpec("param_ag", rows=2), OpSpec("grad_rs", a=0, b=1))), groups).gm
    (problem,) = I.regrouped("fuse_chained_allgathers", (chained, chained), (half, chained))
    assert problem == ("fuse_chained_allgathers forward: all-gather chains (bytes in, bytes out, dims) changed: "
                       "lost [((64, 512, ('dp', 'tp')), 1)], gained [((64, 256, ('dp',)), 1)]")


def test_partitioned_allows_one_backward_regather_per_forward_gather(groups):
    joint = _gathers(groups, tag="is_forward")
    fw = _gathers(groups)
    bw = _gathers(groups, recompute=CheckpointPolicy.MUST_RECOMPUTE)
    assert I.partitioned("first_partition", joint, (fw, bw)) == []
    more = _gathers(groups, rows=(1, 1, 1), recompute=CheckpointPolicy.MUST_RECOMPUTE)
    problems = I.partitioned("first_partition", joint, (fw, more))
    assert problems == ["first_partition backward: recomputed all-gathers with no forward twin, or more than one per "
                        "forward all-gather: [(('dp', 128), 1)]"]
    untagged = _gathers(groups)  # a backward all-gather that is no recompute: a duplicate
    (problem,) = I.partitioned("first_partition", joint, (fw, untagged))
    assert problem.startswith("first_partition backward (joint backward region + recomputed all-gathers): ")


def test_partitioned_lets_a_dead_gather_go_but_not_a_live_one(groups):
    """A parameter whose use the loss drops (a pooler an LM head skips) is gathered in the joint
    graph, and the partitioner keeps only what its outputs need."""
    b = GraphBuilder(groups)
    live = b.call(aten.sum.default, b.all_gather(b.param((1, 8)), "dp"))
    b.all_gather(b.param((1, 8)), "dp")  # nothing reads it
    joint = b.output([live], [roles.LOSS])
    one = _gathers(groups, rows=(1,))
    assert I.partitioned("first_partition", joint, (one, _gathers(groups, rows=()))) == []
    (problem,) = I.partitioned("first_partition", _gathers(groups), (one, _gathers(groups, rows=())))
    assert problem == "first_partition forward: collectives (count, bytes) changed: all_gather/dp (2, 256) -> (1, 128)"


def test_saved_values_compare_per_op_index_shape_and_dtype(groups):
    def pair(index):
        fb = GraphBuilder(groups)
        x = fb.placeholder("x", (4, 8), role=roles.input_(0))
        ln = fb.call(aten.native_layer_norm.default, x, [8], None, None, 1e-5)
        kept = fb.call(operator.getitem, ln, index)
        kept.name = "kept"
        fw = fb.output([fb.call(aten.sum.default, x), kept], [roles.LOSS, roles.saved(0)])
        bb = GraphBuilder(groups)
        s = bb.placeholder("kept", (4, 1), role=roles.saved(0))
        bw = bb.output([bb.call(aten.neg.default, s)], [roles.grad("x")])
        return fw, bw

    mean, rstd = pair(1), pair(2)
    assert I.multi_output_saves(*mean) == {"aten.native_layer_norm.default[1]": 1}
    assert I.check_saved_equal(mean, pair(1)) == []
    (problem,) = I.check_saved_equal(mean, rstd)
    assert "only in the first [(('aten.native_layer_norm.default[1]', (4, 1), torch.float32), 1)]" in problem
    assert "only in the second [(('aten.native_layer_norm.default[2]', (4, 1), torch.float32), 1)]" in problem


def test_unknown_stage_and_wrong_graph_kinds_are_named(groups):
    g = _gathers(groups)
    with pytest.raises(ValueError, match=r"no conservation law for stage 'joint'; laws: \['cleanup'"):
        check_conservation("joint", g, g)
    with pytest.raises(ValueError, match="stage 'pre_overlap_bucketing': expected a \\(forward, backward\\) pair"):
        check_conservation("pre_overlap_bucketing", g, g)
    with pytest.raises(ValueError, match="stage 'first_partition': expected one joint graph"):
        check_conservation("first_partition", (g, g), (g, g))
    with pytest.raises(ValueError, match="stage 'cleanup': input and output are not the same kind of graphs"):
        check_conservation("cleanup", g, (g, g))


# --- same graph, same values -------------------------------------------------------------------


def _viewed(alias: bool = True, stride_of_t=None):
    """x -> t(x) -> clone: the transpose's value aliases x's storage (or, ``alias=False``, has a
    storage of its own); ``stride_of_t`` overrides its stride."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 2)
        t = (x if alias else torch.empty(4, 2)).t()
        if stride_of_t is not None:
            t = torch.empty_strided(t.shape, stride_of_t)
        c = t.clone()
    g = torch.fx.Graph()
    nx = g.placeholder("x")
    nt = g.call_function(aten.t.default, (nx,))
    nc = g.call_function(aten.clone.default, (nt,))
    g.output(nc)
    for node, v in zip((nx, nt, nc), (x, t, c), strict=True):
        node.meta[M.VAL] = v
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_same_graph_and_values_holds_for_equal_graphs():
    assert I.check_same_graph_and_values(_viewed(), _viewed()) == []


def test_a_value_with_another_stride_is_named():
    problems = I.check_same_graph_and_values(_viewed(), _viewed(stride_of_t=(2, 1)))
    assert len(problems) == 2 and problems[0].startswith("node 1 differs: ('t_default'")


def test_values_that_alias_otherwise_are_named():
    """Same shapes and strides; only the transpose's storage differs: a reused value (one storage
    for two nodes) or a lost view shows only here."""
    problems = I.check_same_graph_and_values(_viewed(alias=True), _viewed(alias=False))
    assert problems == ["values alias otherwise: storages shared only in the second [['t_default'], ['x']]"]


def test_a_node_missing_at_the_end_is_named():
    short = _viewed()
    out = short.graph.output_node()
    out.args = (out.args[0].args[0],)
    short.graph.erase_node(next(n for n in short.graph.nodes if n.target is aten.clone.default))
    problems = I.check_same_graph_and_values(_viewed(), short)
    assert problems and problems[0].startswith("node 2 differs")
