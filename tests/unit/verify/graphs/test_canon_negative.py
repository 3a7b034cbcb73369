"""verify.graphs.canon against wrong input: graphs that differ must print differently, graphs that differ
only in what canon promises to ignore must print the same, and names stay local to their scope.

The weaker canonicalizers these kill: one that drops tags, groups, dtypes or constants; one that
prints shapes only; one that numbers nodes globally (an inserted node renames the whole graph);
one that reads FX node names or creation order; one that prints a dangling argument instead of
refusing the graph.
"""

from __future__ import annotations

import difflib

import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from verify.graphs.canon import canonicalize, node_names

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _val(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _block(*, op=aten.relu.default, scale=2.0, dtype=torch.float32, rows=8, group="0", policy=None,
           path="blocks.0.ffn", extra_mul=False, names=None) -> fx.GraphModule:
    """all_gather(w) -> t -> mm(x, .) -> op -> mul(., scale) -> sum, with knobs for every field
    canon prints. Node FX names are taken from ``names`` when given."""
    names = names or {}
    g = fx.Graph()

    def node(target, args, val, key, kwargs=None, scope=path):
        n = g.call_function(target, args, kwargs or {}, name=names.get(key))
        n.meta[M.VAL] = val
        if scope:
            M.custom_meta(n)[M.MODULE_PATH] = scope
        return n

    x = g.placeholder(names.get("x", "x"))
    x.meta[M.ROLE], x.meta[M.VAL] = "input:0", _val((rows, 16), dtype)
    w = g.placeholder(names.get("w", "w"))
    w.meta[M.ROLE], w.meta[M.VAL] = "param:blocks.0.ffn.w.weight", _val((4, 16), dtype)
    ag = node(c10d.all_gather_into_tensor.default, (w, 4, group), _val((16, 16), dtype), "ag", scope=path + ".w.weight")
    if policy is not None:
        ag.meta[M.RECOMPUTE] = policy
    wt = node(c10d.wait_tensor.default, (ag,), _val((16, 16), dtype), "wt", scope=path + ".w.weight")
    t = node(aten.t.default, (wt,), _val((16, 16), dtype), "t", scope=path + ".w")
    mm = node(aten.mm.default, (x, t), _val((rows, 16), dtype), "mm", scope=path + ".w")
    act = node(op, (mm,), _val((rows, 16), dtype), "act")
    mul = node(aten.mul.Tensor, (act, scale), _val((rows, 16), dtype), "mul")
    if extra_mul:
        mul = node(aten.mul.Tensor, (mul, 3.0), _val((rows, 16), dtype), "extra")
    out = node(aten.sum.default, (mul,), _val((), dtype), "sum", scope=None)
    g.output((out,)).meta[M.ROLE] = ["loss"]
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {"0": "dp", "1": "tp"}
    return gm


def changed_lines(a: str, b: str) -> list[str]:
    """Lines of ``b`` that are not in ``a`` at the same place (a replaced line counts once)."""
    out = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a.splitlines(), b.splitlines(), autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            out.extend(b.splitlines()[j1:j2])
    return out


BASE = canonicalize(_block())


@pytest.mark.parametrize(
    "what, kwargs, line",
    [
        ("op", dict(op=aten.gelu.default), "blocks.0.ffn/gelu_0: f32[8, 16] = aten.gelu.default(blocks.0.ffn.w/mm_0)"),
        ("constant arg", dict(scale=2.5), "blocks.0.ffn/mul_0: f32[8, 16] = aten.mul.Tensor(blocks.0.ffn/relu_0, 2.5)"),
        ("shape", dict(rows=4), "input:0: f32[4, 16]"),
        ("tag", dict(policy=CheckpointPolicy.MUST_RECOMPUTE), "{recompute=MUST_RECOMPUTE}"),
        ("group", dict(group="1"), "all_gather_into_tensor.default(param:blocks.0.ffn.w.weight, 4, tp)"),
        ("module", dict(path="blocks.1.ffn"), "blocks.1.ffn/relu_0: f32[8, 16] = aten.relu.default(blocks.1.ffn.w/mm_0)"),
    ],
)
def test_one_difference_changes_the_text_where_it_is(what, kwargs, line):
    text = canonicalize(_block(**kwargs))
    assert text != BASE, what
    assert any(line in ln for ln in changed_lines(BASE, text)), (what, changed_lines(BASE, text))


def test_dtype_difference_shows_on_every_value():
    text = canonicalize(_block(dtype=torch.bfloat16))
    assert text != BASE
    assert "input:0: bf16[8, 16]" in text and "f32" not in text


@pytest.mark.parametrize("key, value, shown", [
    (M.AP_MUST_SAVE, True, "{must_save}"),
    (M.PHASE, M.PHASE_FORWARD, "{phase=forward}"),
])
def test_custom_tags_change_the_text(key, value, shown):
    gm = _block()
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    M.custom_meta(mul)[key] = value
    assert [ln for ln in changed_lines(BASE, canonicalize(gm)) if shown in ln]


def test_bucket_tag_changes_the_text():
    gm = _block()
    M.set_bucket_tag(next(n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default), "fsdp_ag")
    (line,) = changed_lines(BASE, canonicalize(gm))
    assert line.endswith("{bucket=fsdp_ag}")


def test_argument_order_changes_the_text():
    gm = _block()
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    mm.args = (mm.args[1], mm.args[0])
    (line,) = changed_lines(BASE, canonicalize(gm))
    assert "aten.mm.default(blocks.0.ffn.w/t_0, input:0)" in line


def test_fx_names_and_creation_order_do_not_matter():
    odd = {k: f"n{i}_{k}" for i, k in enumerate(["x", "w", "ag", "wt", "t", "mm", "act", "mul", "sum"])}
    assert canonicalize(_block(names=odd)) == BASE
    # The same graph order, nodes created in another order: the mm is created before the t it reads.
    g = _block().graph
    mm = next(n for n in g.nodes if n.target is aten.mm.default)
    t = mm.args[1]
    with g.inserting_before(mm):
        new_mm = g.call_function(aten.mm.default, mm.args)
    new_mm.meta = dict(mm.meta)
    mm.replace_all_uses_with(new_mm)
    g.erase_node(mm)
    with g.inserting_before(new_mm):
        new_t = g.call_function(aten.t.default, t.args)  # created after the mm that uses it
    new_t.meta = dict(t.meta)
    t.replace_all_uses_with(new_t)
    g.erase_node(t)
    assert canonicalize(g) == BASE


def test_graph_order_of_independent_nodes_is_shown():
    """Intended: a scheduling pass that reorders independent nodes shows up in the diff."""
    gm = _block()
    g = gm.graph
    x = next(iter(g.nodes))
    ag = next(n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default)
    early = g.call_function(aten.neg.default, (x,))
    early.meta[M.VAL] = _val((8, 16))
    late = g.call_function(aten.abs.default, (x,))
    late.meta[M.VAL] = _val((8, 16))
    for n in (early, late):
        n.prev.append(n)  # detach from the end ...
    ag.prepend(early)
    ag.prepend(late)
    text_a = canonicalize(gm)
    ag.prepend(early)  # ... now after late
    assert canonicalize(gm) != text_a
    assert sorted(canonicalize(gm).splitlines()) == sorted(text_a.splitlines())


# --- names are local to their scope -------------------------------------------------------------


def test_names_are_numbered_per_op_within_the_module_path():
    lines = BASE.splitlines()
    assert "blocks.0.ffn.w.weight/all_gather_into_tensor_0: f32[16, 16] = " in BASE
    assert "blocks.0.ffn.w/mm_0: f32[8, 16] = aten.mm.default(input:0, blocks.0.ffn.w/t_0)" in lines
    # No module of its own: numbered in the scope of its input.
    assert lines[-3] == "blocks.0.ffn/sum_0: f32[] = aten.sum.default(blocks.0.ffn/mul_0)"


def test_an_inserted_node_renames_only_its_scope():
    """An extra mul in blocks.0.ffn: the mul after it in that scope is renumbered, the sum that
    reads it changes its argument, nothing else (a global counter would rename the other mul)."""
    text = canonicalize(_block(extra_mul=True))
    assert changed_lines(BASE, text) == [
        "blocks.0.ffn/mul_1: f32[8, 16] = aten.mul.Tensor(blocks.0.ffn/mul_0, 3.0)",
        "blocks.0.ffn/sum_0: f32[] = aten.sum.default(blocks.0.ffn/mul_1)",
    ]


def _graph_with(meta_by_node: list[dict], *, phases=None) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = _val((2,))
    prev = x
    for i, meta in enumerate(meta_by_node):
        n = g.call_function(aten.neg.default, (prev,))
        n.meta[M.VAL] = _val((2,))
        n.meta.update(meta)
        if phases:
            n.meta[M.PARTITIONER_TAG] = phases[i]
        prev = n
    g.output(prev)
    return g


def _in_graph_order(g: fx.Graph) -> list[str]:
    names = node_names(g)
    return [names[n] for n in g.nodes if n.op not in ("placeholder", "output")]


def test_nn_module_stack_and_ac_region_give_scopes():
    stack_make_fx = {M.NN_MODULE_STACK: {"": ("", "M"), "blocks.0": ("blocks.0", "Inner"), "blocks.0.lin": ("blocks.0.lin", "L")}}
    stack_dynamo = {M.NN_MODULE_STACK: {"140": ("L['self'].layers[0]", "B"), "141": ("L['self'].layers[0].attention", "A")}}
    stack_dynamo_keys = {M.NN_MODULE_STACK: {"1": ("L['self'].layers['1'].mlp", "A")}}
    region = {M.CUSTOM: {M.AC_REGION: 3}}
    both = {M.CUSTOM: {M.MODULE_PATH: "wins", M.AC_REGION: 3}, **stack_make_fx}
    names = _in_graph_order(_graph_with([stack_make_fx, stack_dynamo, stack_dynamo_keys, region, both]))
    assert names == ["blocks.0.lin/neg_0", "layers.0.attention/neg_0", "layers.1.mlp/neg_0", "ac3/neg_0", "wins/neg_0"]


def test_borrowed_scope_comes_from_the_latest_own_scoped_input_and_never_chains():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.neg.default, (x,))
    M.custom_meta(a)[M.MODULE_PATH] = "a"
    b = g.call_function(aten.neg.default, (x,))
    M.custom_meta(b)[M.MODULE_PATH] = "b"
    acc = g.call_function(aten.add.Tensor, (a, b))  # no scope: borrows from b, the later input
    acc2 = g.call_function(aten.add.Tensor, (acc, x))  # acc's scope is borrowed: not passed on
    g.output((acc2,))
    for n in g.nodes:
        n.meta.setdefault(M.VAL, _val((2,)))
    names = node_names(g)
    assert names[acc] == "b/add_0" and names[acc2] == "add_0"
    acc.args = (b, a)
    assert node_names(g)[acc] == "b/add_0"  # argument order does not matter, graph order does


