"""IOPDDL: the contest's evaluator (with negative tests), the solver on the contest's example,
on random instances against brute force, and on the committed instances B and G; star moves (star.py)
on hand-made and random stars."""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel.planner.iopddl import deadline, from_dict, load, solve
from autoparallel.planner.iopddl.penalty import penalty_search, priced_descent
from autoparallel.planner.iopddl.search import cost, descend, least_usage, local_costs, profile
from autoparallel.planner.iopddl.star import star_descend, star_move, stars
from verify.__main__ import main as verify_main
from verify.commands.iopddl import cli
from verify.commands.iopddl.bench import BEST, table
from verify.commands.iopddl.check import Judge, Rejected, check, evaluate, read_problem

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "iopddl")
EXAMPLE = os.path.join(DATA, "example.json")


def example() -> dict:
    return read_problem(EXAMPLE)


# --- the evaluator: google/iopddl's own EvaluateTest cases, then ours ---

def test_evaluator_matches_the_contests_own_cases():
    p = example()
    assert evaluate(p, [0, 1, 2, 0, 0]) == 495
    with pytest.raises(Rejected, match="exceeds the limit"):
        evaluate(p, [0, 0, 1, 1, 0])
    del p["usage_limit"]
    assert evaluate(p, [0, 0, 1, 1, 0]) == 415


@pytest.mark.parametrize("solution, match", [
    ([0, 0, 0, 0, 0, 0], "6 entries for 5 nodes"),
    ([0, 0, 0, 0], "4 entries for 5 nodes"),
    ([0, 0, -1, 0, 0], "node 2"),
    ([0, 0, 3, 0, 0], "node 2"),
    ([0, 2, 0, 0, 0], "node 1"),
    ([0, 1, 2.0, 0, 0], "node 2"),
    ([True, 1, 2, 0, 0], "node 0"),
])
def test_evaluator_rejects_malformed_solutions(solution, match):
    with pytest.raises(Rejected, match=match):
        evaluate(example(), solution)


def _two_nodes(limit, second=(5, 10)) -> dict:
    return {"nodes": {"intervals": [[0, 5], list(second)], "costs": [[1, 2], [3, 4]], "usages": [[10, 4], [10, 6]]},
            "edges": {"nodes": [[0, 1]], "costs": [[100, 200, 300, 400]]}, "usage_limit": limit}


def test_evaluator_uses_half_open_intervals_and_the_edge_index_rule():
    # [0, 5) and [5, 10) never overlap: each alone fits a limit of 10
    p = _two_nodes(10)
    assert evaluate(p, [0, 0]) == 1 + 3 + 100
    assert evaluate(p, [1, 0]) == 2 + 3 + 300  # index = s0 * 2 + s1
    assert evaluate(p, [0, 1]) == 1 + 4 + 200


def test_evaluator_rejects_usage_over_the_limit_at_a_single_step():
    p = _two_nodes(15, second=(4, 10))  # the nodes overlap at step 4 only
    assert evaluate(p, [1, 0]) == 2 + 3 + 300  # 4 + 10 = 14 at step 4
    with pytest.raises(Rejected, match="usage 20 exceeds the limit 15 at time step 4"):
        evaluate(p, [0, 0])
    p["usage_limit"] = 9
    with pytest.raises(Rejected, match="at time step 0"):
        evaluate(p, [0, 1])


def test_check_rejects_a_wrong_claimed_cost():
    p = example()
    assert check(p, [0, 1, 2, 0, 0], 495) == 495
    with pytest.raises(Rejected, match="claimed cost 494"):
        check(p, [0, 1, 2, 0, 0], 494)


# --- the solver ---

def _brute_force(problem: dict):
    sizes = [len(c) for c in problem["nodes"]["costs"]]
    best = None
    for sol in itertools.product(*(range(k) for k in sizes)):
        try:
            c = evaluate(problem, list(sol))
        except Rejected:
            continue
        best = c if best is None else min(best, c)
    return best


