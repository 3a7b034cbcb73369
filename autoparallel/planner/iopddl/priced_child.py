"""The adaptive-penalty toulbar2 loop of priced.py, run as a child process. It does not import the
package (that pulls in torch, tens of seconds on a loaded machine): it loads ``instance.py`` and
``search.py`` (numpy only) by their paths and runs the solver's own profile, cost and descent on the instance's arrays.

The winning entry's method (OpenReview xvzwLMgX3U): the usage limit leaves the network and becomes
a price. Time step t has a price lam[t]; node i's strategy s pays usage[i][s] times the sum of the
prices over i's live interval. Each round toulbar2 solves the priced network (unary + binary cost
functions only, which it solves fast even with 40k nodes: instance D's unpriced optimum in 7 CPU
seconds) and the plan's usage profile is measured. The first prices are the base price at the
steps where the limit can bind at all (every node at its largest usage over it). A plan over the limit goes through a greedy
repair (cheapest cost per byte saved first, then descent under the limit) and the prices at its
over-full steps grow (times ``growth`` plus a base price: the repair's median cost per byte-step
when larger than the instance's, see base_price); a plan that fits shrinks every price a little, to look for
cheaper plans that still fit. Each round's search is sized by backtracks (ROUND_BACKTRACKS), not CPU
time, so it ends with a plan at any load; a round without one is rerun with twice the work. A
plan over the limit is also recombined with the cheapest plans that fit (cross.py: the chains
where two plans differ switch as wholes), and so is every plan that fits (restore, recombine);
the parent's polish of a plan, written beside the output (``donor.json``, priced.offer), joins
those. Each feasible plan cheaper than the last is written to the output file (JSON, replaced
atomically), with the best Lagrangian bound so far (toulbar2's dual bound on the priced problem
less the prices times the limit: it holds for any prices >= 0).

Usage: python priced_child.py SOURCE OUT.json OPTIONS_JSON, where SOURCE is the instance's arrays
pickled by priced.start (``*.pkl``) or the instance file itself (priced.start_file: the child
reads it and exits when it is too small for the rounds, see OPTIONS' min_nodes and min_pairs).
"""

import importlib.util
import json
import os
import pickle
import sys
import time
import types

import numpy as np


def _load(name: str):
    """A sibling module (numpy only) by its path, without the package."""
    spec = importlib.util.spec_from_file_location(f"_iopddl_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


instance, search, cross = _load("instance"), _load("search"), _load("cross")

SCALE_CAP = 1e16  # summed costs above this are scaled down (toulbar2 costs are 64-bit integers)
# A round's search stops after this many backtracks, not after a CPU time: toulbar2's preprocessing
# alone takes ~7 CPU s on D, and a round capped at 8 CPU s ended without any plan (then rebuilt and
# rerun at 16); a work limit ends each round with its plan whatever the machine's load (D: 2,000
# backtracks, 11.6 CPU s with the build, a plan of 5.21e11 at round 0's prices).
ROUND_BACKTRACKS = 2000
# The child's time should hold at least this many rounds: the schedule needs several plans that
# fit before its prices come down to the cheap ones (K: 1.70x at round 1, 1.21x at round 4), and
# at 2,000 backtracks a round on K took 10-43 CPU s, so only rounds 0-2 ran in the 100 s it had.
ROUNDS_WANTED = 12
MIN_BACKTRACKS = 100  # and no round smaller (a round without a plan doubles anyway)
# Round 0's search is also stopped after this share of the child's time, in CPU seconds: its
# 2,000 backtracks took longer than the child's 105 s on L (28,526 nodes), which then had no plan
# at all (5.12x the best, from the parent's search alone); capped at 25 CPU s, round 0 went over
# the limit and round 1 fit at 1.08x. D's round 0 takes 12-17 CPU s, under the cap.
ROUND0_SHARE = 1 / 3
# Plans over the limit are also recombined with the cheapest plans that fit (cross.py, restore),
# and every plan that fits with them (recombine); off: the greedy repair alone. Off by default:
# with the same plans it gives cheaper ones (K 1.0720x -> 1.0448x at round 15), but through the
# 120 s command on a loaded box its CPU time cost rounds (U behind main in 3 of 4 pairs, K level;
# docs/iopddl.md, "Plans over the limit recombined").
CROSS = False


def base_price(cost: list, usage: list, starts: np.ndarray, ends: np.ndarray) -> float:
    """A typical cost per unit of usage per live step: the median over nodes whose allowed
    strategies trade usage for cost of (cost range) / (usage range) / (interval length). Nodes
    whose strategies all cost the same do not trade: on D and M they are 70 % of those with a
    usage range, and counting them made the median 0 (the first round then ran unpriced, its plan
    over the limit at 21k-28k steps: a wasted round; without them it is 0.22 on both, the repair's
    own price step was 0.10-0.11). Vectorised over the concatenated strategies (a loop over 40k nodes takes tens of seconds at
    this machine's load)."""
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in cost])[:-1]])
    c, u = np.concatenate(cost), np.concatenate(usage).astype(np.float64)
    ok = np.isfinite(c)

    def span(a):
        return np.maximum.reduceat(np.where(ok, a, -np.inf), offsets) - np.minimum.reduceat(np.where(ok, a, np.inf), offsets)

    dc, du, length = span(c), span(u), (ends - starts).astype(np.float64)
    keep = (np.add.reduceat(ok.astype(np.int64), offsets) >= 2) & (length > 0) & (du > 0) & (dc > 0)
    if not keep.any():
        return 1.0
    return max(float(np.median(dc[keep] / du[keep] / length[keep])), 1e-12)


