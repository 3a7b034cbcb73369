"""Reading an IOPDDL instance (plain or gzipped JSON) into arrays the solvers work on.

Costs of 10**18 and above mean "forbidden" in the contest's files: they become ``inf`` in the
float cost arrays, so a solver can never pick them while the exact integer costs stay available.
Edges between the same two nodes are merged (their cost tables summed) so each solver sees one.
"""

from __future__ import annotations

import gzip
import json
import re
import warnings
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

INFINITE = 10**18


@dataclass
class Instance:
    name: str
    starts: np.ndarray  # int64 [n]
    ends: np.ndarray  # int64 [n], exclusive
    cost: list  # float64 [n_strategies] per node, inf where forbidden
    usage: list  # int64 [n_strategies] per node
    edge_u: np.ndarray  # int64 [m]
    edge_v: np.ndarray  # int64 [m]
    edge_cost: list  # float64 [n_strategies(u), n_strategies(v)] per edge, inf where forbidden
    limit: int | None
    horizon: int = 0
    incident: list = field(default_factory=list)  # per node: [(edge index, node is edge's u)]

    @property
    def n(self) -> int:
        return len(self.cost)

    def sizes(self) -> np.ndarray:
        return np.array([len(c) for c in self.cost], dtype=np.int64)


def incident_lists(n: int, edge_u, edge_v) -> list:
    """Per node: [(edge index, node is the edge's u)] (``Instance.incident``), in edge order:
    one stable sort of the edges' ends by node, cut into lists."""
    ends = np.stack([np.asarray(edge_u, dtype=np.int64), np.asarray(edge_v, dtype=np.int64)], axis=1).ravel()
    order = np.argsort(ends, kind="stable")  # entry 2e is edge e's u, 2e + 1 its v
    entries = list(zip((order >> 1).tolist(), (order & 1 == 0).tolist()))
    cuts = np.cumsum(np.bincount(ends, minlength=n)).tolist()
    return [entries[a:b] for a, b in zip([0] + cuts[:-1], cuts)]


def arrays(inst: Instance) -> dict:
    """The instance's arrays the priced rounds read (priced_child.py), picklable: no incident lists."""
    return {"cost": inst.cost, "usage": inst.usage, "edge_u": inst.edge_u, "edge_v": inst.edge_v,
            "edge_cost": inst.edge_cost, "starts": inst.starts, "ends": inst.ends, "limit": inst.limit,
            "horizon": inst.horizon}


def _floats(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    a[a >= INFINITE] = np.inf
    return a


def _flat(lists, dtype, total: int) -> np.ndarray:
    """The concatenation of many short lists as one array: one conversion instead of one per
    list (a 40k-node instance's 110k lists took 4 CPU seconds one by one)."""
    return np.fromiter(chain.from_iterable(lists), dtype=dtype, count=total)


def _pieces(flat: np.ndarray, sizes) -> list:
    """``flat`` cut into consecutive views of the given sizes (slices: ``np.split`` took 1 CPU s
    on a 40k-node instance's 110k pieces)."""
    ends = np.cumsum(sizes).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]


def read_json(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _lengths(lists) -> np.ndarray:
    return np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))


def from_dict(data: dict) -> Instance:
    """Build an :class:`Instance` from the parsed JSON; raise ValueError on a malformed one.
    Every list of numbers is converted in one flat array and cut into views."""
    try:
        p = data["problem"]
        nodes, edges = p["nodes"], p["edges"]
        intervals, costs, usages = nodes["intervals"], nodes["costs"], nodes["usages"]
        pairs, tables = edges["nodes"], edges["costs"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"not an IOPDDL instance: missing {e}") from None
    n = len(costs)
    if not (len(intervals) == len(usages) == n) or len(pairs) != len(tables):
        raise ValueError("not an IOPDDL instance: node or edge lists of different lengths")
    iv = np.asarray(intervals, dtype=np.int64).reshape(n, 2)
    sizes, usizes = _lengths(costs), _lengths(usages)
    bad = np.flatnonzero((sizes == 0) | (sizes != usizes))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"node {i}: {sizes[i]} costs, {usizes[i]} usages")
    cost = _floats(_flat(costs, np.float64, int(sizes.sum())))
    usage = _flat(usages, np.int64, int(sizes.sum()))
    bad = np.flatnonzero(_lengths(pairs) != 2)
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: only edges between two nodes are supported, got {pairs[k]}")
    uv = _flat(pairs, np.int64, 2 * len(pairs)).reshape(-1, 2)
    bad = _bad_edges(uv, n)
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: bad nodes {pairs[k]}")
    rows, cols = sizes[uv[:, 0]], sizes[uv[:, 1]]
    tsizes = _lengths(tables)
    bad = np.flatnonzero(tsizes != rows * cols)
    if len(bad):
        k = int(bad[0])
        raise ValueError(f"edge {k}: {tsizes[k]} costs for {rows[k]}x{cols[k]} strategy pairs")
    table = _floats(_flat(tables, np.float64, int(tsizes.sum())))
    return _build(p, iv, sizes, cost, usage, uv, table)


