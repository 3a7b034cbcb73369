"""The ILP: prune, formulate, solve with HiGHS (``scipy.optimize.milp``), explain infeasibility.

Variables (all binary): ``s[c, j]``, class ``c`` takes choice ``j``; ``y[e, u, v]``, edge class
``e`` moves producer placement ``v`` into consumer placement ``u`` (the anchor's
x[node, arg, output choice, input choice], with choices that look alike on that edge merged).
Before any variable exists, choices that cannot be part of a finite-cost plan are pruned (arc
consistency over the edge tables: a choice whose input placement no live producer placement
reaches at finite cost, or whose output no live consumer can take, goes), and only finite
``(u, v)`` pairs become variables.

Constraint groups (named in errors and checked independently by ``verify.parity.plan_check``):

* ``one_choice``: ``sum_j s[c, j] = 1``;
* ``consistent_output`` (per edge class, per row u): ``sum_v y[e, u, v] = sum_{j -> u} s[cons, j]``,
  so every input of a node agrees with the node's one choice;
* ``flow`` (per edge class, per column v): ``sum_u y[e, u, v] = sum_{k -> v} s[prod, k]``;
* ``fwd_bwd``: ``s[a, j] = s[b, j]`` for parameter/gradient, input/gradient, output/tangent,
  buffer/its new value (a model that updates a buffer in place: the value is copied into the piece);
* ``grad_reduce_dtype``: dtype-locked edges only have ``u == v`` pairs (no redistribution
  around a mixed-precision cast);
* ``param_memory``: ``sum count * bytes * s <= budget``;
* ``pins``: disallowed choices have no variable.

Given binary ``s``, both marginal constraints pin ``y`` to the single pair (u, v) of the chosen
choices, so the LP relaxation differs from the ILP only through ``s``; the relaxation is solved
too and its bound and gap reported.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from autoparallel import patches
from autoparallel.planner.incumbent import PATCH as INCUMBENT_PATCH
from autoparallel.planner.incumbent import incumbent
from autoparallel.planner.problem import Problem
from autoparallel.planner.reduce import reduce_problem

log = logging.getLogger(__name__)

GROUPS = ("one_choice", "consistent_output", "flow", "fwd_bwd", "grad_reduce_dtype", "param_memory", "peak_memory", "pins")


class PlannerError(ValueError):
    """A plan cannot be made; the message says which input to change."""


class InfeasiblePlanError(PlannerError):
    def __init__(self, message: str, group: str, smallest_budget: float | None = None):
        super().__init__(message)
        self.group = group
        self.smallest_budget = smallest_budget


class SolverTimeout(PlannerError):
    """The solver ran out of time before finding any plan."""


@dataclass
class SolveStats:
    classes: int
    edge_classes: int
    variables_before: int
    variables_after: int
    constraints_before: int
    constraints_after: int
    build_seconds: float
    solve_seconds: float
    lp_seconds: float
    lp_bound_us: float
    status: str  # "optimal" or "time_limit"
    mip_nodes: int
    eliminated: int = 0  # classes solved in closed form (reduce.py)
    fixed_by_reduced_cost: int = 0  # variables no plan better than the incumbent can use
    plan_source: str = "solver"  # "heuristic": the solver found nothing in time (planner/incumbent.py)
    incumbent_seconds: float = 0.0  # finding the heuristic plan (part of build_seconds)
    lp_iterations: int = 0  # dual simplex iterations of the LP relaxation(s), finished or not

    @property
    def proven_optimal(self) -> bool:
        return self.status == "optimal"


@dataclass
class IlpResult:
    choice: np.ndarray  # one choice per class
    objective_us: float  # without the tie-breaker
    stats: SolveStats

    @property
    def gap(self) -> float:
        if self.objective_us <= 0:
            return 0.0
        return max(0.0, (self.objective_us - self.stats.lp_bound_us) / self.objective_us)


def objective(problem: Problem, choice: np.ndarray) -> float:
    """The cost of an assignment (no tie-breaker); ``inf`` if an edge has no redistribution."""
    total = 0.0
    for c in range(problem.num_classes):
        total += float(problem.count[c]) * float(problem.compute[c][choice[c]])
    for e in problem.edges:
        total += e.count * float(e.cost[e.cons_map[choice[e.cons]], e.prod_map[choice[e.prod]]])
    return total


# --- pruning --------------------------------------------------------------------------------------


@dataclass
class Pruned:
    alive: list[np.ndarray]
    emptied: int | None  # a class left without choices
    emptied_by: str | None


def prune(problem: Problem) -> Pruned:
    """Arc consistency: drop choices that no finite-cost plan can use (see module docstring)."""
    alive = [np.ones(problem.choices(c), dtype=bool) for c in range(problem.num_classes)]
    for c, mask in problem.allowed.items():
        alive[c] &= mask
        if not alive[c].any():
            return Pruned(alive, c, "pins")
    finite = [np.isfinite(e.cost) for e in problem.edges]
    changed = True
    while changed:
        changed = False
        for e, fin in zip(problem.edges, finite, strict=True):
            ca, pa = alive[e.cons], alive[e.prod]
            u_alive = np.zeros(fin.shape[0], dtype=bool)
            u_alive[e.cons_map[ca]] = True
            v_alive = np.zeros(fin.shape[1], dtype=bool)
            v_alive[e.prod_map[pa]] = True
            ok = fin & u_alive[:, None] & v_alive[None, :]
            new_ca = ca & ok.any(axis=1)[e.cons_map]
            new_pa = pa & ok.any(axis=0)[e.prod_map]
            for c, old, new in ((e.cons, ca, new_ca), (e.prod, pa, new_pa)):
                if not np.array_equal(old, new):
                    alive[c] = new
                    changed = True
                    if not new.any():
                        return Pruned(alive, c, "grad_reduce_dtype" if e.locked else "flow")
        for a, b, _ in problem.equal:
            both = alive[a] & alive[b]
            for c in (a, b):
                if not np.array_equal(alive[c], both):
                    alive[c] = both
                    changed = True
            if not both.any():
                return Pruned(alive, a, "fwd_bwd")
    return Pruned(alive, None, None)


# --- formulation ----------------------------------------------------------------------------------


@dataclass
class Formulation:
    c: np.ndarray
    a: sparse.csr_matrix
    lb: np.ndarray
    ub: np.ndarray
    s_cols: list[np.ndarray]  # per class: column of each choice (-1 where pruned)
    groups: dict[str, tuple[int, int]]  # constraint group -> row range
    num_choice_cols: int  # the s columns come first, the edge columns after


def formulate(problem: Problem, alive: list[np.ndarray], *, objective_weights: list[np.ndarray] | None = None) -> Formulation:
    """Sparse constraint matrix and objective of the pruned problem."""
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lb: list[np.ndarray] = []
    ub: list[np.ndarray] = []
    cost: list[np.ndarray] = []
    groups: dict[str, tuple[int, int]] = {}
    ncol = 0
    nrow = 0
    s_cols: list[np.ndarray] = []
    tie = problem.tie or [np.zeros(problem.choices(c)) for c in range(problem.num_classes)]
    for c in range(problem.num_classes):
        col = np.full(problem.choices(c), -1, dtype=np.int64)
        idx = np.flatnonzero(alive[c])
        col[idx] = ncol + np.arange(len(idx))
        ncol += len(idx)
        s_cols.append(col)
        w = objective_weights[c] if objective_weights is not None else problem.count[c] * (problem.compute[c] + tie[c])
        cost.append(np.asarray(w, dtype=np.float64)[idx])

    def add(group: str, r, cc, v, lo, hi):
        rows.append(r)
        cols.append(cc)
        vals.append(v)
        start, _ = groups.get(group, (nrow, nrow))
        groups[group] = (start, nrow + len(lo))
        lb.append(lo)
        ub.append(hi)

    # one_choice
    r = np.concatenate([np.full(int(alive[c].sum()), c) for c in range(problem.num_classes)]) if problem.num_classes else np.zeros(0, np.int64)
    cc = np.concatenate([s_cols[c][alive[c]] for c in range(problem.num_classes)]) if problem.num_classes else np.zeros(0, np.int64)
    add("one_choice", r + nrow, cc, np.ones(len(cc)), np.ones(problem.num_classes), np.ones(problem.num_classes))
    nrow += problem.num_classes

    num_s = ncol
    # per edge: y columns, consistent_output rows (u), flow rows (v)
    cons_parts, flow_parts = [], []
    for e in problem.edges:
        ca, pa = alive[e.cons], alive[e.prod]
        u_alive = np.zeros(e.cost.shape[0], dtype=bool)
        u_alive[e.cons_map[ca]] = True
        v_alive = np.zeros(e.cost.shape[1], dtype=bool)
        v_alive[e.prod_map[pa]] = True
        ok = np.isfinite(e.cost) & u_alive[:, None] & v_alive[None, :]
        uu, vv = np.nonzero(ok)
        ycols = ncol + np.arange(len(uu))
        ncol += len(uu)
        cost.append(e.count * e.cost[uu, vv] if objective_weights is None else np.zeros(len(uu)))
        cons_parts.append((e, u_alive, uu, ycols, ca))
        flow_parts.append((e, v_alive, vv, ycols, pa))
    for group, parts, is_cons in (("consistent_output", cons_parts, True), ("flow", flow_parts, False)):
        for e, live, idx, ycols, mask in parts:
            row_of = np.full(len(live), -1, dtype=np.int64)
            n = int(live.sum())
            row_of[live] = nrow + np.arange(n)
            cmap = e.cons_map if is_cons else e.prod_map
            scol = s_cols[e.cons if is_cons else e.prod]
            choices = np.flatnonzero(mask)
            r = np.concatenate([row_of[idx], row_of[cmap[choices]]])
            cc = np.concatenate([ycols, scol[choices]])
            v = np.concatenate([np.ones(len(idx)), -np.ones(len(choices))])
            add(group, r, cc, v, np.zeros(n), np.zeros(n))
            nrow += n

    # fwd_bwd equalities
    for a, b, _ in problem.equal:
        if problem.choices(a) != problem.choices(b):
            raise AssertionError(f"equal classes {problem.labels[a]} / {problem.labels[b]} have different choice lists")
        idx = np.flatnonzero(alive[a] & alive[b])
        n = len(idx)
        r = np.concatenate([nrow + np.arange(n), nrow + np.arange(n)])
        cc = np.concatenate([s_cols[a][idx], s_cols[b][idx]])
        v = np.concatenate([np.ones(n), -np.ones(n)])
        add("fwd_bwd", r, cc, v, np.zeros(n), np.zeros(n))
        nrow += n

    # param_memory
    if problem.budget is not None and problem.memory:
        # in units of the budget (bytes would put 1e9-sized coefficients next to 1s)
        scale = 1.0 / max(float(problem.budget), 1.0)
        cc = np.concatenate([s_cols[c][alive[c]] for c, _ in problem.memory])
        v = np.concatenate([problem.count[c] * per[alive[c]] * scale for c, per in problem.memory])
        add("param_memory", np.full(len(cc), nrow), cc, v, np.array([-np.inf]), np.array([float(problem.budget) * scale * (1 + 1e-9)]))
        nrow += 1

    # peak_memory: the live bytes at every point that can be a peak (planner/memory.py)
    if problem.peak_budget is not None and problem.peak:
        scale = 1.0 / max(float(problem.peak_budget), 1.0)
        for _, row in problem.peak:
            cc = np.concatenate([s_cols[c][alive[c]] for c in row])
            v = np.concatenate([b[alive[c]] * scale for c, b in row.items()])
            add("peak_memory", np.full(len(cc), nrow), cc, v, np.array([-np.inf]), np.array([float(problem.peak_budget) * scale * (1 + 1e-9)]))
            nrow += 1

    a = sparse.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))) if rows else ([], ([], [])),
        shape=(nrow, ncol),
    )
    return Formulation(np.concatenate(cost), a, np.concatenate(lb), np.concatenate(ub), s_cols, groups, num_s)


def formulate_size(problem: Problem) -> tuple[int, int]:
    """(variables, constraints) of the unpruned, unreduced problem: one variable per choice and
    per (consumer choice, producer choice) of every edge class, as the anchor counts them."""
    variables = sum(problem.choices(c) for c in range(problem.num_classes)) + sum(
        problem.choices(e.cons) * problem.choices(e.prod) for e in problem.edges
    )
    constraints = (
        problem.num_classes
        + sum(problem.choices(e.cons) + problem.choices(e.prod) for e in problem.edges)
        + sum(problem.choices(a) for a, _, _ in problem.equal)
        + (1 if problem.budget is not None and problem.memory else 0)
        + (len(problem.peak) if problem.peak_budget is not None else 0)
    )
    return variables, constraints


def _decode(problem: Problem, f: Formulation, x: np.ndarray) -> np.ndarray:
    choice = np.zeros(problem.num_classes, dtype=np.int64)
    for c in range(problem.num_classes):
        live = np.flatnonzero(f.s_cols[c] >= 0)
        choice[c] = live[int(np.argmax(x[f.s_cols[c][live]]))]
    return choice


# --- solve ----------------------------------------------------------------------------------------


@dataclass
class LPResult:
    status: int  # 0 optimal, 2 infeasible, other: not solved
    fun: float
    x: np.ndarray | None
    rc: np.ndarray | None  # reduced cost of every column (>= 0 at 0, <= 0 at 1)
    iterations: int = 0  # simplex iterations: the machine-independent measure of the LP's work


def _lp(f: Formulation, time_limit: float | None) -> LPResult:
    """The LP relaxation (HiGHS dual simplex) with every column's reduced cost."""
    from scipy.optimize import linprog

    eq = f.lb == f.ub
    a = f.a.tocsr()
    a_eq, a_ub = a[eq], a[~eq]
    options = {} if time_limit is None else {"time_limit": max(float(time_limit), 1e-3)}
    res = linprog(
        f.c,
        A_ub=a_ub if a_ub.shape[0] else None,
        b_ub=f.ub[~eq] if a_ub.shape[0] else None,
        A_eq=a_eq,
        b_eq=f.lb[eq],
        bounds=(0, 1),
        method="highs-ds",
        options=options,
    )
    if res.status != 0:
        return LPResult(int(res.status), math.nan, None, None, int(getattr(res, "nit", 0) or 0))
    return LPResult(0, float(res.fun), res.x, res.lower.marginals + res.upper.marginals, int(res.nit))