def test_backward_nodes_have_their_own_counters_counted_from_the_end():
    g = _graph_with([{M.CUSTOM: {M.MODULE_PATH: "m"}}] * 4, phases=["is_forward", "is_forward", "is_backward", "is_backward"])
    assert _in_graph_order(g) == ["m/neg_0", "m/neg_1", "m/bw/neg_1", "m/bw/neg_0"]
    trainer = _graph_with([{M.CUSTOM: {M.PHASE: M.PHASE_BACKWARD}}] * 2)
    assert _in_graph_order(trainer) == ["bw/neg_1", "bw/neg_0"]


def test_names_stay_unique_when_scopes_collide():
    g = _graph_with([{M.CUSTOM: {M.MODULE_PATH: "m/bw"}}, {M.CUSTOM: {M.MODULE_PATH: "m"}}], phases=["is_forward", "is_backward"])
    assert _in_graph_order(g) == ["m/bw/neg_0", "m/bw/neg_1"]


# --- bad input ----------------------------------------------------------------------------------


def test_use_before_definition_names_both_nodes():
    gm = _block()
    g = gm.graph
    mm = next(n for n in g.nodes if n.target is aten.mm.default)
    act = next(iter(mm.users))
    mm.prepend(act)  # act (reads mm) now sits before mm
    with pytest.raises(ValueError, match=r"node 'relu\w*' \(aten.relu.default\) uses 'mm\w*' before it is defined: .*topological"):
        canonicalize(gm)


def test_argument_from_another_graph_is_refused():
    other = fx.Graph()
    foreign = other.placeholder("foreign")
    g = fx.Graph()
    n = g.call_function(aten.neg.default, (foreign,), name="reads_foreign")
    n.meta[M.VAL] = _val((2,))
    g.output(n)
    with pytest.raises(ValueError, match=r"'reads_foreign' .* uses 'foreign' which is not a node of this graph"):
        canonicalize(g)


def test_not_a_graph_is_a_type_error():
    with pytest.raises(TypeError, match="expected an fx.GraphModule or fx.Graph, got Linear"):
        canonicalize(torch.nn.Linear(2, 2))
