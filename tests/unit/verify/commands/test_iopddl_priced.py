"""IOPDDL's priced toulbar2 rounds (autoparallel/planner/iopddl/priced.py, priced_child.py): the
greedy repair that brings a plan under the usage limit, the child's plans (feasible, never below
brute force, checked by the independent evaluator) and its bound (never above the optimum), and the
solve keeping their plan only when it fits and is cheaper."""

from __future__ import annotations

import copy
import importlib
import json
import os
import pickle
import random
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel.planner.iopddl import from_dict, priced, priced_child, solve
from autoparallel.planner.iopddl.instance import arrays
from verify.commands.iopddl.check import check, evaluate

solve_module = importlib.import_module("autoparallel.planner.iopddl.solve")
pytest.importorskip("pytoulbar2")


def _problem(rng: random.Random, n: int, slack: int) -> dict:
    """Random nodes (1-3 strategies), random edges, a limit ``slack`` above the least usage's peak."""
    sizes = [rng.randint(1, 3) for _ in range(n)]
    intervals = [[s, s + rng.randint(0, 5)] for s in (rng.randint(0, 8) for _ in range(n))]
    edges = [[u, v] for u in range(n) for v in range(u + 1, n) if rng.random() < 0.4]
    usages = [[rng.randint(1, 10) for _ in range(s)] for s in sizes]
    lows = [sum(min(us) for (a, b), us in zip(intervals, usages) if a <= t < b) for t in range(14)]
    return {"nodes": {"intervals": intervals, "usages": usages,
                      "costs": [[rng.randint(0, 50) for _ in range(s)] for s in sizes]},
            "edges": {"nodes": edges, "costs": [[rng.randint(0, 30) for _ in range(sizes[u] * sizes[v])] for u, v in edges]},
            "usage_limit": max(lows) + slack}


def _optimum(problem: dict) -> int:
    """The optimum by the whole-problem MIP (proven on these few nodes)."""
    r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=10.0, full_mip_pairs=10**9, cfn_entries=-1)
    assert r.optimal
    return r.cost


def _model(problem: dict):
    """The instance as the child sees it (``priced_child.network`` over the arrays ``priced.start`` pickles)."""
    inst = from_dict({"problem": copy.deepcopy(problem)})
    return priced_child.network({"cost": inst.cost, "usage": inst.usage, "edge_u": inst.edge_u, "edge_v": inst.edge_v,
                                 "edge_cost": inst.edge_cost, "starts": inst.starts, "ends": inst.ends,
                                 "limit": inst.limit, "horizon": inst.horizon})


def test_interval_sums_and_profile_follow_half_open_intervals():
    lam = np.array([1.0, 2.0, 4.0, 8.0])
    starts, ends = np.array([0, 1, 3, 2]), np.array([2, 4, 3, 3])  # node 2 never live
    assert priced_child.interval_sums(lam, starts, ends).tolist() == [3.0, 14.0, 0.0, 4.0]
    usage = [np.array([5, 1]), np.array([2]), np.array([100]), np.array([7, 3])]
    net = priced_child.network({"cost": [np.zeros(len(u)) for u in usage], "usage": usage, "edge_u": [], "edge_v": [],
                                "edge_cost": [], "starts": starts, "ends": ends, "limit": 10, "horizon": 4})
    assert priced_child.search.profile(net, [1, 0, 0, 0]).tolist() == [1, 3, 9, 2]


def test_base_price_is_the_median_cost_per_byte_step_over_nodes_that_trade():
    inf = np.inf
    cost = [np.array([0.0, 10.0]), np.array([inf, 4.0]), np.array([0.0, 6.0, 2.0]), np.array([0.0, 9.0]), np.array([1.0, 5.0]),
            np.array([3.0, 3.0]), np.array([0.0, 0.0])]
    usage = [np.array([1, 3]), np.array([1, 9]), np.array([2, 2, 5]), np.array([1, 2]), np.array([4, 4]),
             np.array([1, 5]), np.array([2, 9])]
    starts, ends = np.array([0, 0, 3, 2, 0, 0, 0]), np.array([5, 5, 4, 2, 1, 9, 9])
    # node 0: 10 / 2 / 5 = 1; node 1 has one allowed strategy, node 3 is never live, node 4's
    # usages are equal, nodes 5 and 6 save usage for free (no price); node 2: 6 / 3 / 1 = 2
    assert priced_child.base_price(cost, usage, starts, ends) == 1.5
    assert priced_child.base_price(cost[1:2], usage[1:2], starts[1:2], ends[1:2]) == 1.0  # nothing trades


def _two_on_one_step(cost_a=(0, 10), cost_b=(0, 1)) -> dict:
    """Nodes a and b live at step 0 only, strategy 0 uses 2, strategy 1 uses 1; limit 3: one of
    them must move to 1. Moving a costs 10, b costs 1."""
    return {"nodes": {"intervals": [[0, 1], [0, 1]], "usages": [[2, 1], [2, 1]], "costs": [list(cost_a), list(cost_b)]},
            "edges": {"nodes": [], "costs": []}, "usage_limit": 3}


