"""Chained all-gather fusion on hand-built graphs (values on a real 2x2 gloo world are checked in
tests/parity/test_bucketing_parity.py)."""

from __future__ import annotations

import operator
import re

import pytest
import torch

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER, WAIT, copy_graph_module
from autoparallel.mesh import fake_world
from autoparallel.passes.fuse_chained_allgathers import (
    DISABLED,
    NO_FLAT_GROUP,
    NOT_IDENTITY,
    SAME_DIM,
    SHARED,
    ChainReport,
    fuse_chained_allgathers,
)
from autoparallel.passes.permuted_split_cat import permuted_split_cat
from verify.graphs.generators import GraphBuilder, mesh_groups
from verify.parity import differential as D

aten = torch.ops.aten
H = 8


MESH = "dp=2,tp=2"  # the mesh fixture's world (tests/conftest.py)


def _chain(b, first, second, views=()):
    """param [3, H] -> all_gather(first) -> wait -> views -> all_gather(second) -> wait."""
    v = b.all_gather(b.param((3, H)), first)
    for view in views:
        v = view(b, v)
    return b.all_gather(v, second)


def _tt(b, v):
    return b.call(aten.t.default, b.call(aten.t.default, v))


def _flat_round_trip(b, v):
    shape = list(v.meta["val"].shape)
    return b.call(aten.view.default, b.call(aten.view.default, v, [-1]), shape)


def _out(b, *ws):
    return b.output(list(ws), [f"output:{i}" for i in range(len(ws))])


def _ag_groups(gm):
    return [n.args[2] for n in gm.graph.nodes if n.target is ALL_GATHER]


