"""mark_fsdp_all_gather_recomputation on hand-built FX graphs, plus one traced toy model.

Hand-built graphs: placeholder -> _to_copy(dtype) -> all_gather -> wait -> layout chain -> mm,
an activation all-gather (not FSDP), and malformed graphs that must be rejected by name.
"""

import logging
import operator
import re

import pytest
import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER, WAIT
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, build_joint_graph
from autoparallel.partition import apply_placement
from autoparallel.passes.fsdp_recompute import (
    is_fsdp_all_gather,
    mark_fsdp_all_gather_recomputation,
)

aten = torch.ops.aten
MUST_RECOMPUTE, MUST_SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE


def _node(g, target, args, val, kwargs=None):
    n = g.call_function(target, args, kwargs or {})
    if val is not None:
        n.meta[M.VAL] = val
    return n


def _placeholder(g, name, val, role):
    n = g.placeholder(name)
    n.meta[M.VAL] = val
    n.meta[M.ROLE] = role
    return n


def _fsdp_graph(chain=("permute",), cast=True, with_val=True, activation_ag=False):
    """w [4, 8] shard -> (cast bf16) -> all_gather(x4) -> wait [16, 8] -> chain -> mm(x, .)."""
    g = fx.Graph()
    dt = torch.bfloat16 if cast else torch.float32
    w = _placeholder(g, "w", torch.empty(4, 8, device="meta"), "param:lin.weight")
    x = _placeholder(g, "x", torch.empty(2, 8, device="meta", dtype=dt), "input:0")
    nodes = {"w": w, "x": x}
    src = w
    if cast:
        src = nodes["cast"] = _node(g, aten._to_copy.default, (w,), torch.empty(4, 8, device="meta", dtype=dt), {"dtype": dt})
    val = (lambda *s: torch.empty(*s, device="meta", dtype=dt)) if with_val else (lambda *s: None)
    ag = nodes["ag"] = _node(g, ALL_GATHER, (src, 4, "dp"), val(16, 8))
    cur = nodes["wait"] = _node(g, WAIT, (ag,), val(16, 8))
    for op in chain:
        if op == "permute":
            cur = nodes[op] = _node(g, aten.permute.default, (cur, [1, 0]), val(8, 16))
        elif op == "t":
            cur = nodes[op] = _node(g, aten.t.default, (cur,), val(8, 16))
        elif op == "view":
            cur = nodes[op] = _node(g, aten.view.default, (cur, [8, 16]), val(8, 16))
        elif op == "slice":
            cur = nodes[op] = _node(g, aten.slice.Tensor, (cur, 0, 0, 16), val(*cur.meta[M.VAL].shape) if with_val else None)
        elif op == "cast32":
            cur = nodes[op] = _node(g, aten._to_copy.default, (cur,), torch.empty(*cur.meta[M.VAL].shape, device="meta"), {"dtype": torch.float32})
    out = nodes["mm"] = _node(g, aten.mm.default, (x, cur), torch.empty(2, cur.meta[M.VAL].shape[-1] if with_val else 16, device="meta", dtype=dt))
    if activation_ag:
        ag2 = nodes["act_ag"] = _node(g, ALL_GATHER, (out, 2, "tp"), torch.empty(4, 16, device="meta", dtype=dt))
        out = nodes["act_wait"] = _node(g, WAIT, (ag2,), torch.empty(4, 16, device="meta", dtype=dt))
        out = nodes["act_relu"] = _node(g, aten.relu.default, (out,), torch.empty(4, 16, device="meta", dtype=dt))
    g.output((out,))
    return g, nodes


def _tags(node):
    return node.meta.get(M.RECOMPUTE), node.meta.get(M.AC_GRAPH_ID)


def test_recompute_tags_cast_all_gather_wait_and_chain():
    g, n = _fsdp_graph(chain=("slice", "permute", "view"))
    report = mark_fsdp_all_gather_recomputation(g)
    for name in ("cast", "ag", "wait", "slice", "permute", "view"):
        assert _tags(n[name]) == (MUST_RECOMPUTE, M.AP_AC_GRAPH_ID), name
    for name in ("w", "x", "mm"):
        assert M.RECOMPUTE not in n[name].meta, name
    assert report.all_gathers == [n["ag"]] and not report.saved
    assert report.gathered_bytes == 16 * 8 * 2  # bf16
    g.lint()


