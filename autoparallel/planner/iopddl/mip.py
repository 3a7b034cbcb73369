"""A HiGHS MIP over the strategies of a set of free nodes, every other node held at a plan.

Variables: a binary x[i, s] per free node and allowed strategy, a continuous y[e, s, t] per
edge between two free nodes and allowed pair (its marginals equal the two nodes' x, so it is the
product of two one-hot vectors). Edges to held nodes fold into the free node's linear cost.
Usage: one row per stretch of time over which the set of live free nodes is constant, with the
held nodes' largest usage over that stretch taken off the limit. With every node free this is
the whole problem and HiGHS's dual bound is a bound on it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import highspy
import numpy as np
from scipy import sparse

from autoparallel.planner.iopddl.instance import Instance

# What a forbidden choice the current plan already makes costs in the MIP, so that the plan stays
# a valid warm start and the MIP moves away from it (finite: HiGHS needs finite costs).
PENALTY = 1e16


@dataclass
class SubResult:
    x: np.ndarray | None  # strategies of the free nodes (None: nothing found)
    objective: float
    bound: float
    optimal: bool


class _Rows:
    def __init__(self):
        self.r, self.c, self.v, self.lo, self.hi = [], [], [], [], []
        self.n = 0

    def add(self, rows, cols, vals, lo, hi):
        self.r.append(np.asarray(rows) + self.n)
        self.c.append(np.asarray(cols))
        self.v.append(np.asarray(vals, dtype=np.float64))
        self.lo.append(np.asarray(lo, dtype=np.float64))
        self.hi.append(np.asarray(hi, dtype=np.float64))
        self.n += len(self.lo[-1])


def solve_sub(inst: Instance, x: np.ndarray, prof: np.ndarray, free: np.ndarray, time_limit: float,
              warm: bool = True, threads: int = 1, gap: float = 1e-7) -> SubResult:
    """Optimise the strategies of ``free`` (sorted node ids) with the others held at ``x``."""
    free = np.asarray(free, dtype=np.int64)
    pos = -np.ones(inst.n, dtype=np.int64)
    pos[free] = np.arange(len(free))
    limit = inst.limit
    # held nodes' usage: the profile minus the free nodes' current usage
    held = prof.copy()
    for i in free:
        s, e = inst.starts[i], inst.ends[i]
        if s < e:
            held[s:e] -= inst.usage[i][x[i]]
    col_cost, col_int, kept = [], [], []
    rows = _Rows()
    ncol = 0
    for k, i in enumerate(free):
        local = inst.cost[i].copy()
        for e, is_u in inst.incident[i]:
            other = inst.edge_v[e] if is_u else inst.edge_u[e]
            if pos[other] < 0:
                m = inst.edge_cost[e]
                local += m[:, x[other]] if is_u else m[x[other], :]
        if not np.isfinite(local[x[i]]):
            local[x[i]] = PENALTY
        ok = np.isfinite(local)
        s, e = inst.starts[i], inst.ends[i]
        if limit is not None and s < e:
            ok &= inst.usage[i] <= limit - int(held[s:e].max())
        idx = np.flatnonzero(ok)
        if len(idx) == 0:
            return SubResult(None, np.inf, np.inf, False)
        kept.append((idx, ncol))
        col_cost.append(local[idx])
        col_int.append(np.ones(len(idx), dtype=bool))
        rows.add(np.zeros(len(idx), dtype=np.int64), ncol + np.arange(len(idx)), np.ones(len(idx)), [1.0], [1.0])
        ncol += len(idx)
    for e in range(len(inst.edge_u)):
        a, b = inst.edge_u[e], inst.edge_v[e]
        if pos[a] < 0 or pos[b] < 0:
            continue
        (ia, ca), (ib, cb) = kept[pos[a]], kept[pos[b]]
        sub = inst.edge_cost[e][np.ix_(ia, ib)]
        cur = (ia == x[a])[:, None] & (ib == x[b])[None, :]
        sub = np.where(cur & ~np.isfinite(sub), PENALTY, sub)
        ss, tt = np.nonzero(np.isfinite(sub))
        ny = len(ss)
        ycols = ncol + np.arange(ny)
        col_cost.append(sub[ss, tt])
        col_int.append(np.zeros(ny, dtype=bool))
        ncol += ny
        # sum_t y[s, t] - x[a, s] = 0 for every s; sum_s y[s, t] - x[b, t] = 0 for every t
        na, nb = len(ia), len(ib)
        rows.add(np.concatenate([ss, np.arange(na)]), np.concatenate([ycols, ca + np.arange(na)]),
                 np.concatenate([np.ones(ny), -np.ones(na)]), np.zeros(na), np.zeros(na))
        rows.add(np.concatenate([tt, np.arange(nb)]), np.concatenate([ycols, cb + np.arange(nb)]),
                 np.concatenate([np.ones(ny), -np.ones(nb)]), np.zeros(nb), np.zeros(nb))
    if limit is not None:
        _usage_rows(inst, free, kept, held, rows)
    cost = np.concatenate(col_cost)
    integ = np.concatenate(col_int)
    a = sparse.csc_matrix((np.concatenate(rows.v), (np.concatenate(rows.r), np.concatenate(rows.c))),
                          shape=(rows.n, ncol))
    start = None
    if warm:
        start = np.zeros(ncol)
        for k, i in enumerate(free):
            idx, c0 = kept[k]
            hit = np.flatnonzero(idx == x[i])
            if len(hit) == 0:
                start = None
                break
            start[c0 + hit[0]] = 1.0
    return _run(a, cost, integ, np.concatenate(rows.lo), np.concatenate(rows.hi), start, time_limit, threads, gap,
                lambda col: _decode(col, free, kept))


def _usage_rows(inst, free, kept, held, rows):
    """One usage row per stretch with a constant set of live free nodes (tightest held usage)."""
    s, e = inst.starts[free], inst.ends[free]
    live = s < e
    if not live.any():
        return
    cuts = np.unique(np.concatenate([s[live], e[live]]))
    nseg = len(cuts) - 1
    # reduceat over the cuts: segment k is held[cuts[k]:cuts[k+1]], i.e. [cuts[k], cuts[k+1])
    padded = np.concatenate([held, np.zeros(1, dtype=held.dtype)])
    peak = np.maximum.reduceat(padded, cuts)[:nseg]
    r, c, v = [], [], []
    for k in np.flatnonzero(live):
        idx, c0 = kept[k]
        lo_seg = np.searchsorted(cuts, s[k])
        hi_seg = np.searchsorted(cuts, e[k])
        span = hi_seg - lo_seg
        r.append(np.repeat(np.arange(lo_seg, hi_seg), len(idx)))
        c.append(np.tile(c0 + np.arange(len(idx)), span))
        v.append(np.tile(inst.usage[free[k]][idx].astype(np.float64), span))
    rhs = inst.limit - peak.astype(np.float64)
    rows.add(np.concatenate(r), np.concatenate(c), np.concatenate(v), np.full(nseg, -np.inf), rhs)


def _decode(col, free, kept):
    out = np.zeros(len(free), dtype=np.int64)
    for k in range(len(free)):
        idx, c0 = kept[k]
        out[k] = idx[int(np.argmax(col[c0:c0 + len(idx)]))]
    return out


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """HiGHS prints its banner from C++ to file descriptor 1 when a solver is built, before any
    option can silence it; ``plan --iopddl --json`` promises one JSON object on stdout, so the
    descriptor points at stderr while the solver is built, and is restored after."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run(a, cost, integ, lo, hi, start, time_limit, threads, gap, decode) -> SubResult:
    with _native_stdout_to_stderr():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(time_limit, 0.05)))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("mip_rel_gap", gap)
    h.setOptionValue("random_seed", 0)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(a.shape[1])
    lp.col_upper_ = np.where(integ, 1.0, np.inf)
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr
    lp.a_matrix_.index_ = a.indices
    lp.a_matrix_.value_ = a.data
    lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in integ]
    h.passModel(lp)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    optimal = status == highspy.HighsModelStatus.kOptimal
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return SubResult(None, np.inf, float(info.mip_dual_bound), False)
    col = np.asarray(h.getSolution().col_value)
    return SubResult(decode(col), float(info.objective_function_value), float(info.mip_dual_bound), optimal)
