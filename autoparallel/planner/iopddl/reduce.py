"""Exact reductions that shrink an IOPDDL instance before a solver sees it.

Two rules, applied in turn until neither changes anything; both keep the optimum (every plan of
the original maps to a plan of the reduced instance no worse in cost and in usage at every step,
and :meth:`Reduction.lift` maps any reduced plan back to an original plan of the same cost):

- dominated strategies: strategy ``s`` of a node goes when another allowed strategy ``t`` has a
  cost, a usage and, on every incident edge, a whole row of edge costs each <= ``s``'s (equal
  strategies: the higher index goes). Swapping ``s`` for ``t`` in any plan never costs more and
  never uses more memory.
- folded leaves: a node with one neighbour ``j`` whose best response to every strategy of ``j``
  can be taken at the leaf's least usage becomes an isolated one-strategy node (cost 0, that least
  usage, same live interval); ``j``'s costs gain the leaf's best response cost. So does a leaf
  live only at steps where every node at its largest usage fits the limit (it keeps its largest
  usage, which cannot break those steps). When the cheapest
  response needs more memory than the leaf's least, folding would decide the leaf's memory without
  the limit, so such a leaf stays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from autoparallel.planner.iopddl.instance import Instance


@dataclass
class Reduction:
    """A reduced instance and what maps its plans back to the original's."""

    inst: Instance
    keep: list  # per node: original strategy index of each reduced strategy
    folded: list = field(default_factory=list)  # (leaf, neighbour, response by neighbour's original strategy)
    removed: int = 0  # dominated strategies removed
    original_sizes: np.ndarray | None = None

    def lift(self, x) -> np.ndarray:
        """The original plan of a reduced plan ``x`` (same cost, usage no higher at any step)."""
        x = np.asarray(x, dtype=np.int64)
        if x.shape != (self.inst.n,):
            raise ValueError(f"a plan of {self.inst.n} nodes expected, got shape {x.shape}")
        sizes = self.inst.sizes()
        if (x < 0).any() or (x >= sizes).any():
            raise ValueError("plan holds a strategy index out of range for the reduced instance")
        out = np.array([int(self.keep[i][x[i]]) for i in range(self.inst.n)], dtype=np.int64)
        for leaf, j, response in reversed(self.folded):
            out[leaf] = int(response[out[j]])
        return out


def _rows(inst: Instance, i: int, alive: list) -> np.ndarray:
    """Node ``i``'s alive strategies as rows: cost, usage, then every incident edge's costs over
    the neighbour's alive strategies."""
    live = inst.starts[i] < inst.ends[i]  # usage of a node never live counts nowhere
    use = inst.usage[i].astype(np.float64) if live else np.zeros(len(inst.usage[i]))
    parts = [inst.cost[i][:, None], use[:, None]]
    for e, is_u in inst.incident[i]:
        m = inst.edge_cost[e]
        parts.append(m[:, alive[int(inst.edge_v[e])]] if is_u else m[alive[int(inst.edge_u[e])], :].T)
    return np.concatenate(parts, axis=1)


def _dominated(inst: Instance, i: int, alive: list) -> np.ndarray:
    """Indices among node ``i``'s alive strategies that another alive strategy dominates."""
    idx = np.flatnonzero(alive[i])
    if len(idx) < 2:
        return idx[:0]
    rows = _rows(inst, i, alive)[idx]
    head = rows[:, :2]  # cost and usage: a cheap first filter before the edge rows
    gone = np.zeros(len(idx), dtype=bool)
    order = np.arange(len(idx))
    for a in range(len(idx)):
        if gone[a]:
            continue
        cand = np.flatnonzero((head[a][None, :] <= head).all(axis=1) & ~gone & (order != a))
        if not len(cand):
            continue
        sub = rows[cand]
        le = (rows[a][None, :] <= sub).all(axis=1)  # a dominates the candidate (weakly)
        strict = (rows[a][None, :] < sub).any(axis=1)
        gone[cand[le & (strict | (cand > a))]] = True
    return idx[gone]


def _free_steps(inst: Instance, alive: list) -> np.ndarray:
    """Per time step: whether the limit holds there even with every node at its largest allowed
    usage (a leaf live only at such steps may take any strategy)."""
    if inst.limit is None or inst.horizon == 0:
        return np.ones(max(inst.horizon, 0), dtype=bool)
    diff = np.zeros(inst.horizon + 1, dtype=np.int64)
    top = np.array([int(u[a].max()) if a.any() else 0 for u, a in zip(inst.usage, alive)], dtype=np.int64)
    live = inst.starts < inst.ends
    np.add.at(diff, inst.starts[live], top[live])
    np.add.at(diff, inst.ends[live], -top[live])
    return np.cumsum(diff)[: inst.horizon] <= inst.limit