def _mip(f: Formulation, lb: np.ndarray, ub: np.ndarray, time_limit: float | None):
    """HiGHS MIP over the columns ``ub`` leaves open; closed columns are dropped, not sent.

    An edge variable can only be nonzero if both of its marginal rows still have an open choice
    variable, so closing choices closes the edge variables that depend on them too.
    """
    n = f.a.shape[1]
    open_ = ub > 0
    if f.num_choice_cols < n:
        choice = f.a[:, : f.num_choice_cols].tocsr()
        supply = (-choice.minimum(0)) @ open_[: f.num_choice_cols].astype(np.float64)
        marginal = np.asarray((-choice.minimum(0)).sum(axis=1)).ravel() > 0
        closed_rows = (marginal & (supply <= 0)).astype(np.float64)
        edge = f.a[:, f.num_choice_cols :].tocsc()
        open_[f.num_choice_cols :] &= (edge.T @ closed_rows) == 0
    keep = np.flatnonzero(open_)
    options = {"disp": False, "presolve": True, "mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = max(float(time_limit), 1e-3)
    res = milp(
        f.c[keep],
        integrality=np.ones(len(keep)),
        bounds=Bounds(lb[keep], ub[keep]),
        constraints=LinearConstraint(f.a.tocsc()[:, keep], f.lb, f.ub),
        options=options,
    )
    if res.x is not None:
        x = np.zeros(n)
        x[keep] = res.x
        res.x = x
    return res


def _s_integral(problem: Problem, f: Formulation, x: np.ndarray, tol: float = 1e-6) -> np.ndarray:
    """Per class: whether the LP gave it a 0/1 choice."""
    out = np.zeros(problem.num_classes, dtype=bool)
    for c in range(problem.num_classes):
        v = x[f.s_cols[c][f.s_cols[c] >= 0]]
        out[c] = bool(np.all(np.abs(v - np.round(v)) <= tol))
    return out


def solve(problem: Problem, *, time_limit: float | None = 120.0, lp_bound: bool = True, method: str = "lp_first") -> IlpResult:
    """Optimal (or, on time-out, the best found) assignment; :class:`PlannerError` otherwise.

    ``method="lp_first"`` (default) solves the LP relaxation first: if it is integral it is the
    optimum; otherwise the classes the LP left integral are fixed to find an incumbent, every
    variable whose reduced cost exceeds the incumbent's gap to the LP bound is fixed to 0 (no
    plan using it can beat the incumbent), and the MIP over the rest proves the optimum.
    ``method="direct"`` hands the whole MIP to HiGHS (the tests compare both).
    """

    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + float(time_limit)

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.perf_counter(), 1e-3)

    pruned = prune(problem)
    if pruned.emptied is not None:
        raise diagnose(problem, pruned.emptied_by, problem.labels[pruned.emptied])
    before = formulate_size(problem)
    reduced = reduce_problem(problem, pruned.alive)
    small = reduced.problem
    pruned_small = prune(small)
    if pruned_small.emptied is not None:
        raise diagnose(problem, pruned_small.emptied_by, small.labels[pruned_small.emptied])
    f = formulate(small, pruned_small.alive)
    n = f.a.shape[1]
    heuristic = incumbent(small, f, pruned_small.alive) if patches.enabled(INCUMBENT_PATCH) else None
    if heuristic is not None:
        log.info("incumbent: a heuristic plan of %.6g us in %.2fs", heuristic.value, heuristic.seconds)
    build = time.perf_counter() - t0
    t1 = time.perf_counter()
    lp_s = 0.0
    lp_fun = math.nan
    lp_iterations = 0
    mip_nodes = 0
    fixed = 0
    status = "optimal"
    x_best: np.ndarray | None = None
    if method == "lp_first":
        lp = _lp(f, left())
        lp_s = time.perf_counter() - t1
        lp_iterations = lp.iterations
        if lp.status == 2:
            raise diagnose(problem, None, None)
        if lp.status == 0:
            lp_fun = float(lp.fun)
            integral = _s_integral(small, f, lp.x)
            if integral.all():
                x_best = np.round(lp.x)
            else:
                # incumbent: keep what the LP decided, search the rest
                lb, ub = np.zeros(n), np.ones(n)
                for c in np.flatnonzero(integral):
                    cols = f.s_cols[c][f.s_cols[c] >= 0]
                    lb[cols] = ub[cols] = np.round(lp.x[cols])
                inc = _mip(f, lb, ub, left())
                mip_nodes += int(getattr(inc, "mip_node_count", 0) or 0)
                bound_ub = np.ones(n)
                if inc.x is not None:
                    x_best = inc.x
                best = min([float(f.c @ inc.x)] if inc.x is not None else [], default=math.inf)
                best = min(best, heuristic.value if heuristic is not None else math.inf)
                if math.isfinite(best):
                    gap = best - lp_fun
                    keep = lp.rc <= gap + 1e-7 * max(1.0, abs(lp_fun)) + 1e-9
                    bound_ub = keep.astype(np.float64)
                    fixed = int((~keep).sum())
                res = _mip(f, np.zeros(n), bound_ub, left())
                mip_nodes += int(getattr(res, "mip_node_count", 0) or 0)
                if res.x is not None and (x_best is None or float(f.c @ res.x) <= float(f.c @ x_best)):
                    x_best = res.x
                if res.status == 1:
                    status = "time_limit"
                elif res.status == 2 and x_best is None:
                    raise diagnose(problem, None, None)
        elif heuristic is None or deadline is None or deadline - time.perf_counter() > 1.0:
            method = "direct"  # the LP did not finish: let the MIP try with the time left
    if method == "direct":
        res = _mip(f, np.zeros(n), np.ones(n), left())
        mip_nodes += int(getattr(res, "mip_node_count", 0) or 0)
        if res.status == 2:
            raise diagnose(problem, None, None)
        x_best = res.x
        status = "optimal" if res.status == 0 else "time_limit"
        if res.status not in (0, 1) and res.x is None:
            raise PlannerError(f"HiGHS failed (status {res.status}): {res.message}")
        if lp_bound and math.isnan(lp_fun):
            t2 = time.perf_counter()
            lp = _lp(f, left())
            lp_s += time.perf_counter() - t2
            lp_iterations += lp.iterations
            if lp.status == 0:
                lp_fun = float(lp.fun)
    x_best, status, source = _or_incumbent(x_best, status, heuristic, f)
    if x_best is None:
        raise SolverTimeout(
            f"the solver found no plan within the time limit of {time_limit} s "
            f"({n} variables, {f.a.shape[0]} constraints); raise the time limit"
        )
    solve_s = time.perf_counter() - t1 - lp_s
    choice = reduced.expand(_decode(small, f, x_best), problem)
    lp_val = math.nan
    if not math.isnan(lp_fun):
        # The LP objective includes the tie-breaker; take off the solution's tie part so that
        # bound and objective are on one scale.
        tie_part = float(f.c @ x_best) - objective(problem, choice)
        lp_val = lp_fun - max(tie_part, 0.0)
    if source == "heuristic":
        log.warning("NOT proven optimal: the solver's time limit (%s s) stopped it; plan = heuristic incumbent", time_limit)
    elif status != "optimal":
        log.warning("solver stopped at the time limit (%s s): the plan is the best found, not proven optimal", time_limit)
    stats = SolveStats(
        classes=problem.num_classes,
        edge_classes=len(problem.edges),
        variables_before=before[0],
        variables_after=int(n),
        constraints_before=before[1],
        constraints_after=int(f.a.shape[0]),
        eliminated=reduced.eliminated_leaf + reduced.eliminated_series,
        build_seconds=build,
        solve_seconds=solve_s,
        lp_seconds=lp_s,
        lp_bound_us=lp_val,
        status=status,
        mip_nodes=mip_nodes,
        fixed_by_reduced_cost=fixed,
        plan_source=source,
        incumbent_seconds=heuristic.seconds if heuristic is not None else 0.0,
        lp_iterations=lp_iterations,
    )
    return IlpResult(choice, objective(problem, choice), stats)