def test_transposed_weight_after_wait_is_recomputed_not_saved(first_partition_toy):
    """The seed's bug: only the all-gather and wait tagged, so the permute/t after the wait (the
    transposed full weight) was saved for backward. Now the chain is recomputed and the backward
    re-gathers the weight from the saved shard."""
    fw, bw = first_partition_toy
    saved = [ph for ph in bw.graph.find_nodes(op="placeholder") if not str(ph.meta.get(M.ROLE, "")).startswith("tangent")]
    full_shapes = {(32, 16), (16, 32), (8, 32), (32, 8)}  # the gathered weights and their transposes
    assert not [ph.name for ph in saved if tuple(ph.meta[M.VAL].shape) in full_shapes]
    fw_chain = [n for n in fw.graph.nodes if n.target in (aten.permute.default, aten.t.default)]
    assert fw_chain and all(n.meta.get(M.RECOMPUTE) == MUST_RECOMPUTE for n in fw_chain)
    # Recomputed in the backward: down.weight is gathered again there, from its saved shard
    # (up.weight's full value is not needed: the input needs no gradient).
    assert sum(1 for n in bw.graph.nodes if n.target is ALL_GATHER) == 1
    assert any(ph.meta.get(M.ROLE) == "param:down.weight" and ph.users for ph in saved)


def test_chain_stops_at_multi_input_nodes_and_follows_every_single_input_user():
    g, n = _fsdp_graph(chain=("permute",))
    mark_fsdp_all_gather_recomputation(g)
    assert M.RECOMPUTE not in n["mm"].meta  # two inputs: the chain ends before it

    g = fx.Graph()
    w = _placeholder(g, "w", torch.empty(4, 8, device="meta"), "param:w")
    x = _placeholder(g, "x", torch.empty(8, 16, device="meta"), "input:0")
    ag = _node(g, ALL_GATHER, (w, 4, "dp"), torch.empty(16, 8, device="meta"))
    wait = _node(g, WAIT, (ag,), torch.empty(16, 8, device="meta"))
    t = _node(g, aten.t.default, (wait,), torch.empty(8, 16, device="meta"))
    a = _node(g, aten.relu.default, (t,), torch.empty(8, 16, device="meta"))
    b = _node(g, aten.neg.default, (t,), torch.empty(8, 16, device="meta"))
    c = _node(g, aten.mul.Tensor, (b, x), torch.empty(8, 16, device="meta"))
    g.output((a, c))
    report = mark_fsdp_all_gather_recomputation(g)
    # t has two users, each reading only the gathered weight: the tree is tagged, in graph order
    assert report.recomputed == [ag, wait, t, a, b]
    assert M.RECOMPUTE not in c.meta


def test_fan_out_after_a_padded_narrow_is_recomputed_not_saved():
    """A padded shard [3, 8] on 4 ranks gathers 12 rows; the narrow keeps the real 10 and the
    parameter is read twice (``scale[0]``, ``scale[1]``-style selects). Every node that reads
    only the gathered weight is recomputed: a saved select would keep the whole padded gathered
    storage alive. The gradient math on the select (a backward node) is not followed."""
    g = fx.Graph()
    w = _placeholder(g, "w", torch.empty(3, 8, device="meta"), "param:scale")
    x = _placeholder(g, "x", torch.empty(8, device="meta"), "input:0")
    ag = _node(g, ALL_GATHER, (w, 4, "dp"), torch.empty(12, 8, device="meta"))
    wait = _node(g, WAIT, (ag,), torch.empty(12, 8, device="meta"))
    narrow = _node(g, aten.slice.Tensor, (wait, 0, 0, 10), torch.empty(10, 8, device="meta"))
    s0 = _node(g, aten.select.int, (narrow, 0, 0), torch.empty(8, device="meta"))
    s1 = _node(g, aten.select.int, (narrow, 0, 1), torch.empty(8, device="meta"))
    y = _node(g, aten.mul.Tensor, (_node(g, aten.mul.Tensor, (x, s0), torch.empty(8, device="meta")), s1), torch.empty(8, device="meta"))
    bw = _node(g, aten.neg.default, (s1,), torch.empty(8, device="meta"))
    bw.meta[M.PARTITIONER_TAG] = "is_backward"
    g.output((y, bw))
    report = mark_fsdp_all_gather_recomputation(g)
    assert report.recomputed == [ag, wait, narrow, s0, s1]
    assert all(_tags(n) == (MUST_RECOMPUTE, M.AP_AC_GRAPH_ID) for n in report.recomputed)
    assert M.RECOMPUTE not in bw.meta and M.RECOMPUTE not in y.meta