def test_repair_moves_the_cheapest_byte_first():
    for cost_a, cost_b, moved in (((0, 10), (0, 1), (0, 1)), ((0, 1), (0, 10), (1, 0))):
        model = _model(_two_on_one_step(cost_a, cost_b))
        x = [0, 0]
        prof = priced_child.search.profile(model, x)
        assert len(priced_child.repair(model, x, prof)) == 1
        assert x == list(moved) and prof.tolist() == [3]


def test_repair_reports_a_plan_it_cannot_fix():
    p = _two_on_one_step()
    p["nodes"]["usages"] = [[2, 3], [2, 2]]  # no strategy of less usage anywhere
    model = _model(p)
    x = [0, 0]
    prof = priced_child.search.profile(model, x)
    assert priced_child.repair(model, x, prof) == []
    assert x == [0, 0] and prof.tolist() == [4]


def test_descent_after_a_repair_clears_forbidden_pairs_within_the_limit():
    # edge (a, b): pair (0, 1) forbidden, (1, 1) costs 1; a at 1 uses 2, b uses 1 either way; limit 3
    p = {"nodes": {"intervals": [[0, 1], [0, 1]], "usages": [[1, 2], [1, 1]], "costs": [[0, 0], [0, 0]]},
         "edges": {"nodes": [[0, 1]], "costs": [[5, 10**18, 7, 1]]}, "usage_limit": 3}
    model = _model(p)
    x = [0, 1]
    prof = priced_child.search.profile(model, x)
    priced_child.search.descend(model, x, prof, order=[0, 1], passes=3)
    assert x == [1, 1] and prof.tolist() == [3] and evaluate(p, x) == 1
    p["usage_limit"] = 2  # a may not grow: b must leave the forbidden pair instead
    model = _model(p)
    x = [0, 1]
    prof = priced_child.search.profile(model, x)
    priced_child.search.descend(model, x, prof, order=[0, 1], passes=3)
    assert x == [0, 0] and evaluate(p, x) == 5


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), slack=st.integers(0, 4))
def test_repair_from_the_most_usage_ends_within_the_limit(seed, slack):
    rng = random.Random(seed)
    problem = _problem(rng, rng.randint(1, 7), slack)
    model = _model(problem)
    x = [int(np.argmax(u)) for u in model.usage]
    prof = priced_child.search.profile(model, x)
    priced_child.repair(model, x, prof)
    assert prof.tolist() == priced_child.search.profile(model, x).tolist()
    assert int(prof.max(initial=0)) <= problem["usage_limit"]


def test_priced_rounds_give_feasible_plans_and_a_bound_below_the_optimum():
    rng = random.Random(5)
    found = 0
    for k in range(3):
        problem = _problem(rng, rng.randint(3, 7), k % 3)
        inst = from_dict({"problem": copy.deepcopy(problem)})
        job = priced.start(inst, time.perf_counter() + 30, rounds=3, round_cpu=1)
        x, bound = priced.collect(job)
        best = _optimum(problem)
        assert bound is not None and bound <= best + 1e-6
        if x is not None:
            found += 1
            assert evaluate(problem, [int(v) for v in x]) >= best
    assert found == 3  # the repair makes every round's plan fit


def test_a_second_collect_returns_the_first_ones_plan():
    """The alarm may stop the solve between collecting the rounds and keeping their plan; its
    handler collects again and must get the same plan (the child's file is gone by then)."""
    rng = random.Random(5)
    problem = _problem(rng, rng.randint(3, 7), 0)
    job = priced.start(from_dict({"problem": copy.deepcopy(problem)}), time.perf_counter() + 30, rounds=3, round_cpu=1)
    x, bound = priced.collect(job)
    assert x is not None and not os.path.exists(job.out)
    again, bound_again = priced.collect(job)
    assert again is not None and again.tolist() == x.tolist() and bound_again == bound


def test_a_stopped_child_gives_nothing():
    problem = _problem(random.Random(6), 5, 0)
    job = priced.start(from_dict({"problem": problem}), time.perf_counter() + 0.01)
    assert priced.collect(job) == (None, None)


@pytest.mark.parametrize("answer,kept", [([1, 1], False), ([0, 1], True)], ids=["over-the-limit", "fits"])
def test_solve_keeps_a_priced_plan_only_when_it_fits(monkeypatch, answer, kept):
    # strategy 1 is free but uses 2, limit 3: [1, 1] costs 0 and is over the limit; descent from the
    # least usage moves node 0 first and ends at [1, 0] (cost 6); the optimum is [0, 1] (cost 5)
    problem = {"nodes": {"intervals": [[0, 1], [0, 1]], "usages": [[1, 2], [1, 2]], "costs": [[5, 0], [6, 0]]},
               "edges": {"nodes": [], "costs": []}, "usage_limit": 3}
    monkeypatch.setattr(solve_module.priced, "collect", lambda job, *a, **k: (np.array(answer), None))
    r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=5.0, full_mip_pairs=-1, cfn_entries=-1,
              priced_share=0.5, priced_nodes=0)
    assert check(problem, r.solution, r.cost) == r.cost
    assert r.method.startswith("priced") == kept


