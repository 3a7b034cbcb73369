"""The ILP against brute force on generated problems, and the solver's bad-input behaviour.

Problems are generated directly (no graph): a few classes of 2-4 choices, random compute costs,
edge tables with impossible (infinite) pairs, placement maps that merge choices on an edge,
identical-block counts, equalities, a memory row and pins. Brute force enumerates every
assignment with its own objective and constraint code; the ILP's optimum must match it for
both solve methods.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel.planner import ilp
from autoparallel.planner.blocks import NotPeriodic, expand_graph
from autoparallel.planner.ilp import InfeasiblePlanError, SolverTimeout, solve
from autoparallel.planner.incumbent import columns, incumbent, violated
from autoparallel.planner.problem import (
    OP,
    EdgeClass,
    Graph,
    PNode,
    Problem,
    build_problem,
    cluster,
)
from autoparallel.planner.reduce import reduce_problem
from autoparallel.planner.strategies import Candidate

# Costs are multiples of 0.25 so that distinct plans differ by far more than the tie-breaker.
COST = st.integers(0, 40).map(lambda v: v / 4)


@st.composite
def problems(draw, *, max_classes: int = 5, memory: bool = True, equal: bool = True, pins: bool = True):
    n = draw(st.integers(2, max_classes))
    choices = [draw(st.integers(2, 4)) for _ in range(n)]
    counts = [draw(st.integers(1, 3)) for _ in range(n)]
    compute = [np.array([draw(COST) for _ in range(j)]) for j in choices]
    edges = []
    for c in range(1, n):
        producers = draw(st.lists(st.integers(0, c - 1), min_size=1, max_size=min(2, c), unique=True))
        for arg, p in enumerate(producers):
            u = draw(st.integers(1, choices[c]))
            v = draw(st.integers(1, choices[p]))
            cons_map = np.array([draw(st.integers(0, u - 1)) for _ in range(choices[c])])
            prod_map = np.array([draw(st.integers(0, v - 1)) for _ in range(choices[p])])
            cost = np.array([[math.inf if draw(st.integers(0, 5)) == 0 else draw(COST) for _ in range(v)] for _ in range(u)])
            edges.append(EdgeClass(c, p, arg, cons_map, prod_map, cost, draw(st.integers(1, 3)), f"e{c}<-{p}"))
    eq = []
    if equal and draw(st.booleans()):
        pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if choices[a] == choices[b]]
        if pairs:
            a, b = draw(st.sampled_from(pairs))
            eq.append((a, b, "fwd_bwd"))
    mem, budget = [], None
    if memory and draw(st.booleans()):
        classes = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        mem = [(c, np.array([float(draw(st.integers(1, 8))) for _ in range(choices[c])])) for c in sorted(classes)]
        lo = sum(counts[c] * per.min() for c, per in mem)
        hi = sum(counts[c] * per.max() for c, per in mem)
        budget = float(draw(st.integers(int(lo), int(hi))))
    allowed = {}
    if pins and draw(st.booleans()):
        c = draw(st.integers(0, n - 1))
        mask = np.array([draw(st.booleans()) for _ in range(choices[c])])
        if mask.any():
            allowed[c] = mask
    tie = [1e-3 * np.arange(j) / max(j - 1, 1) for j in choices]
    return Problem([f"c{i}" for i in range(n)], compute, np.array(counts), edges, eq, mem, budget, allowed, tie)


def brute_force(p: Problem):
    """(best objective, best memory) over every feasible assignment, or (None, None)."""
    best = None
    for choice in itertools.product(*[range(len(c)) for c in p.compute]):
        if any(not p.allowed[c][choice[c]] for c in p.allowed):
            continue
        if any(choice[a] != choice[b] for a, b, _ in p.equal):
            continue
        mem = sum(p.count[c] * per[choice[c]] for c, per in p.memory)
        if p.budget is not None and mem > p.budget + 1e-9:
            continue
        total = sum(p.count[c] * p.compute[c][choice[c]] for c in range(len(choice)))
        for e in p.edges:
            total += e.count * e.cost[e.cons_map[choice[e.cons]], e.prod_map[choice[e.prod]]]
        if math.isfinite(total) and (best is None or total < best):
            best = total
    return best


SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(SETTINGS, max_examples=30)


@SETTINGS
@given(problems())
def test_ilp_optimum_equals_brute_force(p):
    want = brute_force(p)
    for method in ("lp_first", "direct"):
        if want is None:
            with pytest.raises(InfeasiblePlanError):
                solve(p, method=method)
            continue
        sol = solve(p, method=method)
        assert sol.stats.proven_optimal
        assert sol.objective_us == pytest.approx(want, abs=1e-6), method
        assert ilp.objective(p, sol.choice) == pytest.approx(sol.objective_us)
        # the LP bound is a bound
        assert sol.stats.lp_bound_us <= sol.objective_us + 1e-6


@FEWER
@given(problems(memory=False, equal=False, pins=False))
def test_reductions_keep_every_assignments_cost(p):
    """Leaf/series elimination: the reduced problem's optimum, expanded, is the original optimum,
    and the expansion of any kept assignment costs what the reduced problem says."""
    alive = ilp.prune(p).alive
    if any(not a.any() for a in alive):
        return
    red = reduce_problem(p, alive)
    small = red.problem
    for choice in itertools.islice(itertools.product(*[range(len(c)) for c in small.compute]), 50):
        full = red.expand(np.array(choice), p)
        reduced_cost = sum(small.count[c] * small.compute[c][choice[c]] for c in range(len(choice))) + sum(
            e.count * e.cost[e.cons_map[choice[e.cons]], e.prod_map[choice[e.prod]]] for e in small.edges
        )
        tie = sum(p.count[c] * p.tie[c][full[c]] for c in range(p.num_classes))
        assert ilp.objective(p, full) + tie == pytest.approx(reduced_cost, abs=1e-6) or not math.isfinite(reduced_cost)


@FEWER
@given(problems(), st.integers(1, 6))
def test_a_looser_memory_budget_never_raises_the_objective(p, extra):
    if p.budget is None or brute_force(p) is None:
        return
    tight = solve(p).objective_us
    loose = solve(replace(p, budget=p.budget + extra)).objective_us
    assert loose <= tight + 1e-9
    assert solve(replace(p, budget=None)).objective_us <= loose + 1e-9


def _chain(n: int = 4, choices: int = 3) -> Problem:
    """c0 -> c1 -> ... ; memory on c0 (bytes 4, 2, 1 by choice); all edges free on the diagonal."""
    compute = [np.array([0.0, 1.0, 2.0])[:choices] for _ in range(n)]
    edges = []
    for c in range(1, n):
        cost = np.full((choices, choices), 5.0)
        np.fill_diagonal(cost, 0.0)
        edges.append(EdgeClass(c, c - 1, 0, np.arange(choices), np.arange(choices), cost, 1, f"{c}"))
    mem = [(0, np.array([4.0, 2.0, 1.0])[:choices])]
    return Problem([f"c{i}" for i in range(n)], compute, np.ones(n, dtype=np.int64), edges, [], mem, 4.0, {}, None)


def test_infeasible_budget_names_the_group_and_the_smallest_budget():
    p = replace(_chain(), budget=0.5)
    with pytest.raises(InfeasiblePlanError) as e:
        solve(p)
    assert e.value.group == "param_memory"
    assert e.value.smallest_budget == pytest.approx(1.0)
    assert "param_memory" in str(e.value) and "raise the budget" in str(e.value)


def test_pins_that_no_plan_meets_are_named():
    p = _chain()
    cost = np.full((3, 3), math.inf)
    np.fill_diagonal(cost, 0.0)
    p.edges[0] = replace(p.edges[0], cost=cost)  # c1 must equal c0
    p = replace(p, allowed={0: np.array([True, False, False]), 1: np.array([False, True, False])})
    with pytest.raises(InfeasiblePlanError) as e:
        solve(p)
    assert e.value.group == "pins"
    assert "c0" in str(e.value) and "c1" in str(e.value)


def test_a_choice_without_any_finite_edge_is_pruned_before_variables_exist():
    p = _chain()
    cost = np.array([[0.0, math.inf, math.inf], [math.inf, 0.0, math.inf], [math.inf, math.inf, math.inf]])
    p.edges[0] = replace(p.edges[0], cost=cost)
    pruned = ilp.prune(p)
    assert not pruned.alive[0][2] and not pruned.alive[1][2]
    f = ilp.formulate(p, pruned.alive)
    assert f.a.shape[1] < ilp.formulate_size(p)[0]


def _big(seed: int = 0, n: int = 300) -> Problem:
    rng = np.random.default_rng(seed)
    compute = [rng.integers(0, 50, 6).astype(float) for _ in range(n)]
    edges = []
    for c in range(1, n):
        for arg, prod in enumerate(sorted({int(rng.integers(0, c)), c - 1})):
            edges.append(EdgeClass(c, prod, arg, np.arange(6), np.arange(6), rng.integers(0, 50, (6, 6)).astype(float), 1, "e"))
    return Problem([f"c{i}" for i in range(n)], compute, np.ones(n, dtype=np.int64), edges, [], [], None, {}, None)


def test_a_solver_time_out_with_no_plan_says_so(monkeypatch):
    """No solver plan in time and no heuristic plan either: the named time-out, never a guess."""
    monkeypatch.setattr(ilp, "incumbent", lambda *a, **k: None)
    with pytest.raises(SolverTimeout, match="time limit"):
        solve(_big(), time_limit=1e-6)


def test_a_solver_time_out_returns_the_heuristic_plan_marked_not_proven():
    """A time limit too short for the LP and the MIP: the heuristic incumbent, checked, flagged."""
    p = _big()
    sol = solve(p, time_limit=1e-3)
    assert sol.stats.status == "time_limit" and not sol.stats.proven_optimal
    assert sol.stats.plan_source == "heuristic"
    assert math.isfinite(sol.objective_us) and ilp.objective(p, sol.choice) == pytest.approx(sol.objective_us)


def _feasible_choice(p: Problem, choice) -> bool:
    """The brute force's own constraint code, for one assignment."""
    if any(not p.allowed[c][choice[c]] for c in p.allowed) or any(choice[a] != choice[b] for a, b, _ in p.equal):
        return False
    if p.budget is not None and sum(p.count[c] * per[choice[c]] for c, per in p.memory) > p.budget + 1e-9:
        return False
    return math.isfinite(ilp.objective(p, choice))


