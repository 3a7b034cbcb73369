"""A plan for any :class:`Problem` without the solver: greedy with forward checking, then best responses.

Why: HiGHS may not finish the LP relaxation or the MIP of a large problem within the time limit
(gemma3n_text: 548k variables, LP 257 s at load 10-25; deepseek_v4: 1.86M variables), and a time
limit must not make a model unplannable, nor make its verdict depend on the machine's load. This
plan is found in a few passes over the classes, is checked against every row of the formulation
(``f.a @ x`` within ``[f.lb, f.ub]``), and is what ``ilp.solve`` returns, marked NOT proven
optimal, when the solver finds nothing within its limit.

* **greedy**: classes (an equality group as one unit) in index order take the cheapest choice
  given the choices already made (neighbours not yet chosen count at their cheapest still-possible
  pair), provided arc consistency over the finite edge pairs, the equalities and the memory rows
  (each row's sum of its classes' smallest still-possible bytes within its budget) still holds
  after it; otherwise the next cheapest. A unit with no such choice ends the attempt (no incumbent).
* **best response**: each unit in turn moves to its cheapest choice with every other unit held,
  where that keeps every edge finite and every memory row within budget; a few passes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from autoparallel.planner.problem import Problem

log = logging.getLogger(__name__)

PATCH = "solver_incumbent"
INF = np.inf
PASSES = 4  # best-response passes (each one is cheap; most gains come in the first two)


@dataclass
class Incumbent:
    choice: np.ndarray  # per class of the problem
    x: np.ndarray  # the formulation's columns
    value: float  # f.c @ x (with the tie-breaker, as the solver's objective)
    seconds: float


def incumbent(problem: Problem, f, alive: list[np.ndarray]) -> Incumbent | None:
    """A feasible plan of ``problem`` (formulated as ``f`` over the ``alive`` choices), or None."""
    t0 = time.perf_counter()
    choice = _Search(problem, f, alive).run()
    if choice is None:
        log.info("incumbent: the greedy search found no plan (%.2fs)", time.perf_counter() - t0)
        return None
    x = columns(f, choice)
    bad = violated(f, x)
    if bad:  # a defect of this module, not of the problem: the solver's answer decides
        log.warning("incumbent: the heuristic plan breaks constraint group(s) %s; not used", ", ".join(bad))
        return None
    return Incumbent(choice, x, float(f.c @ x), time.perf_counter() - t0)


def columns(f, choice: np.ndarray) -> np.ndarray:
    """The formulation's columns of an assignment: its choice columns, and each edge column whose
    two marginal rows (consistent_output row u, flow row v) both belong to the chosen choices."""
    x = np.zeros(f.a.shape[1])
    for c, j in enumerate(choice):
        col = f.s_cols[c][j]
        if col < 0:
            return x  # a pruned choice: no column, the check fails on one_choice
        x[col] = 1.0
    ns = f.num_choice_cols
    if ns < f.a.shape[1]:
        a = f.a.tocsc()
        active = (-(a[:, :ns].minimum(0)) @ x[:ns]) > 0.5  # marginal rows of chosen choices
        hits = a[:, ns:].T @ active.astype(np.float64)
        x[ns:] = (hits > 1.5).astype(np.float64)
    return x


def violated(f, x: np.ndarray, tol: float = 1e-9) -> list[str]:
    """The constraint groups whose rows ``x`` breaks (empty: feasible)."""
    lhs = f.a @ x
    bad = (lhs < f.lb - tol) | (lhs > f.ub + tol)
    return [g for g, (lo, hi) in f.groups.items() if bad[lo:hi].any()]


class _Search:
    """Greedy with forward checking and best responses over units (equality groups of classes)."""

    def __init__(self, problem: Problem, f, alive: list[np.ndarray]):
        self.p = problem
        n = problem.num_classes
        self.w = [np.where(f.s_cols[c] >= 0, f.c[np.maximum(f.s_cols[c], 0)], INF) for c in range(n)]
        self.dom = [a.copy() for a in alive]
        self.finite = [np.isfinite(e.cost) for e in problem.edges]
        self.edges_of: list[list[int]] = [[] for _ in range(n)]
        for i, e in enumerate(problem.edges):
            self.edges_of[e.cons].append(i)
            if e.prod != e.cons:
                self.edges_of[e.prod].append(i)
        # equality groups (union-find)
        root = list(range(n))

        def find(c):
            while root[c] != c:
                root[c] = root[root[c]]
                c = root[c]
            return c

        for a, b, _ in problem.equal:
            root[find(a)] = find(b)
        groups: dict[int, list[int]] = {}
        for c in range(n):
            groups.setdefault(find(c), []).append(c)
        self.units = sorted(groups.values(), key=min)
        self.unit_of = np.zeros(n, dtype=np.int64)
        for u, members in enumerate(self.units):
            self.unit_of[members] = u
        self.unit_edges = [sorted({i for m in members for i in self.edges_of[m]}) for members in self.units]
        # memory rows: (cap, {class: bytes per choice})
        self.rows: list[tuple[float, dict[int, np.ndarray]]] = []
        if problem.budget is not None and problem.memory:
            self.rows.append((float(problem.budget), {c: problem.count[c] * per for c, per in problem.memory}))
        if problem.peak_budget is not None:
            self.rows += [(float(problem.peak_budget), dict(row)) for _, row in problem.peak]
        self.rows_of: list[list[int]] = [[] for _ in range(n)]
        for r, (_, row) in enumerate(self.rows):
            for c in row:
                self.rows_of[c].append(r)
        self.choice = np.full(n, -1, dtype=np.int64)

    # --- forward checking ----------------------------------------------------------------------

    def _row_ok(self, r: int) -> bool:
        cap, row = self.rows[r]
        need = sum(float(b[self.dom[c]].min()) for c, b in row.items())
        return need <= cap * (1 + 1e-10)

    def _support(self, i: int, of: int) -> np.ndarray:
        """Choices of class ``of`` (an end of edge ``i``) with a finite pair at the other end."""
        e, fin = self.p.edges[i], self.finite[i]
        if e.cons == e.prod:
            return fin[e.cons_map, e.prod_map]
        if of == e.prod:
            live = np.zeros(fin.shape[0], dtype=bool)
            live[e.cons_map[self.dom[e.cons]]] = True
            return fin[live].any(axis=0)[e.prod_map]
        live = np.zeros(fin.shape[1], dtype=bool)
        live[e.prod_map[self.dom[e.prod]]] = True
        return fin[:, live].any(axis=1)[e.cons_map]

    def _propagate(self, changed: list[int], trail: list[tuple[int, np.ndarray]]) -> bool:
        """Arc consistency from the classes in ``changed``; every domain change goes on ``trail``."""
        queue = list(changed)
        rows: set[int] = set()
        while queue:
            c = queue.pop()
            rows.update(self.rows_of[c])
            if not self.dom[c].any():
                return False
            others = [(i, o) for i in self.edges_of[c] for o in {self.p.edges[i].cons, self.p.edges[i].prod}]
            for i, o in others:
                new = self.dom[o] & self._support(i, o)
                if not np.array_equal(new, self.dom[o]):
                    trail.append((o, self.dom[o]))
                    self.dom[o] = new
                    if not new.any():
                        return False
                    queue.append(o)
            for o in self.units[self.unit_of[c]]:
                if o != c and not np.array_equal(self.dom[o], self.dom[o] & self.dom[c]):
                    trail.append((o, self.dom[o]))
                    self.dom[o] = self.dom[o] & self.dom[c]
                    if not self.dom[o].any():
                        return False
                    queue.append(o)
        return all(self._row_ok(r) for r in rows)

    def _undo(self, trail: list[tuple[int, np.ndarray]]) -> None:
        for c, old in reversed(trail):
            self.dom[c] = old

    # --- costs ---------------------------------------------------------------------------------

    def _unit_cost(self, u: int, held: bool, dom: list[np.ndarray]) -> np.ndarray:
        """Cost of each choice of unit ``u``: its classes' own costs plus every edge at it, with
        other ends at their choice (or, not chosen yet and ``held`` false, their cheapest pair)."""
        members = self.units[u]
        tot = sum(self.w[m] for m in members) + np.where(np.logical_and.reduce([dom[m] for m in members]), 0.0, INF)
        inside = set(members)
        for i in self.unit_edges[u]:
            e = self.p.edges[i]
            if e.cons in inside and e.prod in inside:
                vec = e.cost[e.cons_map, e.prod_map]
            elif e.cons in inside:
                o = e.prod
                if self.choice[o] >= 0:
                    vec = e.cost[e.cons_map, e.prod_map[self.choice[o]]]
                elif held:
                    raise AssertionError("best response with an unchosen neighbour")
                else:
                    vec = e.cost[:, np.unique(e.prod_map[self.dom[o]])].min(axis=1)[e.cons_map]
            else:
                o = e.cons
                if self.choice[o] >= 0:
                    vec = e.cost[e.cons_map[self.choice[o]], e.prod_map]
                else:
                    vec = e.cost[np.unique(e.cons_map[self.dom[o]])].min(axis=0)[e.prod_map]
            tot = tot + e.count * vec
        return tot

    # --- the two phases ------------------------------------------------------------------------

    def run(self) -> np.ndarray | None:
        if not self._propagate(list(range(self.p.num_classes)), []):
            return None
        consistent = list(self.dom)  # the choices any plan may take: the best responses' domains
        for u, members in enumerate(self.units):
            cost = self._unit_cost(u, held=False, dom=self.dom)
            for j in np.argsort(cost, kind="stable"):
                if not np.isfinite(cost[j]):
                    break
                trail: list[tuple[int, np.ndarray]] = []
                for m in members:
                    one = np.zeros_like(self.dom[m])
                    one[j] = True
                    trail.append((m, self.dom[m]))
                    self.dom[m] = one
                if self._propagate(list(members), trail):
                    self.choice[members] = j
                    break
                self._undo(trail)
            else:
                return None
            if self.choice[members[0]] < 0:
                return None
        self._improve(consistent)
        return self.choice

    def _improve(self, dom: list[np.ndarray]) -> None:
        used = [sum(float(b[self.choice[c]]) for c, b in row.items()) for _, row in self.rows]
        for _ in range(PASSES):
            moved = False
            for u, members in enumerate(self.units):
                cost = self._unit_cost(u, held=True, dom=dom)
                cur = int(self.choice[members[0]])
                for r in {r for m in members for r in self.rows_of[m]}:
                    cap, row = self.rows[r]
                    delta = sum(row[m] - row[m][cur] for m in members if m in row)
                    cost = np.where(used[r] + delta <= cap * (1 + 1e-10), cost, INF)
                j = int(np.argmin(cost))
                if cost[j] < cost[cur] - 1e-9 * max(1.0, abs(cost[cur])):
                    for r in {r for m in members for r in self.rows_of[m]}:
                        row = self.rows[r][1]
                        used[r] += sum(float(row[m][j] - row[m][cur]) for m in members if m in row)
                    self.choice[members] = j
                    moved = True
            if not moved:
                break
