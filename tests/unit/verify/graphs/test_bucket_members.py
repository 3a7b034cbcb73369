"""verify.graphs.bucket_members: two ranks' merged buckets of the same total size but with their
members in another order are told apart (docs/failure-classes.md 11m), and the same order agrees."""

import operator

import pytest
import torch
from torch import fx

from autoparallel import meta as M
from verify.graphs.bucket_members import bucket_members
from verify.graphs.collective_agreement import CollectiveMismatchError, check_agreement, collective_calls, rank_calls

_c10d = torch.ops._c10d_functional


def _merged_reduce_scatter(order=("a", "b")) -> fx.GraphModule:
    """Two gradients (4 elements each) concatenated in ``order``, one reduce-scatter, split into
    the two pieces, each returned as its parameter's gradient; an all-gather of the two
    parameters' shards in the same order."""
    g = fx.Graph()
    ph = {}
    for name in order:
        ph[name] = g.placeholder(f"p_{name}")
        ph[name].meta[M.VAL] = torch.empty(2)
        ph[name].meta[M.ROLE] = f"param:{name}"
    flat = g.call_function(torch.ops.aten.cat.default, ([ph[n] for n in order],))
    flat.meta[M.VAL] = torch.empty(4)
    ag = g.call_function(_c10d.all_gather_into_tensor.default, (flat, 2, "0"))
    ag.meta[M.VAL] = torch.empty(8)
    w0 = g.call_function(_c10d.wait_tensor.default, (ag,))
    w0.meta[M.VAL] = ag.meta[M.VAL]
    rs = g.call_function(_c10d.reduce_scatter_tensor.default, (w0, "sum", 2, "0"))
    rs.meta[M.VAL] = torch.empty(4)
    w = g.call_function(_c10d.wait_tensor.default, (rs,))
    w.meta[M.VAL] = rs.meta[M.VAL]
    split = g.call_function(torch.ops.aten.split_with_sizes.default, (w, [2, 2]))
    pieces = [g.call_function(operator.getitem, (split, i)) for i in range(2)]
    views = [g.call_function(torch.ops.aten.view.default, (p, [2])) for p in pieces]
    out = g.output(tuple(views))
    out.meta[M.ROLE] = [f"grad:{n}" for n in order]
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {"0": "dp"}
    return gm


def test_members_are_the_gradients_each_piece_reaches_and_the_params_gathered():
    gm = _merged_reduce_scatter(("a", "b"))
    ag, rs = (n for n in gm.graph.nodes if n.target in (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default))
    assert bucket_members(rs, "reduce_scatter") == ("grad:a", "grad:b")
    assert bucket_members(ag, "all_gather") == ("param:a", "param:b")
    assert [c.members for c in collective_calls(gm)] == [("param:a", "param:b"), ("grad:a", "grad:b")]


def test_same_sizes_other_member_order_is_a_named_mismatch():
    ref = rank_calls([("bw", _merged_reduce_scatter(("a", "b")))])
    check_agreement([ref, rank_calls([("bw", _merged_reduce_scatter(("a", "b")))])])  # same members: agree
    swapped = rank_calls([("bw", _merged_reduce_scatter(("b", "a")))])
    with pytest.raises(CollectiveMismatchError, match=r"graph 'bw', collective #0: the same sizes, other members: .*"
                       r"\['param:a', 'param:b'\] from piece #0 of 2 on rank 0.*\['param:b', 'param:a'\]"):
        check_agreement([ref, swapped])
