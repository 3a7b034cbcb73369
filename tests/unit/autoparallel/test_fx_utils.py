"""The shared helpers of autoparallel/fx_utils.py on small hand-built FX graphs (dtype casts,
group arguments, sizes, group resolution, wait lookup, the compute-run metric, graph copies,
the missing-val error)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    collective_bytes,
    copy_graph_module,
    group_arg,
    group_arg_index,
    group_arg_name,
    group_of,
    group_size_of,
    is_dtype_cast,
    is_flop_compute,
    max_consec_compute_between_rs,
    missing_val_error,
    node_val,
    resolve_attr,
    resolve_group,
    tensor_bytes,
    wait_of,
)
from autoparallel.mesh import fake_world
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
prims = torch.ops.prims
_c10d = torch.ops._c10d_functional
GROUPS = {"dp": ("0", 4), "tp": ("1", 2)}  # group names without a running world
H = 64


def _bare():
    """An empty graph and one placeholder (no vals: the predicates here only read structure)."""
    g = fx.Graph()
    return g, g.placeholder("x")


# --- is_dtype_cast ------------------------------------------------------------------------------


def test_dtype_casts():
    g, x = _bare()
    bf16 = torch.bfloat16
    assert is_dtype_cast(g.call_function(prims.convert_element_type.default, (x, bf16)))
    assert is_dtype_cast(g.call_function(aten._to_copy.default, (x,), {"dtype": bf16}))


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((), {}),  # a plain copy
        ((), {"device": "cpu"}),  # moves, no dtype
        ((), {"dtype": torch.bfloat16, "device": "cpu"}),  # also moves
        ((0,), {"dtype": torch.bfloat16}),  # more than the input positionally
    ],
)
def test_to_copy_that_is_not_only_a_dtype_cast(args, kwargs):
    g, x = _bare()
    assert not is_dtype_cast(g.call_function(aten._to_copy.default, (x, *args), kwargs))


def test_other_nodes_are_not_dtype_casts():
    g, x = _bare()
    assert not is_dtype_cast(x)
    assert not is_dtype_cast(g.call_function(aten.relu.default, (x,)))
    assert not is_dtype_cast(g.call_method("to", (x, torch.bfloat16)))


# --- group_arg_index / group_of -----------------------------------------------------------------


def test_group_arg_index_per_collective():
    g, x = _bare()
    assert group_arg_index(g.call_function(ALL_GATHER, (x, 4, "0"))) == 2
    assert group_arg_index(g.call_function(REDUCE_SCATTER, (x, "sum", 4, "0"))) == 3
    assert group_arg_index(g.call_function(ALL_REDUCE, (x, "sum", "1"))) == 2
    assert group_arg_index(g.call_function(WAIT, (x,))) is None  # _c10d_functional, no group
    assert group_arg_index(g.call_function(aten.relu.default, (x,))) is None
    assert group_arg_index(g.call_function(operator.add, (x, x))) is None
    assert group_arg_index(x) is None


def test_group_of_positional_and_keyword():
    g, x = _bare()
    assert group_of(g.call_function(REDUCE_SCATTER, (x, "sum", 4, "7"))) == "7"
    assert group_of(g.call_function(REDUCE_SCATTER, (x, "sum", 4), {"group_name": "5"})) == "5"
    assert group_of(g.call_function(ALL_GATHER, (x, 4), {"group_name": "3"})) == "3"
    assert group_of(g.call_function(aten.relu.default, (x,))) is None


# --- node_val / tensor_bytes / collective_bytes ---------------------------------------------------


def test_node_val_and_its_error():
    b = GraphBuilder(GROUPS)
    x = b.placeholder("x", (2, 3))
    assert node_val(x, "anything") is x.meta["val"]
    del x.meta["val"]
    with pytest.raises(
        ValueError,
        match=r"node 'x' \(%x : .*\) has no meta\['val'\], needed for my reason; "
        r"propagate FakeTensor vals first \(trace with make_fx/aot or run FakeTensorProp\)",
    ):
        node_val(x, "my reason")


def test_tensor_bytes():
    assert tensor_bytes(torch.empty(3, 5, device="meta")) == 60
    assert tensor_bytes(torch.empty(3, 5, dtype=torch.bfloat16, device="meta")) == 30
    assert tensor_bytes(torch.empty(0, 5, device="meta")) == 0


def test_tensor_bytes_of_symbolic_sizes():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, ConstantSource("s")), hint=6)
    u = env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        backed, unbacked = torch.empty(s, 4), torch.empty(u, 4)
    assert tensor_bytes(backed) == 6 * 4 * 4  # the trace-time hint
    assert tensor_bytes(unbacked) == 0  # no hint: counted as empty


def test_collective_bytes_is_the_full_buffer():
    b = GraphBuilder(GROUPS)
    ag = b.all_gather(b.placeholder("x", (2, 8)), "dp").args[0]  # [2, 8] -> [8, 8]
    rs = b.reduce_scatter(b.placeholder("g", (8, 8)), "dp").args[0]  # [8, 8] -> [2, 8]
    ar = b.all_reduce(b.placeholder("h", (3, 8), dtype=torch.bfloat16), "tp").args[0]
    assert (collective_bytes(ag), collective_bytes(rs), collective_bytes(ar)) == (256, 256, 48)


def test_collective_bytes_names_the_missing_val():
    b = GraphBuilder(GROUPS)
    ag = b.all_gather(b.placeholder("x", (2, 8)), "dp").args[0]
    del ag.meta["val"]
    with pytest.raises(ValueError, match=rf"node '{ag.name}' .*needed for the collective's size;"):
        collective_bytes(ag)
    rs = b.reduce_scatter(b.placeholder("g", (8, 8)), "dp").args[0]
    del rs.args[0].meta["val"]
    with pytest.raises(
        ValueError, match=rf"node 'g' .*needed for the size of collective '{rs.name}';"
    ):
        collective_bytes(rs)


# --- resolve_group ------------------------------------------------------------------------------


def test_resolve_group_in_a_world():
    with fake_world("dp=4,tp=2") as mesh:
        b = GraphBuilder(mesh_groups(mesh))
        ar = b.all_reduce(b.placeholder("x", (2,)), "tp").args[0]
        assert resolve_group(ar).size() == 2
        ar.args = (*ar.args[:2], "no_such_group")
        with pytest.raises(
            ValueError,
            match=rf"node '{ar.name}' uses unknown process group 'no_such_group': .*rebind the "
            r"graph to this world \(autoparallel\.runtime\.rebind\.rebind_groups\) or trace it "
            "on this world",
        ):
            resolve_group(ar)


def test_resolve_group_needs_a_world(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    b = GraphBuilder(GROUPS)
    ag = b.all_gather(b.placeholder("x", (2,)), "dp").args[0]
    with pytest.raises(
        ValueError,
        match=rf"node '{ag.name}' uses process group '0' but no world is running; enter "
        r"autoparallel\.mesh\.fake_world\(\.\.\.\) \(or a real world\) whose groups the graph "
        "names",
    ):
        resolve_group(ag)


def test_resolve_group_of_a_non_collective():
    g, x = _bare()
    with pytest.raises(ValueError, match="node 'x' is not a _c10d_functional collective"):
        resolve_group(x)


# --- wait_of ----------------------------------------------------------------------------------


def test_wait_of():
    g, x = _bare()
    ag = g.call_function(ALL_GATHER, (x, 4, "0"))
    w = g.call_function(WAIT, (ag,))
    assert wait_of(ag) is w
    g.call_function(WAIT, (ag,))
    assert wait_of(ag) is None  # two users
    rs = g.call_function(REDUCE_SCATTER, (x, "sum", 4, "0"))
    g.call_function(aten.relu.default, (rs,))
    assert wait_of(rs) is None  # one user, not a wait
    ar = g.call_function(ALL_REDUCE, (x, "sum", "0"))
    assert wait_of(ar) is None  # no user
    g.output((ar,))
    assert wait_of(ar) is None  # the output node


# --- is_flop_compute / max_consec_compute_between_rs ---------------------------------------------


def test_is_flop_compute():
    g, x = _bare()
    assert is_flop_compute(g.call_function(aten.mm.default, (x, x)))
    assert is_flop_compute(g.call_function(aten.mm, (x, x)))  # an op packet
    assert is_flop_compute(
        g.call_function(aten._scaled_dot_product_flash_attention.default, (x, x, x))
    )
    assert not is_flop_compute(g.call_function(aten.relu.default, (x,)))
    assert not is_flop_compute(g.call_function(operator.add, (x, x)))
    assert not is_flop_compute(x)
    assert not is_flop_compute(g.call_module("mm", (x, x)))


def _metric_graph(pattern: str) -> fx.Graph:
    """``m``: an mm, ``r``: a reduce-scatter, ``c``: a coalesced reduce-scatter, ``e``: relu."""
    g, x = _bare()
    for ch in pattern:
        if ch == "m":
            g.call_function(aten.mm.default, (x, x))
        elif ch == "e":
            g.call_function(aten.relu.default, (x,))
        elif ch == "r":
            g.call_function(REDUCE_SCATTER, (x, "sum", 4, "0"))
        elif ch == "c":
            g.call_function(_c10d.reduce_scatter_tensor_coalesced.default, ([x], "sum", 4, "0"))
    g.output(())
    return g


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("mmmm", 0),  # no reduce-scatter
        ("mmmmr", 0),  # compute before the first reduce-scatter does not count
        ("rmmmm", 0),  # nor after the last one
        ("rr", 0),
        ("rmr", 1),
        ("mmrmemrmmmermmmmmm", 3),  # relu is not compute; longest closed run is 3
        ("rmmcmr", 2),  # the coalesced variant separates runs too
        ("rmmmrmr", 3),  # the longest run need not be the last
    ],
)
def test_max_consec_compute_between_rs(pattern, expected):
    assert max_consec_compute_between_rs(_metric_graph(pattern)) == expected


def test_max_consec_compute_with_custom_compute():
    g = _metric_graph("rmemer")

    def everything(n):
        return n.op == "call_function"

    assert max_consec_compute_between_rs(g, is_compute=everything) == 4


# --- copy_graph_module / missing_val_error ---------------------------------------------------------


def test_copy_graph_module_is_independent_and_keeps_the_calling_convention():
    def f(xs):  # a pytree input: the copy must keep gm(list) working
        return [xs[0].relu() + xs[1]]

    gm = make_fx(f, tracing_mode="fake")([torch.randn(3), torch.randn(3)])
    gm.meta[M.GM_STAGE] = "s"
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.meta[M.RECOMPUTE] = "tag"
    out = copy_graph_module(gm)
    assert [n.name for n in out.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert out.meta == gm.meta and out.meta is not gm.meta
    copied = next(n for n in out.graph.nodes if n.name == relu.name)
    assert copied is not relu and copied.meta[M.RECOMPUTE] == "tag" and copied.meta is not relu.meta
    copied.meta[M.RECOMPUTE] = "changed"
    copied.target = torch.ops.aten.neg.default
    out.recompile()
    assert relu.meta[M.RECOMPUTE] == "tag" and relu.target is torch.ops.aten.relu.default
    x = [torch.tensor([-1.0, 2.0, 3.0]), torch.ones(3)]
    assert torch.equal(gm(x)[0], torch.tensor([1.0, 3.0, 4.0]))
    assert torch.equal(out(x)[0], torch.tensor([2.0, -1.0, -2.0]))


def test_missing_val_error_names_node_need_and_hint():
    b = GraphBuilder(GROUPS)
    x = b.placeholder("x", (2,))
    err = missing_val_error(x, "a reason", "; or else")
    assert isinstance(err, ValueError)
    assert str(err).startswith("node 'x' (%x : ") and str(err).endswith(
        "has no meta['val'], needed for a reason; propagate FakeTensor vals first (trace with "
        "make_fx/aot or run FakeTensorProp); or else"
    )


# --- group_size_of (moved from passes/test_topo_span_bucketing.py) ------------------------------


def test_group_size_of(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    ag = b.all_gather(b.param((1, H)), "dp").args[0]
    assert group_size_of(ag) == 4
    ag.args = (ag.args[0], 1, ag.args[2])  # the argument wins over the world's size
    assert group_size_of(ag) == 1
    ag.args, ag.kwargs = (ag.args[0],), {"group_size": 3, "group_name": ag.args[2]}
    assert group_size_of(ag) == 3
    ar = b.all_reduce(b.param((1, H)), "tp").args[0]
    assert ar.target is ALL_REDUCE and group_size_of(ar) == 2  # no argument: the world's
    relu = b.call(aten.relu.default, b.param((1, H)))
    with pytest.raises(ValueError, match="node 'relu_default' is not a _c10d_functional"):
        group_size_of(relu)


def test_group_size_of_a_python_function_node():
    g = fx.Graph()
    x = g.placeholder("x")
    with pytest.raises(ValueError, match="node 'add' is not a _c10d_functional collective"):
        group_size_of(g.call_function(operator.add, (x, x)))


def test_group_arg_name_and_resolve_attr():
    assert group_arg_name(type("PG", (), {"group_name": "7"})()) == "7" and group_arg_name(3) == "3"
    root = torch.nn.Module()
    root.sub = torch.nn.Module()
    root.sub.register_buffer("scale", torch.ones(1))
    assert resolve_attr(root, "sub.scale") is root.sub.scale
    assert resolve_attr(root, "sub.nope.deeper") is None


def test_group_arg_positional_keyword_or_none():

    g = fx.Graph()
    x = g.placeholder("x")
    pos = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "5"))
    kw = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum"), {"group_name": "6"})
    plain = g.call_function(aten.relu.default, (x,))
    assert (group_arg(pos), group_arg(kw), group_arg(plain), group_arg(x)) == ("5", "6", None, None)
    # the autograd twins name a group too; group_arg_index is for _c10d_functional only
    node = g.call_function(torch.ops._c10d_functional_autograd.all_gather_into_tensor.default, (x, 2, "7"))
    assert group_arg(node) == "7" and group_arg_index(node) is None
