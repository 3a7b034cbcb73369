"""verify.graphs.collective_agreement on hand-built graphs: ranks agree when their collectives
match in op, mesh dim, sizes, dtypes and arguments (group names may differ: they are per rank);
any one of those differing, or a missing collective, is named with its node and module path."""

import operator

import pytest
import torch
from torch import fx

from autoparallel import meta as M
from verify.graphs.collective_agreement import (
    CollectiveMismatchError,
    check_agreement,
    collective_calls,
    first_disagreement,
    rank_calls,
    structure_disagreement,
)

_c10d = torch.ops._c10d_functional


def _graph(*gathers, group="3", dim="tp", dtype=torch.float32, module=None) -> fx.GraphModule:
    """One all-gather (then a reduce-scatter of its result) per entry of ``gathers`` (rows)."""
    g = fx.Graph()
    out = []
    for i, rows in enumerate(gathers):
        x = g.placeholder(f"x{i}")
        x.meta[M.VAL] = torch.empty(rows, 4, dtype=dtype)
        ag = g.call_function(_c10d.all_gather_into_tensor.default, (x, 2, group))
        ag.meta[M.VAL] = torch.empty(2 * rows, 4, dtype=dtype)
        if module:
            M.custom_meta(ag)[M.MODULE_PATH] = module
        w = g.call_function(_c10d.wait_tensor.default, (ag,))
        w.meta[M.VAL] = ag.meta[M.VAL]
        rs = g.call_function(_c10d.reduce_scatter_tensor.default, (w, "sum", 2, group))
        rs.meta[M.VAL] = x.meta[M.VAL]
        out.append(g.call_function(_c10d.wait_tensor.default, (rs,)))
    g.output(tuple(out))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {group: dim}
    return gm


def test_calls_in_issue_order_with_what_ranks_must_agree_on():
    calls = collective_calls(_graph(2, 4))
    assert [c.node for c in calls] == ["all_gather_into_tensor_default", "reduce_scatter_tensor_default",
                                      "all_gather_into_tensor_default_1", "reduce_scatter_tensor_default_1"]
    assert calls[0].signature == ("_c10d_functional.all_gather_into_tensor.default", "tp",
                                  (((2, 4), "float32"), ((4, 4), "float32")), (2,))
    assert calls[1].signature[3] == ("sum", 2)


def test_ranks_of_one_mesh_dim_agree_across_group_names():
    """Ranks 0 and 2 of dp=2,tp=2 name their tp groups differently ('3' and '4')."""
    a, b = rank_calls([("g", _graph(2, group="3"))]), rank_calls([("g", _graph(2, group="4"))])
    assert first_disagreement([a, b]) is None
    check_agreement([a, b, a])


@pytest.mark.parametrize(
    "other, expect",
    [
        (dict(gathers=(3,)), "float32[3, 4]"),  # a size
        (dict(gathers=(2,), dtype=torch.bfloat16), "bfloat16[2, 4]"),  # a dtype
        (dict(gathers=(2,), dim="dp"), "on dp"),  # another mesh dim
        (dict(gathers=()), "no collective (its graph ends)"),  # a missing collective
    ],
)
def test_each_difference_is_named_with_node_and_module(other, expect):
    ref = rank_calls([("joint", _graph(2, module="head"))])
    kw = dict(other)
    gathers = kw.pop("gathers")
    got = rank_calls([("joint", _graph(*gathers, module="head", **kw))])
    with pytest.raises(CollectiveMismatchError, match="graph 'joint', collective #0") as info:
        check_agreement([ref, ref, got])
    text = str(info.value)
    assert "rank 2 issues" in text and expect in text
    assert "rank 0 issues _c10d_functional.all_gather_into_tensor.default on tp" in text
    assert "at node 'all_gather_into_tensor_default' in head" in text


def test_a_graph_only_one_rank_has_is_named():
    a = rank_calls([("joint", _graph(2))])
    b = rank_calls([("joint", _graph(2)), ("extra", _graph(2))])
    assert "rank 1 has ['extra', 'joint']" in first_disagreement([a, b])


def _piece_graph(rank: int, pad: bool = False, group: str = "3") -> fx.GraphModule:
    """A local split keeping piece ``rank``, then an all-gather (a zero pad before it if ``pad``)."""
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = torch.empty(4, 4)
    sp = g.call_function(aten.split.Tensor, (x, 2))
    sp.meta[M.VAL] = (torch.empty(2, 4), torch.empty(2, 4))
    pieces = [g.call_function(operator.getitem, (sp, i)) for i in range(2)]
    for p in pieces:
        p.meta[M.VAL] = torch.empty(2, 4)
    mine = pieces[rank]
    if pad:
        mine = g.call_function(aten.constant_pad_nd.default, (mine, [0, 0, 0, 0], 0.0))
        mine.meta[M.VAL] = torch.empty(2, 4)
    ag = g.call_function(_c10d.all_gather_into_tensor.default, (mine, 2, group))
    ag.meta[M.VAL] = torch.empty(4, 4)
    g.output((ag,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {group: "tp"}
    return gm


def test_ranks_keeping_different_pieces_of_a_split_are_one_program():
    assert structure_disagreement([_piece_graph(0), _piece_graph(1, group="4")]) is None


def test_a_pad_only_one_rank_has_is_named_though_the_collectives_agree():
    graphs = [_piece_graph(0), _piece_graph(1, pad=True)]
    assert first_disagreement([rank_calls([("g", gm)]) for gm in graphs]) is None  # same sizes
    diff = structure_disagreement(graphs)
    assert diff is not None and "rank 1 has constant_pad_nd" in diff, diff


def _slice_graph(start: int, length: int = 2) -> fx.GraphModule:
    """A rank's rows of a replicated tensor as the lowering's direct ``Replicate -> Shard`` move
    writes them (``narrow`` -> ``slice`` at the rank's offset, then a clone)."""
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = torch.empty(4, 4)
    sl = g.call_function(aten.slice.Tensor, (x, 0, start, start + length))
    sl.meta[M.VAL] = torch.empty(length, 4)
    c = g.call_function(aten.clone.default, (sl,))
    c.meta[M.VAL] = torch.empty(length, 4)
    g.output((c,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_ranks_slicing_their_own_rows_are_one_program_and_other_lengths_are_named():
    """Failed before (CI on ae7e987): the direct moves' rank offset made every planned program look
    rank-specific to the uneven-plan property test."""
    assert structure_disagreement([_slice_graph(0), _slice_graph(2)]) is None
    diff = structure_disagreement([_slice_graph(0), _slice_graph(1, length=3)])
    assert diff is not None and "slice" in diff, diff