def _or_incumbent(x_best, status: str, heuristic, f: Formulation):
    """(x, status, source): the heuristic incumbent where the solver stopped without a plan or
    with a worse one; never in place of a proven optimum."""
    if heuristic is None or status == "optimal" and x_best is not None:
        return x_best, status, "solver"
    if x_best is not None and float(f.c @ x_best) <= heuristic.value + 1e-9 * max(1.0, abs(heuristic.value)):
        return x_best, status, "solver"
    return heuristic.x, "time_limit", "heuristic"


def _feasible(problem: Problem) -> bool:
    pruned = prune(problem)
    if pruned.emptied is not None:
        return False
    f = formulate(problem, pruned.alive)
    n = f.a.shape[1]
    return _mip(f, np.zeros(n), np.ones(n), 60.0).status in (0, 1)


def smallest_budget(problem: Problem) -> float | None:
    """The least parameter memory any plan meeting every other constraint needs (None if none does)."""
    free = replace(problem, budget=None)
    pruned = prune(free)
    if pruned.emptied is not None:
        return None
    weights = [np.zeros(free.choices(c)) for c in range(free.num_classes)]
    for c, per in free.memory:
        weights[c] = weights[c] + free.count[c] * per
    f = formulate(free, pruned.alive, objective_weights=weights)
    n = f.a.shape[1]
    res = _mip(f, np.zeros(n), np.ones(n), 60.0)
    if res.x is None:
        return None
    choice = _decode(free, f, res.x)
    return float(sum(free.count[c] * per[choice[c]] for c, per in free.memory))