def _fold(inst: Instance, i: int, alive: list, free_prefix: np.ndarray):
    """(neighbour, response over the neighbour's strategies, added costs, leaf usage) when leaf
    ``i`` folds exactly, else None: its cheapest response is always of least usage, or it is
    live only at free steps (then it keeps its largest usage, which those steps can hold)."""
    (e, is_u), = inst.incident[i]
    j = int(inst.edge_v[e] if is_u else inst.edge_u[e])
    m = inst.edge_cost[e].T if is_u else inst.edge_cost[e]  # [strategies of j, strategies of i]
    ok = alive[i]
    total = np.where(ok[None, :], m + inst.cost[i][None, :], np.inf)
    s0, e0 = int(inst.starts[i]), int(inst.ends[i])
    if s0 >= e0 or free_prefix[e0] - free_prefix[s0] == e0 - s0:
        return j, np.where(np.isfinite(total.min(axis=1)), total.argmin(axis=1), 0), total.min(axis=1), \
            int(inst.usage[i][ok].max())
    umin = int(inst.usage[i][ok].min())
    lean = ok & (inst.usage[i] == umin)
    lean_total = np.where(lean[None, :], total, np.inf)
    best = total.min(axis=1)
    lean_best = lean_total.min(axis=1)
    rows = alive[j]
    if not (lean_best[rows] <= best[rows]).all():
        return None
    response = np.where(np.isfinite(lean_best), lean_total.argmin(axis=1), 0)
    return j, response, lean_best, umin


def reduce(inst: Instance, rounds: int = 20, say=lambda m: None, deadline=None, clock=time.perf_counter) -> Reduction:
    """Apply the dominated-strategy and leaf-folding rules until a fixed point, ``rounds`` or
    ``deadline`` (each single step is exact, so stopping anywhere keeps the optimum)."""
    alive = [np.isfinite(c) for c in inst.cost]
    cost = [c.copy() for c in inst.cost]
    usage = [u.copy() for u in inst.usage]
    work = Instance(inst.name, inst.starts, inst.ends, cost, usage, inst.edge_u, inst.edge_v, inst.edge_cost,
                    inst.limit, inst.horizon, [list(x) for x in inst.incident])
    folded, removed = [], 0
    free = _free_steps(inst, alive)
    free_prefix = np.concatenate([[0], np.cumsum(free)])
    for r in range(rounds):
        changed = 0
        if deadline is not None and clock() > deadline:
            break
        for i in range(work.n):
            if deadline is not None and i % 512 == 0 and clock() > deadline:
                break
            gone = _dominated(work, i, alive)
            if len(gone) and len(gone) < alive[i].sum():
                alive[i] = alive[i].copy()
                alive[i][gone] = False
                removed += len(gone)
                changed += len(gone)
        for i in range(work.n):
            if len(work.incident[i]) != 1:
                continue
            hit = _fold(work, i, alive, free_prefix)
            if hit is None:
                continue
            j, response, add, umin = hit
            (e, _), = work.incident[i]
            work.cost[j] = work.cost[j] + add
            work.incident[i] = []
            work.incident[j] = [(f, s) for f, s in work.incident[j] if f != e]
            folded.append((i, j, response))
            keep_i = int(response[np.flatnonzero(alive[j])[0]])
            work.cost[i] = np.where(np.arange(len(cost[i])) == keep_i, 0.0, np.inf)
            work.usage[i] = np.full(len(usage[i]), umin, dtype=np.int64)
            alive[i] = np.isfinite(work.cost[i])
            changed += 1
        say(f"reduce round {r}: {changed} changes ({removed} strategies removed, {len(folded)} leaves folded)")
        if not changed:
            break
    return _build(inst, work, alive, folded, removed)


def _build(inst: Instance, work: Instance, alive: list, folded: list, removed: int) -> Reduction:
    """The reduced instance: alive strategies only, folded leaves' edges dropped."""
    keep = [np.flatnonzero(a) for a in alive]
    edges = sorted({e for i in range(work.n) for e, _ in work.incident[i]})
    eu, ev = work.edge_u[edges], work.edge_v[edges]
    tables = [work.edge_cost[e][np.ix_(keep[int(work.edge_u[e])], keep[int(work.edge_v[e])])] for e in edges]
    out = Instance(inst.name, inst.starts, inst.ends, [work.cost[i][keep[i]] for i in range(work.n)],
                   [work.usage[i][keep[i]] for i in range(work.n)], eu, ev, tables, inst.limit, inst.horizon)
    out.incident = [[] for _ in range(out.n)]
    for k, (u, v) in enumerate(zip(eu, ev)):
        out.incident[int(u)].append((k, True))
        out.incident[int(v)].append((k, False))
    return Reduction(out, keep, folded, removed, inst.sizes())
