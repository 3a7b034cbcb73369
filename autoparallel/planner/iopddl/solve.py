"""The IOPDDL solve: a feasible start, coordinate descent and star moves (star.py), then HiGHS MIPs
(or toulbar2, cfn.py) until the time runs out.

Small problems (few strategy pairs on their edges) go to one MIP over every node, warm-started
from the descent: HiGHS either proves the plan optimal or returns its best plan and dual bound.
Problems with too many pairs for that but a small cost function network (few nodes: the usage
constraints grow with nodes live at once) go whole to toulbar2.
Otherwise, and after a whole-problem MIP that ran out of time, a large-neighbourhood search frees
a connected set of nodes around a random one (breadth first over the edges), solves that set's
MIP with the rest held, and keeps the result when it is cheaper; the set grows while its MIPs
finish quickly and shrinks when they time out. Its bound is then the sum of each node's and each
edge's cheapest allowed cost, which holds but is weak.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autoparallel.planner.iopddl import priced
from autoparallel.planner.iopddl.cfn import CFN_ENTRIES, model_size, solve_cfn, toulbar2_available
from autoparallel.planner.iopddl.deadline import CLOSING_SAFETY, Closing, Incumbent, Overrun, alarm
from autoparallel.planner.iopddl.instance import Instance, forbid_unsupported
from autoparallel.planner.iopddl.mip import PENALTY, solve_sub
from autoparallel.planner.iopddl.penalty import penalty_search
from autoparallel.planner.iopddl.reduce import reduce
from autoparallel.planner.iopddl.search import cost, descend, least_usage, profile
from autoparallel.planner.iopddl.star import star_descend, stars

FULL_MIP_PAIRS = 400_000  # strategy pairs on edges up to which one MIP over everything is tried first
# Share of the time the adaptive-penalty search (penalty.py) may take before the LNS. Off: on
# V, D, M, A at 60 s it never beat the plain start + LNS (docs/iopddl.md, "Adaptive penalties").
PENALTY_SHARE = 0.0
# Shrink the instance first with the exact reductions of reduce.py (dominated strategies, folded
# leaves). Off: V's toulbar2 run ended worse from the reduced network and A's reduction took 120 s
# for 6 % fewer pairs (docs/iopddl.md, "Exact reductions").
REDUCE = False
REDUCE_SHARE = 0.25  # at most this share of the time goes to the reductions
# Share of the time the priced toulbar2 rounds (priced.py) run beside the first descent, on
# instances too large for the whole-problem MIP and for cfn.py's constrained network. Most of it:
# on M their first feasible plan was 1.01x the contest's best against 1.8x from descent + star moves.
PRICED_SHARE = 0.9
# While the priced child runs, the plans it writes are polished by this process (star moves and
# descent; it waited idle there) and handed back to it as donors (_Follow); off: only its last plan.
# Off by default: on K at load 4-6 each polish took 7-20 s, the child's rounds slowed, and its last
# plan came after the polish of an older one (1.4354x against 1.1020x without; docs/iopddl.md).
FOLLOW = False
PRICED_NODES = 1000  # and only from this many nodes (below, cfn.py's constrained network is small)
# Seconds (at most a tenth of the time) between the deadline the phases check and the hard one, the
# alarm (deadline.py), which stops whatever phase still runs; the hard one keeps the measured closing
# before the limit (deadline.Closing; C and Q overran 120 s by up to 22 s at load ~17 before).
HARD_GRACE = 0.5


@dataclass
class Result:
    solution: list
    cost: int
    bound: float
    optimal: bool
    seconds: float
    method: str
    stats: dict = field(default_factory=dict)


def _region_cost(inst: Instance, x, nodes, edges) -> float:
    """Cost of the nodes and edges, each forbidden choice counted as PENALTY, so that a plan
    with fewer forbidden choices compares cheaper."""
    terms = [inst.cost[i][x[i]] for i in nodes] + [inst.edge_cost[e][x[inst.edge_u[e]], x[inst.edge_v[e]]] for e in edges]
    return float(sum(min(float(t), PENALTY) for t in terms))


def _trivial_bound(inst: Instance) -> float:
    """Each node's and each edge's cheapest entry, summed (in node then edge order, as floats)."""
    b = sum(_minima(inst.cost).tolist())
    return b + sum(_minima([m.ravel() for m in inst.edge_cost]).tolist())


def _minima(arrays: list) -> np.ndarray:
    """The minimum of each non-empty array, in one pass (one ``np.min`` each took 0.8 s on D)."""
    if not arrays:
        return np.zeros(0)
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])[:-1]])
    return np.minimum.reduceat(np.concatenate(arrays), offsets)


def _exact_cost(inst: Instance, x) -> int:
    """The plan's cost in integers (indexed with Python ints, see search.cost)."""
    xs = np.asarray(x).tolist()
    total = sum(int(c[s]) for c, s in zip(inst.cost, xs))
    ends = zip(inst.edge_cost, np.asarray(inst.edge_u).tolist(), np.asarray(inst.edge_v).tolist())
    return total + sum(int(m[xs[u], xs[v]]) for m, u, v in ends)


