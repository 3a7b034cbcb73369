"""Chained all-gather fusion on hand-built graphs (values on a real 2x2 gloo world are checked in
tests/parity/test_bucketing_parity.py)."""

from __future__ import annotations

import pytest
import torch

from autoparallel.mesh import fake_world
from autoparallel.passes import registry
from autoparallel.passes.fuse_chained_allgathers import fuse_chained_allgathers
from autoparallel.passes.graph_utils import ALL_GATHER, WAIT
from verify.strategies import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 8


@pytest.fixture
def mesh():
    with fake_world("dp=2,tp=2") as m:
        yield m


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
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 0
    assert len(_ag_groups(gm)) == 4


def test_keeps_chains_with_other_users_or_same_dim(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    w1 = b.all_gather(b.param((3, H)), "dp")
    shared = b.all_gather(w1, "tp")  # wait1 also used below
    same = b.all_gather(b.all_gather(b.param((3, H)), "dp"), "dp")  # dp -> dp: not the mesh
    gm = _out(b, shared, b.call(aten.relu.default, w1), same)
    assert fuse_chained_allgathers(gm, mesh.group_dims) == 0


def test_chain_over_two_dims_of_a_3d_mesh_is_kept():
    with fake_world("dp=2,tp=2,cp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        gm = _out(b, _chain(b, "dp", "tp"))
        assert fuse_chained_allgathers(gm, mesh.group_dims) == 0  # dp*tp is not the whole mesh


def test_disabled_patch_fuses_nothing(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    gm = _out(b, _chain(b, "dp", "tp"))
    with registry.disabled("fuse_chained_allgathers"):
        assert fuse_chained_allgathers(gm, mesh.group_dims) == 0
    assert len(_ag_groups(gm)) == 2


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