def _bad_edges(uv: np.ndarray, n: int) -> np.ndarray:
    return np.flatnonzero((uv < 0).any(axis=1) | (uv >= n).any(axis=1) | (uv[:, 0] == uv[:, 1]))


def _build(p: dict, iv: np.ndarray, sizes: np.ndarray, cost: np.ndarray, usage: np.ndarray, uv: np.ndarray,
           table: np.ndarray) -> Instance:
    """The instance from checked flat arrays (``p``: the problem object, for its name and limit):
    each node's costs and usages and each edge's table are views of them; parallel edges merged."""
    n = len(sizes)
    rows, cols = sizes[uv[:, 0]], sizes[uv[:, 1]]
    ends = np.cumsum(rows * cols).tolist()
    tables = [table[a:b].reshape(r, c) for a, b, r, c in zip([0] + ends[:-1], ends, rows.tolist(), cols.tolist())]
    eu, ev, tables = merge_parallel(uv, n, tables)
    limit = p.get("usage_limit")
    inst = Instance(str(p.get("name", "")), iv[:, 0].copy(), iv[:, 1].copy(), _pieces(cost, sizes),
                    _pieces(usage, sizes), eu, ev, tables, None if limit is None else int(limit))
    inst.horizon = int(max(iv[:, 1].max(initial=0), 0))
    inst.incident = incident_lists(n, eu, ev)
    return inst


def merge_parallel(uv: np.ndarray, n: int, tables: list):
    """One edge per unordered node pair, in order of first appearance and oriented as it first
    appears; a later parallel edge's table is added (transposed when reversed), in file order.
    Returns (edge_u, edge_v, tables). Only the few pairs that repeat are merged one by one."""
    lo, hi = np.minimum(uv[:, 0], uv[:, 1]), np.maximum(uv[:, 0], uv[:, 1])
    _, first, group, counts = np.unique(lo * n + hi, return_index=True, return_inverse=True, return_counts=True)
    keep = np.sort(first)
    merged: dict = {}
    for k in np.flatnonzero(counts[group] > 1).tolist():
        g = int(group[k])
        if g in merged:
            f = int(first[g])
            merged[g] = merged[g] + (tables[k].T if uv[k, 0] != uv[f, 0] else tables[k])
        else:
            merged[g] = tables[k]
    groups = group.tolist()
    return uv[keep, 0].copy(), uv[keep, 1].copy(), [merged.get(groups[k], tables[k]) for k in keep.tolist()]


def load(path: str) -> Instance:
    """The instance in ``path`` (JSON, plain or gzipped): its arrays of integers parsed straight
    into numpy (:func:`read_fast`); a file that reader does not take whole goes through ``json``
    and :func:`from_dict`, which then builds the same instance or raises its error."""
    text = read_bytes(path)
    inst = read_fast(text)
    return inst if inst is not None else from_dict(json.loads(text))


def read_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped when they start with gzip's magic number."""
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


# A key whose value is an array of arrays: the instance's five arrays of integers are such values.
_ARRAYS = re.compile(rb'"(intervals|costs|usages|nodes)"\s*:\s*(?=\[\s*\[)')
_ARRAY_END = re.compile(rb"\]\s*\]")
_MARK = b'"@iopddl-array-'
_INT64 = np.iinfo(np.int64)


