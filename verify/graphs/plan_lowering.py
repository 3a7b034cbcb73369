"""Predicted vs traced: does the lowered graph communicate exactly what the plan predicted?

The plan predicts, per step, its collectives per kind and mesh dim (``Solution.comm``: count and
bytes, the bytes ``verify.graphs.stats`` counts: an all-gather's output, a reduce-scatter's or
all-reduce's input). The lowered joint graph (the ``joint`` stage of a ``plan="auto"`` run) has
real collective nodes; :func:`traced_comm` counts them with ``verify.graphs.stats``. They must be equal.

When they are not, the totals do not say where. Every lowered node carries the canonical key of
the planned node it was made for (``custom[PLANNED_NODE]``, written by the lowering), so
:func:`mismatches` compares per planned node (the plan's predicted moves of each of its inputs,
priced with the plan's cost model, against the collectives traced for it) and names each node
whose collectives differ.

On a CPU mesh DTensor runs a ``Shard(i) -> Shard(j)`` move (an all-to-all in the plan) as an
all-gather of the whole buffer followed by a local chunk (gloo has no all-to-all in DTensor):
:func:`expected_on` turns the plan's prediction into what a mesh of that device type traces.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import group_arg
from autoparallel.mesh import dim_label, group_dims_of
from autoparallel.planner.costs import ALL_GATHER, ALL_TO_ALL, CostModel
from autoparallel.planner.graph import PlanningGraph, tensor_args
from autoparallel.planner.lower import OUTPUT_KEY, decode
from autoparallel.planner.solution import Solution
from verify.graphs.classify import collective_kind, collective_node_bytes
from verify.graphs.stats import graph_stats

Comm = dict[str, dict[str, dict[str, int]]]  # kind -> mesh dim -> {"count", "bytes"}


def _add(out: dict, key, kind: str, dim: str, nbytes: int) -> None:
    slot = out.setdefault(key, {}).setdefault(kind, {}).setdefault(dim, {"count": 0, "bytes": 0})
    slot["count"] += 1
    slot["bytes"] += int(nbytes)


def traced_comm(gm: fx.GraphModule) -> Comm:
    """The graph's collectives per kind and mesh dim (``verify.graphs.stats``), as ``Solution.comm`` spells them."""
    out: Comm = {}
    for kind, per in graph_stats(gm).collectives.items():
        for dim, cs in per.items():
            out.setdefault(kind, {})[dim] = {"count": cs.count, "bytes": cs.bytes}
    return out


def expected_on(comm: Comm, device_type: str, sizes: Mapping[str, int]) -> Comm:
    """``comm`` as a mesh of ``device_type`` runs it: on ``cpu`` an all-to-all over dim d is an
    all-gather of ``sizes[d]`` times its buffer (see the module docstring)."""
    if device_type != "cpu" or ALL_TO_ALL not in comm:
        return {k: {d: dict(c) for d, c in v.items()} for k, v in comm.items()}
    out: Comm = {k: {d: dict(c) for d, c in v.items()} for k, v in comm.items() if k != ALL_TO_ALL}
    for dim, c in comm[ALL_TO_ALL].items():
        slot = out.setdefault(ALL_GATHER, {}).setdefault(dim, {"count": 0, "bytes": 0})
        slot["count"] += c["count"]
        slot["bytes"] += c["bytes"] * sizes[dim]
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def predicted_by_node(pg: PlanningGraph, plan: Solution, costs: CostModel) -> dict[str, Comm]:
    """Per planned node key: the collectives that move its inputs (graph outputs: ``"output"``)."""
    names = plan.mesh_names
    out: dict[str, Comm] = {}

    def out_of(node: fx.Node):
        return decode(plan.nodes[pg.keys[node.name]].out[0], names)

    for node in pg.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        key = pg.keys[node.name]
        wanted = [decode(i, names) for i in plan.nodes[key].ins]
        for arg, want in zip(tensor_args(node), wanted, strict=True):
            for step in costs.redistribute(arg.meta[M.VAL], out_of(arg), want).steps:
                _add(out, key, step.kind, step.mesh_dim, step.nbytes)
    output = pg.graph.output_node()
    for i, (arg, role) in enumerate(zip(output.args[0], pg.output_roles, strict=True)):
        if not isinstance(arg, fx.Node):
            continue
        want = decode(plan.nodes[f"out:{role or roles.user_output(i)}"].out[0], names)
        for step in costs.redistribute(arg.meta[M.VAL], out_of(arg), want).steps:
            _add(out, OUTPUT_KEY, step.kind, step.mesh_dim, step.nbytes)
    return out


def traced_by_node(gm: fx.GraphModule) -> dict[str, Comm]:
    """Per planned node key (``custom[PLANNED_NODE]``): the collectives the lowered graph runs
    for it. A collective without the key is filed under ``"?"`` (it came from no planned node)."""
    dims = group_dims_of(gm)
    out: dict[str, Comm] = {}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        key = (node.meta.get(M.CUSTOM) or {}).get(M.PLANNED_NODE, "?")
        dim = dim_label(str(group_arg(node)), dims, where=node.name)
        _add(out, key, kind, dim, collective_node_bytes(node))
    return out


def mismatches(predicted: Mapping[str, Comm], traced: Mapping[str, Comm]) -> list[str]:
    """One line per planned node whose traced collectives differ from its predicted ones."""
    lines = []
    for key in sorted(set(predicted) | set(traced)):
        p, t = predicted.get(key, {}), traced.get(key, {})
        if p != t:
            lines.append(f"node {key}: plan predicts {_text(p)}, the lowered graph runs {_text(t)}")
    return lines


def _text(comm: Comm) -> str:
    if not comm:
        return "nothing"
    return ", ".join(f"{kind}({dim}) x{c['count']} {c['bytes']} B" for kind, per in sorted(comm.items()) for dim, c in sorted(per.items()))


__all__ = ["expected_on", "mismatches", "predicted_by_node", "traced_by_node", "traced_comm"]
