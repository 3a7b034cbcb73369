"""Per-rank memory over the step: parameters, activations and gradients, at every point of the joint graph.

A parameter budget alone says nothing about a step's peak: activations saved for backward and
gradients held until the optimizer dominate it. Here every tensor the joint graph makes is live
from the node that makes it to its last reader (placeholders, the parameters among them, for the
whole step; a graph output, every gradient among them, to the end). Views (``alias``
and ops whose schema returns a view or a written argument: ``aten.t``, ``view``, in-place ops)
hold no bytes of their own and keep their base alive; each output of a multi-output op is its
``getitem``'s, live from the op to the getitem's last reader. A tensor's bytes per rank
depend on its placement, so the live bytes at a point are a linear function of the choices:
one ILP row per point. Only points where some tensor dies need a row: between two deaths the
live set only grows, so the last point before each death dominates the points before it.

Not counted: redistribution buffers (the gathered copy a consumer reads) and the autograd
engine's temporaries; the peak is the graph's, as the planner can choose it.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from dataclasses import dataclass

import numpy as np
import torch

from autoparallel.planner.costs import local_shape, nbytes
from autoparallel.planner.problem import ALIAS_KIND, GETITEM, OP, OUTPUT, PLACEHOLDER, Graph, PNode


@dataclass
class Lifetimes:
    """``first[i]``/``last[i]``: the points node i's bytes are live (inclusive); ``owner[i]`` the node holding its bytes."""

    first: np.ndarray
    last: np.ndarray
    owner: np.ndarray
    gone: np.ndarray  # becomes a graph output: its bytes are the output's


def _holds_bytes(pn: PNode) -> bool:
    return pn.kind != ALIAS_KIND and not (pn.kind == OP and _returns_alias(pn.op))


@functools.cache
def _returns_alias(op: str) -> bool:
    """Whether ``aten.<name>.<overload>`` returns a view or a written argument (its schema's alias
    annotation, ``Tensor(a)``): its output shares its first input's storage."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return False
    packet = getattr(torch.ops.aten, parts[1], None)
    overload = getattr(packet, parts[2], None) if packet is not None else None
    schema = getattr(overload, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None)


def lifetimes(graph: Graph) -> Lifetimes:
    """Live intervals in node order; a view's readers extend its base's interval. Each output of
    a multi-output op is its ``getitem``'s buffer, made when the op runs. A graph output (a
    gradient, the loss) is a buffer at the output's placement, from its producer's point to the
    end of the step: a producer no op reads *becomes* that output (``gone``: no bytes of its own),
    so a gradient made on a shard and gathered for the caller counts at its gathered size."""
    n = len(graph.nodes)
    owner = np.arange(n)
    first = np.arange(n)
    last = np.arange(n)
    read = np.zeros(n, dtype=bool)
    fed_out = np.zeros(n, dtype=bool)
    for pn in graph.nodes:
        if pn.kind == GETITEM:
            first[pn.index] = pn.inputs[0]
        elif not _holds_bytes(pn) and pn.inputs:
            owner[pn.index] = owner[pn.inputs[0]]
    for pn in graph.nodes:
        if pn.kind == OUTPUT:
            for p in pn.inputs:
                first[pn.index] = first[owner[p]]
                fed_out[owner[p]] = True
            last[pn.index] = n - 1
            continue
        for p in pn.inputs:
            o = owner[p]
            last[o] = max(last[o], pn.index)
            read[o] |= _holds_bytes(pn) and pn.kind != GETITEM
        if pn.kind == PLACEHOLDER:  # parameters, inputs, tangents: the caller's, the whole step
            first[pn.index], last[pn.index] = 0, n - 1
    placeholder = np.array([pn.kind == PLACEHOLDER for pn in graph.nodes], dtype=bool)
    return Lifetimes(first, last, owner, fed_out & ~read & ~placeholder)


def taken_outputs(graph: Graph) -> dict[int, set[int]]:
    """Node index -> the output indices its ``getitem`` users take."""
    taken: dict[int, set[int]] = {}
    for q in graph.nodes:
        if q.kind == GETITEM:
            taken.setdefault(q.inputs[0], set()).add(q.static[0])
    return taken


def node_bytes(graph: Graph, pn: PNode, taken: dict[int, set[int]]) -> np.ndarray:
    """Per-rank bytes ``pn`` holds under each of its candidates: 0 for views; a multi-output op
    holds the outputs no ``getitem`` takes (``taken``: those are the getitem's)."""
    if not _holds_bytes(pn):
        return np.zeros(len(pn.candidates))
    return np.array([_candidate_bytes(graph, pn, j, taken) for j in range(len(pn.candidates))], dtype=np.float64)


def _candidate_bytes(graph: Graph, pn: PNode, j: int, taken: dict[int, set[int]]) -> int:
    skip = taken.get(pn.index, ())
    return sum(
        nbytes(local_shape(meta.shape, pl, graph.mesh_sizes), meta.dtype)
        for k, (meta, pl) in enumerate(zip(pn.metas, pn.candidates[j].outs, strict=False))
        if k not in skip and meta is not None and pl is not None and hasattr(meta, "shape")
    )


def row_points(lt: Lifetimes, holders: Sequence[int]) -> list[int]:
    """The points that can be a peak: the last point of each interval (deduplicated, sorted)."""
    return sorted({int(lt.last[i]) for i in holders})


def peak_rows(graph: Graph, class_of: Sequence[int]) -> list[tuple[int, dict[int, np.ndarray]]]:
    """``(point, {class: live bytes per choice})`` for every point that can be a peak."""
    lt = lifetimes(graph)
    holders = [pn.index for pn in graph.nodes if _holds_bytes(pn) and not lt.gone[pn.index]]
    taken = taken_outputs(graph)
    per = {i: node_bytes(graph, graph.nodes[i], taken) for i in holders}
    holders = [i for i in holders if per[i].any()]
    rows = []
    for t in row_points(lt, holders):
        row: dict[int, np.ndarray] = {}
        for i in holders:
            if lt.first[i] <= t <= lt.last[i]:
                c = class_of[i]
                row[c] = row[c] + per[i] if c in row else per[i].copy()
        rows.append((t, row))
    return rows


def peak_of(graph: Graph, choice: Sequence[int]) -> tuple[int, str]:
    """(peak per-rank bytes, key of the node at whose point it happens) of an assignment (one choice per PNode)."""
    lt = lifetimes(graph)
    n = len(graph.nodes)
    delta = np.zeros(n + 1)
    taken = taken_outputs(graph)
    for pn in graph.nodes:
        if _holds_bytes(pn) and not lt.gone[pn.index]:
            b = _candidate_bytes(graph, pn, choice[pn.index], taken) if pn.candidates else 0
            delta[lt.first[pn.index]] += b
            delta[lt.last[pn.index] + 1] -= b
    live = np.cumsum(delta[:n])
    t = int(np.argmax(live)) if n else 0
    return (int(live[t]) if n else 0), (graph.nodes[t].key if n else "")
