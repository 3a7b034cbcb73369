"""IOPDDL instance reading (autoparallel/planner/iopddl/instance.py): the flat-array ``from_dict``
against a node-by-node reading of the same JSON, parallel and reversed edges merged, forbidden
costs as ``inf``, and each malformed input refused with its message."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from autoparallel.planner.iopddl import from_dict
from autoparallel.planner.iopddl.instance import INFINITE


def _problem(rng: random.Random, n: int) -> dict:
    """Random nodes (1-3 strategies, some forbidden) and edges, some parallel or reversed."""
    sizes = [rng.randint(1, 3) for _ in range(n)]

    def value():
        return INFINITE if rng.random() < 0.1 else rng.randint(0, 99)

    edges = [list(rng.sample(range(n), 2)) for _ in range(2 * n)]
    return {"problem": {"name": "r", "usage_limit": 50,
                        "nodes": {"intervals": [[s, s + rng.randint(0, 4)] for s in (rng.randint(0, 6) for _ in range(n))],
                                  "costs": [[value() for _ in range(s)] for s in sizes],
                                  "usages": [[rng.randint(1, 9) for _ in range(s)] for s in sizes]},
                        "edges": {"nodes": edges, "costs": [[value() for _ in range(sizes[u] * sizes[v])] for u, v in edges]}}}


def _reference(problem: dict) -> dict:
    """Each node's costs and usages and each unordered pair's summed table, read one list at a
    time (oriented from the lower node)."""
    p = problem["problem"]

    def floats(a):
        return np.where(np.asarray(a, dtype=np.float64) >= INFINITE, np.inf, np.asarray(a, dtype=np.float64))

    costs = [floats(c) for c in p["nodes"]["costs"]]
    tables: dict = {}
    for (u, v), t in zip(p["edges"]["nodes"], p["edges"]["costs"]):
        m = floats(t).reshape(len(costs[u]), len(costs[v]))
        key, m = ((u, v), m) if u < v else ((v, u), m.T)
        tables[key] = tables[key] + m if key in tables else m
    return {"costs": costs, "usages": [np.asarray(u) for u in p["nodes"]["usages"]], "tables": tables}


@pytest.mark.parametrize("seed", range(5))
def test_from_dict_matches_a_node_by_node_reading(seed):
    problem = _problem(random.Random(seed), random.Random(seed).randint(2, 9))
    inst, ref = from_dict(copy.deepcopy(problem)), _reference(problem)
    assert inst.n == len(ref["costs"]) and inst.limit == 50
    for i in range(inst.n):
        assert np.array_equal(inst.cost[i], ref["costs"][i]) and inst.usage[i].tolist() == ref["usages"][i].tolist()
    got = {}
    for u, v, m in zip(inst.edge_u.tolist(), inst.edge_v.tolist(), inst.edge_cost):
        key, m = ((u, v), m) if u < v else ((v, u), m.T)
        assert key not in got  # parallel and reversed edges are merged into one
        got[key] = m
    assert got.keys() == ref["tables"].keys()
    for key, m in got.items():
        assert np.array_equal(m, ref["tables"][key])
    intervals = problem["problem"]["nodes"]["intervals"]
    assert inst.starts.tolist() == [a for a, _ in intervals] and inst.ends.tolist() == [b for _, b in intervals]
    assert inst.horizon == max(b for _, b in intervals)
    assert sorted(e for es in inst.incident for e, _ in es) == sorted(2 * list(range(len(inst.edge_u))))


def test_a_reversed_parallel_edge_is_transposed_before_summing():
    p = {"problem": {"nodes": {"intervals": [[0, 1], [0, 1]], "costs": [[0, 0], [0, 0, 0]], "usages": [[1, 1], [1, 1, 1]]},
                     "edges": {"nodes": [[0, 1], [1, 0]], "costs": [[1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60]]}}}
    inst = from_dict(p)
    assert inst.edge_u.tolist() == [0] and inst.edge_v.tolist() == [1]
    assert inst.edge_cost[0].tolist() == [[11, 32, 53], [24, 45, 66]]
    assert inst.limit is None


def _tiny() -> dict:
    return {"problem": {"nodes": {"intervals": [[0, 1], [0, 1]], "costs": [[0, 1], [2]], "usages": [[1, 1], [1]]},
                        "edges": {"nodes": [[0, 1]], "costs": [[5, 6]]}, "usage_limit": 3}}


@pytest.mark.parametrize("edit, match", [
    (lambda p: p["problem"].pop("nodes"), "missing 'nodes'"),
    (lambda p: p["problem"]["nodes"]["usages"].pop(), "different lengths"),
    (lambda p: p["problem"]["edges"]["costs"].append([1]), "different lengths"),
    (lambda p: p["problem"]["nodes"]["usages"].__setitem__(1, [1, 2]), "node 1: 1 costs, 2 usages"),
    (lambda p: p["problem"]["nodes"]["costs"].__setitem__(1, []), "node 1: 0 costs"),
    (lambda p: p["problem"]["edges"]["nodes"].__setitem__(0, [0, 1, 1]), "edge 0: only edges between two nodes"),
    (lambda p: p["problem"]["edges"]["nodes"].__setitem__(0, [0, 2]), r"edge 0: bad nodes \[0, 2\]"),
    (lambda p: p["problem"]["edges"]["nodes"].__setitem__(0, [-1, 0]), "edge 0: bad nodes"),
    (lambda p: p["problem"]["edges"]["nodes"].__setitem__(0, [1, 1]), "edge 0: bad nodes"),
    (lambda p: p["problem"]["edges"]["costs"].__setitem__(0, [5]), "edge 0: 1 costs for 2x1 strategy pairs"),
])
def test_from_dict_refuses_malformed_instances(edit, match):
    assert from_dict(_tiny()).edge_cost[0].tolist() == [[5], [6]]  # the unedited instance reads
    p = _tiny()
    edit(p)
    with pytest.raises(ValueError, match=match):
        from_dict(p)
