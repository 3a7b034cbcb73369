"""Star moves: change a node and all its leaves (degree-1 neighbours) at once.

Most nodes of the contest's instances are leaves (A: 27,456 of 34,932). A hub's strategy change
is then rarely an improvement alone, because each leaf's edge punishes it until the leaf moves
too, and a leaf never moves first. A star move picks the hub's strategy with every leaf's best
response to it folded in (exact for the star when memory allows, as in the contest's graph
reduction of degree-1 nodes), twice: leaves free, and leaves held to at most their current
usage; the cheapest candidate whose whole change fits the usage limit at every step is taken.
"""

from __future__ import annotations

import numpy as np

from autoparallel.planner.iopddl.instance import Instance


def stars(inst: Instance) -> dict:
    """Hub -> [(edge, hub is the edge's u, leaf)] for every leaf (a node with one neighbour)."""
    out: dict = {}
    for j in range(inst.n):
        if len(inst.incident[j]) == 1:
            e, j_is_u = inst.incident[j][0]
            hub = int(inst.edge_v[e] if j_is_u else inst.edge_u[e])
            if len(inst.incident[hub]) == 1 and hub > j:
                continue  # an isolated pair: one star, hub = the larger index
            out.setdefault(hub, []).append((e, not j_is_u, j))
    return out


def _fits(inst: Instance, prof: np.ndarray, changes) -> bool:
    """Whether ``prof`` plus the usage changes [(node, old, new)] stays within the limit."""
    if inst.limit is None:
        return True
    spans = [(inst.starts[i], inst.ends[i], int(inst.usage[i][new] - inst.usage[i][old])) for i, old, new in changes]
    spans = [(s, e, d) for s, e, d in spans if s < e and d]
    if not spans or all(d < 0 for _, _, d in spans):
        return True
    lo, hi = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
    diff = np.zeros(hi - lo + 1, dtype=np.int64)
    for s, e, d in spans:
        diff[s - lo] += d
        diff[e - lo] -= d
    return int((prof[lo:hi] + np.cumsum(diff)[:-1]).max()) <= inst.limit


def star_move(inst: Instance, x: np.ndarray, prof: np.ndarray, hub: int, leaves) -> float:
    """Best feasible star move at ``hub`` applied in place; returns the gain (0 when none)."""
    base = inst.cost[hub].copy()
    leaf_set = {j for _, _, j in leaves}
    for e, is_u in inst.incident[hub]:
        other = int(inst.edge_v[e] if is_u else inst.edge_u[e])
        if other not in leaf_set:
            m = inst.edge_cost[e]
            base += m[:, x[other]] if is_u else m[x[other], :]
    free_cost, held_cost = base.copy(), base.copy()
    free_pick, held_pick, current = [], [], float(base[x[hub]])
    for e, hub_is_u, j in leaves:
        r = (inst.edge_cost[e] if hub_is_u else inst.edge_cost[e].T) + inst.cost[j][None, :]
        current += float(r[x[hub], x[j]])
        t = np.argmin(r, axis=1)
        free_cost += r[np.arange(len(t)), t]
        free_pick.append(t)
        rh = np.where(inst.usage[j][None, :] <= inst.usage[j][x[j]], r, np.inf)
        th = np.argmin(rh, axis=1)
        held_cost += rh[np.arange(len(th)), th]
        held_pick.append(th)
    if not np.isfinite(current):
        current = np.inf
    cands = sorted([(float(free_cost[s]), s, free_pick) for s in range(len(base))]
                   + [(float(held_cost[s]), s, held_pick) for s in range(len(base))], key=lambda c: c[0])
    for value, s, picks in cands[:8]:
        if not value < current - 1e-9 * max(1.0, abs(value)):
            break
        changes = [(hub, x[hub], s)] + [(j, x[j], int(p[s])) for (_, _, j), p in zip(leaves, picks)]
        changes = [c for c in changes if c[1] != c[2]]
        if _fits(inst, prof, changes):
            for i, old, new in changes:
                if inst.starts[i] < inst.ends[i]:
                    prof[inst.starts[i]:inst.ends[i]] += inst.usage[i][new] - inst.usage[i][old]
                x[i] = new
            return current - value if np.isfinite(current) else np.inf
    return 0.0


def star_descend(inst: Instance, x: np.ndarray, prof: np.ndarray, passes: int = 5, deadline=None,
                 clock=None, hubs: dict | None = None) -> int:
    """Star moves at every hub, repeated while some pass improves; returns the moves made."""
    hubs = stars(inst) if hubs is None else hubs
    moves = 0
    for _ in range(passes):
        changed = 0
        for hub, leaves in hubs.items():
            if deadline is not None and clock() > deadline:
                return moves + changed
            if star_move(inst, x, prof, hub, leaves) > 0:
                changed += 1
        moves += changed
        if not changed:
            break
    return moves