def _random_problem(rng: random.Random, n: int) -> dict:
    sizes = [rng.randint(1, 3) for _ in range(n)]
    intervals = []
    for _ in range(n):
        s = rng.randint(0, 8)
        intervals.append([s, s + rng.randint(0, 5)])  # some empty
    edges = [[u, v] for u in range(n) for v in range(u + 1, n) if rng.random() < 0.4]
    inf = 10**18
    problem = {
        "nodes": {"intervals": intervals, "costs": [[rng.choice([rng.randint(0, 50), inf]) if k else rng.randint(0, 50)
                                                     for k in range(s)] for s in sizes],
                  "usages": [[rng.randint(1, 10) for _ in range(s)] for s in sizes]},
        "edges": {"nodes": edges, "costs": [[rng.randint(0, 30) for _ in range(sizes[u] * sizes[v])] for u, v in edges]},
    }
    lows = [0] * 14
    for (s, e), us, cs in zip(intervals, problem["nodes"]["usages"], problem["nodes"]["costs"]):
        for t in range(s, e):
            lows[t] += min(u for u, c in zip(us, cs) if c < inf)
    problem["usage_limit"] = max(lows) + rng.randint(0, 8)  # always feasible
    return problem


@pytest.mark.parametrize("full_mip_pairs,penalty_share", [(10**9, 0.0), (0, 0.0), (0, 0.4)], ids=["mip", "lns", "penalty"])
def test_solver_matches_brute_force_on_random_instances(full_mip_pairs, penalty_share):
    rng = random.Random(43)
    for _ in range(12):
        problem = _random_problem(rng, rng.randint(2, 6))
        # cfn_entries=-1: no toulbar2 (test_iopddl_cfn.py), so "lns" and "penalty" test those paths
        r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=5.0, full_mip_pairs=full_mip_pairs,
                  cfn_entries=-1, penalty_share=penalty_share)
        assert check(problem, r.solution, r.cost) == r.cost
        if full_mip_pairs:
            assert r.optimal
        if r.optimal:
            assert r.cost == _brute_force(problem)


def test_solver_finds_the_contests_example_optimum():
    r = solve(load(EXAMPLE), time_limit=5.0)
    assert r.solution == [0, 0, 2, 1, 0]  # google/iopddl's SolveTest.FindsOptimalSolution
    assert r.optimal and r.cost == evaluate(example(), r.solution)


def test_solver_refuses_an_infeasible_instance():
    p = example()
    p["usage_limit"] = 10
    with pytest.raises(ValueError, match="infeasible"):
        solve(from_dict({"problem": p}), time_limit=1.0)


