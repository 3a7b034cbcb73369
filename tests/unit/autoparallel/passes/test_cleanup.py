"""cleanup_graph, the first step at the apply_placement boundary (autoparallel/passes/cleanup.py):
CSE, no-op removal, DCE and view -> reshape on a small traced function, what its report counts,
and a node without a FakeTensor value rejected by name.
"""

import operator
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel.passes.cleanup import CleanupReport, cleanup_graph
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten


def _traced_for_cleanup():
    def f(x):
        a = x.view(2, 8)  # view -> reshape
        b, c = torch.relu(a), torch.relu(a)  # CSE merges the second relu
        unused = x * 2  # dead code  # noqa: F841
        return b.clone() + c  # the clone is a no-op

    gm = make_fx(f, tracing_mode="fake")(torch.randn(16))
    x = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(x):  # an unused node whose target is not an OpOverload
        item = gm.graph.call_function(operator.getitem, (x, 0))
    item.meta[M.VAL] = x.meta[M.VAL][0]
    return gm


def test_cleanup_report_counts_removed_ops_by_name():
    gm = _traced_for_cleanup()
    report = cleanup_graph(gm)
    assert report == CleanupReport(
        nodes_before=9,
        nodes_after=5,
        removed={"<built-in function getitem>": 1, "aten.relu": 1, "aten.clone": 1, "aten.mul": 1},
        views_to_reshape=1,
    )
    assert report.summary() == (
        "9 -> 5 nodes (removed: <built-in function getitem> x1, aten.clone x1, aten.mul x1, aten.relu x1); "
        "1 view -> reshape"
    )
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        aten.reshape.default, aten.relu.default, aten.add.Tensor
    ]


def test_cleanup_report_when_nothing_is_removed():
    report = cleanup_graph(make_fx(torch.relu, tracing_mode="fake")(torch.randn(4)))
    assert report.summary() == "3 -> 3 nodes (removed: none); 0 view -> reshape"


def test_cleanup_rejects_a_node_without_val_by_name():
    gm = _traced_for_cleanup()
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    del relu.meta[M.VAL]
    message = (
        f"node 'relu' ({relu.format_node()}) has no meta['val'], needed for the clean-up's no-op removal "
        "(it compares input and output values); propagate FakeTensor vals first (trace with make_fx/aot "
        "or run FakeTensorProp)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cleanup_graph(gm)


def test_a_collective_merged_by_cse_keeps_one_wait(mesh):
    """Two gradients computed alike (GPT-NeoX) give two identical reduce-scatters; CSE merges them
    but not their waits, and the bucketing passes refuse a collective with two waits."""
    b = GraphBuilder(mesh_groups(mesh))
    a = b.placeholder("a", (4, 8), role="input:0")
    g = b.call(torch.ops.aten.mm.default, b.call(torch.ops.aten.t.default, a), a)  # [8, 8]
    first, second = b.reduce_scatter(g, "dp"), b.reduce_scatter(g, "dp")
    gm = b.output([first, second], ["grad:p0", "grad:p1"])
    report = cleanup_graph(gm)
    collectives = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.reduce_scatter_tensor.default)
    waits = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.wait_tensor.default)
    assert len(collectives) == 1 and len(waits) == 1
    assert list(gm.graph.output_node().args[0]) == [waits[0], waits[0]]
    assert report.removed["_c10d_functional.wait_tensor"] == 1
    gm.graph.lint()


def _traced_with_an_assert():
    """one_hot's range check (longcat_flash's router): ``aten._assert_async.msg``, an op that returns
    nothing, traced without ``meta['val']``."""
    def f(x):
        torch._assert_async((x >= 0).all(), "Class values must be non-negative.")
        return x.clone() * 2

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4))
    (check,) = gm.graph.find_nodes(op="call_function", target=aten._assert_async.msg)
    check.meta.pop(M.VAL, None)  # AOT's trace leaves it none (make_fx stores None)
    return gm


def test_an_op_that_returns_nothing_passes_the_cleanup_and_is_kept():
    gm = _traced_with_an_assert()
    report = cleanup_graph(gm)
    assert gm.graph.find_nodes(op="call_function", target=aten._assert_async.msg), "the assert was removed"
    assert report.removed == {"aten.clone": 1}
    assert torch.equal(gm(torch.ones(4)), torch.full((4,), 2.0))
    with pytest.raises(RuntimeError):
        gm(-torch.ones(4))  # the kept check still fires


def test_an_op_with_an_output_and_no_val_is_still_rejected():
    gm = _traced_with_an_assert()
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    del mul.meta[M.VAL]
    with pytest.raises(ValueError, match="node 'mul' .* has no meta\\['val'\\]"):
        cleanup_graph(gm)