def test_next_prices_grow_at_the_overfull_steps_and_relax_when_the_plan_fits():
    lam = np.array([1.0, 0.0, 2.0])
    grown = priced_child.next_prices(lam, np.array([True, True, False]), growth=4.0, base=0.5, relax=0.8)
    assert grown.tolist() == [4.5, 0.5, 2.0] and lam.tolist() == [1.0, 0.0, 2.0]  # the input is kept
    assert priced_child.next_prices(lam, np.zeros(3, dtype=bool), 4.0, 0.5, 0.8).tolist() == [0.8, 0.0, 1.6]


def _rounds(schedule, need: np.ndarray, lam: np.ndarray, limit: int, rounds: int = 40):
    """Priced rounds against a stand-in for toulbar2 whose plan uses, at each step, the limit
    plus 10 % when that step's price is below ``need`` (then over) and less the further the price
    is above it (a plan that saves more memory than it must, and costs more for it); the
    round's plan cost is the summed excess price. ``schedule(lam, prof)`` -> the next prices."""
    history = []
    for _ in range(rounds):
        prof = np.where(lam < need, 1.1 * limit, limit * np.maximum(0.5, 1.0 - 0.1 * np.log2(np.maximum(lam, 1e-300) / need)))
        history.append((lam.copy(), prof))
        lam = schedule(lam, prof)
    return history


def test_schedule_after_a_fit_lowers_only_steps_with_slack_and_never_below_prices_that_fit():
    """D's failure: every price times 0.8 after each plan that fit (16 rounds 9 % under the limit),
    then the plans went over and each repair made them 2.5x dearer (growth x4 at the overfull
    steps). The schedule from the prices that fit must get near the needed prices in a few rounds
    and stay there: from round 10 no price above 2.5x the needed one (the old rule: 23.7x), few
    rounds over, and the last round's prices within 10 % of the need (the old rule: 1.3-4.2x)."""
    limit, need = 1000, np.array([1.3, 4.7, 0.29, 2.1])
    start = np.full(4, 64.0)  # far too high: every step 9-25 % under the limit, as on D and M

    def new(lam, prof, sched=[None]):
        if sched[0] is None:
            sched[0] = priced_child.Schedule(lam, limit, growth=4.0, relax=0.8)
        return sched[0].after(prof, base=0.5)

    history = _rounds(new, need, start, limit)
    fits = [i for i, (_, prof) in enumerate(history) if (prof <= limit).all()]
    assert fits and fits[0] == 0
    overs = [i for i, (_, prof) in enumerate(history) if (prof > limit).any()]
    assert len(overs) <= 12, overs
    for lam, _ in history[10:]:
        assert (lam <= 2.5 * need).all(), lam
    assert (history[-1][0] <= 1.1 * need).all() and (history[-1][0] >= need / 1.1).all(), history[-1][0]
    # a step at its limit keeps its price; one with slack is lowered
    sched = priced_child.Schedule(np.array([2.0, 2.0]), 10, growth=4.0, relax=0.8)
    assert sched.after(np.array([10, 5]), base=1.0).tolist() == [2.0, 1.0]
    # over after that: the overfull step goes back to the price that fit; lowered again, only
    # halfway (in ratio) to the price that went over there
    assert sched.after(np.array([10, 11]), base=1.0).tolist() == [2.0, 2.0]
    assert sched.after(np.array([5, 5]), base=1.0).tolist() == [1.0, pytest.approx(2 ** 0.5)]
    # before any plan fits: grow at the overfull steps as next_prices does
    first = priced_child.Schedule(np.array([1.0, 1.0]), 10, growth=4.0, relax=0.8)
    assert first.after(np.array([11, 5]), base=0.5).tolist() == [4.5, 1.0]


def _file(tmp_path, problem: dict) -> str:
    path = tmp_path / "instance.json"
    path.write_text(json.dumps({"problem": problem}))
    return str(path)


def test_the_child_reads_the_file_as_from_dict_does_and_skips_small_instances(tmp_path):
    problem = _problem(random.Random(7), 6, 1)
    path = _file(tmp_path, problem)
    model, inst = priced_child.read(path, {}), from_dict({"problem": copy.deepcopy(problem)})
    assert [c.tolist() for c in model["cost"]] == [c.tolist() for c in inst.cost]
    assert [m.tolist() for m in model["edge_cost"]] == [m.tolist() for m in inst.edge_cost]
    assert model["limit"] == inst.limit and model["edge_u"].tolist() == inst.edge_u.tolist()
    assert priced_child.read(path, {"min_nodes": 7}) is None
    pairs = sum(m.size for m in inst.edge_cost)
    assert priced_child.read(path, {"min_pairs": pairs}) is None and priced_child.read(path, {"min_pairs": pairs - 1})
    del problem["usage_limit"]
    assert priced_child.read(_file(tmp_path, problem), {}) is None


