"""split -> getitems -> cat as one permuted copy (autoparallel/passes/permuted_split_cat.py), on
hand-built graphs: DTensor's gather and scatter shapes around a collective, the shapes it must
leave alone, and (hypothesis) the rewritten graph computing bitwise the original's values on real
tensors for generated shapes, group sizes and dims."""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER, REDUCE_SCATTER
from autoparallel.passes.permuted_split_cat import PATCH, permute_plan, permuted_split_cat
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten


def _split_cat(b, x, pieces: int, split_dim: int, cat_dim: int, order=None, with_sizes=False):
    """cat([getitem(split(x), i) for i in order], cat_dim); ``with_sizes``: split_with_sizes."""
    n = b._meta[x].shape[split_dim] // pieces
    if with_sizes:
        s = b.call(aten.split_with_sizes.default, x, [n] * pieces, split_dim)
    else:
        s = b.call(aten.split.Tensor, x, n, split_dim)
    items = [b.call(operator.getitem, s, i) for i in range(pieces)]
    order = range(pieces) if order is None else order
    return b.call(aten.cat.default, [items[i] for i in order], cat_dim)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _permuted_copy(gm):
    return [t for t in _targets(gm) if t in (aten.reshape.default, aten.permute.default, aten.clone.default, aten.view.default)]


def test_a_gather_on_dim_1_becomes_one_permuted_copy(mesh):
    """all_gather -> wait -> split(dim 0) -> 2 getitems -> cat(dim 1): DTensor's Shard(1) -> Replicate."""
    b = GraphBuilder(mesh_groups(mesh))
    w = b.all_gather(b.param((3, 8)), "tp")
    out = _split_cat(b, w, 2, 0, 1)
    b.graph.find_nodes(op="call_function", target=aten.cat.default)[0].meta[M.CUSTOM] = {M.PLANNED_NODE: "n:mm"}
    gm = b.output([out])
    report = permuted_split_cat(gm)
    assert report.rewritten == ["cat_default: W=2 dim 0 -> 1"] and report.acted == 1
    assert report.nodes_after == report.nodes_before  # split, 2 getitems, cat -> 4 nodes (W=2)
    assert aten.cat.default not in _targets(gm) and aten.split.Tensor not in _targets(gm)
    assert operator.getitem not in _targets(gm)
    assert _permuted_copy(gm) == [aten.reshape.default, aten.permute.default, aten.clone.default, aten.view.default]
    assert tuple(gm.graph.output_node().args[0][0].meta[M.VAL].shape) == (3, 16)
    # the copy serves the cat's planned node; the collective is untouched
    assert all(n.meta[M.CUSTOM][M.PLANNED_NODE] == "n:mm" for n in gm.graph.nodes if n.target in _permuted_copy(gm))
    assert _targets(gm).count(ALL_GATHER) == 1


def test_a_scatter_on_dim_1_becomes_one_permuted_copy(mesh):
    """split(dim 1) -> 2 getitems -> cat(dim 0) -> reduce_scatter: DTensor's Partial -> Shard(1)."""
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("g", (4, 6))
    out = b.reduce_scatter(_split_cat(b, x, 2, 1, 0), "dp")
    gm = b.output([out])
    assert permuted_split_cat(gm).acted == 1
    rs = next(n for n in gm.graph.nodes if n.target is REDUCE_SCATTER)
    assert rs.args[0].target is aten.view.default and tuple(rs.args[0].meta[M.VAL].shape) == (8, 3)
    assert aten.cat.default not in _targets(gm)


