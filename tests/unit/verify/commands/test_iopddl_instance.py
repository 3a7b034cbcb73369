"""IOPDDL instance reading (autoparallel/planner/iopddl/instance.py): the flat-array ``from_dict``
against a node-by-node reading of the same JSON, parallel and reversed edges merged, forbidden
costs as ``inf``, and each malformed input refused with its message; the numpy reader (``load``)
and the vectorised arc consistency, least-usage start and trivial bound against the
one-list-at-a-time code they replaced, on B, G and generated instances, and every input the
reader must leave to ``json``."""

from __future__ import annotations

import copy
import gzip
import json
import os
import random

import numpy as np
import pytest

from autoparallel.planner.iopddl import from_dict, load
from autoparallel.planner.iopddl.solve import _trivial_bound
from autoparallel.planner.iopddl.instance import INFINITE, Instance, forbid_unsupported, integer_lists, read_fast
from autoparallel.planner.iopddl.search import least_usage


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


# --- the numpy reader (load) and the vectorised arc consistency, least-usage start and bound,
# against the one-list-at-a-time versions they replaced (HEAD 85a5114's code, kept here as the reference) ---

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "iopddl")


def _old_build(problem: dict) -> Instance:
    """The instance as the old ``from_dict`` built it: each list converted alone, parallel edges
    merged through a dict keyed by the first orientation, incident lists edge by edge."""
    p = problem["problem"]

    def floats(a):
        a = np.asarray(a, dtype=np.float64)
        a[a >= INFINITE] = np.inf
        return a

    cost = [floats(c) for c in p["nodes"]["costs"]]
    usage = [np.asarray(u, dtype=np.int64) for u in p["nodes"]["usages"]]
    merged: dict = {}
    for (u, v), t in zip(p["edges"]["nodes"], p["edges"]["costs"]):
        m = floats(t).reshape(len(cost[u]), len(cost[v]))
        if (v, u) in merged:
            u, v, m = v, u, m.T
        merged[(u, v)] = merged[(u, v)] + m if (u, v) in merged else m
    iv = np.asarray(p["nodes"]["intervals"], dtype=np.int64).reshape(len(cost), 2)
    eu = np.array([k[0] for k in merged], dtype=np.int64)
    ev = np.array([k[1] for k in merged], dtype=np.int64)
    limit = p.get("usage_limit")
    inst = Instance(str(p.get("name", "")), iv[:, 0].copy(), iv[:, 1].copy(), cost, usage, eu, ev, list(merged.values()),
                    None if limit is None else int(limit))
    inst.horizon = int(max(iv[:, 1].max(initial=0), 0))
    inst.incident = [[] for _ in range(len(cost))]
    for e, (u, v) in enumerate(merged):
        inst.incident[u].append((e, True))
        inst.incident[v].append((e, False))
    return inst


def _old_forbid(inst: Instance) -> int:
    """The old arc consistency: one edge at a time, again at every edge of a node that lost a strategy."""
    allowed = [np.isfinite(c) for c in inst.cost]
    finite = [np.isfinite(m) for m in inst.edge_cost]
    removed, dirty = 0, set(range(inst.n))
    while dirty:
        edges = sorted({e for i in dirty for e, _ in inst.incident[i]})
        dirty = set()
        for e in edges:
            a, b = int(inst.edge_u[e]), int(inst.edge_v[e])
            sa = allowed[a] & finite[e][:, allowed[b]].any(axis=1)
            sb = allowed[b] & finite[e][allowed[a], :].any(axis=0)
            for node, new in ((a, sa), (b, sb)):
                if new.sum() < allowed[node].sum():
                    if not new.any():
                        raise ValueError(f"infeasible: node {node}")
                    removed += int(allowed[node].sum() - new.sum())
                    allowed[node] = new
                    dirty.add(node)
    for i in range(inst.n):
        inst.cost[i] = np.where(allowed[i], inst.cost[i], np.inf)
    return removed


def _old_least_usage(inst: Instance) -> list:
    return [int(np.lexsort((c, np.where(np.isfinite(c), u, np.iinfo(np.int64).max)))[0]) for c, u in zip(inst.cost, inst.usage)]