def _forbidden_nodes(inst: Instance, x) -> list:
    """Endpoints of the edges whose chosen pair is forbidden under ``x``."""
    return [int(n) for e in range(len(inst.edge_u))
            if not np.isfinite(inst.edge_cost[e][x[inst.edge_u[e]], x[inst.edge_v[e]]])
            for n in (inst.edge_u[e], inst.edge_v[e])]


def _neighbourhood(inst: Instance, rng, size: int, prof=None, around=None) -> np.ndarray:
    """A connected set of about ``size`` nodes around a random one (breadth first over the
    edges). With ``prof``, the set starts from the nodes live at a time step drawn towards the
    usage peak instead, so nodes that compete for memory are freed together."""
    seen: set = set()
    if around:  # a plan with forbidden pairs: free their endpoints first
        seen.update(int(i) for i in rng.permutation(np.array(around))[: max(1, size // 4)])
    elif prof is not None and len(prof):
        weight = np.maximum(prof - np.quantile(prof, 0.5), 0).astype(np.float64) + 1.0
        t = int(rng.choice(len(prof), p=weight / weight.sum()))
        live = np.flatnonzero((inst.starts <= t) & (t < inst.ends))
        rng.shuffle(live)
        seen.update(int(i) for i in live[: max(1, size // 2)])
    if not seen:
        seen.add(int(rng.integers(inst.n)))
    queue = deque(sorted(seen))
    while queue and len(seen) < size:
        i = queue.popleft()
        nbrs = [inst.edge_v[e] if is_u else inst.edge_u[e] for e, is_u in inst.incident[i]]
        rng.shuffle(nbrs)
        for j in nbrs:
            if j not in seen:
                seen.add(int(j))
                queue.append(int(j))
                if len(seen) >= size:
                    break
        if not queue and len(seen) < size:  # disconnected: jump to another component
            j = int(rng.integers(inst.n))
            if j not in seen:
                seen.add(j)
                queue.append(j)
    return np.array(sorted(seen), dtype=np.int64)


def solve(inst: Instance, time_limit: float = 120.0, seed: int = 0, progress=None, threads: int = 1,
          clock=time.perf_counter, full_mip_pairs: int = FULL_MIP_PAIRS,
          penalty_share: float = PENALTY_SHARE, cfn_entries: int = CFN_ENTRIES, reduce_first: bool = REDUCE,
          priced_share: float = PRICED_SHARE, priced_nodes: int = PRICED_NODES, priced_job=None,
          closing: Closing | None = None) -> Result:
    """Best plan found, returned within ``time_limit`` seconds (from this call) less the caller's
    share of ``closing`` (its work after the return); raise ValueError if no plan exists.

    ``priced_job``: priced rounds the caller started on the instance's file before reading it
    (priced.start_file); used when this instance wants them, else stopped. Stopped on return.
    ``closing``: the reserve kept for what runs after the hard deadline (deadline.Closing), fed
    by the caller's busy stretches (reading); measured here on the first plan."""
    t0 = clock()
    limits = _Limits(t0 + time_limit, closing or Closing(clock=clock), clock)
    deadline = limits.soft()
    say = progress or (lambda msg: None)
    pairs = sum(m.size for m in inst.edge_cost)
    job = None
    if (not reduce_first and priced_share > 0 and inst.limit is not None and inst.n >= priced_nodes
            and pairs > full_mip_pairs and toulbar2_available() and model_size(inst) > cfn_entries):
        if priced_job is not None:
            job, priced_job = priced_job, None
            say(f"priced toulbar2 rounds (started on the file) run beside the descent, up to {job.stop - clock():.0f}s")
        else:
            job = priced.start(inst, clock() + priced_share * (deadline - clock()))  # toulbar2 does its own arc consistency
            say(f"priced toulbar2 rounds started beside the descent, up to {job.stop - clock():.0f}s")
    if priced_job is not None:
        priced.stop(priced_job)
        priced_job.tmp.cleanup()
    kept = Incumbent(-np.inf)
    try:
        with alarm(limits.hard() - clock()) as rearm:
            limits.rearm = rearm
            return _solve(inst, t0, limits, say, job, pairs, kept, seed=seed, threads=threads, clock=clock,
                          full_mip_pairs=full_mip_pairs, penalty_share=penalty_share, cfn_entries=cfn_entries,
                          reduce_first=reduce_first, priced_share=priced_share, priced_nodes=priced_nodes)
    except Overrun:
        say(f"hard deadline: stopped a phase {clock() - limits.soft():.1f}s past the deadline, "
            f"{limits.end - clock():.1f}s left for the closing; the last kept plan")
        if job is not None:  # the phase stopped may have come before the priced rounds were collected
            _keep_priced(inst, job, kept, clock, say, wait=False)
        return _from_kept(inst, kept, t0, clock)
    finally:
        if job is not None:  # killed, not waited for: a large child's exit took 2.5 s at load 15
            priced.stop(job, wait=False)


class _Limits:
    """The solve's two deadlines, kept before ``end`` by the measured closing: the hard one (the
    alarm) and the soft one that phases check, HARD_GRACE (at most a tenth of the time) before."""

    def __init__(self, end: float, closing: Closing, clock):
        self.end, self.closing, self.clock, self.rearm = end, closing, clock, None
        self.grace = min(HARD_GRACE, 0.1 * max(0.0, end - clock()))

    def hard(self) -> float:
        return self.end - self.closing.seconds()

    def soft(self) -> float:
        return self.hard() - self.grace

    def update(self) -> float:
        """The soft deadline after a new measurement; the alarm moved to the new hard one."""
        if self.rearm is not None:
            self.rearm(self.hard() - self.clock())
        return self.soft()


def _closing_work(inst: Instance, x) -> None:
    """What the closing does with a plan, at most: the live and the priced plans' checks (profile
    and cost each) and the exact cost of the one returned (a plan with a forbidden pair has
    none: its float cost, the same loop, stands in)."""
    for _ in range(2):
        profile(inst, x)
        finite = np.isfinite(cost(inst, x))
    _exact_cost(inst, x) if finite else cost(inst, x)


def _keep_priced(inst: Instance, job, kept: Incumbent, clock, say, wait: bool = True) -> None:
    """Offer the priced rounds' plan (collected or not) to ``kept`` when it fits the limit."""
    y, _ = priced.collect(job, clock, say, wait=wait)
    if y is None or len(y) != inst.n:
        return
    yprof = profile(inst, y)
    if not (len(yprof) and int(yprof.max()) > inst.limit):
        kept.keep(y, cost(inst, y), "priced")


def _from_kept(inst: Instance, kept: Incumbent, t0, clock) -> Result:
    """The result of a solve stopped by the alarm: its last kept plan, or the plan the stopped
    phase was improving when that is checked to fit the limit and is cheaper."""
    if kept.live is not None and len(kept.live) == inst.n:
        live = np.array(kept.live, dtype=np.int64)
        prof = profile(inst, live)
        if inst.limit is None or not len(prof) or int(prof.max()) <= inst.limit:
            kept.keep(live, cost(inst, live))
    if kept.x is None or not np.isfinite(kept.cost):
        raise ValueError(f"no plan free of forbidden (infinite-cost) choices found by the deadline ({clock() - t0:.0f}s)")
    x = kept.x
    return Result([int(v) for v in x], _exact_cost(inst, x), kept.bound, False, clock() - t0, kept.method, {"overrun": True})


def _solve(inst, t0, limits, say, job, pairs, kept, *, seed, threads, clock, full_mip_pairs, penalty_share, cfn_entries,
           reduce_first, priced_share, priced_nodes) -> Result:
    deadline, closing = limits.soft(), limits.closing
    with closing.stretch():
        say(f"arc consistency forbade {forbid_unsupported(inst)} strategies ({clock() - t0:.1f}s)")
    if reduce_first:
        return _solve_reduced(inst, t0, deadline, say, clock, seed=seed, threads=threads, full_mip_pairs=full_mip_pairs,
                              penalty_share=penalty_share, cfn_entries=cfn_entries, priced_share=priced_share,
                              priced_nodes=priced_nodes)
    with closing.stretch():
        x = least_usage(inst)
        prof = profile(inst, x)
    if inst.limit is not None and len(prof) and int(prof.max()) > inst.limit:
        t = int(np.argmax(prof))
        raise ValueError(f"infeasible: even the least-usage strategies use {int(prof.max())} > limit {inst.limit} at time {t}")
    kept.bound = _trivial_bound(inst)
    kept.keep(x, cost(inst, x))
    closing.measure(lambda: _closing_work(inst, x))
    deadline = limits.update()
    say(f"closing reserve {closing.seconds():.2f}s ({closing.cpu:.3f} CPU s x {closing.slowdown():.1f} wall/CPU, "
        f"x {1 + closing.after:g} with the caller's share, x safety {CLOSING_SAFETY:g}); hard deadline at {limits.hard() - t0:.1f}s")
    with closing.stretch():
        descend(inst, x, prof, deadline=deadline, clock=clock)
    deadline = limits.update()
    best = cost(inst, x)
    kept.keep(x, best)
    say(f"descent from the least-usage plan: cost {best:.6g} ({clock() - t0:.1f}s)")
    with closing.stretch():
        moved = star_rounds(inst, x, prof, deadline, clock)
    deadline = limits.update()
    if moved:
        best = cost(inst, x)
        kept.keep(x, best)
        say(f"star moves (a node with its leaves) and descent: cost {best:.6g} ({clock() - t0:.1f}s)")
    bound, optimal, method = kept.bound, False, "descent"
    stats = {"subproblems": 0, "improved": 0}
    if job is not None:
        x, prof, best, bound, method = _priced(inst, job, x, prof, best, bound, method, deadline, clock, say, kept)
        kept.bound = bound
        deadline = limits.update()
    if pairs <= full_mip_pairs and clock() < deadline:
        say(f"one MIP over all {inst.n} nodes ({pairs} strategy pairs), up to {deadline - clock():.0f}s")
        r = solve_sub(inst, x, prof, np.arange(inst.n), 0.8 * (deadline - clock()) - 1.0, threads=threads)
        method = "mip"
        if r.x is not None and r.objective < best:
            x = r.x.copy()
            prof = profile(inst, x)
            best = cost(inst, x)
            kept.keep(x, best, "mip")
        if np.isfinite(r.bound):
            bound = max(bound, r.bound)
        optimal = r.optimal
        say(f"MIP: cost {best:.6g}, bound {bound:.6g}, {'optimal' if optimal else 'not proven optimal'} ({clock() - t0:.1f}s)")
    if pairs > full_mip_pairs and clock() < deadline - 2.0 and toulbar2_available() and model_size(inst) <= cfn_entries:
        x, prof, best, optimal, bound = _toulbar2(inst, x, prof, best, bound, deadline, clock, say)
        method = "toulbar2"
        kept.keep(x, best, method)
    if penalty_share > 0 and not optimal and pairs > full_mip_pairs and inst.limit is not None and clock() < deadline - 1.0:
        px, pcost = penalty_search(inst, least_usage(inst), clock() + penalty_share * (deadline - clock()), clock, say,
                                   plan_cost=cost)
        if px is not None:
            pprof = profile(inst, px)
            descend(inst, px, pprof, deadline=deadline, clock=clock)
            pcost = cost(inst, px)
            say(f"adaptive penalties: cost {pcost:.6g} vs {best:.6g} ({clock() - t0:.1f}s)")
            if pcost < best:
                x, prof, best, method = px, pprof, pcost, "penalty"
                kept.keep(x, best, method)
    if not optimal and method != "toulbar2" and clock() < deadline - 0.5:  # toulbar2 takes the time to the end
        method = f"{method}+lns" if method != "descent" else "lns"
        kept.method = method
        x, prof, best, whole = _lns(inst, x, prof, best, deadline, seed, threads, clock, say, stats, kept)
        if whole is not None:  # a neighbourhood held every node and its MIP finished: proven
            bound, optimal = max(bound, whole), True
    if not np.isfinite(best):
        raise ValueError(f"no plan free of forbidden (infinite-cost) choices found in {deadline - t0:.0f}s")
    if best <= bound + 1e-9 * max(1.0, abs(best)):
        optimal = True
    return Result([int(v) for v in x], _exact_cost(inst, x), bound, optimal, clock() - t0, method, stats)


def _solve_reduced(inst: Instance, t0, deadline, say, clock, **options) -> Result:
    """Solve the exactly reduced instance (same optimum, reduce.py) and lift its plan back; the
    cost is recomputed on the original, the bound carries over."""
    red = reduce(inst, deadline=t0 + REDUCE_SHARE * (deadline - t0), clock=clock)
    pairs = (sum(m.size for m in inst.edge_cost), sum(m.size for m in red.inst.edge_cost))
    say(f"reduced: {red.removed} dominated strategies removed, {len(red.folded)} leaves folded, "
        f"{len(inst.edge_u)} -> {len(red.inst.edge_u)} edges, {pairs[0]} -> {pairs[1]} strategy pairs ({clock() - t0:.1f}s)")
    r = solve(red.inst, deadline - clock(), progress=say, clock=clock, reduce_first=False, **options)
    x = red.lift(r.solution)
    return Result([int(v) for v in x], _exact_cost(inst, x), r.bound, r.optimal, clock() - t0, r.method,
                  {**r.stats, "removed": red.removed, "folded": len(red.folded)})


class _Follow:
    """The polish of the priced rounds' plans while the child runs (priced.follow): each plan it
    writes that fits and is cheaper than what this process has goes through star moves and
    descent, until the child's stop; the cheapest result is kept (``kept``) and handed back to
    the child as a donor for its recombinations (priced.offer)."""

    def __init__(self, inst, job, best: float, deadline: float, clock, say, kept):
        self.inst, self.job, self.deadline, self.clock, self.say, self.kept = inst, job, deadline, clock, say, kept
        self.x, self.prof, self.cost, self.source = None, None, best, None

    def __call__(self, y, stop: float) -> None:
        yprof = profile(self.inst, y)
        if len(yprof) and int(yprof.max()) > self.inst.limit or not cost(self.inst, y) < self.cost:
            return
        self.source = y.copy()
        star_rounds(self.inst, y, yprof, min(stop, self.deadline), self.clock)
        ycost = cost(self.inst, y)
        if ycost < self.cost:
            self.x, self.prof, self.cost = y, yprof, ycost
            self.kept.keep(y, ycost, "priced")
            priced.offer(self.job, y)
            self.say(f"priced toulbar2 rounds: a plan of theirs polished while they run: cost {ycost:.6g}")


def _priced(inst, job, x, prof, best, bound, method, deadline, clock, say, kept):
    """Collect the priced rounds (priced.py), their plans polished while they run (_Follow); keep
    their last plan when it fits and is cheaper, then polish it under the hard limit (descent and
    star moves), unless it is the one already polished. Their bound (the unpriced problem's)
    holds for this one."""
    follow = _Follow(inst, job, best, deadline, clock, say, kept) if FOLLOW else None
    y, b = priced.collect(job, clock, say, polish=follow)
    if b is not None:
        bound = max(bound, float(b))
    if follow is not None and follow.x is not None:
        x, prof, best, method = follow.x, follow.prof, follow.cost, "priced"
        if y is not None and np.array_equal(y, follow.source):
            y = None  # the child's last plan: already polished
    if y is None or len(y) != inst.n:
        if method != "priced":
            say("priced toulbar2 rounds: no plan within the limit")
        return x, prof, best, bound, method
    yprof = profile(inst, y)
    ycost = cost(inst, y)
    if len(yprof) and int(yprof.max()) > inst.limit or not ycost < best:
        say(f"priced toulbar2 rounds: plan of cost {ycost:.6g} not kept (over the limit or not cheaper than {best:.6g})")
        return x, prof, best, bound, method
    kept.keep(y, ycost, "priced")
    star_rounds(inst, y, yprof, deadline, clock)
    ycost = cost(inst, y)
    if not ycost < best:
        say(f"priced toulbar2 rounds: their last plan polished to {ycost:.6g}, not cheaper than {best:.6g}")
        return x, prof, best, bound, method
    kept.keep(y, ycost, "priced")
    say(f"priced toulbar2 rounds, then star moves and descent: cost {ycost:.6g} (was {best:.6g})")
    return y, yprof, ycost, bound, "priced"


def _toulbar2(inst, x, prof, best, bound, deadline, clock, say):
    """The whole problem through toulbar2 (cfn.py) until shortly before the deadline (no
    neighbourhood search after it: on a loaded machine one sub-MIP overran the limit by 15 s);
    its plan is kept when it fits the limit and is cheaper (or proven optimal)."""
    stop = deadline - 1.0 - 0.01 * (deadline - clock())  # left over: checking and printing the plan
    say(f"toulbar2 on the whole problem (a cost function network), up to {stop - clock():.0f}s")
    y, optimal = solve_cfn(inst, best, stop, clock=clock, say=say)
    if y is not None:
        yprof = profile(inst, y)
        ycost = cost(inst, y)
        fits = inst.limit is None or not len(yprof) or int(yprof.max()) <= inst.limit
        if fits and (ycost < best or (optimal and ycost <= best)):
            x, prof, best = y, yprof, ycost
        optimal = optimal and fits and ycost <= best
    else:  # a finished search with nothing below the start's cost proves the start optimal
        optimal = optimal and bool(np.isfinite(best))
    if optimal:
        bound = max(bound, best)
    say(f"toulbar2: cost {best:.6g}, {'optimal' if optimal else 'not proven optimal'}")
    return x, prof, best, optimal, bound


def star_rounds(inst: Instance, x, prof, deadline, clock, rounds: int = 10) -> int:
    """Star moves then single-node descent, alternated until neither moves; returns the moves."""
    hubs, total = stars(inst), 0
    for _ in range(rounds):
        moves = star_descend(inst, x, prof, deadline=deadline, clock=clock, hubs=hubs)
        moves += descend(inst, x, prof, deadline=deadline, clock=clock)
        total += moves
        if not moves or clock() > deadline:
            break
    return total


def _lns(inst, x, prof, best, deadline, seed, threads, clock, say, stats, kept):
    rng = np.random.default_rng(seed)
    size = min(inst.n, 200)
    last_report = clock()
    whole = None
    while clock() < deadline - 0.2 and whole is None:
        around = None if np.isfinite(best) else _forbidden_nodes(inst, x)
        free = _neighbourhood(inst, rng, size, prof if inst.limit is not None and stats["subproblems"] % 2 else None, around)
        edges = sorted({e for i in free for e, _ in inst.incident[i]})
        before = _region_cost(inst, x, free, edges)
        budget = min(5.0, deadline - clock() - 0.5)
        if budget < 0.2:
            break
        t = clock()
        r = solve_sub(inst, x, prof, free, budget, threads=threads)
        took = clock() - t
        stats["subproblems"] += 1
        if len(free) == inst.n and r.optimal:
            whole = r.bound
        if r.x is not None:
            trial = x.copy()
            trial[free] = r.x
            after = _region_cost(inst, trial, free, edges)
            if after < before - 1e-6 * max(1.0, abs(before)) * 1e-6:
                for i in free[trial[free] != x[free]]:
                    s, e = inst.starts[i], inst.ends[i]
                    if s < e:
                        prof[s:e] += inst.usage[i][trial[i]] - inst.usage[i][x[i]]
                x = trial
                best = best + (after - before) if before < PENALTY else cost(inst, x)
                stats["improved"] += 1
                kept.keep(x, best)
        if r.optimal and took < 1.0:
            size = min(inst.n, int(size * 1.2) + 1)
        elif not r.optimal:
            size = max(20, int(size * 0.7))
        if clock() - last_report > 10:
            say(f"LNS: cost {best:.6g}, {stats['subproblems']} subproblems ({stats['improved']} improved), size {size}")
            last_report = clock()
    return x, prof, best, whole
