"""What must hold across each pipeline stage, as checks that return the problems they find.

Goldens show what a stage's graphs look like; these say what no stage may break, whatever the
graphs look like, so a reviewer cannot wave a violation through with ``--update``.

Collectives: no collective lost or duplicated
    A collective's *bytes* follow ``verify.graphs.stats`` (an all-gather its output, the others their
    input); a *ledger* is ``{(kind, mesh dim): (count, bytes)}`` of one graph. Each stage keeps
    its own conservation law (which one: ``verify.stages.registry``):

    * ``cleanup``, ``fsdp_tagging``: the ledger is unchanged. (CSE may merge two identical
      collectives, e.g. of a tied weight; that would show here as a loss, and the law would need
      to say so. No model the tests run has one.)
    * ``first_partition``: the forward's ledger is the joint graph's forward region's; the
      backward's is the joint backward region's plus the forward all-gathers it recomputes (each
      tagged MUST_RECOMPUTE, each the twin of a forward all-gather of the same mesh dim and bytes,
      at most one per forward all-gather: a parameter is gathered again once, not per use).
      Collectives no output of the joint graph depends on are left out of the joint's ledgers:
      the partitioner keeps only what its outputs need (a parameter whose use the loss drops,
      e.g. a pooler an LM head skips, is gathered in the joint graph and not in the forward).
    * ``second_compile``: each graph's ledger equals the first partition's.
    * ``fuse_chained_allgathers`` re-groups all-gathers over the flat group: every kind but the
      all-gather keeps its ledger, and all-gathers keep their *end-to-end chains*: the multiset
      of (bytes in, bytes out, mesh dims spanned) over maximal chains ``all_gather -> wait ->
      views -> all_gather`` (a lone all-gather is a chain of one; ``dp*tp`` spans dp and tp).
    * ``pre_overlap_bucketing``, ``topo_span_bucketing`` merge: per kind and mesh dim, the bytes
      are unchanged and the count never grows (and stays >= 1 where it was).

Saved values
    :func:`saved_values`: what a (forward, backward) pair saves, as a multiset of (what computes
    it, shape, dtype), where a getitem of a multi-output op is ``(op, index)`` (LayerNorm's mean
    and rstd are ``native_layer_norm[1]`` and ``[2]``). The second compile must save exactly the
    first partition's (:func:`check_saved_equal`).

Same graph, same values
    :func:`check_same_graph_and_values`: two graphs equal node by node (name, target, arguments,
    each fake value's shape, stride, offset and dtype) and in which values share a storage. For a
    patch that must build exactly what upstream builds, only faster (``reused_bucket_traces``).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import ALL_GATHER, ALL_GATHER_OUT, WAIT
from autoparallel.mesh import FLAT_SEP, group_dims_of
from verify.graphs.classify import collective_kind, collective_node_bytes, group_label
from verify.graphs.stats import graph_stats

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]
Ledger = dict[tuple[str, str], tuple[int, int]]

aten = torch.ops.aten


# --- ledgers ------------------------------------------------------------------------------------


def ledger(gm: fx.GraphModule, nodes: Callable[[fx.Node], bool] | None = None) -> Ledger:
    """``{(kind, mesh dim): (count, bytes)}`` of ``gm``'s collectives (those ``nodes`` accepts)."""
    if nodes is None:
        st = graph_stats(gm)
        return {(k, d): (s.count, s.bytes) for k, per in st.collectives.items() for d, s in per.items()}
    dims = group_dims_of(gm)
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for n in gm.graph.nodes:
        kind = collective_kind(n)
        if kind is None or not nodes(n):
            continue
        key = (kind, group_label(n, dims))
        c, b = out.get(key, (0, 0))
        out[key] = (c + 1, b + collective_node_bytes(n))
    return out


def _add(a: Ledger, b: Ledger) -> Ledger:
    out = dict(a)
    for k, (c, by) in b.items():
        c0, b0 = out.get(k, (0, 0))
        out[k] = (c0 + c, b0 + by)
    return out


def _fmt(led: Ledger) -> str:
    return ", ".join(f"{k}/{d}: {c} x {b} B" for (k, d), (c, b) in sorted(led.items())) or "none"


def _compare(where: str, want: Ledger, got: Ledger) -> list[str]:
    if want == got:
        return []
    keys = sorted(set(want) | set(got))
    diff = [f"{k}/{d} {want.get((k, d), (0, 0))} -> {got.get((k, d), (0, 0))}" for k, d in keys
            if want.get((k, d), (0, 0)) != got.get((k, d), (0, 0))]
    return [f"{where}: collectives (count, bytes) changed: {'; '.join(diff)}"]


