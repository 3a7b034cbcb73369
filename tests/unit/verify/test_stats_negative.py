"""verify.stats on hand graphs with known answers, aimed at plausible wrong implementations:
bytes of the wrong side of a collective, coalesced lists counted once, in-place and autograd
variants missed, tangents counted as saved, ``must_save=False`` counted, symbolic sizes dropped,
a table that hides a dim or a kind, unknown groups defaulted instead of refused."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from verify.stats import format_stats_table, graph_stats, node_category, partition_stats

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
DIMS = {"1": "dp", "3": "tp"}


def _meta(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _node(g, target, args, val, kwargs=None):
    n = g.call_function(target, args, kwargs or {})
    n.meta[M.VAL] = val
    return n


def _gm(g: fx.Graph, dims=DIMS) -> fx.GraphModule:
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = dict(dims)
    return gm


def _placeholder(g, name, shape, dtype=torch.float32, role=None):
    p = g.placeholder(name)
    p.meta[M.VAL] = _meta(shape, dtype)
    if role:
        p.meta[M.ROLE] = role
    return p


def test_ddp_style_graph_bytes_are_inputs_of_reductions():
    """DDP: all-reduce of bf16 gradients (input bytes), in-place variant, a coalesced all-reduce
    and a coalesced reduce-scatter whose inputs are summed, not the first one only."""
    g = fx.Graph()
    a = _placeholder(g, "a", (10, 10), torch.bfloat16)  # 200 B
    b = _placeholder(g, "b", (5,))  # 20 B
    _node(g, c10d.all_reduce.default, (a, "sum", "1"), _meta((10, 10), torch.bfloat16))
    _node(g, c10d.all_reduce_.default, (b, "sum", "1"), _meta((5,)))
    _node(g, c10d.all_reduce_coalesced.default, ([a, b], "avg", "3"), [_meta((10, 10), torch.bfloat16), _meta((5,))])
    _node(g, c10d.reduce_scatter_tensor_coalesced.default, ([a, b], "sum", 5, "1"), [_meta((2, 10), torch.bfloat16), _meta((1,))])
    g.output(None)
    st = graph_stats(_gm(g))
    assert st.to_dict()["collectives"] == {
        "all_reduce": {"dp": {"count": 2, "bytes": 200 + 20}, "tp": {"count": 1, "bytes": 220}},
        "reduce_scatter": {"dp": {"count": 1, "bytes": 220}},
    }


def test_all_gather_bytes_are_the_output_even_when_the_input_dtype_differs():
    g = fx.Graph()
    x = _placeholder(g, "x", (4, 8), torch.float32)  # the fp32 shard (128 B) ...
    cast = _node(g, aten._to_copy.default, (x,), _meta((4, 8), torch.bfloat16), {"dtype": torch.bfloat16})
    _node(g, c10d.all_gather_into_tensor.default, (cast, 8, "1"), _meta((32, 8), torch.bfloat16))
    g.output(None)
    assert graph_stats(_gm(g)).collective_bytes("all_gather", "dp") == 32 * 8 * 2  # ... gathered in bf16


def test_autograd_collectives_and_broadcast_are_counted():
    g = fx.Graph()
    x = _placeholder(g, "x", (4,))
    _node(g, torch.ops._c10d_functional_autograd.all_gather_into_tensor.default, (x, 2, "3"), _meta((8,)))
    _node(g, c10d.broadcast.default, (x, 0, "1"), _meta((4,)))
    g.output(None)
    st = graph_stats(_gm(g))
    assert st.collective_count("all_gather", "tp") == 1 and st.collective_bytes("all_gather") == 32
    assert st.collective_count("broadcast", "dp") == 1 and st.collective_bytes("broadcast") == 16


def test_symbolic_sizes_count_with_their_trace_hint():
    def f(x):
        return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, 4, "1"))

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 8))
    gm.meta[M.GM_GROUP_DIMS] = DIMS
    assert isinstance(next(iter(gm.graph.nodes)).meta[M.VAL].shape[0], torch.SymInt)
    assert graph_stats(gm).collective_bytes("all_gather", "dp") == 6 * 4 * 8 * 4


def test_collective_without_a_known_group_is_refused_not_defaulted():
    g = fx.Graph()
    x = _placeholder(g, "x", (4,))
    _node(g, c10d.all_reduce.default, (x, "sum"), _meta((4,)), {"group_name": "9"})
    g.output(None)
    gm = _gm(g)
    with pytest.raises(ValueError, match=r"'9'.*all_reduce"):
        graph_stats(gm)
    assert graph_stats(gm, group_dims={"9": "ep"}).collective_count("all_reduce", "ep") == 1
    with pytest.raises(ValueError, match=r"'9'"):
        graph_stats(_gm(g, dims={}))  # an empty map is not "everything is dp"


def test_categories_of_tricky_nodes():
    g = fx.Graph()
    x = _placeholder(g, "x", (4, 4))
    cases = {
        "view": [_node(g, aten.t.default, (x,), _meta((4, 4))), _node(g, aten.reshape.default, (x, [16]), _meta((16,))),
                 _node(g, aten._unsafe_view.default, (x, [16]), _meta((16,)))],
        "compute": [_node(g, aten.clone.default, (x,), _meta((4, 4))), _node(g, aten.mm.default, (x, x), _meta((4, 4))),
                    g.call_method("relu", (x,))],
        "other": [_node(g, aten.sym_size.int, (x, 0), 4), _node(g, operator.getitem, (x, 0), _meta((4,))), g.get_attr("w")],
        "wait": [_node(g, c10d.wait_tensor.default, (x,), _meta((4, 4)))],
        "collective": [_node(g, c10d.all_gather_into_tensor.default, (x, 2, "1"), _meta((8, 4)))],
    }
    for cat, nodes in cases.items():
        assert [node_category(n) for n in nodes] == [cat] * len(nodes), cat


def _pair(tangent_by_role: bool, saved_dtype=torch.float32):
    fg = fx.Graph()
    w = _placeholder(fg, "primals_1", (8, 8))
    y = _node(fg, aten.relu.default, (w,), _meta((8, 8)))
    s = _node(fg, aten.sum.default, (y,), _meta(()))
    M.custom_meta(y)[M.AP_MUST_SAVE] = True
    M.custom_meta(s)[M.AP_MUST_SAVE] = False  # recorded as NOT saved: must not count
    fg.output((s, y))
    bg = fx.Graph()
    saved = _placeholder(bg, "y", (8, 8), saved_dtype)
    sym = bg.placeholder("sym")  # a saved SymInt: not a tensor, not counted
    sym.meta[M.VAL] = 8
    if tangent_by_role:
        tan = _placeholder(bg, "grad_in", (), role="tangent:loss")  # named like any saved value
    else:
        tan = _placeholder(bg, "tangents_1", ())
    gr = _node(bg, aten.mul.Tensor, (saved, tan), _meta((8, 8)))
    bg.output((gr,))
    return _gm(fg), _gm(bg)


@pytest.mark.parametrize("tangent_by_role", [True, False])
def test_saved_tensors_exclude_tangents_and_symints(tangent_by_role):
    ps = partition_stats(*_pair(tangent_by_role))
    assert (ps.saved_count, ps.saved_bytes) == (1, 8 * 8 * 4)
    assert ps.fw.must_save == 1  # must_save=False is not a save


def test_saved_bytes_follow_the_dtype():
    assert partition_stats(*_pair(True, torch.bfloat16)).saved_bytes == 8 * 8 * 2


def test_table_shows_every_kind_and_dim_it_counted():
    """A table that dropped a row would hide a changed count from the golden reviewer."""
    g = fx.Graph()
    x = _placeholder(g, "x", (4,))
    _node(g, c10d.all_gather_into_tensor.default, (x, 2, "3"), _meta((8,)))
    _node(g, c10d.all_gather_into_tensor.default, (x, 2, "1"), _meta((8,)))
    _node(g, c10d.all_to_all_single.default, (x, [2, 2], [2, 2], "1"), _meta((4,)))
    g.output(None)
    st = graph_stats(_gm(g))
    table = format_stats_table(st)
    rows = [ln.split()[:3] for ln in table.splitlines()[2:5]]
    assert rows == [["all_gather", "dp", "1"], ["all_gather", "tp", "1"], ["all_to_all", "dp", "1"]]
    st.collectives["all_gather"]["dp"].count = 2  # a wrong count shows in the text
    assert format_stats_table(st) != table