@SETTINGS
@given(problems())
def test_the_heuristic_plan_is_feasible_and_no_better_than_the_optimum(p):
    """On the original problem and on its reduction: a heuristic plan meets every constraint (by
    the brute force's code, not the formulation's) and costs at least the brute-force optimum;
    a problem without a plan gets none."""
    want = brute_force(p)
    pruned = ilp.prune(p)
    if pruned.emptied is not None:
        assert want is None
        return
    red = reduce_problem(p, pruned.alive)
    small_alive = ilp.prune(red.problem).alive
    for prob, alive, expand in ((p, pruned.alive, lambda c: c), (red.problem, small_alive, lambda c: red.expand(c, p))):
        if any(not a.any() for a in alive):
            assert want is None
            continue
        f = ilp.formulate(prob, alive)
        got = incumbent(prob, f, alive)
        if got is None:
            continue
        assert want is not None, "a heuristic plan for a problem without one"
        assert not violated(f, got.x)
        choice = expand(got.choice)
        assert _feasible_choice(p, choice)
        assert ilp.objective(p, choice) >= want - 1e-6


def test_the_heuristic_finds_a_plan_for_most_generated_problems():
    """Feasible problems of the generator (a fixed sample): the heuristic finds a plan for most,
    and the optimum for many (its plans are not random)."""
    found = optimal = feasible = 0
    for p in _sample(problems(), 60):
        want = brute_force(p)
        if want is None:
            continue
        feasible += 1
        pruned = ilp.prune(p)
        f = ilp.formulate(p, pruned.alive)
        got = incumbent(p, f, pruned.alive)
        if got is not None:
            found += 1
            optimal += ilp.objective(p, got.choice) <= want + 1e-6
    assert feasible >= 20
    assert found >= 0.9 * feasible and optimal >= 0.5 * feasible, (found, optimal, feasible)


