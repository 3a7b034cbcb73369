"""Feasible starts and local search for IOPDDL instances.

Usage is separable over nodes, so the strategy of least usage at every node is feasible whenever
any plan is: that is the start. Coordinate descent (iterated conditional modes) then moves one
node at a time to its cheapest strategy given its neighbours, never above the usage limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: priced_child.py loads this file alone, without the package (and torch)
    from autoparallel.planner.iopddl.instance import Instance


def profile(inst: Instance, x: np.ndarray) -> np.ndarray:
    """Summed usage at every time step of the half-open live intervals under plan ``x``."""
    diff = np.zeros(inst.horizon + 1, dtype=np.int64)
    u = np.array([u[s] for u, s in zip(inst.usage, np.asarray(x).tolist())], dtype=np.int64)
    live = inst.starts < inst.ends
    np.add.at(diff, inst.starts[live], u[live])
    np.add.at(diff, inst.ends[live], -u[live])
    return np.cumsum(diff)[: inst.horizon]


def cost(inst: Instance, x: np.ndarray) -> float:
    """The plan's cost as a float (``inf`` when it uses a forbidden strategy or pair), summed in
    node then edge order. Indexed with Python ints (numpy scalars as indices made it 0.3 CPU s on
    D, 10 s of wall time after the deadline at load 15)."""
    xs = np.asarray(x).tolist()
    total = sum(float(c[s]) for c, s in zip(inst.cost, xs))
    for m, u, v in zip(inst.edge_cost, np.asarray(inst.edge_u).tolist(), np.asarray(inst.edge_v).tolist()):
        total += float(m[xs[u], xs[v]])
    return total


def least_usage(inst: Instance) -> np.ndarray:
    """Each node's strategy of least usage among its allowed ones (cheapest on ties, then the
    first): one sort of every strategy by (node, usage, cost, index)."""
    sizes = np.array([len(c) for c in inst.cost], dtype=np.int64)
    if not inst.n:
        return np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    c, u = np.concatenate(inst.cost), np.concatenate(inst.usage)
    ok = np.isfinite(c)
    none = np.flatnonzero(~np.logical_or.reduceat(ok, offsets))
    if len(none):
        raise ValueError(f"node {int(none[0])}: every strategy has infinite cost")
    node = np.repeat(np.arange(inst.n), sizes)
    local = np.arange(len(c)) - offsets[node]
    order = np.lexsort((local, c, np.where(ok, u, np.iinfo(np.int64).max), node))
    return local[order[offsets]]


def local_costs(inst: Instance, x: np.ndarray, i: int) -> np.ndarray:
    """Node ``i``'s cost for each of its strategies with every neighbour held at ``x``."""
    local = inst.cost[i].copy()
    for e, is_u in inst.incident[i]:
        m = inst.edge_cost[e]
        local += m[:, x[inst.edge_v[e]]] if is_u else m[x[inst.edge_u[e]], :]
    return local


def descend(inst: Instance, x: np.ndarray, prof: np.ndarray, order=None, passes: int = 10, deadline=None,
            clock=None) -> int:
    """Coordinate descent in place on ``x`` and ``prof``; returns the number of moves made."""
    limit = inst.limit
    moves = 0
    nodes = range(inst.n) if order is None else order
    for _ in range(passes):
        changed = 0
        for i in nodes:
            if deadline is not None and clock() > deadline:
                return moves + changed
            local = local_costs(inst, x, i)
            cur = x[i]
            s, e = inst.starts[i], inst.ends[i]
            use = inst.usage[i]
            if limit is not None and s < e:
                slack = limit - int(prof[s:e].max()) + int(use[cur])
                local = np.where(use <= slack, local, np.inf)
            best = int(np.argmin(local))
            if local[best] < local[cur] or (not np.isfinite(local[cur]) and np.isfinite(local[best])):
                if s < e:
                    prof[s:e] += use[best] - use[cur]
                x[i] = best
                changed += 1
        moves += changed
        if not changed:
            break
    return moves