@pytest.mark.parametrize("name", ["B", "G"])
def test_committed_contest_instances_solve_feasibly(name, capsys):
    path = os.path.join(DATA, f"asplos-2025-iopddl-{name}.json.gz")
    assert verify_main(["solve", "--iopddl", path, "--time-limit", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["solution"]) == out["nodes"] == 816
    assert check(read_problem(path), out["solution"], out["cost"]) == out["cost"]


def test_json_output_is_one_object_on_the_processs_stdout():
    """Whole stdout of a fresh process, file descriptor 1 included: HiGHS's C++ banner went there
    before the JSON (capsys sees only Python's sys.stdout, so the test above could not see it)."""
    run = subprocess.run([sys.executable, "-m", "verify", "solve", "--iopddl", EXAMPLE, "--time-limit", "5", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert check(read_problem(EXAMPLE), out["solution"], out["cost"]) == out["cost"]


def test_command_prints_the_cost_and_refuses_bad_input(capsys):
    assert verify_main(["solve", "--iopddl", EXAMPLE, "--time-limit", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(evaluate(example(), [0, 0, 2, 1, 0]))
    assert verify_main(["solve", "--iopddl", EXAMPLE + ".missing"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_command_fails_when_the_solver_claims_a_wrong_cost(monkeypatch, capsys):
    real = cli.solve

    def lying(*args, **kwargs):
        r = real(*args, **kwargs)
        r.cost -= 1
        return r

    monkeypatch.setattr(cli, "solve", lying)
    assert verify_main(["solve", "--iopddl", EXAMPLE, "--json"]) == 2
    assert "claimed cost" in capsys.readouterr().err
    assert capsys.readouterr().out == ""


def test_the_evaluator_process_confirms_a_right_answer_and_rejects_wrong_ones(tmp_path):
    """The command's evaluator runs as its own process reading the file with json (Judge)."""
    x = [0, 0, 2, 1, 0]
    right = evaluate(example(), x)
    assert Judge(EXAMPLE).verdict(x, right) == {"cost": right, "edges": len(example()["edges"]["nodes"])}
    for answer, cost_, match in [(x, right + 1, "claimed cost"), (x[:-1], right, "solution has 4 entries"),
                                 ([0, 0, 2, 1, 7], right, "node 4: strategy 7")]:
        judge = Judge(EXAMPLE)
        with pytest.raises(Rejected, match=match):
            judge.verdict(answer, cost_)
        judge.stop()
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="the evaluator failed"):
        Judge(str(bad)).verdict(x, right)
    waiting = Judge(EXAMPLE)  # never sent an answer (the solve failed): stopped, pipes closed
    waiting.stop()
    assert waiting.proc.returncode is not None and waiting.proc.stdin.closed


def test_neighbourhood_search_alone_keeps_instance_g_feasible_and_no_worse():
    """The path large instances take (no whole-problem MIP): every accepted neighbourhood keeps
    the plan within the limit and the cost never rises above the descent's."""
    path = os.path.join(DATA, "asplos-2025-iopddl-G.json.gz")
    seen = []
    r = solve(load(path), time_limit=4.0, full_mip_pairs=0, cfn_entries=-1, progress=seen.append)
    start = float(next(m for m in seen if m.startswith("descent")).split("cost ")[1].split(" ")[0])
    assert r.method == "lns" and r.stats["subproblems"] > 0
    assert check(read_problem(path), r.solution, r.cost) == r.cost
    assert r.cost <= start


def test_bench_table_reports_ratios_beaten_bests_and_failures():
    rows = [{"letter": "B", "nodes": 816, "cost": BEST["B"] * 2, "seconds": 1.0, "optimal": False},
            {"letter": "G", "nodes": 816, "cost": BEST["G"] // 2, "seconds": 2.0, "optimal": True},
            {"letter": "K", "nodes": None, "cost": None, "seconds": 3.0, "optimal": False, "error": "no plan"}]
    text = table(rows)
    assert "| B | 816 | 1,065,686 | 2.0000 |" in text and "| G | 816 | 108,519 | 0.5000 | 2.0 | yes |" in text
    assert "geometric mean of cost / best over 2 instances: 1.0000" in text
    assert "beat the best: G" in text and "no feasible plan: K" in text


# --- the adaptive-penalty search ---

def _problem(rng: random.Random, n: int, slack: int) -> dict:
    sizes = [rng.randint(1, 3) for _ in range(n)]
    intervals = [[s, s + rng.randint(0, 5)] for s in (rng.randint(0, 8) for _ in range(n))]
    edges = [[u, v] for u in range(n) for v in range(u + 1, n) if rng.random() < 0.4]
    usages = [[rng.randint(1, 10) for _ in range(s)] for s in sizes]
    lows = [0] * 14
    for (s, e), us in zip(intervals, usages):
        for t in range(s, e):
            lows[t] += min(us)
    return {"nodes": {"intervals": intervals, "usages": usages,
                      "costs": [[rng.randint(0, 50) for _ in range(s)] for s in sizes]},
            "edges": {"nodes": edges, "costs": [[rng.randint(0, 30) for _ in range(sizes[u] * sizes[v])] for u, v in edges]},
            "usage_limit": max(lows) + slack}


def test_priced_descent_without_prices_ends_at_a_local_minimum():
    rng = random.Random(1)
    for _ in range(10):
        inst = from_dict({"problem": _problem(rng, 7, 0)})
        x = least_usage(inst)
        priced_descent(inst, x, np.zeros(inst.n), range(inst.n))
        for i in range(inst.n):
            local = local_costs(inst, x, i)
            assert local[x[i]] <= local.min() + 1e-9


def test_priced_descent_with_dominant_prices_picks_least_usage():
    rng = random.Random(2)
    for _ in range(10):
        inst = from_dict({"problem": _problem(rng, 7, 0)})
        x = np.zeros(inst.n, dtype=np.int64)
        priced_descent(inst, x, np.full(inst.n, 1e9), range(inst.n))
        for i in range(inst.n):
            assert inst.usage[i][x[i]] == inst.usage[i].min()


def test_penalty_search_returns_feasible_plans_no_better_than_brute_force_and_terminates():
    rng = random.Random(3)
    found = 0
    for k in range(20):
        problem = _problem(rng, rng.randint(2, 7), k % 4)
        inst = from_dict({"problem": problem})
        said = []
        x, c = penalty_search(inst, least_usage(inst), time.perf_counter() + 30, time.perf_counter, said.append,
                              rounds=40, plan_cost=cost)
        assert len(said) <= 40
        if x is None:
            assert c == np.inf
            continue
        found += 1
        assert int(profile(inst, x).max(initial=0)) <= inst.limit
        assert evaluate(problem, [int(v) for v in x]) == c >= _brute_force(problem)
    assert found >= 15  # the prices reach feasibility on nearly all of them


def test_penalty_search_without_memory_pressure_is_the_unpriced_descent():
    rng = random.Random(4)
    problem = _problem(rng, 6, 10**6)
    inst = from_dict({"problem": problem})
    said = []
    x, c = penalty_search(inst, least_usage(inst), time.perf_counter() + 30, time.perf_counter, said.append,
                          plan_cost=cost)
    assert len(said) == 1 and "round 0: feasible" in said[0]
    for i in range(inst.n):
        assert local_costs(inst, x, i)[x[i]] <= local_costs(inst, x, i).min()


# --- star moves (a node with all its leaves at once): exact on stars without a binding limit,
# never over the limit, never worse, and able to leave a plan where single-node descent is stuck ---

def _stuck_star(limit=None) -> dict:
    """Hub 0 with three leaves. Strategy 0 everywhere costs 3 x 5 on the edges; moving the hub
    alone to 1 costs 3 x 20 more on the edges, moving a leaf alone costs 20 more: descent is
    stuck at cost 15, the star move reaches 0 (every node at 1, usage 2 each)."""
    same = [5, 20, 20, 0]  # pair (a, b) at index 2a + b
    p = {"nodes": {"intervals": [[0, 2]] * 4, "costs": [[0, 0]] * 4, "usages": [[1, 2]] * 4},
         "edges": {"nodes": [[0, 1], [0, 2], [3, 0]], "costs": [same] * 3}}
    if limit is not None:
        p["usage_limit"] = limit
    return p


def test_star_move_leaves_the_plan_where_single_node_descent_is_stuck():
    inst = from_dict({"problem": _stuck_star()})
    x = least_usage(inst)
    prof = profile(inst, x)
    assert descend(inst, x, prof) == 0 and cost(inst, x) == 15
    assert stars(inst) == {0: [(0, True, 1), (1, True, 2), (2, False, 3)]}
    assert star_descend(inst, x, prof) == 1
    assert list(x) == [1, 1, 1, 1] and cost(inst, x) == 0 == _brute_force(_stuck_star())
    assert (prof == profile(inst, x)).all()


def test_star_move_is_refused_when_it_would_pass_the_usage_limit():
    inst = from_dict({"problem": _stuck_star(limit=7)})  # all at 1 would use 8 at both steps
    x = least_usage(inst)
    prof = profile(inst, x)
    assert star_move(inst, x, prof, 0, stars(inst)[0]) == 0.0
    assert list(x) == [0, 0, 0, 0]


def _random_star(rng: random.Random, leaves: int, slack) -> dict:
    n = leaves + 1
    sizes = [rng.randint(1, 3) for _ in range(n)]
    intervals = [[s, s + rng.randint(0, 4)] for s in (rng.randint(0, 5) for _ in range(n))]
    edges = [[0, j] if rng.random() < 0.5 else [j, 0] for j in range(1, n)]
    usages = [[rng.randint(1, 9) for _ in range(s)] for s in sizes]
    p = {"nodes": {"intervals": intervals, "usages": usages,
                   "costs": [[rng.randint(0, 40) for _ in range(s)] for s in sizes]},
         "edges": {"nodes": edges, "costs": [[rng.randint(0, 40) for _ in range(sizes[u] * sizes[v])] for u, v in edges]}}
    if slack is not None:
        lows = [0] * 10
        for (s, e), us in zip(intervals, usages):
            for t in range(s, e):
                lows[t] += min(us)
        p["usage_limit"] = max(lows) + slack
    return p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), leaves=st.integers(1, 5))
def test_star_moves_are_exact_on_stars_without_a_limit(seed, leaves):
    problem = _random_star(random.Random(seed), leaves, None)
    inst = from_dict({"problem": problem})
    x = least_usage(inst)
    prof = profile(inst, x)
    star_descend(inst, x, prof)
    assert evaluate(problem, [int(v) for v in x]) == _brute_force(problem)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), leaves=st.integers(1, 5), slack=st.integers(0, 8))
def test_star_moves_stay_feasible_and_never_worsen_under_a_limit(seed, leaves, slack):
    problem = _random_star(random.Random(seed), leaves, slack)
    inst = from_dict({"problem": problem})
    x = least_usage(inst)
    prof = profile(inst, x)
    before = evaluate(problem, [int(v) for v in x])
    star_descend(inst, x, prof)
    after = evaluate(problem, [int(v) for v in x])  # raises Rejected when over the limit
    assert _brute_force(problem) <= after <= before
    assert (prof == profile(inst, x)).all() and np.all(prof <= problem["usage_limit"])


def test_solve_uses_star_moves_before_the_neighbourhood_search():
    said = []
    r = solve(from_dict({"problem": _stuck_star()}), time_limit=5.0, full_mip_pairs=0, cfn_entries=-1,
              progress=said.append)
    assert any(m.startswith("star moves (a node with its leaves) and descent: cost 0 ") for m in said), said
    assert r.cost == 0 and evaluate(_stuck_star(), r.solution) == 0


# --- the hard deadline (deadline.py): a phase that overruns is stopped, the last kept plan returned ---
solve_module = importlib.import_module("autoparallel.planner.iopddl.solve")


def _spin(seconds: float) -> int:
    """Pure-Python work for ``seconds`` (what a phase slow to check its deadline looks like)."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def test_alarm_stops_python_work_and_restores_the_previous_handler_and_timer():
    before, outer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's, if any

    def left_as_before():  # the enclosing timer re-armed with what is left of it, or none
        now = signal.getitimer(signal.ITIMER_REAL)[0]
        return now == 0 if outer == 0 else 0 < now <= outer

    with pytest.raises(deadline.Overrun):  # raised inside the spin: it was stopped, not finished
        with deadline.alarm(0.2):
            _spin(5.0)
    assert signal.getsignal(signal.SIGALRM) is before
    assert left_as_before()
    with pytest.raises(deadline.Overrun):  # a nested alarm that does not fire leaves the outer one armed
        with deadline.alarm(0.4):
            with deadline.alarm(10.0):
                _spin(0.05)
            _spin(5.0)
    with deadline.alarm(5.0):  # work that ends in time is not interrupted
        assert _spin(0.05) > 0
    assert left_as_before()


def test_incumbent_keeps_a_copy_of_the_cheapest_plan():
    kept = deadline.Incumbent(0.0)
    x = np.array([1, 2])
    kept.keep(x, np.inf)  # the first plan, even at an infinite cost
    x[0] = 5
    assert kept.x.tolist() == [1, 2]
    kept.keep([3, 3], 10.0, "mip")
    kept.keep([4, 4], 11.0, "lns")  # dearer: not kept
    assert kept.x.tolist() == [3, 3] and kept.cost == 10.0 and kept.method == "mip"


@pytest.mark.parametrize("limit,usage_limit,kept_cost", [(1.0, 7, 15), (2.0, 7, 15), (1.0, 10**6, 0)])
def test_solve_returns_by_the_deadline_when_a_phase_overruns(monkeypatch, limit, usage_limit, kept_cost):
    """Star moves that ignore the deadline (here: spin 6 s past it) after moving every node to 1
    (cost 0, usage 8): the solve still returns within its grace, feasible and at its true cost,
    with that plan when it fits the limit, else the descent's (kept before the phase, cost 15)."""
    problem = _stuck_star(limit=usage_limit)

    def slow(inst, x, prof, dl, clock, rounds=10):
        x[:] = 1  # every node moved (what the phase would make): checked, kept only when it fits
        _spin(dl - clock() + 6.0)
        return 1

    monkeypatch.setattr(solve_module, "star_rounds", slow)
    said = []
    r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=limit, full_mip_pairs=0, cfn_entries=-1,
              progress=said.append)
    # the alarm, not the phase's own end, stopped it (no wall-clock bound asserted: CI's load varies)
    assert any(m.startswith("hard deadline") for m in said) and r.stats.get("overrun") and not r.optimal
    assert check(problem, r.solution, r.cost) == r.cost == kept_cost


@pytest.mark.parametrize("answer,cost_", [([1, 1, 1, 1], 0), ([1, 1, 1, 0], 15)], ids=["fits", "dearer"])
def test_solve_stopped_by_the_deadline_still_takes_the_priced_plan_when_it_fits(monkeypatch, answer, cost_):
    """The alarm stops the star phase before the priced rounds are collected: their plan (all
    nodes at 1: cost 0) is still read and kept; a dearer one is not."""
    problem = _stuck_star(limit=10**6)
    monkeypatch.setattr(solve_module, "star_rounds", lambda inst, x, prof, dl, clock, rounds=10: _spin(dl - clock() + 6.0))
    monkeypatch.setattr(solve_module.priced, "collect", lambda job, *a, **k: (np.array(answer), None))
    r = solve(from_dict({"problem": copy.deepcopy(problem)}), time_limit=1.0, full_mip_pairs=0, cfn_entries=-1,
              priced_share=0.5, priced_nodes=0)
    assert r.stats.get("overrun") and check(problem, r.solution, r.cost) == r.cost == cost_
    assert r.method == ("priced" if cost_ == 0 else "descent")


# --- a bounded end of the run: the command returns within its limit however slow the closing ---

END_SLACK = 0.5  # seconds past the limit a command may take (process wake-ups, the evaluator's reply)


def _many_stuck_stars(copies: int, limit: int | None) -> dict:
    """``copies`` of _stuck_star side by side at shifted times (descent stuck at 15 each, star
    moves reach 0 with every node at usage 2); two stars overlap at every step."""
    one = _stuck_star()
    nodes = {"intervals": [], "costs": [], "usages": []}
    edges = {"nodes": [], "costs": []}
    for k in range(copies):
        nodes["intervals"] += [[k, k + 2]] * 4
        nodes["costs"] += one["nodes"]["costs"]
        nodes["usages"] += one["nodes"]["usages"]
        edges["nodes"] += [[4 * k + a, 4 * k + b] for a, b in one["edges"]["nodes"]]
        edges["costs"] += one["edges"]["costs"]
    p = {"nodes": nodes, "edges": edges}
    if limit is not None:
        p["usage_limit"] = limit
    return p


@pytest.mark.parametrize("usage_limit,best", [(16, 0), (12, None)], ids=["star-plan-fits", "star-plan-over"])
def test_command_returns_within_its_limit_when_the_closing_is_slow(tmp_path, monkeypatch, capsys, usage_limit, best):
    """What a loaded machine does to the end of the run, made deterministic: the exact cost (the
    closing's last step) takes 0.6 s, and star moves ignore the deadline (they spin past it after
    moving every node to 1). The command (reading, solve, the evaluator) must still return within
    its limit + END_SLACK (before the measured closing: 0.8-0.9 s past 12 s, the closing after the
    alarm), and print the cheapest plan that fits of all it kept: the star phase's own (cost 0)
    when it fits, else the descent's (15 per star)."""
    copies = 500
    problem = _many_stuck_stars(copies, usage_limit)
    path = tmp_path / "stars.json"
    path.write_text(json.dumps({"problem": problem}))
    real_exact = solve_module._exact_cost

    def slow_exact(inst, x):
        _spin(0.6)
        return real_exact(inst, x)

    def slow_stars(inst, x, prof, dl, clock, rounds=10):
        x[:] = 1
        offered.append(np.array(x, dtype=np.int64))  # the plan the phase was changing (in place)
        _spin(dl - clock() + 30.0)
        return 1

    offered = []
    real_keep = deadline.Incumbent.keep

    def keep(self, x, plan_cost, method=None):
        offered.append(np.array(x, dtype=np.int64))
        return real_keep(self, x, plan_cost, method)

    monkeypatch.setattr(solve_module, "_exact_cost", slow_exact)
    monkeypatch.setattr(solve_module, "star_rounds", slow_stars)
    monkeypatch.setattr(deadline.Incumbent, "keep", keep)
    monkeypatch.setattr(cli, "process_age", lambda: 0.0, raising=False)  # pytest's own start is not this command's
    limit = 12.0  # the reserve grows with the load (up to ~8 s at 3x slowdown): the star phase must still start
    t = time.perf_counter()
    assert verify_main(["solve", "--iopddl", str(path), "--time-limit", str(limit), "--json"]) == 0
    took = time.perf_counter() - t
    out = json.loads(capsys.readouterr().out)
    assert out["stats"].get("overrun") and any((x == 1).all() for x in offered), "the alarm did not stop the star phase"
    assert took <= limit + END_SLACK, f"returned {took - limit:.2f}s past its {limit}s"
    feasible = []  # every plan offered to the incumbent, and the live one, that the evaluator accepts
    for x in offered:
        try:
            feasible.append(evaluate(problem, x.tolist()))
        except Rejected:
            pass
    assert check(problem, out["solution"], out["cost"]) == out["cost"] == min(feasible)
    assert out["cost"] == (best if best is not None else 15 * copies)


def test_the_closing_reserve_grows_with_the_measured_work_and_slowdown():
    """deadline.Closing: floor + safety x (wall per CPU second) x closing CPU x (1 + the caller's share)."""
    c = deadline.Closing(after=1.0, floor=0.25)
    assert c.seconds() == 0.25 and c.slowdown() == 1.0
    c.cpu = 0.1
    c.busy(wall=2.0, cpu=1.0)  # half the CPU: twice the wall time
    assert c.slowdown() == 2.0
    assert c.seconds() == pytest.approx(0.25 + deadline.CLOSING_SAFETY * 2.0 * 0.1 * 2.0)
    c.busy(wall=0.0, cpu=3.0)  # a stretch faster than the wall clock cannot make it below 1
    assert c.slowdown() == 1.0
    c.measure(lambda: _spin(0.2))
    assert c.cpu >= 0.1


@pytest.mark.parametrize("age,left", [(30.0, 90.0), (100.0, 60.0)])
def test_the_command_counts_the_processs_start_in_its_time_limit(monkeypatch, capsys, age, left):
    """The time limit is wall time from the process's start: the interpreter and the package's
    imports (23 s for D at load 4-6: the command said 118.2 s, the shell saw 141.4 s) come off
    what the solve gets, down to half the limit (a limit the imports spent cannot be met)."""
    assert 0.0 < cli.process_age() < time.monotonic() + 1.0  # this process has run a while, not since boot
    seen = {}

    def fake_run(path, time_limit, say):
        seen["limit"] = time_limit
        return {"optimal": True, "cost": 1, "bound": 1.0}

    monkeypatch.setattr(cli, "process_age", lambda: age)
    monkeypatch.setattr(cli, "run", fake_run)
    assert verify_main(["solve", "--iopddl", EXAMPLE, "--time-limit", "120"]) == 0
    assert seen["limit"] == left
    assert f"{age:.1f}s since the process started" in capsys.readouterr().err
