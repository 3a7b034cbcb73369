"""The exact reductions (autoparallel/planner/iopddl/reduce.py) against brute force on tiny instances."""

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel.planner.iopddl.instance import forbid_unsupported, from_dict, load
from autoparallel.planner.iopddl.reduce import reduce
from autoparallel.planner.iopddl.search import cost, profile
from autoparallel.planner.iopddl.solve import solve


def make(intervals, costs, usages, edges, limit):
    """An instance from plain lists; ``edges`` is [((u, v), flat cost table)]."""
    return from_dict({"problem": {"name": "t", "usage_limit": limit, "nodes": {
        "intervals": intervals, "costs": costs, "usages": usages},
        "edges": {"nodes": [list(p) for p, _ in edges], "costs": [list(t) for _, t in edges]}}})


def brute(inst):
    """The optimum cost and one optimal plan, over every plan (inf, None when none fits)."""
    best, arg = np.inf, None
    for x in itertools.product(*[range(len(c)) for c in inst.cost]):
        x = np.array(x)
        if inst.limit is not None and inst.horizon and (profile(inst, x) > inst.limit).any():
            continue
        c = cost(inst, x)
        if c < best:
            best, arg = c, x
    return best, arg


def assert_exact(inst):
    red = reduce(inst)
    want, _ = brute(inst)
    got, plan = brute(red.inst)
    assert got == want
    if plan is not None:
        lifted = red.lift(plan)
        assert cost(inst, lifted) == got
        assert not (profile(inst, lifted) > inst.limit).any()
    return red


def test_dominated_strategy_removed_and_optimum_kept():
    # node 0: strategy 1 costs and uses more than 0, and its edge row is no better: it goes.
    inst = make([[0, 2], [1, 3]], [[1, 5], [2, 3]], [[1, 2], [1, 1]],
                [((0, 1), [0, 1, 0, 1])], 10)
    red = assert_exact(inst)
    assert red.removed >= 1
    assert list(red.keep[0]) == [0]


def test_cheaper_but_heavier_strategy_is_not_dominated():
    # strategy 1 of node 0 is cheaper but uses more memory: neither dominates the other.
    inst = make([[0, 2], [1, 3]], [[5, 1], [0, 0, 0]], [[1, 3], [1, 2, 4]],
                [((0, 1), [0] * 6)], 4)
    red = reduce(inst)
    assert list(red.keep[0]) == [0, 1]
    assert_exact(inst)


def test_edge_row_blocks_domination():
    # node 0's strategy 1 is cheaper at the same usage, but its edge rows are worse for one
    # partner strategy: it stays, and so does strategy 0. Nodes 1 and 2 are leaves whose cheap
    # response is their heavy strategy, so they do not fold.
    inst = make([[0, 2], [0, 2], [0, 2]], [[5, 1], [0, 0], [0, 0]], [[1, 1], [3, 1], [3, 1]],
                [((0, 1), [0, 0, 0, 9]), ((0, 2), [0, 0, 0, 9])], 5)
    red = reduce(inst)
    assert [list(k) for k in red.keep] == [[0, 1], [0, 1], [0, 1]]
    assert red.folded == []
    assert_exact(inst)


def test_leaf_folds_when_its_best_response_is_lean():
    # a path 0-1-2 of nodes whose strategies use equal memory: node 0 folds into node 1, which
    # then is a leaf of node 2 and folds into it; no edge is left.
    inst = make([[0, 2], [0, 2], [1, 3]], [[1, 2], [3, 1], [4, 0]], [[1, 1], [1, 1], [2, 2]],
                [((0, 1), [0, 5, 5, 0]), ((1, 2), [0, 7, 7, 0])], 10)
    red = assert_exact(inst)
    assert [(leaf, j) for leaf, j, _ in red.folded] == [(0, 1), (1, 2)]
    assert len(red.inst.edge_u) == 0


def test_leaf_whose_cheap_response_is_heavy_is_not_folded():
    # the leaf's cheap strategy needs memory the limit cannot give at node 0's heavy strategy;
    # folding at the cheap response would lose the optimum, so the leaf stays.
    inst = make([[0, 1], [0, 1]], [[0, 1], [0, 10]], [[5, 1], [5, 1]],
                [((0, 1), [0, 0, 0, 0])], 6)
    red = reduce(inst)
    assert red.folded == []
    assert_exact(inst)


def test_leaf_at_free_steps_folds_even_when_heavy():
    # the same star with a limit that holds every node at its largest usage: the leaf folds at
    # its cheap (heavy) response and keeps its largest usage.
    inst = make([[0, 1], [0, 1]], [[0, 1], [0, 10]], [[5, 1], [5, 1]], [((0, 1), [0, 0, 0, 0])], 10)
    red = assert_exact(inst)
    assert len(red.folded) == 1
    leaf = red.folded[0][0]
    assert list(red.inst.usage[leaf]) == [5]


def test_lift_rejects_bad_plans():
    inst = make([[0, 1], [0, 1]], [[0, 1], [0, 10]], [[5, 1], [5, 1]], [((0, 1), [0, 0, 0, 0])], 6)
    red = reduce(inst)
    with pytest.raises(ValueError, match="nodes expected"):
        red.lift([0])
    with pytest.raises(ValueError, match="out of range"):
        red.lift([0, 7])


def test_committed_instance_b_shrinks():
    inst = load(str(Path(__file__).parents[3] / "data/iopddl/asplos-2025-iopddl-B.json.gz"))
    forbid_unsupported(inst)
    red = reduce(inst)
    assert red.inst.sizes().sum() < inst.sizes().sum()
    x = np.array([0 if np.isfinite(c[0]) else int(np.argmax(np.isfinite(c))) for c in red.inst.cost])
    assert red.lift(x).shape == (inst.n,)


def test_solve_through_the_reduction_lifts_an_optimal_plan():
    # a path 0-1-2 whose leaves fold; the solve on the reduced instance must come back as a plan
    # of the original with the brute-force optimum.
    inst = make([[0, 2], [0, 2], [1, 3]], [[1, 2], [3, 1], [4, 0]], [[1, 1], [1, 1], [2, 2]],
                [((0, 1), [0, 5, 5, 0]), ((1, 2), [0, 7, 7, 0])], 10)
    want, _ = brute(inst)
    r = solve(inst, time_limit=30, reduce_first=True)
    assert r.stats["folded"] == 2
    assert len(r.solution) == inst.n
    assert r.cost == want == cost(inst, np.array(r.solution))


@st.composite
def tiny(draw):
    n = draw(st.integers(2, 5))
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    intervals = []
    for _ in range(n):
        a = draw(st.integers(0, 3))
        intervals.append([a, a + draw(st.integers(0, 2))])
    small = st.integers(0, 6)
    costs = [[draw(small) for _ in range(m)] for m in k]
    usages = [[draw(st.integers(0, 4)) for _ in range(m)] for m in k]
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] != p[1]),
                          max_size=n + 1, unique=True))
    edges = [(p, [draw(small) for _ in range(k[p[0]] * k[p[1]])]) for p in pairs]
    limit = draw(st.integers(0, 12))
    return make(intervals, costs, usages, edges, limit)


@settings(max_examples=150, deadline=None)
@given(tiny())
def test_reduction_keeps_the_optimum(inst):
    assert_exact(inst)