def _sample(strategy, n: int) -> list:
    out = []

    @settings(SETTINGS, max_examples=n, database=None)
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


def test_the_feasibility_check_names_every_broken_group():
    """The check the heuristic plan must pass, fed plans that break a constraint."""
    p = _chain()  # memory on c0: 4, 2, 1 bytes by choice; budget 4
    alive = ilp.prune(p).alive
    f = ilp.formulate(p, alive)
    assert violated(f, columns(f, np.zeros(4, dtype=np.int64))) == []
    tight = ilp.formulate(replace(p, budget=1.0), alive)
    assert violated(tight, columns(tight, np.zeros(4, dtype=np.int64))) == ["param_memory"]  # 4 bytes > 1
    x = columns(f, np.zeros(4, dtype=np.int64))
    x[f.s_cols[3][1]] = 1.0  # c3 takes two choices
    assert "one_choice" in violated(f, x)
    locked = replace(p, edges=[replace(p.edges[0], cost=np.where(np.eye(3) > 0, 0.0, math.inf))] + p.edges[1:])
    fl = ilp.formulate(locked, ilp.prune(locked).alive)
    assert set(violated(fl, columns(fl, np.array([0, 1, 1, 1])))) == {"consistent_output", "flow"}  # c1 != c0 has no edge pair


def test_an_infeasible_problem_never_gets_a_heuristic_plan():
    """No plan meets the budget: the named infeasibility, whatever the time limit; never a plan."""
    p = replace(_chain(), budget=0.5)
    alive = ilp.prune(p).alive
    assert incumbent(p, ilp.formulate(p, alive), alive) is None
    with pytest.raises(InfeasiblePlanError) as e:
        solve(p)
    assert e.value.group == "param_memory"
    with pytest.raises(ilp.PlannerError):
        solve(p, time_limit=1e-3)


