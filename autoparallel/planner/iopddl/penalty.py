"""Adaptive penalties on the usage limit: descend on the cheap plans, then raise prices until feasible.

The least-usage start sits far from the cheap plans on memory-tight instances, and descent under
the hard limit cannot leave its basin. Here the limit becomes a price: each time step t has a
multiplier lam[t], a node pays usage * (sum of lam over its live interval), and coordinate descent
(a work list of nodes whose neighbours or prices changed) runs on cost + price starting with every
price at zero, i.e. from the unconstrained descent. The prices at the over-full steps then double
(plus a base price scaled to the instance's cost per unit of usage) and the descent resumes, until
the plan fits or the rounds or time run out. The best feasible plan seen is returned (None if none).
"""

from __future__ import annotations

import numpy as np

from autoparallel.planner.iopddl.instance import Instance
from autoparallel.planner.iopddl.priced_child import base_price
from autoparallel.planner.iopddl.search import local_costs, profile


def _base_price(inst: Instance) -> float:
    """A typical cost per unit of usage per live step (priced_child.base_price)."""
    return base_price(inst.cost, inst.usage, inst.starts, inst.ends)


def _neighbours(inst: Instance, i: int):
    return [int(inst.edge_v[e] if is_u else inst.edge_u[e]) for e, is_u in inst.incident[i]]


def priced_descent(inst: Instance, x: np.ndarray, weight: np.ndarray, dirty, deadline=None, clock=None) -> int:
    """Coordinate descent in place on ``x`` for cost + usage * weight[i] over a work list
    (nodes whose neighbours move are revisited); every move strictly lowers the priced cost, so
    it ends. Returns the number of moves."""
    work = list(dict.fromkeys(int(i) for i in dirty))
    queued = set(work)
    moves = 0
    k = 0
    while k < len(work):
        if deadline is not None and k % 256 == 0 and clock() > deadline:
            break
        i = work[k]
        k += 1
        queued.discard(i)
        local = local_costs(inst, x, i) + weight[i] * inst.usage[i]
        if not np.isfinite(local).any():
            continue
        best = int(np.argmin(local))
        cur = int(x[i])
        if not np.isfinite(local[cur]) or local[best] < local[cur] - 1e-12 * max(1.0, abs(local[cur])):
            x[i] = best
            moves += 1
            for j in _neighbours(inst, i):
                if j not in queued:
                    queued.add(j)
                    work.append(j)
    return moves


def penalty_search(inst: Instance, x: np.ndarray, deadline: float, clock, say=lambda m: None, rounds: int = 60,
                   plan_cost=None, relax: float | None = None, growth: float = 2.0):
    """Adaptive-penalty search from ``x`` (modified in place); returns the best feasible plan
    found (a copy) and its cost, or (None, inf). With ``relax``, each feasible round multiplies
    every price by it and the search goes on until ``rounds`` or ``deadline``; else it stops at
    the first feasible plan."""
    if inst.limit is None or inst.horizon == 0:
        return None, np.inf
    lam = np.zeros(inst.horizon, dtype=np.float64)
    base = _base_price(inst)
    live = inst.starts < inst.ends
    weight = np.zeros(inst.n)
    dirty = range(inst.n)
    best_x, best_cost = None, np.inf
    for r in range(rounds):
        if clock() > deadline:
            break
        priced_descent(inst, x, weight, dirty, deadline, clock)
        prof = profile(inst, x)
        over = prof > inst.limit
        if not over.any():
            c = plan_cost(inst, x)
            if c < best_cost:
                best_x, best_cost = x.copy(), c
            say(f"penalty round {r}: feasible, cost {c:.6g}")
            if relax is None:
                break
            lam *= relax  # feasible: lower every price and look for a cheaper feasible plan
        else:
            say(f"penalty round {r}: {int(over.sum())} steps over the limit (peak {int(prof.max())} > {inst.limit})")
            lam[over] = growth * lam[over] + base
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        new_weight = np.where(live, cum[inst.ends.clip(0, inst.horizon)] - cum[inst.starts.clip(0, inst.horizon)], 0.0)
        dirty = np.flatnonzero(new_weight != weight)
        weight = new_weight
    return best_x, best_cost