def read_fast(text: bytes):
    """The instance read without ``json``'s Python objects (a 40k-node file holds 10M numbers:
    ``json`` made each an int, 3-6 CPU s), or None when this reader cannot tell that it reads
    the file exactly as ``json`` + :func:`from_dict` would. Each array of arrays of integers is
    cut out of the text (:func:`integer_lists` checks its syntax and parses it with numpy) and
    replaced by a marker; ``json`` parses the rest (name, limit, the nesting), and the five
    markers must sit where :func:`from_dict` looks. Any doubt (whitespace or a number ``json``
    would refuse inside such an array, an empty list, an integer beyond int64, a malformed
    instance) returns None and the caller takes the ``json`` path, which then raises its own error."""
    if _MARK in text:
        return None
    parts, spans, pos = [], [], 0
    while (m := _ARRAYS.search(text, pos)) is not None:
        end = _ARRAY_END.search(text, m.end())
        if end is None:
            return None
        parts += [text[pos:m.end()], _MARK + b'%d"' % len(spans)]
        spans.append((m.end(), end.end()))
        pos = end.end()
    parts.append(text[pos:])
    try:
        p = json.loads(b"".join(parts))["problem"]
        marks = [p["nodes"]["intervals"], p["nodes"]["costs"], p["nodes"]["usages"], p["edges"]["nodes"],
                 p["edges"]["costs"]]
        index = [int(m[len(_MARK) - 1:]) for m in marks if isinstance(m, str) and m.startswith(_MARK[1:].decode())]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if len(index) != 5 or len(set(index)) != 5:
        return None
    chars = np.frombuffer(text, dtype=np.uint8)
    parsed = [integer_lists(chars[a:b]) for a, b in spans]  # each one cut out: json would have checked it
    if any(a is None for a in parsed):
        return None
    return _checked(p, *(parsed[i] for i in index))


_COMMA, _MINUS, _OPEN, _CLOSE_BRACKET, _ZERO, _SPACE = b",-[]0 "


def _digits(c: np.ndarray) -> np.ndarray:
    return (c >= 48) & (c <= 57)


def integer_lists(chars: np.ndarray):
    """``chars`` (one JSON value's bytes, uint8) as (values int64, lengths) when it is an array of
    non-empty arrays of JSON integers written without whitespace, each within int64 and not
    int64's extremes (numpy clamps an overflow to them); else None. The syntax is checked on the
    positions of the few bytes that are not digits (brackets, commas, minus signs: two passes
    over the bytes), and the numbers parsed by ``np.fromstring`` (which on its own would read an
    empty number or a bare minus sign as 0, hence the checks)."""
    size = len(chars)
    low, high = np.flatnonzero(chars < 48), np.flatnonzero(chars > 57)
    lows, highs = chars[low], chars[high]
    commas, minus = low[lows == _COMMA], low[lows == _MINUS]
    opens, closes = high[highs == _OPEN], high[highs == _CLOSE_BRACKET]
    if len(commas) + len(minus) != len(low) or len(opens) + len(closes) != len(high):
        return None  # a byte that is none of 0-9 , - [ ]
    lists = len(opens) - 1
    if lists < 1 or len(closes) != lists + 1 or opens[0] != 0 or closes[-1] != size - 1:
        return None
    first, last = opens[1:], closes[:-1]  # list k holds the bytes strictly between first[k] and last[k]
    if first[0] != 1 or last[-1] != size - 2 or (last <= first + 1).any():
        return None
    if (first[1:] != last[:-1] + 2).any() or (chars[last[:-1] + 1] != _COMMA).any():
        return None  # not [[...],[...],...,[...]] with each list non-empty
    inner = commas[chars[commas - 1] != _CLOSE_BRACKET]  # every other comma sits in a "],["
    if not (_digits(chars[inner - 1]).all() and _digits(chars[last - 1]).all()):
        return None  # a comma or a list's end not after a digit
    starts = np.concatenate([first + 1, inner + 1])  # where each number starts
    signed = chars[starts] == _MINUS
    if int(np.count_nonzero(signed)) != len(minus):
        return None  # a minus sign inside a number
    starts[signed] += 1
    lead = chars[starts]
    if not _digits(lead).all():
        return None  # an empty number or a bare minus sign
    if ((lead == _ZERO) & _digits(chars[starts + 1])).any():
        return None  # a leading zero
    lengths = np.searchsorted(inner, last) - np.searchsorted(inner, first) + 1
    blank = chars.copy()
    blank[high] = _SPACE
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            values = np.fromstring(blank.tobytes(), dtype=np.int64, sep=",")
    except (ValueError, DeprecationWarning):
        return None
    if len(values) != int(lengths.sum()) or (values == _INT64.max).any() or (values == _INT64.min).any():
        return None
    return values, lengths