def test_fuses_direct_chain_both_directions(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"), _chain(b, "tp", "dp"))
    shapes = [tuple(v.meta["val"].shape) for v in gm.graph.output_node().args[0]]
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 2
    flat = mesh.group_name("dp*tp")
    assert _ag_groups(gm) == [flat, flat]
    for ag in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        assert ag.args[1] == 4 and ag.args[0].op == "placeholder"
    # dp -> tp gathers blocks in column-major rank order: view -> permute -> clone -> view.
    outs = gm.graph.output_node().args[0]
    assert outs[0].target is aten.view.default and outs[0].args[0].target is aten.clone.default
    assert outs[0].args[0].args[0].target is aten.permute.default
    # tp -> dp is row-major: the flat all-gather's wait is the result.
    assert outs[1].target is WAIT
    assert [tuple(v.meta["val"].shape) for v in outs] == shapes == [(12, H), (12, H)]
    gm.graph.lint()


def test_fuses_identity_view_chain(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp", [_tt]), _chain(b, "tp", "dp", [_flat_round_trip, _tt]))
    assert fuse_chained_allgathers(gm) == 2  # group_dims from gm.meta
    assert not [n for n in gm.graph.nodes if n.target is aten.t.default]
    gm.graph.lint()


def test_keeps_chains_whose_views_are_not_the_identity(mesh):
    b = GraphBuilder(mesh_groups(mesh))

    def transpose(b, v):  # [6, 8] -> [8, 6]: a different tensor
        return b.call(aten.t.default, v)

    def copy_then_back(b, v):  # t -> reshape (copies) -> view: same shape/strides, other values
        r = b.call(aten.reshape.default, b.call(aten.t.default, v), [-1])
        return b.call(aten.view.default, r, list(v.meta["val"].shape))

    gm = _out(b, _chain(b, "dp", "tp", [transpose]), _chain(b, "dp", "tp", [copy_then_back]))
    report = ChainReport()
    assert fuse_chained_allgathers(gm, mesh.group_dims, report=report) == 0
    assert len(_ag_groups(gm)) == 4
    # both pairs are chains (views between, the reshape may copy), both left for that reason
    assert report.fused == [] and [why for _, why in report.unfused] == [NOT_IDENTITY, NOT_IDENTITY]


def test_keeps_chains_with_other_users_or_same_dim(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    w1 = b.all_gather(b.param((3, H)), "dp")
    shared = b.all_gather(w1, "tp")  # wait1 also used below
    same = b.all_gather(b.all_gather(b.param((3, H)), "dp"), "dp")  # dp -> dp: not the mesh
    gm = _out(b, shared, b.call(aten.relu.default, w1), same)
    report = ChainReport()
    assert fuse_chained_allgathers(gm, mesh.group_dims, report=report) == 0
    assert sorted(why for _, why in report.unfused) == sorted([SHARED, SAME_DIM])
    assert report.summary() == (
        "2 chained all-gathers found, 0 fused; left: 1 x an intermediate value has other users, "
        "1 x both all-gathers on one mesh dim"
    )


def test_chain_over_two_dims_of_a_3d_mesh_is_kept():
    with fake_world("dp=2,tp=2,cp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        gm = _out(b, _chain(b, "dp", "tp"))
        report = ChainReport()
        assert fuse_chained_allgathers(gm, mesh.group_dims, report=report) == 0  # dp*tp is not the whole mesh
        assert [why for _, why in report.unfused] == [NO_FLAT_GROUP]


def test_disabled_patch_fuses_nothing(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    report = ChainReport()
    with patches.disabled("fuse_chained_allgathers"):
        assert fuse_chained_allgathers(gm, mesh.group_dims, report=report) == 0
    assert len(_ag_groups(gm)) == 2
    assert report.fused == [] and [why for _, why in report.unfused] == [DISABLED]


def test_report_names_each_fused_chain_and_its_order(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"), _chain(b, "tp", "dp"))
    report = ChainReport()
    assert fuse_chained_allgathers(gm, mesh.group_dims, report=report) == 2
    assert [re.sub(r"all_gather_into_tensor\w*", "ag", c) for c in report.fused] == [
        "ag(dp) -> ag(tp) on dp*tp [column-major]",
        "ag(tp) -> ag(dp) on dp*tp",
    ]
    assert report.found == 2 and report.summary() == "2 chained all-gathers found, 2 fused"


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_process_group_names_the_node(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    ag = gm.graph.find_nodes(op="call_function", target=ALL_GATHER)[0]
    ag.args = (ag.args[0], ag.args[1], "999")
    with pytest.raises(ValueError, match=rf"unknown process group '999' \(at {ag.name}\)"):
        fuse_chained_allgathers(gm, mesh.group_dims)


def test_chain_of_the_wrong_shape_is_an_error(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    ag = gm.graph.find_nodes(op="call_function", target=ALL_GATHER)[1]
    ag.args = (ag.args[0], 3, ag.args[2])  # says tp has 3 ranks
    with pytest.raises(
        ValueError, match="have the wrong shape: group sizes 2 .* and 3 .*'tp' has 2"
    ):
        fuse_chained_allgathers(gm, mesh.group_dims)


def test_needs_the_group_map(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    with pytest.raises(ValueError, match="needs the graph's group-name -> mesh-dim map"):
        fuse_chained_allgathers(gm.graph)


# --- what the rewrite produces ------------------------------------------------------------------


def test_column_major_reshuffle_uses_the_outer_dim_first():
    """dp=4, tp=2: a dp -> tp chain gathers blocks i_tp * 4 + i_dp; the flat result [8*3, H] is
    viewed as [dp, tp, 3, H], permuted to [tp, dp, 3, H] and made contiguous."""
    with fake_world("dp=4,tp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        gm = _out(b, _chain(b, "dp", "tp"), _chain(b, "tp", "dp"))
        assert fuse_chained_allgathers(gm, mesh.group_dims) == 2
        col, row = gm.graph.output_node().args[0]
        clone = col.args[0]
        perm = clone.args[0]
        view = perm.args[0]
        assert (view.target, view.args[1]) == (aten.view.default, [4, 2, 3, H])
        assert perm.args[1] == [1, 0, 2, 3]
        assert clone.kwargs == {"memory_format": torch.contiguous_format}
        assert col.args[1] == [24, H] and tuple(col.meta["val"].shape) == (24, H)
        ags = gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
        assert [ag.args[1:] for ag in ags] == [(8, mesh.group_name("dp*tp"))] * 2
        assert row.target is WAIT and row.args[0] is ags[1]


def test_fused_nodes_keep_the_chains_meta(mesh):
    """The fused all-gather takes the second all-gather's meta (e.g. its bucketing tag)."""
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "tp", "dp"))
    ag2 = gm.graph.find_nodes(op="call_function", target=ALL_GATHER)[1]
    M.set_bucket_tag(ag2, "fsdp_ag")
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 1
    (ag,) = gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
    assert M.bucket_tag(ag) == "fsdp_ag"
    assert tuple(ag.meta["val"].shape) == (12, H)


def test_graph_module_is_recompiled_and_plain_graphs_work(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "tp", "dp"))
    assert gm.code.count("_c10d_functional.all_gather_into_tensor.default(") == 2
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 1
    assert gm.code.count("_c10d_functional.all_gather_into_tensor.default(") == 1
    b = GraphBuilder(mesh_groups(mesh))
    g = _out(b, _chain(b, "tp", "dp")).graph
    assert fuse_chained_allgathers(g, mesh.group_dims) == 1
    assert len(g.find_nodes(op="call_function", target=ALL_GATHER)) == 1


def test_a_node_joins_at_most_one_chain(mesh):
    """dp -> tp -> dp: both pairs are chains but share the middle all-gather; only the first is
    fused. An independent chain in between must not make the pass forget that."""
    b = GraphBuilder(mesh_groups(mesh))
    ab = _chain(b, "dp", "tp")
    xy = _chain(b, "tp", "dp")
    abc = b.all_gather(ab, "dp")
    gm = _out(b, abc, xy)
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 2
    flat, dp = mesh.group_name("dp*tp"), mesh.group_name("dp")
    assert _ag_groups(gm) == [flat, flat, dp]
    gm.graph.lint()


def test_square_transpose_is_not_the_identity(mesh):
    """[4, 4] -> t(): same storage and shape, other strides."""
    b = GraphBuilder(mesh_groups(mesh))
    v = b.all_gather(b.param((2, 4)), "dp")
    gm = _out(b, b.all_gather(b.call(aten.t.default, v), "tp"))
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 0


def test_reduce_then_gather_is_not_a_chain(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    rs = b.reduce_scatter(b.param((4, H)), "dp")
    ar = b.all_reduce(b.param((4, H)), "dp")
    gm = _out(b, b.all_gather(rs, "tp"), b.all_gather(ar, "tp"))
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 0


# --- group sizes --------------------------------------------------------------------------------

NAMES = {"dp": ("10", 2), "tp": ("11", 2), "dp*tp": ("12", 4)}  # names no world knows
DIMS = {name: label for label, (name, _) in NAMES.items()}


def _unnamed_chain():
    """A dp -> tp chain on group names no world knows, and its two all-gathers."""
    b = GraphBuilder(NAMES)
    gm = _out(b, _chain(b, "dp", "tp"))
    return gm, gm.graph.find_nodes(op="call_function", target=ALL_GATHER)


def test_group_sizes_replace_the_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    gm, _ = _unnamed_chain()
    assert fuse_chained_allgathers(gm, DIMS, {"dp": 2, "tp": 2, "dp*tp": 4}) == 1
    assert _ag_groups(gm) == ["12"]


@pytest.mark.parametrize("missing, at", [("dp", 0), ("tp", 1), ("dp*tp", 1)])
def test_group_sizes_must_name_every_dim(missing, at):
    gm, ags = _unnamed_chain()
    ag = ags[at]
    sizes = {k: v for k, v in {"dp": 2, "tp": 2, "dp*tp": 4}.items() if k != missing}
    with pytest.raises(
        ValueError,
        match=rf"^node '{ag.name}': group_sizes has no size for mesh dim '{re.escape(missing)}'$",
    ):
        fuse_chained_allgathers(gm, DIMS, sizes)


def test_sizes_need_a_world_or_group_sizes(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    gm, (ag, _) = _unnamed_chain()
    with pytest.raises(
        ValueError,
        match=rf"^node '{ag.name}': fusing needs the size of mesh dim 'dp'; pass "
        r"group_sizes=\{label: size\} or run inside the \(fake\) world the graph was traced on$",
    ):
        fuse_chained_allgathers(gm, DIMS)


def test_groups_unknown_to_the_world_are_an_error(mesh):
    gm, (ag, _) = _unnamed_chain()
    with pytest.raises(
        ValueError,
        match=rf"^node '{ag.name}': process group '10' \(mesh dim 'dp'\) is unknown to the "
        "running world; rebind the graph to this world or pass group_sizes$",
    ):
        fuse_chained_allgathers(gm, DIMS)


def test_graph_module_without_group_map(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    del gm.meta[M.GM_GROUP_DIMS]
    with pytest.raises(
        ValueError,
        match=r"^fuse_chained_allgathers needs the graph's group-name -> mesh-dim map: pass "
        r"group_dims=mesh\.group_dims or attach it with autoparallel\.mesh\.attach_group_dims$",
    ):
        fuse_chained_allgathers(gm)


# --- a gather of a dim other than 0 (passes/permuted_split_cat.py's permuted copy between) ------------


def _moved_chain(b, first, second, shard, dim):
    """param ``shard`` -> all_gather(first) -> its blocks moved to ``dim`` (split -> cat, then one
    permuted copy) -> all_gather(second): DTensor's S(0) on ``second``, S(dim) on ``first`` -> R."""
    w = b.all_gather(b.param(shard), first)
    n = b.group(first)[1]
    s = b.call(aten.split.Tensor, w, shard[0])
    w = b.call(aten.cat.default, [b.call(operator.getitem, s, i) for i in range(n)], dim)
    return b.all_gather(w, second)


@pytest.mark.parametrize("first, second, shard, dim", [
    ("tp", "dp", (3, 4), 1),  # row-major: the flat blocks only move
    ("dp", "tp", (2, 3, 4), 1),  # column-major: both mesh dims' blocks reordered
    ("tp", "dp", (2, 3, 4), 2),
])
def test_a_chain_through_a_permuted_copy_is_one_all_gather_computing_the_same(first, second, shard, dim):
    with D.simulated_world(MESH) as world:
        b = GraphBuilder(mesh_groups(world))
        before = b.output([_moved_chain(b, first, second, shard, dim)], ["output:0"])
        assert permuted_split_cat(before).acted == 1
        after = copy_graph_module(before)
        report = ChainReport()
        assert fuse_chained_allgathers(after, world.group_dims, report=report) == 1, report.summary()
        assert _ag_groups(after) == [world.group_name("dp*tp")]
        assert report.fused[0].endswith(f"[blocks to dim {dim}]")
        assert ("[column-major]" in report.fused[0]) == (first == "dp")
        check = D.compare_programs("fuse_chained_allgathers", before, after, D.Feeds(4))
        assert check.equal, check.summary()


@pytest.mark.parametrize("first, second, shard, dim", [("tp", "dp", (3, 4), 1), ("dp", "tp", (2, 3, 4), 2)])
def test_a_chain_through_the_lowerings_own_permuted_copy_is_fused_computing_the_same(first, second, shard, dim):
    """The lowering's moves (planner/moves.py) trace the permuted copy's first step on the
    contiguous gathered tensor as ``view``, not ``reshape``: the chain is the same."""
    with D.simulated_world(MESH) as world:
        b = GraphBuilder(mesh_groups(world))
        before = b.output([_moved_chain(b, first, second, shard, dim)], ["output:0"])
        assert permuted_split_cat(before).acted == 1
        (reshape,) = before.graph.find_nodes(op="call_function", target=aten.reshape.default)
        reshape.target = aten.view.default
        before.recompile()
        after = copy_graph_module(before)
        report = ChainReport()
        assert fuse_chained_allgathers(after, world.group_dims, report=report) == 1, report.summary()
        assert report.fused[0].endswith(f"[blocks to dim {dim}]")
        check = D.compare_programs("fuse_chained_allgathers", before, after, D.Feeds(4))
        assert check.equal, check.summary()


def test_a_permuted_copy_whose_value_is_read_elsewhere_is_no_chain_to_fuse(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    w = _moved_chain(b, "tp", "dp", (3, 4), 1)
    gm = b.output([w])
    permuted_split_cat(gm)
    copy = next(n for n in gm.graph.nodes if n.target is aten.permute.default)
    with gm.graph.inserting_after(copy):
        extra = gm.graph.call_function(aten.neg.default, (copy,))
        extra.meta["val"] = copy.meta["val"]
    gm.graph.output_node().args = ([w, extra],)
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 0
    assert len(_ag_groups(gm)) == 2