def test_rounds_started_on_the_file_give_a_feasible_plan_or_exit_when_not_wanted(tmp_path):
    problem = _problem(random.Random(8), 6, 1)
    path = _file(tmp_path, problem)
    job = priced.start_file(path, time.perf_counter() + 30, min_nodes=0, min_pairs=-1, rounds=2, round_cpu=1)
    x, bound = priced.collect(job)
    assert x is not None and evaluate(problem, [int(v) for v in x]) >= _optimum(problem) >= bound - 1e-6
    job = priced.start_file(path, time.perf_counter() + 30, min_nodes=7, min_pairs=-1)
    assert priced.collect(job) == (None, None) and job.proc.returncode == 0  # exited, not killed at the deadline


def test_solve_stops_rounds_started_on_the_file_when_the_instance_does_not_want_them(tmp_path):
    problem = _problem(random.Random(9), 6, 1)
    job = priced.start_file(_file(tmp_path, problem), time.perf_counter() + 60, min_nodes=0, min_pairs=-1)
    r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=5.0, priced_job=job)  # the whole MIP's size
    assert job.proc.returncode is not None and r.method == "mip"
    assert check(problem, r.solution, r.cost) == r.cost


class _SlowToStart:
    """A network whose search finds its first plan only after more CPU than a small cap gives
    (toulbar2's preprocessing on D: ~7 CPU s, and a round capped at 8 ended without a plan)."""

    def __init__(self, first_plan_cpu: float):
        self.first_plan_cpu, self.calls = first_plan_cpu, []

    def Solve(self, timeLimit=0):
        self.calls.append(timeLimit)
        return None if 0 < timeLimit < self.first_plan_cpu else ([0, 1], 7.0, 1)


def test_default_rounds_are_sized_by_backtracks_and_end_with_a_plan_however_slow_the_start():
    import pytoulbar2

    before = pytoulbar2.tb2.option.backtrackLimit
    try:
        cfn = _SlowToStart(first_plan_cpu=20.0)
        assert priced_child.solve_round(cfn, priced.ROUND_CPU, priced_child.ROUND_BACKTRACKS) is not None
        assert cfn.calls == [0] and pytoulbar2.tb2.option.backtrackLimit == priced_child.ROUND_BACKTRACKS
        cfn = _SlowToStart(first_plan_cpu=20.0)  # an explicit CPU cap still applies
        assert priced_child.solve_round(cfn, 8, 100) is None and cfn.calls == [8]
    finally:
        pytoulbar2.tb2.option.backtrackLimit = before


def test_rounds_with_the_default_sizes_give_feasible_plans():
    problem = _problem(random.Random(10), 7, 1)
    job = priced.start(from_dict({"problem": copy.deepcopy(problem)}), time.perf_counter() + 60, rounds=2)
    x, bound = priced.collect(job)
    assert x is not None and evaluate(problem, [int(v) for v in x]) >= _optimum(problem) >= bound - 1e-6


def test_collect_without_waiting_reads_the_plan_of_a_child_that_still_runs(tmp_path):
    """Past the solve's hard deadline the rounds are collected at once: the plan the child wrote
    is read without waiting for its stop time, and the child is killed (reaped later)."""
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="iopddl-priced-test-")
    out = os.path.join(tmp.name, "best.json")
    priced_child.write(out, {"solution": [1, 0, 1], "cost": 7, "round": 3, "bound": 2.0})
    waits: list = []

    class Recorded(subprocess.Popen):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout=timeout)

    proc = Recorded([sys.executable, "-c", "import time; time.sleep(60)"])
    job = priced.Priced(proc, tmp, out, time.perf_counter() + 30)
    x, bound = priced.collect(job, wait=False)
    assert waits and all(w is not None and w <= 0 for w in waits), waits  # never the 30 s to its stop time
    assert x.tolist() == [1, 0, 1] and bound == 2.0
    proc.wait(timeout=30)  # killed
    assert proc.returncode != 0