def test_a_solver_time_out_returns_the_best_plan_marked_not_proven(monkeypatch):
    """HiGHS stopping at its limit with an incumbent: the plan is kept and flagged."""
    real = ilp._mip

    def stop_early(f, lb, ub, time_limit):
        res = real(f, lb, ub, time_limit)
        res.status = 1  # as if the time limit had hit before the proof
        return res

    monkeypatch.setattr(ilp, "_mip", stop_early)
    p = _big(n=40)
    sol = solve(p, method="direct")
    assert sol.stats.status == "time_limit" and not sol.stats.proven_optimal
    assert math.isfinite(sol.objective_us)


def _neg(nodes: list, block: int | None, i: int, inputs: tuple[int, ...]) -> int:
    """Append a neg PNode (the i-th of its block, or outside the blocks) to ``nodes``; its index."""
    label = None if block is None else f"layers.{block}"
    key = f"{label or 'outside'}/fwd/aten.neg.default#{i}"
    nodes.append(PNode(index=len(nodes), name=f"neg_{block}_{i}", key=key, kind=OP, op="aten.neg.default", role=None,
                       block=label, phase="fwd", metas=(None,), inputs=inputs, candidates=[], compute_us=np.zeros(0)))
    return len(nodes) - 1


def _chain_blocks(reads: dict[int, int]) -> Graph:
    """Two blocks of three negs each; in block b, neg#2 reads neg#reads[b] (neg#1 reads neg#0)."""
    nodes: list[PNode] = []
    for b in (0, 1):
        first = _neg(nodes, b, 0, ())
        _neg(nodes, b, 1, (first,))
        _neg(nodes, b, 2, (first + reads[b],))
    return Graph(nodes, [], ("dp",), (2,))


def test_clustering_merges_corresponding_block_nodes_only_where_the_same_producers_feed_them():
    same = cluster(_chain_blocks({0: 0, 1: 0})).class_of
    assert same[:3] == same[3:] and len(set(same)) == 3
    other = cluster(_chain_blocks({0: 0, 1: 1})).class_of  # block 1's neg#2 reads neg#1, block 0's neg#0
    assert other[:2] == other[3:5] and other[2] != other[5]
    assert cluster(_chain_blocks({0: 0, 1: 0}), enabled=False).class_of == list(range(6))


def test_expanding_blocks_that_read_two_blocks_back_is_refused_naming_the_read():
    """Four traced blocks of one neg each; from block 2 on, each reads the block two before."""
    nodes: list[PNode] = []
    outside = _neg(nodes, None, 0, ())
    for b in range(4):
        _neg(nodes, b, 0, (outside,) if b < 2 else (outside + 1 + b - 2,))
    with pytest.raises(NotPeriodic, match=r"^layers\.2/fwd/aten\.neg\.default#0 reads layers\.0/fwd/aten\.neg\.default#0, 2 blocks away$"):
        expand_graph(Graph(nodes, [], ("dp",), (2,)), "layers", 4, 6)


def test_no_time_limit_solves_to_the_same_optimum():
    bounded, unbounded = solve(_chain()), solve(_chain(), time_limit=None)
    assert unbounded.stats.proven_optimal and unbounded.objective_us == bounded.objective_us
    assert list(unbounded.choice) == list(bounded.choice)


def test_a_dtype_locked_edge_that_empties_a_class_is_named_as_the_lock():
    """A cast whose input is locked to its producer's placement (mixed precision, see
    problem._lock_grad_reduce_dtype) and that can only shard, after a producer that can only
    replicate: no plan, and the error names the lock, not the flow."""
    r, s0 = (Replicate(),), (Shard(0),)
    nodes = [
        PNode(index=0, name="p", key="p", kind=OP, op="aten.neg.default", role=None, block=None, phase="fwd", metas=(None,),
              inputs=(), candidates=[Candidate((r,), ())], compute_us=np.zeros(1)),
        PNode(index=1, name="cast", key="cast", kind=OP, op="prims.convert_element_type.default", role=None, block=None,
              phase="fwd", metas=(None,), inputs=(0,), candidates=[Candidate((s0,), (s0,))], compute_us=np.zeros(1),
              locked_inputs=frozenset({0})),
    ]
    graph = Graph(nodes, [], ("dp",), (2,))
    problem = build_problem(graph, None, cluster(graph), budget=None)
    assert [e.locked for e in problem.edges] == [True]
    with pytest.raises(InfeasiblePlanError) as e:
        solve(problem)
    assert e.value.group == "grad_reduce_dtype"
