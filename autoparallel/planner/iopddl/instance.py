"""Reading an IOPDDL instance (plain or gzipped JSON) into arrays the solvers work on.

Costs of 10**18 and above mean "forbidden" in the contest's files: they become ``inf`` in the
float cost arrays, so a solver can never pick them while the exact integer costs stay available.
Edges between the same two nodes are merged (their cost tables summed) so each solver sees one.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

INFINITE = 10**18


@dataclass
class Instance:
    name: str
    starts: np.ndarray  # int64 [n]
    ends: np.ndarray  # int64 [n], exclusive
    cost: list  # float64 [n_strategies] per node, inf where forbidden
    usage: list  # int64 [n_strategies] per node
    edge_u: np.ndarray  # int64 [m]
    edge_v: np.ndarray  # int64 [m]
    edge_cost: list  # float64 [n_strategies(u), n_strategies(v)] per edge, inf where forbidden
    limit: int | None
    horizon: int = 0
    incident: list = field(default_factory=list)  # per node: [(edge index, node is edge's u)]

    @property
    def n(self) -> int:
        return len(self.cost)

    def sizes(self) -> np.ndarray:
        return np.array([len(c) for c in self.cost], dtype=np.int64)


def incident_lists(n: int, edge_u, edge_v) -> list:
    """Per node: [(edge index, node is the edge's u)] (``Instance.incident``)."""
    adj = [[] for _ in range(n)]
    for e, (u, v) in enumerate(zip(edge_u, edge_v)):
        adj[int(u)].append((e, True))
        adj[int(v)].append((e, False))
    return adj


def arrays(inst: Instance) -> dict:
    """The instance's arrays the priced rounds read (priced_child.py), picklable: no incident lists."""
    return {"cost": inst.cost, "usage": inst.usage, "edge_u": inst.edge_u, "edge_v": inst.edge_v,
            "edge_cost": inst.edge_cost, "starts": inst.starts, "ends": inst.ends, "limit": inst.limit,
            "horizon": inst.horizon}


def _floats(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    a[a >= INFINITE] = np.inf
    return a


def _flat(lists, dtype, total: int) -> np.ndarray:
    """The concatenation of many short lists as one array: one conversion instead of one per
    list (a 40k-node instance's 110k lists took 4 CPU seconds one by one)."""
    return np.fromiter(chain.from_iterable(lists), dtype=dtype, count=total)


def _pieces(flat: np.ndarray, sizes: np.ndarray) -> list:
    """``flat`` cut into consecutive views of the given sizes."""
    return np.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) else []


def read_json(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _lengths(lists) -> np.ndarray:
    return np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))


def from_dict(data: dict) -> Instance:
    """Build an :class:`Instance` from the parsed JSON; raise ValueError on a malformed one.
    Every list of numbers is converted in one flat array and cut into views."""
    try:
        p = data["problem"]
        nodes, edges = p["nodes"], p["edges"]
        intervals, costs, usages = nodes["intervals"], nodes["costs"], nodes["usages"]
        pairs, tables = edges["nodes"], edges["costs"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"not an IOPDDL instance: missing {e}") from None
    n = len(costs)
    if not (len(intervals) == len(usages) == n) or len(pairs) != len(tables):
        raise ValueError("not an IOPDDL instance: node or edge lists of different lengths")
    iv = np.asarray(intervals, dtype=np.int64).reshape(n, 2)
    sizes, usizes = _lengths(costs), _lengths(usages)
    bad = np.flatnonzero((sizes == 0) | (sizes != usizes))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"node {i}: {sizes[i]} costs, {usizes[i]} usages")
    cost = _pieces(_floats(_flat(costs, np.float64, int(sizes.sum()))), sizes)
    usage = _pieces(_flat(usages, np.int64, int(sizes.sum())), sizes)
    bad = np.flatnonzero(_lengths(pairs) != 2)
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: only edges between two nodes are supported, got {pairs[k]}")
    uv = _flat(pairs, np.int64, 2 * len(pairs)).reshape(-1, 2)
    bad = np.flatnonzero((uv < 0).any(axis=1) | (uv >= n).any(axis=1) | (uv[:, 0] == uv[:, 1]))
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: bad nodes {pairs[k]}")
    rows, cols = sizes[uv[:, 0]], sizes[uv[:, 1]]
    tsizes = _lengths(tables)
    bad = np.flatnonzero(tsizes != rows * cols)
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: {tsizes[k]} costs for {rows[k]}x{cols[k]} strategy pairs")
    flat = _pieces(_floats(_flat(tables, np.float64, int(tsizes.sum()))), tsizes)
    merged: dict = {}
    for k, (u, v) in enumerate(uv.tolist()):
        m = flat[k].reshape(rows[k], cols[k])
        if (v, u) in merged:
            u, v, m = v, u, m.T
        merged[(u, v)] = merged[(u, v)] + m if (u, v) in merged else m
    keys = list(merged)
    eu = np.array([k[0] for k in keys], dtype=np.int64)
    ev = np.array([k[1] for k in keys], dtype=np.int64)
    limit = p.get("usage_limit")
    inst = Instance(str(p.get("name", "")), iv[:, 0].copy(), iv[:, 1].copy(), cost, usage, eu, ev,
                    [merged[k] for k in keys], None if limit is None else int(limit))
    inst.horizon = int(max(iv[:, 1].max(initial=0), 0))
    inst.incident = incident_lists(n, eu, ev)
    return inst


def load(path: str) -> Instance:
    return from_dict(read_json(path))


def forbid_unsupported(inst: Instance) -> int:
    """Arc consistency: forbid (cost ``inf``) each strategy that has, on some edge, no allowed
    partner at a finite cost, until none is left; returns how many were forbidden. Without it
    a start of least usage makes forbidden pairs that no single move can undo."""
    allowed = [np.isfinite(c) for c in inst.cost]
    finite = [np.isfinite(m) for m in inst.edge_cost]
    removed, dirty = 0, set(range(inst.n))
    while dirty:
        edges = sorted({e for i in dirty for e, _ in inst.incident[i]})
        dirty = set()
        for e in edges:
            a, b = int(inst.edge_u[e]), int(inst.edge_v[e])
            f = finite[e]
            sa = allowed[a] & (f[:, allowed[b]].any(axis=1))
            sb = allowed[b] & (f[allowed[a], :].any(axis=0))
            for node, new in ((a, sa), (b, sb)):
                if new.sum() < allowed[node].sum():
                    if not new.any():
                        raise ValueError(f"infeasible: node {node} has no strategy compatible with its neighbours")
                    removed += int(allowed[node].sum() - new.sum())
                    allowed[node] = new
                    dirty.add(node)
    for i in range(inst.n):
        inst.cost[i] = np.where(allowed[i], inst.cost[i], np.inf)
    return removed