def test_a_tied_weight_gathered_once_and_read_twice_is_recomputed_on_both_paths():
    """GPT-2's head reads the embedding's gathered weight transposed: the wait has two users (the
    embedding lookup, two inputs; the transpose, one). The transpose used to stay untagged and
    the first partition saved it: the whole gathered embedding, across the step."""
    g = fx.Graph()
    w = _placeholder(g, "w", torch.empty(4, 8, device="meta"), "param:wte.weight")
    ids = _placeholder(g, "ids", torch.empty(3, dtype=torch.long, device="meta"), "input:0")
    ag = _node(g, ALL_GATHER, (w, 4, "dp"), torch.empty(16, 8, device="meta"))
    wait = _node(g, WAIT, (ag,), torch.empty(16, 8, device="meta"))
    emb = _node(g, aten.embedding.default, (wait, ids), torch.empty(3, 8, device="meta"))
    t = _node(g, aten.t.default, (wait,), torch.empty(8, 16, device="meta"))
    logits = _node(g, aten.mm.default, (emb, t), torch.empty(3, 16, device="meta"))
    g.output((logits,))
    report = mark_fsdp_all_gather_recomputation(g)
    assert report.recomputed == [ag, wait, t]
    assert M.RECOMPUTE not in emb.meta and M.RECOMPUTE not in logits.meta


def test_activation_and_tp_all_gathers_are_untouched():
    g, n = _fsdp_graph(activation_ag=True)
    assert is_fsdp_all_gather(n["ag"]) and not is_fsdp_all_gather(n["act_ag"])
    report = mark_fsdp_all_gather_recomputation(g)
    assert report.all_gathers == [n["ag"]]
    for name in ("act_ag", "act_wait", "act_relu"):
        assert M.RECOMPUTE not in n[name].meta, name


def test_all_gather_of_an_input_placeholder_is_not_fsdp():
    g = fx.Graph()
    x = _placeholder(g, "x", torch.empty(4, 8, device="meta"), "input:0")
    ag = _node(g, ALL_GATHER, (x, 4, "dp"), torch.empty(16, 8, device="meta"))
    wait = _node(g, WAIT, (ag,), torch.empty(16, 8, device="meta"))
    g.output((wait,))
    assert mark_fsdp_all_gather_recomputation(g).all_gathers == []
    assert M.RECOMPUTE not in ag.meta


@pytest.mark.parametrize(
    "chain, saved",
    [
        ((), "wait"),  # nothing between the wait and its (two-input) consumer
        (("permute",), "wait"),  # every node after the wait is a view: save the wait
        (("t", "view"), "wait"),
        (("cast32", "t"), "cast32"),  # the last non-view node of the chain
    ],
)
def test_no_reshard_after_forward_saves_chain_end(chain, saved):
    g, n = _fsdp_graph(chain=chain, cast=False)
    report = mark_fsdp_all_gather_recomputation(g, reshard_after_forward=False)
    assert _tags(n[saved]) == (MUST_SAVE, M.AP_AC_GRAPH_ID)
    assert report.saved == [n[saved]]
    tagged = [k for k, v in n.items() if M.RECOMPUTE in v.meta]
    assert tagged == [saved]


@pytest.mark.parametrize("kept, policy", [(("lin.weight",), MUST_SAVE), (("other.weight",), MUST_RECOMPUTE), ((), MUST_RECOMPUTE)])
def test_a_parameter_gathered_first_is_saved_not_recomputed(kept, policy):
    """``kept`` (parameters some ranks read and others do not, gathered first): saved, so no
    rank re-gathers it at a point of its own backward; any other parameter still recomputed."""
    g, n = _fsdp_graph(chain=("permute",), cast=False)
    mark_fsdp_all_gather_recomputation(g, kept=kept)
    assert _tags(n["wait"]) == (policy, M.AP_AC_GRAPH_ID)


def test_disabled_chain_fix_tags_only_all_gather_and_wait():
    g, n = _fsdp_graph(chain=("permute",))
    with patches.disabled("fsdp_chain_recompute"):
        mark_fsdp_all_gather_recomputation(g)
    assert [k for k, v in n.items() if M.RECOMPUTE in v.meta] == ["ag", "wait"]