def test_rounds_are_cut_only_where_the_backtracks_take_the_time():
    size, full, floor = priced_child.RoundSize, priced_child.ROUND_BACKTRACKS, priced_child.MIN_BACKTRACKS
    # first round: all of its 20 CPU s counted per backtrack; 66 s for 6 more rounds, 1 s of each
    # not search: 10 s of search, 1,000 backtracks (a CPU second a wall second here)
    sized = size()
    assert sized.after(2000, searched=20.0, wall=20.0, rest=1.0, left=66.0, rounds_left=6) == 1000
    # 1,000 took 11 s: 9 s per 1,000 and 2 s fixed; 5 rounds in 35 s: 7 - 1 - 2 = 4 s of backtracks
    assert sized.after(1000, searched=11.0, wall=11.0, rest=1.0, left=35.0, rounds_left=5) == 444
    # 444 took as long as 1,000 (A, D): not the backtracks, back to the full round
    assert sized.after(444, searched=11.0, wall=11.0, rest=1.0, left=35.0, rounds_left=4) == full
    sized = size()  # at most a quarter of the last round, never below the floor, never above the full one
    assert sized.after(2000, searched=20.0, wall=20.0, rest=1.0, left=2.0, rounds_left=6) == 500
    assert sized.after(500, searched=1.0, wall=1.0, rest=1.0, left=2.0, rounds_left=6) == 125
    assert sized.after(125, searched=0.5, wall=0.5, rest=1.0, left=2.0, rounds_left=6) == floor
    assert size().after(400, searched=1.0, wall=1.0, rest=0.5, left=60.0, rounds_left=5) == full
    # at two wall seconds a CPU second (a loaded machine) 20 wall seconds of search are 10 CPU s
    assert size().after(2000, searched=20.0, wall=40.0, rest=1.0, left=126.0, rounds_left=6) == 1000
    assert size().after(2000, searched=20.0, wall=20.0, rest=1.0, left=126.0, rounds_left=6) == full
    sized = size()  # a round not comparable (round 0) gives the first cut but no point of the estimate
    assert sized.after(2000, searched=8.0, wall=8.0, rest=1.0, left=2.0, rounds_left=6, comparable=False) == 500
    assert sized.after(500, searched=11.0, wall=11.0, rest=1.0, left=2.0, rounds_left=6) == 125
    # 123 backtracks after 125 (nearly the same size, a noisy slope) are compared with the 500
    assert sized.after(125, searched=3.6, wall=3.6, rest=1.0, left=2.0, rounds_left=6) == floor
    assert sized.after(123, searched=4.2, wall=4.2, rest=1.0, left=2.0, rounds_left=6) == floor
    assert size().after(700, searched=20.0, wall=20.0, rest=2.0, left=60.0, rounds_left=0) == 700  # every round wanted has run
    assert size().after(700, searched=0.0, wall=0.0, rest=2.0, left=60.0, rounds_left=3) == 700  # nothing measured


def _rounds_backtracks(tmp_path, monkeypatch, options: dict, per_backtrack: float, fixed: float, cpus: list | None = None) -> list:
    """The backtracks each of the child's rounds was given (main in this process, toulbar2's
    search replaced by one that records them and returns the least-usage plan; the child's clock
    advances only in that search, by ``fixed`` plus ``per_backtrack`` each); ``cpus`` gets each
    round's CPU cap."""
    inst = from_dict({"problem": _problem(random.Random(11), 6, 2)})
    src = os.path.join(tmp_path, "model.pkl")
    with open(src, "wb") as f:
        pickle.dump(arrays(inst), f)
    given, now = [], [0.0]
    cpus = cpus if cpus is not None else []

    def search(cfn, cpu, backtracks):
        given.append(backtracks)
        cpus.append(cpu)
        now[0] += fixed + per_backtrack * backtracks
        return [int(np.argmin(u)) for u in inst.usage], 0.0, 1

    monkeypatch.setattr(priced_child, "solve_round", search)
    monkeypatch.setattr(priced_child, "time", types.SimpleNamespace(perf_counter=lambda: now[0], process_time=lambda: now[0]))
    priced_child.main([src, os.path.join(tmp_path, "out.json"), json.dumps(options)])
    return given


