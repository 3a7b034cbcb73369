"""Recombining two plans component by component: a repair for plans slightly over the limit.

The priced rounds (priced_child.py) alternate plans within the usage limit with cheaper plans
just over it (K: plans 0.92-1.03x the contest's best, over by 30-8,000 steps). Moving single
nodes to strategies of less usage (priced_child.repair) brought those back at +2-54 %: the
strategies of less usage are compatible only with the neighbours' own smaller ones (most edges
between the nodes two plans set differently forbid the mixed pairs), so each lone move pays its
neighbours' edge costs. Two plans from toulbar2 differ instead by whole chains that it moved
together. The nodes where a plan and a donor (a plan within the limit) differ fall into
connected components of the edges between them; every other edge of a component ends at a node
both plans share, so each component can keep the plan's strategies or take the donor's alone,
its cost change exact (partition crossover). Switching them all gives the donor: a plan within
the limit always exists among the choices.

Numpy only: the priced child loads this file by its path, without the package.
"""

from __future__ import annotations

import heapq

import numpy as np


def parts(net, x, donor) -> list:
    """The nodes where ``x`` and ``donor`` differ, as the connected components (arrays of node
    ids) of the edges between two such nodes. ``net`` has edge_u and edge_v (any Instance)."""
    diff = np.flatnonzero(np.asarray(x) != np.asarray(donor))
    if not len(diff):
        return []
    root = {i: i for i in diff.tolist()}

    def find(i):
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    eu, ev = np.asarray(net.edge_u), np.asarray(net.edge_v)
    inside = np.zeros(len(net.cost), dtype=bool)
    inside[diff] = True
    both = inside[eu] & inside[ev]
    for u, v in zip(eu[both].tolist(), ev[both].tolist()):
        ru, rv = find(u), find(v)
        if ru != rv:
            root[ru] = rv
    groups: dict = {}
    for i in diff.tolist():
        groups.setdefault(find(i), []).append(i)
    return [np.array(g, dtype=np.int64) for g in groups.values()]


class Part:
    """One component of :func:`parts`: the cost change when its nodes take the donor's
    strategies (its nodes and every edge at them; ``-inf`` when that clears a forbidden choice
    of the plan) and the usage change, as spans (start, end, change) of its nodes."""

    def __init__(self, net, x, donor, nodes: np.ndarray):
        self.nodes = nodes
        xs, ds = nodes.tolist(), [int(donor[i]) for i in nodes.tolist()]
        delta = sum(float(net.cost[i][d]) - float(net.cost[i][x[i]]) for i, d in zip(xs, ds))
        edges = {e for i in xs for e, _ in net.incident[i]}
        for e in edges:
            m, u, v = net.edge_cost[e], int(net.edge_u[e]), int(net.edge_v[e])
            delta += float(m[donor[u], donor[v]]) - float(m[x[u], x[v]])
        self.delta = -np.inf if np.isnan(delta) else delta  # inf - inf: forbidden in both, cleared on neither side
        self.donor, self.own = ds, [int(x[i]) for i in xs]
        a, b = np.asarray(net.starts)[nodes], np.asarray(net.ends)[nodes]
        du = np.array([int(net.usage[i][d]) - int(net.usage[i][x[i]]) for i, d in zip(xs, ds)], dtype=np.int64)
        live = (a < b) & (du != 0)
        self.a, self.b, self.du = a[live], b[live], du[live]
        self.lo, self.hi = (int(self.a.min()), int(self.b.max())) if len(self.a) else (0, 0)

    def change(self) -> np.ndarray:
        """The usage change over steps [lo, hi) when the component takes the donor's strategies."""
        diff = np.zeros(self.hi - self.lo + 1, dtype=np.int64)
        np.add.at(diff, self.a - self.lo, self.du)
        np.add.at(diff, self.b - self.lo, -self.du)
        return np.cumsum(diff)[:-1]


def _excess(p: np.ndarray, limit: int) -> int:
    return int(np.maximum(p - limit, 0).sum())


def cross(net, x: list, prof: np.ndarray, donor) -> int:
    """Recombine ``x`` with ``donor`` (a plan within the limit), in place on ``x`` and its
    profile ``prof``: each component of :func:`parts` keeps ``x``'s strategies or takes the
    donor's. While the plan is over the limit, the component that removes the most excess
    (byte-steps over the limit) per unit of cost added is switched first, its ratio recomputed
    before it is switched (a lazy greedy: the excess left changes what each one removes); if
    none removes any and the plan is still over, every component left is switched (the donor's
    choices there). Then, up to three passes, any component whose flip either way lowers the
    cost and keeps the plan within the limit is flipped. So the plan ends within the limit, and
    when ``x`` was already within it, no dearer than ``x``. Returns the components switched."""
    limit = net.limit
    comps = [Part(net, x, donor, c) for c in parts(net, x, donor)]
    on = np.zeros(len(comps), dtype=bool)

    def flip(k: int) -> None:
        c, sign = comps[k], (-1 if on[k] else 1)
        if c.hi > c.lo:
            prof[c.lo:c.hi] += sign * c.change()
        for i, s in zip(c.nodes.tolist(), c.donor if sign > 0 else c.own):
            x[i] = s
        on[k] = sign > 0

    def removed(k: int) -> int:
        c = comps[k]
        if c.hi <= c.lo:
            return 0
        seg = prof[c.lo:c.hi]
        return _excess(seg, limit) - _excess(seg + c.change(), limit)

    heap = []
    if (prof > limit).any():
        heap = [(c.delta / g, k) for k, c in enumerate(comps) if (g := removed(k)) > 0]
        heapq.heapify(heap)
    while heap and (prof > limit).any():
        _, k = heapq.heappop(heap)
        g = removed(k)
        if g <= 0:
            continue
        ratio = comps[k].delta / g
        if heap and ratio > heap[0][0]:
            heapq.heappush(heap, (ratio, k))
            continue
        flip(k)
    if (prof > limit).any():
        for k in np.flatnonzero(~on).tolist():
            flip(k)
    for _ in range(3):
        flipped = 0
        for k in sorted(range(len(comps)), key=lambda k: -comps[k].delta if on[k] else comps[k].delta):
            c, sign = comps[k], (-1 if on[k] else 1)
            if not sign * c.delta < 0:
                continue
            if c.hi > c.lo and int((prof[c.lo:c.hi] + sign * c.change()).max()) > limit:
                continue
            flip(k)
            flipped += 1
        if not flipped:
            break
    return int(on.sum())


class Pool:
    """The cheapest distinct plans within the limit seen so far (at most ``size``), cheapest
    first: the donors. Several, not only the best: each donor differs from a plan by other
    components (K: crossing with the four best after the best took 2.3675e9 to 2.3571e9)."""

    def __init__(self, size: int = 4):
        self.size, self.plans = size, []  # [(cost, plan)]

    def add(self, x, c: float) -> None:
        if not np.isfinite(c) or any(c == pc and list(x) == p for pc, p in self.plans):
            return
        self.plans = sorted(self.plans + [(c, list(x))], key=lambda t: t[0])[: self.size]

    def donors(self) -> list:
        return [p for _, p in self.plans]
