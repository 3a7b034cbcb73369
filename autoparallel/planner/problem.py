"""From the planning graph to an abstract choice problem, with identical blocks merged.

:func:`build_nodes` turns every node of the planning graph (and every graph output) into a
:class:`PNode`: its candidates, their compute costs, its producers, and the facts constraints
are made of (role, block, dtype-locked inputs). :func:`build_problem` turns the nodes into a
:class:`Problem`: choice classes (one per node, or one per set of identical nodes of identical
blocks), edge classes with their redistribution cost tables, equalities, the memory row and
pins. The ILP (``ilp.py``) only ever sees a ``Problem``, so the solver is tested on generated
problems against brute force without any graph.

Edge tables are indexed by *placements*, not by candidate: ``cost[u, v]`` is the cost of moving
the producer's output placement ``v`` into the input placement ``u`` the consumer's candidate
needs. Candidates that look the same on an edge share its variables; with one candidate per
placement this is exactly the anchor's variable per (node, arg, output choice, input choice).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.planner.costs import CostModel, local_shape, nbytes
from autoparallel.planner.graph import NO_BLOCK, PlanningGraph, op_name, phase_of, tensor_args
from autoparallel.planner.strategies import (
    Candidate,
    NoStrategyError,
    Placements,
    StrategyEnumerator,
    alias_candidates,
    all_placements,
    constant_candidates,
    divides,
    getitem_candidates,
    is_alias,
    is_getitem,
    out_metas,
    placeholder_candidates,
    static_args,
)

# Node kinds (placeholder / call_function / output as FX names them; getitem and alias apart).
PLACEHOLDER, OP, GETITEM, ALIAS_KIND, OUTPUT = "placeholder", "call_function", "getitem", "alias", "output"
CONSTANT = "get_attr"  # a tensor constant lifted into the graph
LOSS_ROLE = "loss"


@dataclass
class PNode:
    """A node the planner places: an FX node, or one output of the graph (``kind == "output"``)."""

    index: int
    name: str
    key: str
    kind: str
    op: str
    role: str | None
    block: str | None
    phase: str
    metas: tuple
    inputs: tuple[int, ...]
    candidates: list[Candidate]
    compute_us: np.ndarray
    static: tuple = ()
    locked_inputs: frozenset[int] = frozenset()
    fallback: str | None = None  # why the node took the replicated fallback (strategies.NO_STRATEGY, RANDOM_OP)

    @property
    def meta(self):
        return self.metas[0]

    def out_placements(self) -> list[Placements]:
        return [c.outs[0] for c in self.candidates]


@dataclass
class Graph:
    """PNodes plus the pairs whose placements must agree (parameter/gradient, input/grad, output/tangent)."""

    nodes: list[PNode]
    equal: list[tuple[int, int, str]]  # (a, b, why)
    mesh_names: tuple[str, ...]
    mesh_sizes: tuple[int, ...]
    strategy_seconds: float = 0.0

    def by_key(self) -> dict[str, PNode]:
        return {n.key: n for n in self.nodes}

    def params(self) -> list[PNode]:
        return [n for n in self.nodes if n.kind == PLACEHOLDER and roles.is_param(n.role)]

    def edges(self):
        """(consumer, arg position, producer) for every tensor input of every node."""
        for n in self.nodes:
            for a, p in enumerate(n.inputs):
                yield n, a, self.nodes[p]


def _distinct(items):
    return list(dict.fromkeys(items))


def build_nodes(pg: PlanningGraph, costs: CostModel, enumerator: StrategyEnumerator, *, local_loss: bool = False,
                strided: bool = False) -> Graph:
    """Candidates and compute costs of every node, in graph order. The loss output is Replicate
    (the global loss); ``local_loss`` also offers ``P(avg)`` over any set of mesh dims, each rank
    keeping its local mean as a hand FSDP plan does (only for a pin: offered always, every plan
    would take it to save the loss's all-reduce). ``strided`` also offers parameters the
    FSDP-order ``_StridedShard`` layouts (``autoparallel.planner.strided``; for a pin of a hand
    FSDP+TP layout: unpinned plans, their goldens and the plan checker keep plain shards)."""
    import time

    from torch._functorch._aot_autograd import descriptors as D

    t0 = time.perf_counter()
    sizes = costs.sizes
    nodes: list[PNode] = []
    index: dict[fx.Node, int] = {}
    by_desc: dict[object, int] = {}
    by_role: dict[str, int] = {}  # placeholder role -> node index
    for node in pg.graph.nodes:
        if node.op == "output":
            continue
        inputs = tuple(index[a] for a in tensor_args(node))
        metas = out_metas(node)
        common = dict(
            index=len(nodes),
            name=node.name,
            key=pg.keys[node.name],
            role=node.meta.get(M.ROLE),
            block=pg.blocks.get(node.name),
            phase=phase_of(node),
            metas=metas,
            inputs=inputs,
        )
        if node.op == "placeholder":
            role = node.meta.get(M.ROLE) or ""
            cands = placeholder_candidates(metas[0], sizes, padded_dim0=roles.is_param(role), strided=strided and roles.is_param(role))
            pn = PNode(kind=PLACEHOLDER, op="placeholder", candidates=cands, compute_us=np.zeros(len(cands)), **common)
            desc = node.meta.get(M.DESC)
            if desc is not None:
                by_desc[desc] = pn.index
            by_role[role] = pn.index
        elif node.op == CONSTANT:
            if not isinstance(node.meta.get(M.VAL), torch.Tensor):
                raise NoStrategyError(f"get_attr node {node.name!r} ({node.target!r}) is not a tensor constant: the planner places only tensors")
            cands = constant_candidates(sizes)
            pn = PNode(kind=CONSTANT, op=f"constant {node.target}", candidates=cands, compute_us=np.zeros(1), **common)
        elif is_getitem(node):
            cands = getitem_candidates(nodes[index[node.args[0]]].candidates, node.args[1])
            common["inputs"] = (index[node.args[0]],)
            pn = PNode(kind=GETITEM, op="getitem", candidates=cands, compute_us=np.zeros(len(cands)), static=(node.args[1],), **common)
        elif is_alias(node):
            cands = alias_candidates(metas[0], sizes, nodes[inputs[0]].out_placements())
            pn = PNode(kind=ALIAS_KIND, op="alias", candidates=cands, compute_us=np.zeros(len(cands)), **common)
        elif node.op == "call_function":
            producers = [_distinct(nodes[i].out_placements()) for i in inputs]
            cands = enumerator.op_candidates(node, producers)
            if _casts_a_parameter(node, nodes, inputs):
                # A mixed-precision cast runs on the parameter's local shard, padded or not
                # (FSDP2 casts the padded shard and all-gathers that), so it can follow the
                # parameter's placement even where DTensor's strategy wants even shards.
                extra = [Candidate((pl,), (pl,)) for pl in producers[0] if Candidate((pl,), (pl,)) not in cands]
                cands = cands + extra
            g = costs.global_compute_us(node)
            comp = np.array([costs.compute_us(g, c) for c in cands], dtype=np.float64)
            pn = PNode(kind=OP, op=op_name(node), candidates=cands, compute_us=comp, static=static_args(node),
                       fallback=enumerator.fallbacks.get(node.name), **common)
        else:
            raise ValueError(f"node {node.name!r}: the planner does not handle {node.op!r} nodes")
        index[node] = pn.index
        nodes.append(pn)

    out = pg.graph.output_node()
    descs = out.meta.get(M.DESC) or [None] * len(out.args[0])
    equal: list[tuple[int, int, str]] = []
    for i, (arg, role, desc) in enumerate(zip(out.args[0], pg.output_roles, descs, strict=True)):
        if arg is None:
            continue
        if not isinstance(arg, fx.Node):
            raise ValueError(f"graph output {i} ({role}) is not a tensor node: {arg!r}")
        prod = nodes[index[arg]]
        meta = prod.metas[0]
        role = role or roles.user_output(i)
        twin = by_desc.get(desc.grad_of) if isinstance(desc, D.GradAOTOutput) else None
        if roles.is_mutated(role):  # a buffer's (or a parameter's: an in-place clamp_) new value is copied into its local piece
            fqn = roles.name(role)
            twin = by_role.get(roles.buffer(fqn), by_role.get(roles.param(fqn)))
        if twin is not None:
            placements = nodes[twin].out_placements()
        elif role == LOSS_ROLE:
            placements = loss_placements(len(sizes), local=local_loss)
        else:
            placements = [pl for pl in all_placements(len(meta.shape), len(sizes)) if divides(pl, meta.shape, sizes)]
        cands = [Candidate((pl,), (pl,)) for pl in placements]
        pn = PNode(
            index=len(nodes),
            name=f"{OUTPUT}:{role}",
            key=f"out:{role}",
            kind=OUTPUT,
            op="output",
            role=role,
            block=_block_of_role(role, pg),
            phase="bwd" if roles.is_grad(role) else "fwd",
            metas=(meta,),
            inputs=(prod.index,),
            candidates=cands,
            compute_us=np.zeros(len(cands)),
        )
        nodes.append(pn)
        if twin is not None:
            equal.append((twin, pn.index, "fwd_bwd"))
        if desc is not None:
            tangent = by_desc.get(D.TangentAOTInput(desc)) if not isinstance(desc, D.GradAOTOutput) else None
            if tangent is not None and nodes[tangent].out_placements() == pn.out_placements():
                equal.append((tangent, pn.index, "fwd_bwd"))
    _lock_grad_reduce_dtype(nodes, pg)
    return Graph(nodes, equal, costs.names, costs.sizes, time.perf_counter() - t0)


def loss_placements(ndim: int, *, local: bool) -> list[tuple]:
    """The loss output's candidates: Replicate, and with ``local`` every mix of Replicate and
    ``P(avg)`` (a rank's local mean: the loss is the average over those dims)."""
    from itertools import product

    from torch.distributed.tensor import Partial, Replicate

    if not local:
        return [tuple(Replicate() for _ in range(ndim))]
    return [tuple(Partial("avg") if p else Replicate() for p in mix) for mix in product((False, True), repeat=ndim)]


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def is_dtype_cast(node: fx.Node) -> bool:
    """A node that changes a tensor's dtype and nothing else (shape, device, layout kept)."""
    if node.op != "call_function" or node.target not in _CASTS:
        return False
    ins = tensor_args(node)
    out = node.meta.get(M.VAL)
    if len(ins) != 1 or not isinstance(out, torch.Tensor):
        return False
    src = ins[0].meta.get(M.VAL)
    return isinstance(src, torch.Tensor) and src.shape == out.shape and src.device == out.device and src.dtype != out.dtype


def _casts_a_parameter(node: fx.Node, nodes: list[PNode], inputs: tuple[int, ...]) -> bool:
    if len(inputs) != 1 or not is_dtype_cast(node):
        return False
    src = nodes[inputs[0]]
    if src.kind == ALIAS_KIND:
        src = nodes[src.inputs[0]]
    return src.kind == PLACEHOLDER and roles.is_param(src.role)


def _block_of_role(role: str, pg: PlanningGraph) -> str | None:
    if pg.block_container is None:
        return None
    _, _, fqn = role.partition(":")
    prefix = pg.block_container + "."
    if fqn.startswith(prefix):
        return prefix + fqn[len(prefix) :].split(".")[0]
    return None


def _lock_grad_reduce_dtype(nodes: list[PNode], pg: PlanningGraph) -> None:
    """Mixed precision: a parameter is cast to the compute dtype before any redistribution (the
    all-gather moves the narrow dtype), and a gradient is cast back to the wider parameter dtype
    before any redistribution (the reduction runs in the wide dtype)."""
    fx_nodes = {n.name: n for n in pg.graph.nodes}

    def lock(pn: PNode) -> None:
        pn.locked_inputs = pn.locked_inputs | {0}
        src = nodes[pn.inputs[0]]
        if src.kind == ALIAS_KIND:
            src.locked_inputs = src.locked_inputs | {0}

    def is_cast(pn: PNode) -> bool:
        return pn.kind == OP and is_dtype_cast(fx_nodes[pn.name])

    consumers: dict[int, list[PNode]] = {}
    for pn in nodes:
        for p in pn.inputs:
            consumers.setdefault(p, []).append(pn)
    for pn in nodes:
        if pn.kind == PLACEHOLDER and roles.is_param(pn.role):
            direct = consumers.get(pn.index, [])
            users = [u for d in direct for u in (consumers.get(d.index, []) if d.kind == ALIAS_KIND else [d])]
            for u in users:
                if is_cast(u) and u.meta.dtype.itemsize < pn.meta.dtype.itemsize:
                    lock(u)
        elif pn.kind == OUTPUT and roles.is_grad(pn.role):
            src = nodes[pn.inputs[0]]
            if src.kind == ALIAS_KIND:
                src = nodes[src.inputs[0]]
            if is_cast(src) and nodes[src.inputs[0]].meta.dtype.itemsize < src.meta.dtype.itemsize:
                lock(src)


# --- the abstract problem ------------------------------------------------------------------------


@dataclass
class EdgeClass:
    """Graph edges with identical ends (up to identical blocks): one table, one set of variables."""

    cons: int
    prod: int
    arg: int
    cons_map: np.ndarray  # consumer choice -> row u
    prod_map: np.ndarray  # producer choice -> column v
    cost: np.ndarray  # (U, V) microseconds, inf where no redistribution exists
    count: int
    label: str
    locked: bool = False


@dataclass
class Problem:
    """Choose one choice per class; pay compute per class and redistribution per edge class.

    ``count`` multiplies a class's compute (its number of identical nodes), ``EdgeClass.count``
    an edge table. ``equal`` pairs must take the same choice index; ``memory`` rows
    ``(class, bytes per choice)`` (one node's bytes, times the class count) sum to at most
    ``budget``; ``allowed`` masks choices (pins). ``peak`` rows ``(point, {class: live bytes per
    choice})`` (already summed over the class's live members; see ``planner/memory.py``) each sum to
    at most ``peak_budget``.
    """

    labels: list[str]
    compute: list[np.ndarray]
    count: np.ndarray
    edges: list[EdgeClass]
    equal: list[tuple[int, int, str]] = field(default_factory=list)
    memory: list[tuple[int, np.ndarray]] = field(default_factory=list)
    budget: float | None = None
    allowed: dict[int, np.ndarray] = field(default_factory=dict)
    tie: list[np.ndarray] | None = None
    peak: list[tuple[int, dict[int, np.ndarray]]] = field(default_factory=list)
    peak_budget: float | None = None

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def choices(self, c: int) -> int:
        return len(self.compute[c])


# A deterministic preference among equal-cost choices: earlier candidates (Replicate before
# Shard(0) before Shard(1) ...) win, by at most TIE_US per node; for placeholders (parameters,
# inputs) the preference is PLACEHOLDER_TIE times stronger, so that equal-cost parameter
# layouts resolve to the lowest sharded dim (FSDP's Shard(0)) before anything downstream.
# Reported objectives exclude it.
TIE_US = 1e-3
PLACEHOLDER_TIE = 100.0


@dataclass
class Clustering:
    class_of: list[int]  # PNode index -> class
    members: list[list[int]]  # class -> PNode indices
    edge_class_of: dict[tuple[int, int], int]  # (consumer PNode, arg) -> edge class


def edge_table(graph: Graph, costs: CostModel, cons: PNode, arg: int, prod: PNode):
    """(cons_map, prod_map, cost[u, v], locked) of one graph edge."""
    if cons.kind == GETITEM:
        j, k = len(cons.candidates), len(prod.candidates)
        cost = np.full((j, k), math.inf)
        np.fill_diagonal(cost, 0.0)
        return np.arange(j), np.arange(k), cost, False
    us = _distinct(c.ins[arg] for c in cons.candidates)
    vs = _distinct(c.outs[0] for c in prod.candidates)
    u_index = {u: i for i, u in enumerate(us)}
    v_index = {v: i for i, v in enumerate(vs)}
    cons_map = np.array([u_index[c.ins[arg]] for c in cons.candidates], dtype=np.int64)
    prod_map = np.array([v_index[c.outs[0]] for c in prod.candidates], dtype=np.int64)
    locked = arg in cons.locked_inputs
    if locked:
        cost = np.array([[0.0 if u == v else math.inf for v in vs] for u in us]).reshape(len(us), len(vs))
    else:
        cost = costs.table(prod.meta, us, vs)
    return cons_map, prod_map, cost, locked


def cluster(graph: Graph, *, enabled: bool = True, pins: Mapping[int, np.ndarray] | None = None) -> Clustering:
    """Merge corresponding nodes of identical blocks into one class each.

    Nodes of two blocks correspond when their canonical keys agree up to the block label
    (``layers.3/fwd/aten.mm.default#2`` ~ ``layers.0/fwd/aten.mm.default#2``) and so does their
    structure: op, shapes, static arguments, and which corresponding node (or which outside
    node) feeds each input. A node joins the class of the first such node only if its
    candidates, compute costs, dtype locks and pins are identical too; nodes at the boundary
    of the first or last block that differ keep their own class. Edges between two classes
    then share one table and one set of variables.
    """
    nodes = graph.nodes
    pins = pins or {}
    class_of = list(range(len(nodes)))
    if enabled:
        suffix = {pn.index: unblocked_key(pn.key, pn.block) for pn in nodes if pn.block not in (None, NO_BLOCK)}
        reps: dict[tuple, int] = {}
        for pn in nodes:
            if pn.index not in suffix:
                continue
            feeds = []
            for p in pn.inputs:
                q = nodes[p]
                if q.block == pn.block:
                    feeds.append(suffix[p])
                elif q.block in (None, NO_BLOCK):
                    feeds.append(("outside", q.key))
                else:
                    feeds.append(("other block", suffix[p]))
            sig = (
                suffix[pn.index],
                pn.kind,
                pn.op,
                pn.phase,
                tuple((tuple(m.shape), m.dtype) if m is not None else None for m in pn.metas),
                pn.static,
                tuple(feeds),
            )
            r = reps.setdefault(sig, pn.index)
            if r == pn.index:
                continue
            a = nodes[r]
            if (
                a.candidates == pn.candidates
                and np.array_equal(a.compute_us, pn.compute_us)
                and a.locked_inputs == pn.locked_inputs
                and _same_pin(pins.get(r), pins.get(pn.index))
            ):
                class_of[pn.index] = class_of[r]
    # renumber classes densely in node order
    dense: dict[int, int] = {}
    for i, c in enumerate(class_of):
        class_of[i] = dense.setdefault(c, len(dense))
    members: list[list[int]] = [[] for _ in dense]
    for i, c in enumerate(class_of):
        members[c].append(i)
    edge_class_of: dict[tuple[int, int], int] = {}
    seen: dict[tuple[int, int, int], int] = {}
    for pn in nodes:
        for a, p in enumerate(pn.inputs):
            key = (class_of[pn.index], a, class_of[p])
            edge_class_of[(pn.index, a)] = seen.setdefault(key, len(seen))
    return Clustering(class_of, members, edge_class_of)


BLOCK_PLACEHOLDER = "{B}"


def unblocked_key(key: str, block: str | None) -> str:
    """The key with its block label replaced by ``{B}`` (``layers.3/fwd/...`` -> ``{B}/fwd/...``)."""
    if block is None:
        return key
    out = []
    i = 0
    while True:
        j = key.find(block, i)
        if j < 0:
            out.append(key[i:])
            return "".join(out)
        end = j + len(block)
        boundary_before = j == 0 or key[j - 1] in ":/."
        boundary_after = end == len(key) or key[end] in "/."
        out.append(key[i:j])
        out.append(BLOCK_PLACEHOLDER if boundary_before and boundary_after else block)
        i = end


def _same_pin(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


def build_problem(
    graph: Graph,
    costs: CostModel,
    clustering: Clustering,
    *,
    budget: float | None,
    pins: Mapping[int, np.ndarray] | None = None,
) -> Problem:
    """The abstract problem of ``graph`` under ``clustering`` (see :class:`Problem`)."""
    nodes = graph.nodes
    pins = pins or {}
    nclass = len(clustering.members)
    labels = [nodes[m[0]].key for m in clustering.members]
    compute = [nodes[m[0]].compute_us for m in clustering.members]
    count = np.array([len(m) for m in clustering.members], dtype=np.int64)
    tie = []
    for c in range(nclass):
        j = len(compute[c])
        weight = PLACEHOLDER_TIE if nodes[clustering.members[c][0]].kind == PLACEHOLDER else 1.0
        tie.append(weight * TIE_US * np.arange(j) / max(j - 1, 1))
    edges: list[EdgeClass | None] = [None] * (max(clustering.edge_class_of.values(), default=-1) + 1)
    counts = [0] * len(edges)
    for (ci, a), e in clustering.edge_class_of.items():
        counts[e] += 1
        if edges[e] is None:
            cons = nodes[ci]
            prod = nodes[cons.inputs[a]]
            cm, pm, cost, locked = edge_table(graph, costs, cons, a, prod)
            edges[e] = EdgeClass(
                cons=clustering.class_of[ci],
                prod=clustering.class_of[prod.index],
                arg=a,
                cons_map=cm,
                prod_map=pm,
                cost=cost,
                count=0,
                label=f"{cons.key}[{a}] <- {prod.key}",
                locked=locked,
            )
    for e, n in zip(edges, counts, strict=True):
        e.count = n
    equal = []
    seen_eq = set()
    for a, b, why in graph.equal:
        pair = (clustering.class_of[a], clustering.class_of[b])
        if pair[0] != pair[1] and pair not in seen_eq:
            seen_eq.add(pair)
            equal.append((*pair, why))
    memory: dict[int, np.ndarray] = {}
    for pn in graph.params():
        c = clustering.class_of[pn.index]
        per = np.array([param_local_bytes(pn.meta, cand.outs[0], graph.mesh_sizes) for cand in pn.candidates], dtype=np.float64)
        memory[c] = per  # one node's bytes: the formulation multiplies by the class count
    allowed = {}
    for i, mask in pins.items():
        c = clustering.class_of[i]
        allowed[c] = mask if c not in allowed else allowed[c] & mask
    return Problem(
        labels=labels,
        compute=compute,
        count=count,
        edges=edges,
        equal=equal,
        memory=sorted(memory.items()),
        budget=budget,
        allowed=allowed,
        tie=tie,
    )


def param_local_bytes(meta, placements: Placements, sizes: Sequence[int]) -> int:
    return nbytes(local_shape(meta.shape, placements, sizes), meta.dtype)


def param_bytes(graph: Graph, choice: Sequence[int]) -> int:
    """Per-rank parameter bytes of an assignment (one choice per PNode)."""
    return sum(param_local_bytes(pn.meta, pn.candidates[choice[pn.index]].outs[0], graph.mesh_sizes) for pn in graph.params())


def min_param_bytes(graph: Graph) -> int:
    """Per-rank bytes of the parameters each at its smallest candidate ("fully sharded")."""
    return sum(min(param_local_bytes(pn.meta, c.outs[0], graph.mesh_sizes) for c in pn.candidates) for pn in graph.params())