def _bits(t):
    """``t``'s bytes (bitwise: -0.0 is not 0.0)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _graph(shape, pieces, a, b_, dtype=torch.float32, **kw):
    b = GraphBuilder({})
    x = b.placeholder("x", shape, dtype)
    return b.output([_split_cat(b, x, pieces, a, b_, **kw)])


@pytest.mark.parametrize(
    "why, kw",
    [
        ("pieces out of order", {"order": [1, 0]}),
        ("a piece missing", {"order": [0]}),
        ("a piece twice", {"order": [0, 0]}),
    ],
)
def test_a_cat_that_is_no_permuted_copy_is_left(why, kw):
    gm = _graph((4, 3), 2, 0, 1, **kw)
    before = _targets(gm)
    assert permuted_split_cat(gm).acted == 0, why
    assert _targets(gm) == before


def test_a_cat_of_two_splits_pieces_is_left():
    b = GraphBuilder({})
    x, y = b.placeholder("x", (4, 3)), b.placeholder("y", (4, 3))
    sx, sy = b.call(aten.split.Tensor, x, 2), b.call(aten.split.Tensor, y, 2)
    gm = b.output([b.call(aten.cat.default, [b.call(operator.getitem, sx, 0), b.call(operator.getitem, sy, 1)], 1)])
    assert permuted_split_cat(gm).acted == 0


def test_a_split_and_cat_on_one_dim_is_left():
    gm = _graph((4, 3), 2, 0, 0)
    assert permuted_split_cat(gm).acted == 0


def test_a_piece_read_elsewhere_keeps_the_split_and_its_getitem():
    b = GraphBuilder({})
    x = b.placeholder("x", (4, 3))
    cat = _split_cat(b, x, 2, 0, 1)
    piece = next(n for n in b.graph.nodes if n.target is operator.getitem and n.args[1] == 1)
    gm = b.output([cat, b.call(aten.neg.default, piece)])
    ref = gm(torch.arange(12.0).reshape(4, 3))
    assert permuted_split_cat(gm).acted == 1
    assert [n.args[1] for n in gm.graph.nodes if n.target is operator.getitem] == [1]
    got = gm(torch.arange(12.0).reshape(4, 3))
    assert all(torch.equal(r, g) for r, g in zip(ref, got, strict=True))


def test_disabled_rewrites_nothing_and_reports_what_it_left():
    gm = _graph((4, 3), 2, 0, 1)
    with patches.disabled(PATCH):
        report = permuted_split_cat(gm)
    assert report.acted == 0 and report.left == ["cat_default: W=2 dim 0 -> 1"]
    assert aten.cat.default in _targets(gm) and "disabled" in report.summary()


def test_a_missing_val_names_the_node():
    gm = _graph((4, 3), 2, 0, 1)
    del gm.graph.find_nodes(op="placeholder")[0].meta[M.VAL]
    with pytest.raises(ValueError, match="'x'.*permuted split"):
        permuted_split_cat(gm)


def test_permute_plan_moves_the_pieces_dim_before_the_cat_dim():
    assert permute_plan([6, 5], 2, 0, 1) == ([2, 3, 5], [1, 0, 2])
    assert permute_plan([4, 6, 5], 3, 1, 0) == ([4, 3, 2, 5], [1, 0, 2, 3])
    assert permute_plan([4, 6, 10], 2, 2, 1) == ([4, 6, 2, 5], [0, 2, 1, 3])


@st.composite
def _cases(draw):
    rank = draw(st.integers(2, 4))
    a, b = draw(st.lists(st.integers(0, rank - 1), min_size=2, max_size=2, unique=True))
    pieces = draw(st.integers(2, 5))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    shape[a] *= pieces
    negative = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    transposed = draw(st.booleans())  # the split's input a non-contiguous view
    return shape, pieces, (a - rank if negative else a), b, dtype, transposed, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_the_rewritten_graph_computes_the_cat_bitwise(case):
    shape, pieces, a, b_, dtype, transposed, with_sizes = case
    b = GraphBuilder({})
    x = b.placeholder("x", shape[::-1] if transposed else shape, dtype)
    if transposed:
        x = b.call(aten.permute.default, x, list(range(len(shape)))[::-1])
    gm = b.output([_split_cat(b, x, pieces, a, b_, with_sizes=with_sizes)])
    real = (torch.randn(b._meta[gm.graph.find_nodes(op="placeholder")[0]].shape) * 100).to(dtype)
    ref = gm(real)[0]
    report = permuted_split_cat(gm)
    assert report.acted == 1 and report.nodes_after == report.nodes_before - (pieces + 2) + 4
    assert aten.cat.default not in _targets(gm)
    got = gm(real)[0]
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride()
    assert torch.equal(_bits(got), _bits(ref))
    assert tuple(gm.graph.output_node().args[0][0].meta[M.VAL].shape) == tuple(ref.shape)