def _same(a: Instance, b: Instance) -> None:
    """Every field equal: values (inf included), dtypes, shapes, edge order and orientation, incident lists."""
    assert (a.name, a.limit, a.horizon, a.n) == (b.name, b.limit, b.horizon, b.n)
    for f in ("starts", "ends", "edge_u", "edge_v"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    for f in ("cost", "usage", "edge_cost"):
        xs, ys = getattr(a, f), getattr(b, f)
        assert len(xs) == len(ys), f
        for x, y in zip(xs, ys):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f
    assert a.incident == b.incident


def _write(tmp_path, problem: dict, name: str, zipped: bool) -> str:
    """The problem as the contest writes it: JSON without whitespace (gzipped or not)."""
    text = json.dumps(problem, separators=(",", ":")).encode()
    path = str(tmp_path / (name + (".json.gz" if zipped else ".json")))
    with (gzip.open if zipped else open)(path, "wb") as f:
        f.write(text)
    return path


def _generated(seed: int) -> dict:
    """Random nodes and edges (``_problem``: parallel and reversed edges, costs of 10**18), plus
    three copies of one edge (two reversed), costs just above 10**18 and a name and limit."""
    rng = random.Random(seed)
    problem = _problem(rng, rng.randint(3, 12))
    p = problem["problem"]
    (u, v), t = p["edges"]["nodes"][0], p["edges"]["costs"][0]
    cols = len(p["nodes"]["costs"][v])
    flipped = [t[r * cols + c] for c in range(cols) for r in range(len(t) // cols)]
    p["edges"]["nodes"] += [[v, u], [u, v], [v, u]]
    p["edges"]["costs"] += [flipped, [x + 1 for x in t], [INFINITE + 7] * len(t)]
    p["nodes"]["costs"][0][0] = 3 * INFINITE
    p["name"] = f"generated-{seed}"
    return problem


def _cases(tmp_path):
    yield "B", os.path.join(DATA, "asplos-2025-iopddl-B.json.gz")
    yield "G", os.path.join(DATA, "asplos-2025-iopddl-G.json.gz")
    for seed in range(6):
        yield f"generated-{seed}", _write(tmp_path, _generated(seed), f"g{seed}", zipped=seed % 2 == 0)


def test_the_numpy_reader_builds_what_the_old_builder_built(tmp_path):
    for name, path in _cases(tmp_path):
        with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
            text = f.read()
        assert read_fast(text) is not None, f"{name}: the numpy reader declined the file"
        new, old = load(path), _old_build(json.loads(text))
        _same(new, old)
        _same(from_dict(json.loads(text)), old)  # the json path (the reader's fallback) too


def test_arc_consistency_start_and_bound_match_the_one_at_a_time_versions(tmp_path):
    cases = list(_cases(tmp_path))
    for seed in range(30):  # many forbidden pairs: removals that propagate, some instances infeasible
        rng = random.Random(100 + seed)
        problem = _problem(rng, rng.randint(3, 10))
        for t in problem["problem"]["edges"]["costs"]:
            t[:] = [INFINITE if rng.random() < 0.4 else x for x in t]
        cases.append((f"dense-{seed}", _write(tmp_path, problem, f"d{seed}", zipped=False)))
    removed = infeasible = 0
    for name, path in cases:
        new, old = load(path), load(path)
        try:
            expected = _old_forbid(old)
        except ValueError:
            with pytest.raises(ValueError, match="infeasible: node"):
                forbid_unsupported(new)
            infeasible += 1
            continue
        assert forbid_unsupported(new) == expected, name
        _same(new, old)
        removed += expected
        if all(np.isfinite(c).any() for c in old.cost):
            assert least_usage(new).tolist() == _old_least_usage(old), name
        bound = sum(float(np.min(c)) for c in old.cost)
        assert _trivial_bound(new) == bound + sum(float(np.min(m)) for m in old.edge_cost), name
    assert removed > 0 and infeasible > 0  # both kinds of case were exercised


def test_the_comparison_sees_each_kind_of_difference():
    """Negative: ``_same`` (what the tests above rely on) fails on an instance changed in one place."""
    path = os.path.join(DATA, "asplos-2025-iopddl-G.json.gz")
    edits = [
        lambda i: i.edge_cost[3].__setitem__((0, 0), i.edge_cost[3][0, 0] + 1),
        lambda i: i.cost.__setitem__(5, np.where(np.arange(len(i.cost[5])) == 0, np.inf, i.cost[5])),
        lambda i: i.cost.__setitem__(5, i.cost[5].astype(np.float32)),
        lambda i: (i.edge_u.__setitem__(0, i.edge_v[0]), i.edge_v.__setitem__(0, i.edge_u[0])),
        lambda i: i.edge_cost.insert(0, i.edge_cost.pop(1)),
        lambda i: i.incident[0].reverse() if len(i.incident[0]) > 1 else i.incident[0].append((0, True)),
        lambda i: setattr(i, "limit", (i.limit or 0) + 1),
    ]
    base = load(path)
    _same(copy.deepcopy(base), base)
    for edit in edits:
        changed = copy.deepcopy(base)
        edit(changed)
        with pytest.raises(AssertionError):
            _same(changed, base)


@pytest.mark.parametrize("text", [
    b"[[1]]", b"[[1,2],[3]]", b"[[-1,0,-0],[10,200]]", b"[[1000000000000000000,9223372036854775806]]",
])
def test_integer_lists_reads_json_integers(text):
    values, lengths = integer_lists(np.frombuffer(text, dtype=np.uint8))
    want = json.loads(text)
    assert values.tolist() == [x for row in want for x in row] and lengths.tolist() == [len(r) for r in want]


@pytest.mark.parametrize("text", [
    b"[]", b"[[]]", b"[[1],[]]", b"[[1,,2]]", b"[[,1]]", b"[[1,]]", b"[[-]]", b"[[1-2]]", b"[[--1]]", b"[[01]]",
    b"[[1,00]]", b"[[-01]]", b"[[1 ,2]]", b"[ [1]]", b"[[1]\n]", b"[[1],2]", b"[1,[2]]", b"[[1][2]]", b"[[+1]]",
    b"[[1.5]]", b"[[1e5]]", b"[[9223372036854775807]]", b"[[99999999999999999999]]", b"[[-9223372036854775808]]",
    b"[[1],[2]", b"[[[1]]]", b"[[1],[[2]]]", b"[[1],-[2]]", b"[[1]-,[2]]", b"[[1]a]", b"[[1],[2],]",
])
def test_integer_lists_declines_what_it_cannot_read_exactly(text):
    """np.fromstring alone would read most of these (an empty or bare-minus number as 0, 01 as 1,
    an overflow clamped): each is refused, so the reader falls back to json."""
    assert integer_lists(np.frombuffer(text, dtype=np.uint8)) is None


@pytest.mark.parametrize("edit", [
    lambda s: s.replace('"costs":[[', '"costs":[ [', 1),  # whitespace inside an array
    lambda s: s.replace("],[", "], [", 1),
    lambda s: s.replace('"usage_limit":50', '"usage_limit":50,"extra":"@iopddl-array-0"'),  # the marker in the text
    lambda s: s.replace('"usages":[[', '"usages":[[10000000000000000000,', 1),  # beyond int64 (json: OverflowError)
    lambda s: s.replace('"costs":[[', '"costs":[[1.0,', 1),  # a float
    lambda s: s.replace('"edges":{"nodes":[[', '"edges":{"nodes":[["0",', 1),  # a string
])
def test_load_takes_the_json_path_for_files_the_reader_declines(tmp_path, edit):
    problem = _generated(1)
    text = edit(json.dumps(problem, separators=(",", ":")))
    path = str(tmp_path / "x.json")
    with open(path, "w") as f:
        f.write(text)
    assert read_fast(text.encode()) is None
    try:
        expected = from_dict(json.loads(text))
    except (ValueError, OverflowError, TypeError) as e:  # what the json path says, the load says
        with pytest.raises(type(e)):
            load(path)
        return
    _same(load(path), expected)


@pytest.mark.parametrize("text, error", [
    (b'{"problem":{"nodes":{"intervals":[[0,1]],"costs":[[01]],"usages":[[1]]},"edges":{"nodes":[],"costs":[]}}}', json.JSONDecodeError),
    (b'{"problem":{"nodes":{"intervals":[[0,1]],"costs":[[1,2]],"usages":[[1]]},"edges":{"nodes":[],"costs":[]}}}', ValueError),
    (b'{"problem":{"nodes":{"intervals":[[0,1]],"costs":[[1]],"usages":[[1]]},"edges":{"nodes":[[0,0]],"costs":[[1]]}}}', ValueError),
])
def test_a_malformed_file_gets_the_json_paths_error(tmp_path, text, error):
    path = str(tmp_path / "bad.json")
    with open(path, "wb") as f:
        f.write(text)
    assert read_fast(text) is None
    with pytest.raises(error):
        load(path)
