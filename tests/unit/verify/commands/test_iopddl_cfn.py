"""IOPDDL through toulbar2 (autoparallel/planner/iopddl/cfn.py): optimal against brute force (through
the independent evaluator) on small random trees with a usage limit, the usage constraints' live
sets, the wall-clock stop, the solution file reader, and the solve refusing a plan over the limit."""

from __future__ import annotations

import copy
import importlib
import itertools
import random
import time

import numpy as np
import pytest

from autoparallel.planner.iopddl import from_dict, solve
from autoparallel.planner.iopddl.cfn import maximal_live_sets, model_size, read_solution, solve_cfn
from verify.commands.iopddl.check import Rejected, check, evaluate

INF = 10**18
# the module, not the function `solve` that the package exports under the same name
solve_module = importlib.import_module("autoparallel.planner.iopddl.solve")


def _random_tree(rng: random.Random, n: int) -> dict:
    sizes = [rng.randint(1, 3) for _ in range(n)]
    edges = [[rng.randrange(k), k] for k in range(1, n)]
    intervals = [[s, s + rng.randint(0, 4)] for s in (rng.randint(0, 5) for _ in range(n))]
    usages = [[rng.randint(1, 4) for _ in range(s)] for s in sizes]
    lows = [sum(min(u) for (a, b), u in zip(intervals, usages) if a <= t < b) for t in range(10)]
    return {"nodes": {"intervals": intervals, "costs": [[rng.randint(0, 9) for _ in range(s)] for s in sizes],
                      "usages": usages},
            "edges": {"nodes": edges, "costs": [[rng.choice([rng.randint(0, 9), INF]) for _ in range(sizes[u] * sizes[v])]
                                                for u, v in edges]},
            "usage_limit": max(lows) + rng.randint(0, 3)}


def _optimum(problem: dict):
    """Brute-force optimum among plans free of forbidden (10**18) costs, None if there is none."""
    best = None
    for sol in itertools.product(*(range(len(c)) for c in problem["nodes"]["costs"])):
        try:
            c = evaluate(problem, list(sol))
        except Rejected:
            continue
        if c < INF and (best is None or c < best):
            best = c
    return best


def test_toulbar2_solve_is_optimal_on_random_trees():
    rng = random.Random(7)
    checked = 0
    while checked < 4:
        problem = _random_tree(rng, rng.randint(3, 6))
        best = _optimum(problem)
        if best is None:
            continue
        r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=20.0, full_mip_pairs=0, cfn_entries=10**9)
        assert r.method.startswith("toulbar2")
        assert check(problem, r.solution, r.cost) == r.cost == best
        assert r.optimal
        checked += 1


def _intervals(intervals, limit=10, costs=(0, 1)) -> dict:
    n = len(intervals)
    return {"problem": {"nodes": {"intervals": intervals, "costs": [list(costs)] * n, "usages": [[1, 2]] * n},
                        "edges": {"nodes": [], "costs": []}, "usage_limit": limit}}


def test_live_sets_are_the_maximal_ones_over_half_open_intervals():
    # 0: [0,4), 1: [2,6), 2: [4,8) (touches 0 at 4 only: half open), 3 never live
    inst = from_dict(_intervals([[0, 4], [2, 6], [4, 8], [3, 3]]))
    assert sorted(sorted(s) for s in maximal_live_sets(inst)) == [[0, 1], [1, 2]]
    # every stretch's live strategies: [0,2) 2, [2,4) 4, [4,6) 4, [6,8) 2; no edges
    assert model_size(inst) == 12
    inst.limit = None
    assert model_size(inst) == 0


def test_live_sets_match_the_definition_on_random_intervals():
    rng = random.Random(11)
    for _ in range(50):
        iv = [[a, a + rng.randint(0, 4)] for a in (rng.randint(0, 8) for _ in range(rng.randint(1, 7)))]
        inst = from_dict(_intervals(iv))
        at = [frozenset(i for i, (a, b) in enumerate(iv) if a <= t < b) for t in range(13)]
        want = {s for s in at if s and not any(s < o for o in at)}
        got = [frozenset(s) for s in maximal_live_sets(inst)]
        assert len(got) == len(set(got)) and set(got) == want


def test_the_child_is_stopped_at_the_wall_clock_deadline():
    rng = random.Random(3)
    inst = from_dict({"problem": _random_tree(rng, 5)})
    said = []
    x, optimal = solve_cfn(inst, np.inf, time.perf_counter() + 0.05, say=said.append)  # too short to start toulbar2
    assert said == ["toulbar2 stopped at the deadline"]  # killed, not waited for
    assert x is None and not optimal


def test_solution_reader_takes_the_last_complete_line_only(tmp_path):
    p = tmp_path / "sol.txt"
    p.write_text("0 1 2\n 2 2 1\n1 1")  # a line cut short by the kill
    assert read_solution(str(p), 3).tolist() == [2, 2, 1]
    p.write_text("New solution: 12\n")
    assert read_solution(str(p), 3) is None
    assert read_solution(str(tmp_path / "missing.txt"), 3) is None


def _two_live(costs=(1, 0)) -> dict:
    """Two nodes live together under a limit of 3: at most one may take strategy 1 (usage 2), the
    cheap one, so the optimum is 1 and the cheapest plan of all ([1, 1], 0) is over the limit."""
    return _intervals([[0, 2], [0, 2]], limit=3, costs=costs)


def test_solve_refuses_a_toulbar2_plan_over_the_limit(monkeypatch):
    problem = _two_live()
    monkeypatch.setattr(solve_module, "solve_cfn", lambda inst, *a, **k: (np.array([1, 1]), True))
    r = solve(from_dict(copy.deepcopy(problem)), time_limit=10.0, full_mip_pairs=-1, cfn_entries=10**9)
    assert check(problem["problem"], r.solution, r.cost) == r.cost == 1


@pytest.mark.parametrize("answer", [None, np.array([0, 1])], ids=["start", "its-plan"])
def test_a_finished_toulbar2_search_proves_the_plan_it_returns_or_the_start(monkeypatch, answer):
    problem = _two_live()  # descent ends at cost 1 = the optimum, above the trivial bound 0
    monkeypatch.setattr(solve_module, "solve_cfn", lambda inst, *a, **k: (answer, True))
    r = solve(from_dict(copy.deepcopy(problem)), time_limit=10.0, full_mip_pairs=-1, cfn_entries=10**9)
    assert r.method == "toulbar2"
    assert r.optimal and r.cost == 1 and r.bound == 1
