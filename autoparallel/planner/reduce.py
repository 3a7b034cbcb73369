"""Exact reductions of a :class:`Problem` before it becomes an ILP.

Most nodes of a joint graph sit on chains (views, unary pointwise ops, the alias in front of a
multi-user tensor) or hang off the graph (inputs, buffers, tangents). Such a class can be
solved in closed form once its neighbours are fixed, so it is eliminated before variables are
made, and its choice is recovered after the solve:

* **leaf**: a class whose only edge goes to one neighbour: its best choice for each choice of
  the neighbour (``min_k w[k] + cost[u(j), v(k)]``) is added to the neighbour's compute;
* **series**: a class with exactly one input edge and one output edge: the two tables and its
  own costs fold into one table between its neighbours, ``C[u, v] = min_j out[u, o(j)] + w[j]
  + in[i(j), v]`` (a min-plus product).

Classes in equality, memory or pin constraints are never eliminated. Ties in the recovery take
the first (lowest-index) choice, so the result is deterministic; the objective of the reduced
problem equals that of the original for every assignment of the kept classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoparallel.planner.problem import EdgeClass, Problem

INF = np.inf


@dataclass
class _Leaf:
    node: int
    edge: EdgeClass
    node_is_prod: bool  # the eliminated class is the edge's producer
    weights: np.ndarray


@dataclass
class _Series:
    node: int
    e_in: EdgeClass
    e_out: EdgeClass
    weights: np.ndarray


@dataclass
class Reduced:
    problem: Problem
    keep: np.ndarray  # reduced class -> original class
    steps: list = field(default_factory=list)
    eliminated_leaf: int = 0
    eliminated_series: int = 0

    def expand(self, choice: np.ndarray, original: Problem) -> np.ndarray:
        """Choices of every original class from the reduced problem's choices."""
        full = np.full(original.num_classes, -1, dtype=np.int64)
        full[self.keep] = choice
        for step in reversed(self.steps):
            if isinstance(step, _Leaf):
                e = step.edge
                if step.node_is_prod:
                    row = e.cost[e.cons_map[full[e.cons]], e.prod_map]
                else:
                    row = e.cost[e.cons_map, e.prod_map[full[e.prod]]]
                full[step.node] = int(np.argmin(step.weights + row))
            else:
                ei, eo = step.e_in, step.e_out
                u = eo.cons_map[full[eo.cons]]
                v = ei.prod_map[full[ei.prod]]
                full[step.node] = int(np.argmin(eo.cost[u, eo.prod_map] + step.weights + ei.cost[ei.cons_map, v]))
        return full