def test_the_child_sizes_its_rounds_by_the_seconds_it_was_given(tmp_path, monkeypatch):
    """K (34,932 nodes) at 2,000 backtracks a round ran rounds 0-2 in its 100 s and ended 1.62x
    the best; sized to the time left it ran rounds 0-8 and ended 1.06x (docs/iopddl.md). Here a
    second for 12 rounds of 10 ms a backtrack: each round is cut by the most a round may be."""
    full = priced_child.ROUND_BACKTRACKS
    k = {"per_backtrack": 0.01, "fixed": 0.0}
    assert _rounds_backtracks(tmp_path, monkeypatch, {"rounds": 3}, **k) == [full] * 3  # no time given: as before
    assert _rounds_backtracks(tmp_path, monkeypatch, {"rounds": 3, "seconds": 1.0}, **k) == [full, full // 4, full // 16]
    # a search that takes 10 s whatever its backtracks (A, D): back to the full round once two
    # rounds after round 0 (an easier search, not compared) show it
    d = {"per_backtrack": 0.0, "fixed": 10.0}
    assert _rounds_backtracks(tmp_path, monkeypatch, {"rounds": 4, "seconds": 1.0}, **d) == [full, full // 4, full // 16, full]
    # an explicit size is kept
    assert _rounds_backtracks(tmp_path, monkeypatch, {"rounds": 2, "seconds": 1.0, "backtracks": 300}, **k) == [300, 300]


def test_the_child_is_told_the_seconds_to_its_stop(monkeypatch):
    import subprocess

    seen: list = []

    class Recorded:
        def __init__(self, args, **kwargs):
            seen.append(json.loads(args[-1]))

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    job = priced.start_file("instance.json", time.perf_counter() + 50.0, min_nodes=0, min_pairs=-1)
    job.tmp.cleanup()
    assert 0 < seen[0]["seconds"] <= 50.0


def test_round_0_is_also_capped_by_a_share_of_the_childs_time(tmp_path, monkeypatch):
    """L (28,526 nodes): round 0's 2,000 backtracks outlasted the child's 105 s and the child had no
    plan at all; capped, round 0 returns its plan (over the limit there) and round 1 fit at 1.08x.
    The cap is round 0's only (later rounds are sized by backtracks), and only where the child
    knows its time and was given no CPU cap of its own."""
    k = {"per_backtrack": 0.0, "fixed": 1.0}
    cpus: list = []
    _rounds_backtracks(tmp_path, monkeypatch, {"rounds": 3, "seconds": 90.0}, **k, cpus=cpus)
    assert cpus == [30.0, 0, 0]  # a third of the 90 s (ROUND0_SHARE)
    for options, want in (({"rounds": 3}, [0, 0, 0]), ({"rounds": 2, "seconds": 90.0, "round_cpu": 8}, [8, 8])):
        cpus = []
        _rounds_backtracks(tmp_path, monkeypatch, options, **k, cpus=cpus)
        assert cpus == want, options


# --- plans over the limit recombined with plans within it (cross.py) ---------------------------


def _two_chains() -> dict:
    """Two chains of two nodes, all live at step 0; strategy 0 uses 2, strategy 1 uses 1, and
    each chain's edge forbids mixed pairs, so a chain goes small as a whole. Small costs 10 a node
    on chain (0, 1), 1 on chain (2, 3); limit 7: one chain must go small, the cheap one (cost 2)."""
    inf = 10**18
    return {"nodes": {"intervals": [[0, 1]] * 4, "usages": [[2, 1]] * 4, "costs": [[0, 10], [0, 10], [0, 1], [0, 1]]},
            "edges": {"nodes": [[0, 1], [2, 3]], "costs": [[0, inf, inf, 0]] * 2}, "usage_limit": 7}


def test_parts_are_the_components_of_the_edges_between_nodes_that_differ():
    # a path 0-1-2-3-4 and an edge 5-6; the plans differ at 0, 1, 3, 4, 5, 6
    edges = [[0, 1], [1, 2], [2, 3], [3, 4], [5, 6]]
    net = types.SimpleNamespace(cost=[np.zeros(2)] * 7, edge_u=np.array([u for u, _ in edges]), edge_v=np.array([v for _, v in edges]))
    got = priced_child.cross.parts(net, [0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1, 1])
    assert sorted(c.tolist() for c in got) == [[0, 1], [3, 4], [5, 6]]
    assert priced_child.cross.parts(net, [0] * 7, [0] * 7) == []


def test_restore_recombines_whole_chains_where_the_greedy_repair_pays_the_dearer_one():
    """K's plans over the limit came back at +12-54 % from the greedy repair: the strategies of
    less usage are compatible only with the neighbours' smaller ones (most mixed pairs
    forbidden), so single-node moves pay for it. Here the repair can only move one node into a
    forbidden pair and let descent drag its partner: the first chain (cost 20). Recombined with
    a plan that fits (all small, 22), each chain switches as a whole: the cheap one, the optimum."""
    problem = _two_chains()
    assert _optimum(problem) == 2  # the whole-problem MIP, proven
    net = _model(problem)
    x = [0, 0, 0, 0]
    prof = priced_child.search.profile(net, x)
    made, how = priced_child.restore(net, x, prof, [[1, 1, 1, 1]])
    assert how.startswith("recombined") and x == [0, 0, 1, 1] and evaluate(problem, x) == 2
    assert prof.tolist() == priced_child.search.profile(net, x).tolist() == [6]
    x = [0, 0, 0, 0]
    prof = priced_child.search.profile(net, x)
    made, how = priced_child.restore(net, x, prof, [])  # no donor: the greedy repair alone
    assert how == "repair" and evaluate(problem, x) == 20


def test_the_child_writes_the_recombined_plan_and_only_the_repaired_one_without_it(tmp_path, monkeypatch):
    """The child's loop (toulbar2's search replaced by one that returns given plans): round 0
    fits (all small, 22), round 1 is over the limit (all large, 0). Recombined, its plan is the
    optimum 2; with the recombination off (``cross``: False, or CROSS, its default), the repair's 20."""
    problem = _two_chains()
    inst = from_dict({"problem": copy.deepcopy(problem)})
    src, out = os.path.join(tmp_path, "model.pkl"), os.path.join(tmp_path, "out.json")
    with open(src, "wb") as f:
        pickle.dump(arrays(inst), f)

    def run(options):
        plans = iter([[1, 1, 1, 1], [0, 0, 0, 0]])
        monkeypatch.setattr(priced_child, "solve_round", lambda cfn, cpu, backtracks: (next(plans), 0.0, 1))
        priced_child.main([src, out, json.dumps({"rounds": 2, **options})])
        with open(out) as f:
            found = json.load(f)
        assert check(problem, found["solution"], int(found["cost"])) == found["cost"]
        return found["cost"]

    assert run({"cross": True}) == 2
    assert run({"cross": False}) == 20
    assert run({}) == 20  # off by default (priced_child.CROSS)
    monkeypatch.setattr(priced_child, "CROSS", True)
    assert run({}) == 2


def test_recombining_a_plan_within_the_limit_never_makes_it_dearer():
    # the two chains, both small but the first large in the donor: nothing fits better than x
    problem = _two_chains()
    net = _model(problem)
    x = [0, 0, 1, 1]  # cost 2, within the limit
    prof = priced_child.search.profile(net, x)
    assert priced_child.cross.cross(net, x, prof, [1, 1, 1, 1]) == 0 and x == [0, 0, 1, 1]
    x = [1, 1, 1, 1]  # cost 22: the donor's first chain large is cheaper and still fits
    prof = priced_child.search.profile(net, x)
    assert priced_child.cross.cross(net, x, prof, [0, 0, 1, 1]) == 1 and x == [0, 0, 1, 1] and prof.tolist() == [6]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), slack=st.integers(0, 4))