def _pair(graphs: Graphs, stage: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    if not isinstance(graphs, tuple):
        raise ValueError(f"stage {stage!r}: expected a (forward, backward) pair, got one graph")
    return graphs


def _single(graphs: Graphs, stage: str) -> fx.GraphModule:
    if isinstance(graphs, tuple):
        raise ValueError(f"stage {stage!r}: expected one joint graph, got a (forward, backward) pair")
    return graphs


# --- the laws -----------------------------------------------------------------------------------


def unchanged(stage: str, before: Graphs, after: Graphs) -> list[str]:
    """Every graph keeps its ledger."""
    if isinstance(before, tuple) != isinstance(after, tuple):
        raise ValueError(f"stage {stage!r}: input and output are not the same kind of graphs")
    if isinstance(before, tuple):
        return [p for side, a, b in zip(("forward", "backward"), before, after, strict=True)
                for p in _compare(f"{stage} {side}", ledger(a), ledger(b))]
    return _compare(stage, ledger(before), ledger(after))


def _is_backward(n: fx.Node) -> bool:
    return n.meta.get(M.PARTITIONER_TAG) == M.PARTITIONER_TAG_BACKWARD


def _recomputed(n: fx.Node) -> bool:
    return n.meta.get(M.RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE


def _live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes some output of ``gm`` depends on."""
    live: set[fx.Node] = set()
    todo = [gm.graph.output_node()]
    while todo:
        n = todo.pop()
        if n in live:
            continue
        live.add(n)
        todo.extend(n.all_input_nodes)
    return live


def partitioned(stage: str, before: Graphs, after: Graphs) -> list[str]:
    """Joint -> (forward, backward): the regions split, recomputed all-gathers twin forward ones."""
    joint = _single(before, stage)
    fw, bw = _pair(after, stage)
    live = _live_nodes(joint)
    problems = _compare(f"{stage} forward", ledger(joint, lambda n: n in live and not _is_backward(n)), ledger(fw))
    recomputed = ledger(bw, lambda n: collective_kind(n) == "all_gather" and _recomputed(n))
    want_bw = _add(ledger(joint, lambda n: n in live and _is_backward(n)), recomputed)
    problems += _compare(f"{stage} backward (joint backward region + recomputed all-gathers)", want_bw, ledger(bw))
    fw_gathers = Counter(_gather_signature(n, fw) for n in fw.graph.nodes if collective_kind(n) == "all_gather")
    bw_gathers = Counter(_gather_signature(n, bw) for n in bw.graph.nodes
                         if collective_kind(n) == "all_gather" and _recomputed(n))
    extra = bw_gathers - fw_gathers
    if extra:
        problems.append(f"{stage} backward: recomputed all-gathers with no forward twin, or more than one per "
                        f"forward all-gather: {sorted(extra.items())}")
    return problems


def _gather_signature(n: fx.Node, gm: fx.GraphModule) -> tuple[str, int]:
    return group_label(n, group_dims_of(gm)), collective_node_bytes(n)


_CHAIN_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                          aten.t.default, aten.transpose.int, aten.alias.default, aten.squeeze.dim,
                          aten.unsqueeze.default})


def _previous_gather(ag: fx.Node) -> fx.Node | None:
    """The all-gather whose wait feeds ``ag`` through views only, if any."""
    cur = ag.args[0]
    while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target in _CHAIN_VIEWS:
        cur = cur.args[0]
    if isinstance(cur, fx.Node) and cur.target is WAIT and isinstance(cur.args[0], fx.Node):
        if cur.args[0].target in (ALL_GATHER, ALL_GATHER_OUT):
            return cur.args[0]
    return None


def gather_chains(gm: fx.GraphModule) -> Counter:
    """Multiset of maximal all-gather chains: (bytes in, bytes out, mesh dims spanned)."""
    dims = group_dims_of(gm)
    gathers = [n for n in gm.graph.nodes if collective_kind(n) == "all_gather"]
    continued = {p for n in gathers if (p := _previous_gather(n)) is not None}
    chains: Counter = Counter()
    for last in gathers:
        if last in continued:
            continue
        spanned: set[str] = set()
        first = last
        while True:
            spanned.update(group_label(first, dims).split(FLAT_SEP))
            prev = _previous_gather(first)
            if prev is None:
                break
            first = prev
        src = first.args[0]
        in_bytes = collective_node_bytes(first) // int(first.args[1]) if isinstance(src, fx.Node) else 0
        chains[(in_bytes, collective_node_bytes(last), tuple(sorted(spanned)))] += 1
    return chains


def regrouped(stage: str, before: Graphs, after: Graphs) -> list[str]:
    """Fusion: non-gather collectives unchanged, all-gather chains conserved end to end."""
    problems = []
    for side, a, b in zip(("forward", "backward"), _pair(before, stage), _pair(after, stage), strict=True):
        others = lambda n: collective_kind(n) != "all_gather"  # noqa: E731
        problems += _compare(f"{stage} {side} (other than all-gathers)", ledger(a, others), ledger(b, others))
        ca, cb = gather_chains(a), gather_chains(b)
        if ca != cb:
            problems.append(f"{stage} {side}: all-gather chains (bytes in, bytes out, dims) changed: "
                            f"lost {sorted((ca - cb).items())}, gained {sorted((cb - ca).items())}")
    return problems


def merged(stage: str, before: Graphs, after: Graphs) -> list[str]:
    """Bucketing: per kind and mesh dim, bytes unchanged, count never grows, never drops to 0."""
    problems = []
    for side, a, b in zip(("forward", "backward"), _pair(before, stage), _pair(after, stage), strict=True):
        la, lb = ledger(a), ledger(b)
        for key in sorted(set(la) | set(lb)):
            (ca, ba), (cb, bb) = la.get(key, (0, 0)), lb.get(key, (0, 0))
            where = f"{stage} {side} {key[0]}/{key[1]}"
            if ba != bb:
                problems.append(f"{where}: {ba} B before, {bb} B after (a collective was lost or duplicated)")
            if cb > ca:
                problems.append(f"{where}: {ca} launches before, {cb} after (bucketing only merges)")
            if ca and not cb:
                problems.append(f"{where}: every launch is gone")
    return problems


# --- saved values -------------------------------------------------------------------------------

_SAME_OP = {aten.reshape.default: aten.view.default}  # a re-traced reshape of a contiguous tensor is a view


def _what(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"input {node.meta.get(M.ROLE, node.name)}"
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return f"{node.args[0].target}[{node.args[1]}]"
    return str(_SAME_OP.get(node.target, node.target))


def saved_values(fw: fx.GraphModule, bw: fx.GraphModule) -> Counter:
    """Multiset of what the backward receives from the forward: (what computes it, shape, dtype)."""
    by_name = {n.name: n for n in fw.graph.nodes}
    out: Counter = Counter()
    for ph in bw.graph.find_nodes(op="placeholder"):
        if roles.is_tangent(ph.meta.get(M.ROLE)) or ph.name not in by_name:
            continue
        node = by_name[ph.name]
        v = node.meta[M.VAL]
        out[(_what(node), tuple(v.shape), v.dtype)] += 1
    return out


def multi_output_saves(fw: fx.GraphModule, bw: fx.GraphModule) -> Counter:
    """``Counter({"<op>[<index>]": n})`` over saved getitems of multi-output ops."""
    return Counter({what: n for (what, _, _), n in saved_values(fw, bw).items() if what.endswith("]") and "[" in what
                    and not what.startswith("input ")})


def check_saved_equal(first: Graphs, second: Graphs) -> list[str]:
    """The second pair saves exactly what the first saves (per op, getitem index, shape, dtype)."""
    a, b = saved_values(*_pair(first, "first")), saved_values(*_pair(second, "second"))
    if a == b:
        return []
    return [f"saved values differ: only in the first {sorted((a - b).items(), key=str)}; "
            f"only in the second {sorted((b - a).items(), key=str)}"]


# --- same graph, same values ----------------------------------------------------------------------


def _value_text(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype)
    return v


def node_values(gm: fx.GraphModule) -> list[tuple[str, str, str, str]]:
    """Every node's name, target, arguments and fake value (shape, stride, offset, dtype)."""
    return [(n.name, str(n.target), str(n.args), str(torch.utils._pytree.tree_map(_value_text, n.meta.get(M.VAL))))
            for n in gm.graph.nodes]


def value_aliasing(gm: fx.GraphModule) -> list[list[str]]:
    """The nodes grouped by the storage their fake values use: which values alias which."""
    groups: dict[int, set[str]] = {}
    for n in gm.graph.nodes:
        for v in torch.utils._pytree.tree_leaves(n.meta.get(M.VAL)):
            if isinstance(v, torch.Tensor):
                groups.setdefault(id(v.untyped_storage()), set()).add(n.name)
    return sorted(sorted(g) for g in groups.values())


def check_same_graph_and_values(want: fx.GraphModule, got: fx.GraphModule) -> list[str]:
    """Where ``got`` differs from ``want``: the first node that differs, and the aliasing."""
    problems = []
    a, b = node_values(want), node_values(got)
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        problems.append(f"node {i} differs: {a[i] if i < len(a) else 'none'} != {b[i] if i < len(b) else 'none'}")
    if value_aliasing(want) != value_aliasing(got):
        only = [g for g in value_aliasing(got) if g not in value_aliasing(want)]
        problems.append(f"values alias otherwise: storages shared only in the second {only}")
    return problems


__all__ = [
    "check_same_graph_and_values",
    "check_saved_equal",
    "gather_chains",
    "ledger",
    "merged",
    "multi_output_saves",
    "node_values",
    "partitioned",
    "regrouped",
    "saved_values",
    "unchanged",
    "value_aliasing",
]