def test_wait_on_non_collective_is_an_error_naming_the_node():
    g = fx.Graph()
    x = _placeholder(g, "x", torch.empty(4, device="meta"), "input:0")
    r = _node(g, aten.relu.default, (x,), torch.empty(4, device="meta"))
    w = g.create_node("call_function", WAIT, (r,), {}, name="bad_wait")
    g.output((w,))
    with pytest.raises(ValueError, match=r"wait_tensor node 'bad_wait' waits on .*relu.* not a _c10d_functional"):
        mark_fsdp_all_gather_recomputation(g)


def test_missing_val_is_an_error_naming_the_node():
    g, n = _fsdp_graph(with_val=False)
    with pytest.raises(ValueError, match=rf"node '{n['ag'].name}'.*no meta\['val'\], needed for sizing the FSDP all-gather \(mark_fsdp_all_gather_recomputation\)"):
        mark_fsdp_all_gather_recomputation(g)


def test_fsdp_all_gather_without_single_wait_is_an_error():
    g = fx.Graph()
    w = _placeholder(g, "w", torch.empty(4, 8, device="meta"), "param:w")
    ag = _node(g, ALL_GATHER, (w, 4, "dp"), torch.empty(16, 8, device="meta"))
    r = _node(g, aten.relu.default, (ag,), torch.empty(16, 8, device="meta"))
    g.output((r,))
    with pytest.raises(ValueError, match=rf"FSDP all-gather '{ag.name}' must have exactly one user"):
        mark_fsdp_all_gather_recomputation(g)


# --- edge cases that line-level mutation (python -m verify mutate --lines) found untested ----------


def test_all_gather_of_a_multi_input_node_or_a_literal_is_not_fsdp():
    g = fx.Graph()
    w = _placeholder(g, "w", torch.empty(4, 8, device="meta"), "param:w")
    x = _placeholder(g, "x", torch.empty(4, 8, device="meta"), "input:0")
    mixed = _node(g, aten.mul.Tensor, (w, x), torch.empty(4, 8, device="meta"))  # a param, but two inputs
    ag = _node(g, ALL_GATHER, (mixed, 4, "dp"), torch.empty(16, 8, device="meta"))
    literal = g.call_function(ALL_GATHER, (3, 4, "dp"))  # input is not a node at all
    assert not is_fsdp_all_gather(ag)
    assert not is_fsdp_all_gather(literal)


def test_accepts_a_graph_module():
    g, n = _fsdp_graph(chain=("permute",))
    report = mark_fsdp_all_gather_recomputation(fx.GraphModule(nn.Module(), g))
    assert report.all_gathers == [n["ag"]]
    assert _tags(n["permute"]) == (MUST_RECOMPUTE, M.AP_AC_GRAPH_ID)


def test_report_sums_every_all_gather_and_is_logged(caplog):
    g = fx.Graph()
    waits = []
    for name, rows in (("w1", 4), ("w2", 2)):
        w = _placeholder(g, name, torch.empty(rows, 8, device="meta"), f"param:{name}")
        ag = _node(g, ALL_GATHER, (w, 4, "dp"), torch.empty(4 * rows, 8, device="meta"))
        waits.append(_node(g, WAIT, (ag,), torch.empty(4 * rows, 8, device="meta")))
    g.output(tuple(waits))
    caplog.set_level(logging.INFO, logger="autoparallel.passes.fsdp_recompute")
    report = mark_fsdp_all_gather_recomputation(g)
    assert len(report.all_gathers) == 2
    assert report.gathered_bytes == (16 + 8) * 8 * 4  # both all-gathers, fp32
    logged = [r.getMessage() for r in caplog.records if r.name == "autoparallel.passes.fsdp_recompute"]
    assert logged == [f"mark_fsdp_all_gather_recomputation: {report.summary()}"]
    assert report.summary() == "2 FSDP all-gathers (768 B): 4 nodes MUST_RECOMPUTE, 0 MUST_SAVE"


def test_wait_on_one_output_of_a_coalesced_collective_is_accepted():
    g = fx.Graph()
    a = _placeholder(g, "a", torch.empty(4, 8, device="meta"), "input:0")
    b = _placeholder(g, "b", torch.empty(2, 8, device="meta"), "input:1")
    coalesced = _node(g, torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default, ([a, b], 4, "dp"),
                      [torch.empty(16, 8, device="meta"), torch.empty(8, 8, device="meta")])
    outs = []
    for i, rows in enumerate((16, 8)):
        item = _node(g, operator.getitem, (coalesced, i), torch.empty(rows, 8, device="meta"))
        outs.append(_node(g, WAIT, (item,), torch.empty(rows, 8, device="meta")))
    g.output(tuple(outs))
    assert mark_fsdp_all_gather_recomputation(g).all_gathers == []  # no error: each wait completes a collective