def test_restored_and_recombined_plans_fit_per_the_evaluator(seed, slack):
    """On generated instances (a feasible plan always exists: the limit is at least the least
    usage's peak): any plan, restored with or without a donor that fits, ends within the limit
    per the independent evaluator, at the cost the child computes, never dearer than the greedy
    repair alone; a plan already within the limit is never made dearer by a crossing."""
    rng = random.Random(seed)
    problem = _problem(rng, rng.randint(2, 8), slack)
    net = _model(problem)
    donor = [int(v) for v in priced_child.search.least_usage(net)]  # within the limit: the least usage's peak
    dprof = priced_child.search.profile(net, donor)
    priced_child.search.descend(net, donor, dprof)
    x = [rng.randrange(len(u)) for u in net.usage]
    prof = priced_child.search.profile(net, x)
    within = int(prof.max(initial=0)) <= net.limit
    alone, aprof = list(x), prof.copy()
    if not within:
        priced_child.restore(net, alone, aprof, [])
        assert priced_child.search.profile(net, alone).tolist() == aprof.tolist()
        assert evaluate(problem, alone) == priced_child.search.cost(net, alone)
    y, yprof = list(x), prof.copy()
    if within:
        priced_child.cross.cross(net, y, yprof, donor)
        assert priced_child.search.cost(net, y) <= priced_child.search.cost(net, x)
    else:
        priced_child.restore(net, y, yprof, [donor])
        assert priced_child.search.cost(net, y) <= priced_child.search.cost(net, alone)
    assert priced_child.search.profile(net, y).tolist() == yprof.tolist()
    assert evaluate(problem, y) == priced_child.search.cost(net, y)  # raises when over the limit


def test_the_child_takes_the_plan_the_parent_hands_it_as_a_donor(tmp_path, monkeypatch):
    """The parent's polish of a child's plan, written beside the child's output (priced.offer),
    joins the child's donors: its only round's plan over the limit is then recombined with it
    (2, the optimum) instead of repaired alone (20). A plan over the limit is not taken."""
    problem = _two_chains()
    inst = from_dict({"problem": copy.deepcopy(problem)})
    src, out = os.path.join(tmp_path, "model.pkl"), os.path.join(tmp_path, "out.json")
    with open(src, "wb") as f:
        pickle.dump(arrays(inst), f)
    job = types.SimpleNamespace(tmp=types.SimpleNamespace(name=str(tmp_path)))
    monkeypatch.setattr(priced_child, "solve_round", lambda cfn, cpu, backtracks: ([0, 0, 0, 0], 0.0, 1))

    def run(donor):
        priced.offer(job, donor)
        priced_child.main([src, out, json.dumps({"rounds": 1, "cross": True})])
        with open(out) as f:
            return json.load(f)["cost"]

    assert run([1, 1, 1, 1]) == 2  # a donor of 22 that fits: the cheap chain switched
    assert run([0, 0, 0, 0]) == 20  # over the limit: not a donor, the repair alone


class _Child:
    """A child process stand-in on a fake clock: it writes the given plans to its output at the
    given times and exits at ``ends``; ``wait`` advances the clock."""

    def __init__(self, now: list, out: str, plans: list, ends: float):
        self.now, self.out, self.plans, self.ends, self.returncode = now, out, list(plans), ends, None

    def _tick(self):
        while self.plans and self.plans[0][0] <= self.now[0]:
            priced_child.write(self.out, {"solution": self.plans.pop(0)[1], "cost": 0, "round": 0, "bound": None})
            self.now[0] += 0.001  # a file stamp apart from the next
        if self.now[0] >= self.ends:
            self.returncode = 0

    def poll(self):
        self._tick()
        return self.returncode

    def wait(self, timeout=None):
        import subprocess

        if self.returncode is not None:  # exited or killed
            return self.returncode
        if timeout is not None and timeout is not None and self.now[0] + timeout < self.ends:
            self.now[0] += timeout
            self._tick()
            raise subprocess.TimeoutExpired("child", timeout)
        self.now[0] = max(self.now[0], self.ends)
        self._tick()
        return 0

    def kill(self):
        self.returncode = -9