def diagnose(problem: Problem, group: str | None, where: str | None) -> InfeasiblePlanError:
    """Which constraint group makes the problem infeasible, and what would make it feasible."""
    gib = 2**30
    if problem.budget is not None and problem.memory:
        need = smallest_budget(problem)
        if need is not None and need > problem.budget:
            return InfeasiblePlanError(
                f"constraint group 'param_memory' cannot be met: the parameters need at least "
                f"{need / gib:.4f} GiB per rank ({int(need)} bytes) and the budget is "
                f"{problem.budget / gib:.4f} GiB; raise the budget to at least {need / gib:.4f} GiB",
                "param_memory",
                need,
            )
    if problem.peak_budget is not None and problem.peak and _feasible(replace(problem, peak_budget=None)):
        floor = max(sum(float(b.min()) for b in row.values()) for _, row in problem.peak)
        return InfeasiblePlanError(
            f"constraint group 'peak_memory' cannot be met: no plan keeps the live parameters, activations "
            f"and gradients within {problem.peak_budget / gib:.4f} GiB ({int(problem.peak_budget)} bytes) per rank at every "
            f"point of the step (no plan goes below {int(floor)} bytes, every tensor at its smallest); raise the peak budget",
            "peak_memory",
        )
    if problem.allowed and _feasible(replace(problem, allowed={}, budget=None, peak_budget=None)):
        pinned = ", ".join(problem.labels[c] for c in sorted(problem.allowed))
        return InfeasiblePlanError(
            f"constraint group 'pins' cannot be met: no plan places the pinned nodes ({pinned}) as "
            "pinned; pin fewer nodes or other placements",
            "pins",
        )
    at = f" (first at {where})" if where else ""
    group = group or "flow"
    return InfeasiblePlanError(
        f"constraint group '{group}' cannot be met{at}: no placement of the graph connects every "
        "producer to its consumers at finite cost",
        group,
    )