def reduce_problem(problem: Problem, alive: list[np.ndarray]) -> Reduced:
    """Eliminate leaf and series classes (see module docstring); ``alive`` from pruning."""
    n = problem.num_classes
    tie = problem.tie or [np.zeros(problem.choices(c)) for c in range(n)]
    # per-instance weights: compute + tie-breaker, infinite where pruned
    w = [np.where(alive[c], problem.compute[c] + tie[c], INF) for c in range(n)]
    count = problem.count.astype(np.float64)
    protected = set(problem.allowed)
    for a, b, _ in problem.equal:
        protected.update((a, b))
    protected.update(c for c, _ in problem.memory)
    for _, row in problem.peak:
        protected.update(row)
    edges: dict[int, EdgeClass] = {i: e for i, e in enumerate(problem.edges)}
    ins: list[set[int]] = [set() for _ in range(n)]
    outs: list[set[int]] = [set() for _ in range(n)]
    for i, e in edges.items():
        ins[e.cons].add(i)
        outs[e.prod].add(i)
    gone = np.zeros(n, dtype=bool)
    steps: list = []
    next_id = len(edges)
    leaves = series = 0
    changed = True
    while changed:
        changed = False
        for c in range(n):
            if gone[c] or c in protected:
                continue
            degree = len(ins[c]) + len(outs[c])
            if degree == 1:
                (i,) = ins[c] | outs[c]
                e = edges[i]
                if e.count != count[c] or e.cons == e.prod:
                    continue
                other = e.prod if e.cons == c else e.cons
                if e.cons == c:
                    # best of c for each producer choice, as a function of the producer's column v
                    per_v = np.min(w[c][:, None] + e.cost[e.cons_map, :], axis=0)
                    add = per_v[e.prod_map]
                else:
                    per_u = np.min(w[c][None, :] + e.cost[:, e.prod_map], axis=1)
                    add = per_u[e.cons_map]
                w[other] = w[other] + add * (e.count / count[other])
                steps.append(_Leaf(c, e, e.prod == c, w[c]))
                ins[e.cons].discard(i)
                outs[e.prod].discard(i)
                del edges[i]
                gone[c] = True
                leaves += 1
                changed = True
            elif len(ins[c]) == 1 and len(outs[c]) == 1:
                (i,) = ins[c]
                (o,) = outs[c]
                ei, eo = edges[i], edges[o]
                if ei.count != count[c] or eo.count != count[c] or ei.prod == eo.cons:
                    continue
                # C[u, v] = min_j eo.cost[u, eo.prod_map[j]] + w[j] + ei.cost[ei.cons_map[j], v]
                left = eo.cost[:, eo.prod_map] + w[c][None, :]  # (U, J)
                right = ei.cost[ei.cons_map, :]  # (J, V)
                table = np.min(left[:, :, None] + right[None, :, :], axis=1)
                new = EdgeClass(
                    cons=eo.cons,
                    prod=ei.prod,
                    arg=eo.arg,
                    cons_map=eo.cons_map,
                    prod_map=ei.prod_map,
                    cost=table,
                    count=ei.count,
                    label=f"{eo.label} ~ {ei.label}",
                    locked=ei.locked or eo.locked,
                )
                steps.append(_Series(c, ei, eo, w[c]))
                for k in (i, o):
                    e = edges.pop(k)
                    ins[e.cons].discard(k)
                    outs[e.prod].discard(k)
                edges[next_id] = new
                ins[new.cons].add(next_id)
                outs[new.prod].add(next_id)
                next_id += 1
                gone[c] = True
                series += 1
                changed = True
    keep = np.flatnonzero(~gone)
    new_index = np.full(n, -1, dtype=np.int64)
    new_index[keep] = np.arange(len(keep))
    kept_edges = []
    for i in sorted(edges):
        e = edges[i]
        kept_edges.append(
            EdgeClass(
                cons=int(new_index[e.cons]),
                prod=int(new_index[e.prod]),
                arg=e.arg,
                cons_map=e.cons_map,
                prod_map=e.prod_map,
                cost=e.cost,
                count=e.count,
                label=e.label,
                locked=e.locked,
            )
        )
    reduced = Problem(
        labels=[problem.labels[c] for c in keep],
        compute=[np.where(np.isfinite(w[c]), w[c], 0.0) for c in keep],
        count=problem.count[keep],
        edges=kept_edges,
        equal=[(int(new_index[a]), int(new_index[b]), why) for a, b, why in problem.equal],
        memory=[(int(new_index[c]), per) for c, per in problem.memory],
        budget=problem.budget,
        peak=[(t, {int(new_index[c]): b for c, b in row.items()}) for t, row in problem.peak],
        peak_budget=problem.peak_budget,
        allowed={int(new_index[c]): m for c, m in problem.allowed.items()},
        tie=None,
    )
    # choices whose folded weight is infinite are impossible: mask them
    for r, c in enumerate(keep):
        dead = ~np.isfinite(w[c])
        if dead.any():
            m = reduced.allowed.get(r, np.ones(problem.choices(c), dtype=bool))
            reduced.allowed[r] = m & ~dead & alive[c]
        elif not alive[c].all():
            m = reduced.allowed.get(r, np.ones(problem.choices(c), dtype=bool))
            reduced.allowed[r] = m & alive[c]
    return Reduced(reduced, keep, steps, leaves, series)