def interval_sums(lam: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per node, the sum of ``lam`` over its half-open live interval (0 when never live)."""
    cum = np.concatenate([[0.0], np.cumsum(lam)])
    h = len(lam)
    return np.where(starts < ends, cum[ends.clip(0, h)] - cum[starts.clip(0, h)], 0.0)


def network(model: dict) -> types.SimpleNamespace:
    """The pickled instance's arrays with what ``search`` reads of an ``Instance`` (``n``, ``incident``)."""
    return types.SimpleNamespace(**model, n=len(model["cost"]),
                                 incident=instance.incident_lists(len(model["cost"]), model["edge_u"], model["edge_v"]))


def repair(net, x: list, prof: np.ndarray, passes: int = 1) -> list:
    """Lower usage at the steps over the limit, in place on ``x`` and ``prof``: each pass ranks the
    nodes live at an over-full step by their cheapest cost increase per byte-step saved there (over
    a strategy of less usage, neighbours held) and moves them in that order while their interval
    is still over; the last pass offers only each node's least usage, which always ends within
    the limit (the least-usage plan fits). Returns the ratios of the moves made (a price of usage)."""
    starts, ends, limit, usage = net.starts, net.ends, net.limit, net.usage
    made = []
    for p in range(passes + 1):
        over = prof > limit
        if not over.any():
            break
        cum = np.concatenate([[0], np.cumsum(over)])
        steps = np.where(starts < ends, cum[ends.clip(0, len(over))] - cum[starts.clip(0, len(over))], 0)
        ranked = []
        for i in np.flatnonzero(steps > 0):
            u, cur, allowed = usage[i], x[i], np.isfinite(net.cost[i])
            lower = np.flatnonzero((u < u[cur]) & allowed)
            if not len(lower):
                continue
            local = search.local_costs(net, x, i)
            if p == passes:  # last resort: the least usage, among strategies free of forbidden pairs if any
                ok = lower[np.isfinite(local[lower])]
                pool = ok if len(ok) else lower
                lower = pool[u[pool] == u[pool].min()]
            ratio = (local[lower] - local[cur]) / ((u[cur] - u[lower]) * float(steps[i]))
            ratio = np.where(np.isfinite(local[lower]), ratio, np.inf)
            k = int(np.argmin(ratio))
            if np.isfinite(ratio[k]) or p == passes:
                ranked.append((float(ratio[k]), int(i), int(lower[k])))
        for ratio, i, s in sorted(ranked):
            a, b = starts[i], ends[i]
            if int(prof[a:b].max()) > limit:
                prof[a:b] += usage[i][s] - usage[i][x[i]]
                x[i] = s
                made.append(ratio)
    return made


def polish(net, x: list, prof: np.ndarray, before: list) -> None:
    """Descent under the limit, in place, over the nodes that differ from ``before`` and their
    neighbours: a repair's moves leave room there (it moves a node while any step of its
    interval is over, also after others freed that step)."""
    moved = {i for i in range(len(x)) if x[i] != before[i]}
    near = {int(net.edge_v[k] if is_u else net.edge_u[k]) for i in moved for k, is_u in net.incident[i]}
    search.descend(net, x, prof, order=sorted(moved | near), passes=3)


def restore(net, x: list, prof: np.ndarray, donors: list):
    """Bring a plan over the limit back within it, in place on ``x`` and ``prof``: the greedy
    repair (single nodes) and, with ``donors`` (plans within the limit, cheapest first), the
    recombination with the first one (cross.py: whole components at once), each polished by
    descent; the cheaper one is kept. On K's plans over the limit by 316-8,015 steps the
    recombination gave 2.40-2.62e9 where the repair gave 2.56-3.36e9; on one over by 5 steps
    the repair was cheaper (2.398e9 against 2.435e9). Returns the repair's ratios (a price of
    usage) and which one was kept."""
    before = list(x)
    made = [v for v in repair(net, x, prof) if np.isfinite(v) and v > 0]
    polish(net, x, prof, before)
    if not donors:
        return made, "repair"
    y, py = list(before), search.profile(net, before)
    cross.cross(net, y, py, donors[0])
    polish(net, y, py, before)
    alone = search.cost(net, x)
    if not search.cost(net, y) < alone:
        return made, "repair"
    x[:], prof[:] = y, py
    return made, f"recombined; the repair alone {alone:.6g}"


def recombine(net, x: list, prof: np.ndarray, donors: list) -> float:
    """Cross a plan within the limit with each donor in turn (cross.py), in place, then polish:
    each crossing only flips components that lower the cost and keep the plan within the limit.
    Returns the cost."""
    before = list(x)
    for d in donors:
        cross.cross(net, x, prof, d)
    polish(net, x, prof, before)
    return search.cost(net, x)


def donated(net, out: str, given: tuple) -> tuple:
    """The plan the parent handed over beside ``out`` (priced.offer: its polish of one of this
    child's plans), as (file stamp, plan or None): a new one only when the file changed and the
    plan fits the limit."""
    path = os.path.join(os.path.dirname(out), "donor.json")
    try:
        stamp = os.stat(path).st_mtime_ns
        if stamp == given[0]:
            return stamp, None
        with open(path) as f:
            x = [int(v) for v in json.load(f)]
    except (OSError, ValueError, TypeError):
        return given[0], None
    fits = len(x) == net.n and int(search.profile(net, x).max(initial=0)) <= net.limit
    return stamp, (x if fits else None)


def build(model: dict, unary: list, cache: dict | None = None):
    """The network with the given (priced) unary costs, scaled into toulbar2's integer range;
    forbidden entries (``inf``) cost ``top``. Functions of equal shape go in one call. The edge
    tables only change with the scale and ``top``: ``cache`` keeps them from round to round."""
    import pytoulbar2

    if cache is None:
        cache = {}
    if "edge_cap" not in cache:
        cache["edge_cap"] = sum(float(c[np.isfinite(c)].max(initial=0)) for c in model["edge_cost"])
    cap = sum(float(c[np.isfinite(c)].max(initial=0)) for c in unary) + cache["edge_cap"]
    # powers of two, so that both stay the same from round to round while the prices move
    scale = min(1.0, 2.0 ** np.floor(np.log2(SCALE_CAP / max(cap, 1.0))))
    top = int(2 ** np.ceil(np.log2(cap * scale + 2)))
    cfn = pytoulbar2.CFN(top, verbose=-1)
    for i, c in enumerate(unary):
        cfn.AddVariable(f"x{i}", list(range(len(c))))

    def table(a):
        return np.where(np.isfinite(a), np.rint(a * scale), top).astype(np.float64)

    groups: dict = {}
    for i, c in enumerate(unary):
        groups.setdefault(len(c), []).append(i)
    for nodes in groups.values():
        cfn.AddFunctions(np.array(nodes, dtype=np.int64), np.stack([table(unary[i]) for i in nodes]))
    if cache.get("key") != (scale, top):
        groups = {}
        for k, m in enumerate(model["edge_cost"]):
            groups.setdefault(m.shape, []).append(k)
        cache["key"], cache["edges"] = (scale, top), [
            (np.array([[model["edge_u"][k], model["edge_v"][k]] for k in edges], dtype=np.int64),
             np.stack([table(model["edge_cost"][k]) for k in edges])) for edges in groups.values()]
    for scopes, tables in cache["edges"]:
        cfn.AddFunctions(scopes, tables)
    return cfn, scale


def solve_round(cfn, cpu: float, backtracks: int):
    """One toulbar2 search on the priced network, stopped by ``backtracks`` (the round's size)
    and, only when ``cpu`` > 0, by that many CPU seconds; toulbar2's best plan or None."""
    import pytoulbar2

    pytoulbar2.tb2.option.backtrackLimit = int(backtracks)
    return cfn.Solve(timeLimit=max(1, int(cpu)) if cpu > 0 else 0)


class RoundSize:
    """The rounds' backtracks, sized so that the rounds still wanted fit the time left. A round's
    search takes a fixed part (toulbar2's preprocessing and first dive) plus a part per backtrack;
    both are estimated from this round and the last one at least twice or half its size (the
    rounds' own searches differ: K's 125 and 123 backtracks took 3.6 and 4.2 CPU s; the first
    estimate puts all of it in the backtracks). The backtracks are cut only where they make most of a full round:
    on K (34,932 nodes) 2,000 backtracks took 24-43 s and 100 took 6 s, while on A and D 100
    took as long as 2,000 (12-17 CPU s) and D's plans were worse (1.66x instead of 1.0068x).
    Never above ROUND_BACKTRACKS (a round before this sizing) nor below MIN_BACKTRACKS, and at
    most a quarter of the last round's: a cut that does not pay costs one weaker round."""

    def __init__(self):
        self.seen: list = []  # (backtracks, CPU seconds of the search), round after round

    def after(self, backtracks: int, searched: float, wall: float, rest: float, left: float, rounds_left: int,
              comparable: bool = True) -> int:
        """The next round's backtracks, given this one's (``searched`` CPU seconds of search for
        its ``backtracks``, ``wall`` seconds on the wall clock; ``rest``: the round's building and
        repair, wall seconds) and the wall seconds ``left``. The model is in CPU seconds (the
        parent's phases beside the first rounds slow them on the wall clock, not in CPU), the
        target converted by this round's wall seconds per CPU second. A round not ``comparable``
        (round 0: its prices are the base price at most, an easier search, K's 2,000 backtracks
        took 8 CPU s there and 31 at round 2) is not kept for the estimate."""
        if comparable:
            self.seen.append((backtracks, searched))
        if searched <= 0 or wall <= 0 or rounds_left <= 0:
            return backtracks
        other = next(((b, t) for b, t in reversed(self.seen) if max(b, backtracks) >= 2 * min(b, backtracks)),
                     None) if comparable else None
        if other is None:
            per, fixed = searched / backtracks, 0.0
        else:
            per = (searched - other[1]) / (backtracks - other[0])
            fixed = searched - per * backtracks
            if per * ROUND_BACKTRACKS <= max(fixed, 0.0):  # the backtracks are not where the time goes
                return ROUND_BACKTRACKS
        target = (left / rounds_left - rest) * searched / wall - max(fixed, 0.0)
        return int(min(ROUND_BACKTRACKS, max(MIN_BACKTRACKS, backtracks // 4, target / per)))


def write(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def read(src: str, options: dict):
    """The instance's arrays from the pickle or the instance file; None when the file's instance
    is below the options' sizes for the rounds (or has no usage limit)."""
    if src.endswith(".pkl"):
        with open(src, "rb") as f:
            return pickle.load(f)
    t = time.process_time()
    inst = instance.load(src)
    pairs = sum(m.size for m in inst.edge_cost)
    if inst.limit is None or inst.n < options.get("min_nodes", 0) or pairs <= options.get("min_pairs", -1):
        print(f"priced rounds: not for this instance ({inst.n} nodes, {pairs} strategy pairs)", file=sys.stderr, flush=True)
        return None
    print(f"priced rounds: read the instance in {time.process_time() - t:.1f} CPU s", file=sys.stderr, flush=True)
    return instance.arrays(inst)


def next_prices(lam: np.ndarray, over: np.ndarray, growth: float, base: float, relax: float) -> np.ndarray:
    """The prices after a round before any plan fit: times ``growth`` plus ``base`` at the steps
    the plan overfilled, all times ``relax`` when it fit."""
    lam = lam.copy()
    if over.any():
        lam[over] = growth * lam[over] + base
    else:
        lam *= relax
    return lam


# Once a plan fits, the prices are lowered only at the steps with slack: usage below the limit
# by more than this share of it (a step at its limit is where a price does its work).
TIGHT = 0.005
BISECTED = 0.02  # a price this close above one that went over is not lowered any more


class Schedule:
    """The prices round after round. Until a plan fits: next_prices (grow at the overfull steps).
    Then a search down from the prices that fit, step by step: a round that fits lowers the
    prices at its steps with slack only (times ``step``: 0.5, main's 0.25; no lower than halfway, in ratio,
    to the highest price that went over there: a bisection), and remembers them as the last
    prices that fit; a round that goes over remembers its prices at the overfull steps as too
    low (``low``), and puts them back to the last prices that fit (where they were not lowered,
    one step up). Before (every price times 0.8 after each plan that fit, times 4 plus the price
    step at each overfull one): D's plans stayed 9 % under the limit at their peak for 16 rounds
    while the prices came down, and after round 28 went over and were repaired at 2.5x the cost
    for the rest of the run (docs/iopddl.md, "Priced rounds, a schedule from the prices that fit")."""

    def __init__(self, lam: np.ndarray, limit: int, growth: float, relax: float, step: float = 0.5):
        """``growth``, ``relax``: next_prices's, before any plan fit; ``step``: the lowering after."""
        self.lam, self.limit, self.growth, self.relax, self.step = lam.copy(), limit, growth, relax, step
        self.fit = None  # the last prices whose plan fit (before the repair)
        self.low = np.zeros_like(self.lam)  # per step, the highest price whose plan went over there

    def after(self, prof: np.ndarray, base: float) -> np.ndarray:
        """The next prices, given the round's plan profile (before the repair) and price step."""
        over = prof > self.limit
        if self.fit is None and over.any():
            self.lam = next_prices(self.lam, over, self.growth, base, self.relax)
        elif over.any():
            self.low[over] = np.maximum(self.low[over], self.lam[over])
            self.lam[over] = np.maximum(self.fit[over], self.lam[over] / self.step)
        else:
            self.fit = self.lam.copy()
            slack = prof < (1.0 - TIGHT) * self.limit
            lam, low = self.lam[slack], self.low[slack]
            lower = np.maximum(lam * self.step, np.sqrt(low * lam))
            self.lam[slack] = np.where(lam > (1.0 + BISECTED) * low, lower, lam)
        return self.lam.copy()


def main(args) -> None:
    src, out, options = args[0], args[1], json.loads(args[2])
    model = read(src, options)
    if model is None:
        return
    starts, ends, limit = model["starts"], model["ends"], model["limit"]
    growth, relax = options.get("growth", 4.0), options.get("relax", 0.8)
    base = base_price(model["cost"], model["usage"], starts, ends)
    # first prices: the base price wherever the limit can bind (each node at its largest usage)
    net = network(model)
    lam = np.where(search.profile(net, [int(np.argmax(u)) for u in model["usage"]]) > limit, base, 0.0)
    best, bound = np.inf, None
    schedule = Schedule(lam, limit, growth, relax, options.get("step", 0.25)) if options.get("schedule", "fit") == "fit" else None
    tables: dict = {}  # the edge tables, kept between rounds (build)
    cpu, backtracks = options.get("round_cpu", 0), options.get("backtracks", ROUND_BACKTRACKS)
    end = time.perf_counter() + options["seconds"] if options.get("seconds") and "backtracks" not in options else None
    first = ROUND0_SHARE * options["seconds"] if end is not None and not cpu else 0.0  # round 0's cap, until a plan
    size = RoundSize()
    pool, crossing, given = cross.Pool(), options.get("cross", CROSS), (None, None)
    for r in range(options.get("rounds", 40)):
        began = time.perf_counter()
        w = interval_sums(lam, starts, ends)
        unary = [c + w[i] * model["usage"][i] for i, c in enumerate(model["cost"])]
        t = time.process_time()
        cfn, scale = build(model, unary, tables)
        built = time.process_time() - t
        searching, cpu_searching = time.perf_counter(), time.process_time()
        res = solve_round(cfn, first or cpu, backtracks)
        searched, cpu_searched = time.perf_counter() - searching, time.process_time() - cpu_searching
        if scale == 1.0:  # Lagrangian bound: priced optimum (unaries rounded by <= 0.5) less the prices at the limit
            lagrange = float(cfn.GetDDualBound()) - 0.5 * len(model["cost"]) - float(lam.sum()) * limit
            bound = lagrange if bound is None else max(bound, lagrange)
        if res is None:  # no plan within the limits: the same prices again, twice the work
            print(f"priced round {r}: no plan in {backtracks} backtracks / {int(first or cpu)} CPU s", file=sys.stderr, flush=True)
            cpu, backtracks, first = 2 * cpu, 2 * backtracks, 2 * first
            continue
        first = 0.0  # from the first plan on, the rounds are sized by backtracks (RoundSize)
        x = [int(v) for v in res[0]]
        prof = search.profile(net, x)
        over = prof > limit
        c = search.cost(net, x)
        print(f"priced round {r}: cost {c:.6g}, {int(over.sum())} steps over the limit"
              f" (peak {int(prof.max(initial=0))} / {limit}), {time.process_time() - t:.1f} CPU s ({built:.1f} building), {backtracks} backtracks", file=sys.stderr, flush=True)
        if crossing:
            given = donated(net, out, given)
            if given[1] is not None:
                pool.add(given[1], search.cost(net, given[1]))
        fixed = prof.copy()
        if over.any():
            made, how = restore(net, x, fixed, pool.donors() if crossing else [])
            # the repair's median cost per byte-step: the scale a price must reach. Only until the
            # first plan that fits: later repairs of plans gone over again (prices relaxed) cost
            # more per byte, and a price step grown from them overshot (D: 2.5e5, every later plan 2.5x worse)
            if made and best == np.inf:
                base = max(base, float(np.median(made)))
            c = search.cost(net, x)
            print(f"priced round {r}: repaired to cost {c:.6g} ({how}), price step {base:.3g}", file=sys.stderr, flush=True)
        if crossing and not (fixed > limit).any() and pool.plans:
            if c < best:  # written before the recombination too: the child may be stopped during it (K at load 5)
                best = c
                write(out, {"solution": x, "cost": c, "round": r, "bound": bound})
            was = c
            c = recombine(net, x, fixed, pool.donors())
            if c < was:
                print(f"priced round {r}: recombined with the {len(pool.plans)} best plans: cost {c:.6g}", file=sys.stderr, flush=True)
        if crossing and not (fixed > limit).any():
            pool.add(x, c)
        lam = schedule.after(prof, base) if schedule is not None else next_prices(lam, over, growth, base, relax)
        if end is not None:
            now = time.perf_counter()
            backtracks = size.after(backtracks, cpu_searched, searched, now - began - searched, end - now,
                                    ROUNDS_WANTED - r - 1, comparable=r > 0)
        if not (fixed > limit).any() and c < best:
            best = c
            write(out, {"solution": x, "cost": c, "round": r, "bound": bound})
        elif best == np.inf and bound is not None:
            write(out, {"solution": None, "cost": None, "round": r, "bound": bound})


if __name__ == "__main__":
    main(sys.argv[1:])