@pytest.mark.parametrize("arg", ["node", "none", "literal"])
def test_wait_on_non_collective_message_names_what_it_waits_on(arg):
    g = fx.Graph()
    x = _placeholder(g, "x", torch.empty(4, device="meta"), "input:0")
    r = _node(g, aten.relu.default, (x,), torch.empty(4, device="meta"))
    args = {"node": (r,), "none": (), "literal": (3,)}[arg]
    w = g.create_node("call_function", WAIT, args, {}, name="bad_wait")
    g.output((w, r))
    what = {"node": r.format_node(), "none": "None", "literal": "3"}[arg]  # format_node() shows the users
    message = (
        f"wait_tensor node 'bad_wait' waits on {what}, which is not a _c10d_functional collective; a wait must "
        "consume the collective it completes (fix the pass that rewired it)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        mark_fsdp_all_gather_recomputation(g)


# --- a traced toy model through apply_placement -------------------------------------------------


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        h = torch.relu(x @ self.up.weight.permute(1, 0))
        return self.down(h)  # F.linear: t() of the gathered weight


def _mse(out, target):
    return ((out - target) ** 2).mean()


class _UnevenToy(nn.Module):
    """up [5, 16] and down [3, 5] on dp=2: padded shards of 3 and 2 rows."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 5, bias=False)
        self.down = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return self.down(torch.relu(x @ self.up.weight.t()))


def test_padded_gathered_and_narrowed_weights_are_recomputed_not_saved():
    """Uneven FSDP: the all-gather returns the padded rows ([6, 16], [4, 5]) and a narrow the
    true ones ([5, 16], [3, 5]); neither, nor their transposes, is saved for backward."""
    inputs = (torch.randn(4, 16), torch.randn(4, 3))
    with fake_world("dp=2") as mesh:
        jg = build_joint_graph(_UnevenToy(), ParallelPlan.fsdp(), mesh, inputs, loss_fn=_mse)
        fp = apply_placement(jg).first_partition
    saved = [ph for ph in fp.bw.graph.find_nodes(op="placeholder") if not str(ph.meta.get(M.ROLE, "")).startswith("tangent")]
    gathered = {(6, 16), (5, 16), (16, 5), (4, 5), (3, 5), (5, 3)}
    assert not [ph.name for ph in saved if tuple(ph.meta[M.VAL].shape) in gathered]
    narrows = [n for n in fp.fw.graph.nodes if n.target is aten.slice.Tensor and n.args[0].target is WAIT]
    assert len(narrows) == 2 and all(n.meta.get(M.RECOMPUTE) == MUST_RECOMPUTE for n in narrows)


@pytest.fixture(scope="module")
def first_partition_toy():
    inputs = (torch.randn(4, 16), torch.randn(4, 8))
    with fake_world("dp=2") as mesh:
        jg = build_joint_graph(_Toy(), ParallelPlan.fsdp(), mesh, inputs, loss_fn=_mse)
        fp = apply_placement(jg).first_partition
    return fp.fw, fp.bw


def test_all_gather_of_a_multi_input_result_is_not_fsdp():
    """The walk back from the all-gather stops at the two-input mm, which is no parameter,
    even though both of its inputs are."""
    g = fx.Graph()
    a = _placeholder(g, "a", torch.empty(4, 8, device="meta"), "param:a.weight")
    b = _placeholder(g, "b", torch.empty(8, 8, device="meta"), "param:b.weight")
    mm = _node(g, aten.mm.default, (a, b), torch.empty(4, 8, device="meta"))
    ag = _node(g, ALL_GATHER, (mm, 4, "dp"), torch.empty(16, 8, device="meta"))
    wait = _node(g, WAIT, (ag,), torch.empty(16, 8, device="meta"))
    g.output((wait,))
    assert not is_fsdp_all_gather(ag)
    assert mark_fsdp_all_gather_recomputation(g).all_gathers == []
    assert M.RECOMPUTE not in ag.meta and M.RECOMPUTE not in wait.meta