def test_collect_hands_each_plan_the_child_writes_to_the_polish_while_it_runs(tmp_path):
    """K and U: the parent waited idle for 50-85 s while the child ran; it now polishes each
    plan the child writes, once, in order, until the child's stop (no wall-clock: a fake child
    on a fake clock), and collect still returns the child's last plan."""
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="iopddl-priced-test-")
    out = os.path.join(tmp.name, "best.json")
    now = [0.0]
    child = _Child(now, out, [(1.0, [0, 1]), (4.0, [1, 1]), (9.0, [1, 0]), (30.0, [0, 0])], ends=40.0)
    job = priced.Priced(child, tmp, out, stop=20.0)
    seen = []
    x, _ = priced.collect(job, clock=lambda: now[0], polish=lambda y, stop: seen.append((y.tolist(), stop)))
    assert seen == [([0, 1], 20.0), ([1, 1], 20.0), ([1, 0], 20.0)]  # the one at 30 s is past the stop
    assert x.tolist() == [1, 0] and child.returncode == -9


def test_the_parent_keeps_and_hands_back_its_polish_of_a_childs_plan_only_when_it_fits_and_is_cheaper(tmp_path):
    problem = _two_chains()
    inst = from_dict({"problem": copy.deepcopy(problem)})
    job = types.SimpleNamespace(tmp=types.SimpleNamespace(name=str(tmp_path)))
    kept = solve_module.Incumbent(-np.inf)
    follow = solve_module._Follow(inst, job, 25.0, deadline=10.0, clock=lambda: 0.0, say=lambda m: None, kept=kept)
    follow(np.array([0, 0, 0, 0]), 10.0)  # over the limit: ignored
    assert follow.x is None and not os.path.exists(os.path.join(tmp_path, priced.DONOR))
    follow(np.array([1, 1, 1, 1]), 10.0)  # within the limit, 22: a star move takes the first chain large, 2
    assert follow.cost == 2 and follow.x.tolist() == [0, 0, 1, 1] and kept.cost == 2
    with open(os.path.join(tmp_path, priced.DONOR)) as f:
        assert json.load(f) == [0, 0, 1, 1]
    follow(np.array([0, 0, 1, 1]), 10.0)  # 2: not cheaper than what it has, not polished
    assert follow.source.tolist() == [1, 1, 1, 1] and follow.cost == 2


def test_the_solve_polishes_the_childs_plans_while_it_waits_and_keeps_the_cheaper(monkeypatch):
    """With FOLLOW, solve's wait for the child goes through _Follow: a polished plan of the child's
    is the answer when the child's last plan is no cheaper; with FOLLOW off, only the last plan."""
    problem = _two_chains()
    inst = from_dict({"problem": copy.deepcopy(problem)})
    given: list = []

    def collect(job, clock, say, polish=None):
        given.append(polish)
        if polish is not None:
            polish(np.array([1, 1, 1, 1]), 10.0)  # polished to 2 (a star move)
        return np.array([1, 1, 1, 1]), None  # the child's last plan: the same one

    monkeypatch.setattr(priced, "collect", collect)
    monkeypatch.setattr(priced, "offer", lambda job, x: None)
    x = np.array([1, 1, 1, 1])

    def run():
        kept = solve_module.Incumbent(-np.inf)
        return solve_module._priced(inst, None, x.copy(), solve_module.profile(inst, x), 30.0, 0.0, "descent", 10.0,
                                    lambda: 0.0, lambda m: None, kept)

    monkeypatch.setattr(solve_module, "FOLLOW", True)  # off by default (docs/iopddl.md)
    y, _, c, _, method = run()
    assert isinstance(given[-1], solve_module._Follow) and c == 2 and y.tolist() == [0, 0, 1, 1] and method == "priced"
    monkeypatch.setattr(solve_module, "FOLLOW", False)
    y, _, c, _, method = run()
    assert given[-1] is None and c == 2 and method == "priced"  # the last plan, polished after the wait


def test_the_child_writes_a_better_plan_before_recombining_it(tmp_path, monkeypatch):
    """K at load 5: the child was stopped during a recombination and its round's plan, the best
    it had, was lost. Here the recombination is where it is stopped (it raises)."""
    inst = from_dict({"problem": _two_chains()})
    src, out = os.path.join(tmp_path, "model.pkl"), os.path.join(tmp_path, "out.json")
    with open(src, "wb") as f:
        pickle.dump(arrays(inst), f)
    plans = iter([[1, 1, 1, 1], [0, 0, 1, 1]])  # 22, then 2: both within the limit
    monkeypatch.setattr(priced_child, "solve_round", lambda cfn, cpu, backtracks: (next(plans), 0.0, 1))

    def stopped(*args):
        raise SystemExit("stopped")

    monkeypatch.setattr(priced_child, "recombine", stopped)
    with pytest.raises(SystemExit):
        priced_child.main([src, out, json.dumps({"rounds": 2, "cross": True})])
    with open(out) as f:
        assert json.load(f)["cost"] == 2