def _checked(p: dict, intervals, costs, usages, pairs, tables):
    """The instance from the parsed arrays ((values, lengths) each), or None where
    :func:`from_dict` would refuse it (it then says why)."""
    n = len(costs[1])
    if len(intervals[1]) != n or len(usages[1]) != n or len(pairs[1]) != len(tables[1]):
        return None
    if (intervals[1] != 2).any() or (pairs[1] != 2).any():
        return None
    sizes = costs[1]
    if (sizes == 0).any() or (sizes != usages[1]).any():
        return None
    uv = pairs[0].reshape(-1, 2)
    if len(_bad_edges(uv, n)) or (tables[1] != sizes[uv[:, 0]] * sizes[uv[:, 1]]).any():
        return None
    iv = intervals[0].reshape(n, 2)
    return _build(p, iv, sizes, _floats(costs[0]), usages[0], uv, _floats(tables[0]))


def forbid_unsupported(inst: Instance) -> int:
    """Arc consistency: forbid (cost ``inf``) each strategy that has, on some edge, no allowed
    partner at a finite cost, until none is left; returns how many were forbidden. Without it
    a start of least usage makes forbidden pairs that no single move can undo.

    Vectorised over the edges of one table shape at a time, all edges in the first round, then
    those at a node that lost a strategy: the fixed point (the largest arc-consistent domains)
    is the one a revision per edge reaches in any order. A node left with nothing raises."""
    sizes = inst.sizes()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.concatenate(inst.cost) if inst.n else np.zeros(0)
    allowed = np.isfinite(flat)
    start = int(allowed.sum())
    had = _any_per_node(allowed, offsets)
    groups = _shape_groups(inst, offsets)
    todo = np.ones(len(inst.edge_u), dtype=bool)
    while todo.any():
        before = allowed.copy()
        for edges, ia, ib, finite in groups:
            pick = todo[edges]
            if pick.any():
                _revise(allowed, ia[pick], ib[pick], finite[pick])
        wiped = np.flatnonzero(had & ~_any_per_node(allowed, offsets))
        if len(wiped):
            raise ValueError(f"infeasible: node {int(wiped[0])} has no strategy compatible with its neighbours")
        lost = np.zeros(inst.n, dtype=bool)
        lost[np.searchsorted(offsets, np.flatnonzero(before & ~allowed), side="right") - 1] = True
        todo = lost[inst.edge_u] | lost[inst.edge_v]
    inst.cost[:] = _pieces(np.where(allowed, flat, np.inf), sizes)
    return start - int(allowed.sum())


def _any_per_node(allowed: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.logical_or.reduceat(allowed, offsets[:-1]) if len(allowed) else np.zeros(0, dtype=bool)


def _shape_groups(inst: Instance, offsets: np.ndarray) -> list:
    """Per edge-table shape (r, c): the edges, their strategies' flat indices at u (k x r) and v
    (k x c), and which pairs are finite (k x r x c)."""
    by_shape: dict = {}
    for e, m in enumerate(inst.edge_cost):
        by_shape.setdefault(m.shape, []).append(e)
    groups = []
    for (r, c), edges in by_shape.items():
        edges = np.array(edges, dtype=np.int64)
        ia = offsets[inst.edge_u[edges]][:, None] + np.arange(r)
        ib = offsets[inst.edge_v[edges]][:, None] + np.arange(c)
        finite = np.isfinite(np.stack([inst.edge_cost[e] for e in edges.tolist()]))
        groups.append((edges, ia, ib, finite))
    return groups


def _revise(allowed: np.ndarray, ia: np.ndarray, ib: np.ndarray, finite: np.ndarray) -> None:
    """Forbid, in place, each allowed strategy of u (v) with no allowed partner at a finite cost."""
    a, b = allowed[ia], allowed[ib]
    allowed[ia[a & ~(finite & b[:, None, :]).any(axis=2)]] = False
    allowed[ib[b & ~(finite & a[:, :, None]).any(axis=1)]] = False
