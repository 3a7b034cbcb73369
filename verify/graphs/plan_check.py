"""Re-check a plan against the graph it was made for, without the planner's formulation.

The ILP (``autoparallel.planner.ilp``) encodes each constraint as rows over variables; this
module checks the *plan* instead, from the placements it spells out and the graph's candidate
lists, so that a formulation bug (a missing row, a wrong index, a wrong count of identical
blocks) shows up as a violation rather than as a plausible plan:

* ``one_choice``: every node has one placement, and it is one of its candidates;
* ``flow``: every producer's placement reaches every consumer's wanted placement at finite cost
  (``getitem`` takes exactly its producer's output);
* ``fwd_bwd``: a parameter and its gradient (an output and its tangent) are placed alike;
* ``grad_reduce_dtype``: no redistribution around a mixed-precision cast;
* ``param_memory``: parameter bytes per rank (recomputed from the placements) within the budget;
* ``pins``: pinned nodes are where they were pinned;
* ``tables``: the plan's parameter and input tables agree with its nodes;
* ``objective``: compute + communication recomputed node by node and edge by edge equals the
  reported objective (and the communication summary).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement, Shard

from autoparallel import roles
from autoparallel.planner.plan import Plan, parse_placement


@dataclass(frozen=True)
class Violation:
    group: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.group}] {self.where}: {self.detail}"


def _placements(d: Mapping[str, str] | None, names: Sequence[str]) -> tuple[Placement, ...] | None:
    if d is None:
        return None
    return tuple(parse_placement(d[n]) for n in names)


def _local_bytes(shape, dtype, placements, sizes) -> int:
    local = list(shape)
    for p, n in zip(placements, sizes, strict=True):
        if isinstance(p, Shard):
            local[p.dim] = -(-local[p.dim] // n)
    return math.prod(local) * dtype.itemsize


def check_plan(plan: Plan, graph, costs, *, pins: Mapping[str, Sequence[Placement]] | None = None, rel_tol: float = 1e-6) -> list[Violation]:
    """Every violated constraint of ``plan`` on ``graph`` (PNodes) priced by ``costs``."""
    names = plan.mesh_names
    sizes = [s for _, s in plan.mesh]
    out: list[Violation] = []
    nodes = graph.nodes
    placed_out: dict[int, tuple] = {}
    placed_in: dict[int, list] = {}
    choice: dict[int, int] = {}
    for pn in nodes:
        entry = plan.nodes.get(pn.key)
        if entry is None:
            out.append(Violation("one_choice", pn.key, "the plan does not place this node"))
            continue
        outs = tuple(_placements(o, names) for o in entry.out)
        ins = [_placements(i, names) for i in entry.ins]
        placed_out[pn.index] = outs
        placed_in[pn.index] = ins
        if pn.kind == "getitem":
            matches = [j for j, c in enumerate(pn.candidates) if c.outs == outs]
        else:
            matches = [j for j, c in enumerate(pn.candidates) if c.outs == outs and list(c.ins) == ins]
        if not matches:
            out.append(Violation("one_choice", pn.key, f"placement out={entry.out} in={entry.ins} is not one of its {len(pn.candidates)} candidates"))
        elif len(matches) > 1 and pn.kind != "getitem":
            out.append(Violation("one_choice", pn.key, f"placement matches {len(matches)} candidates"))
        else:
            choice[pn.index] = matches[0]

    # flow, dtype locks and the objective, edge by edge
    compute = 0.0
    comm_us = 0.0
    comm: dict[tuple[str, str], list[int]] = {}
    for pn in nodes:
        if pn.index in choice:
            compute += float(pn.compute_us[choice[pn.index]])
        if pn.index not in placed_out:
            continue
        for a, p in enumerate(pn.inputs):
            prod = nodes[p]
            if p not in placed_out:
                continue
            src = placed_out[p]
            where = f"{pn.key} input {a} <- {prod.key}"
            if pn.kind == "getitem":
                idx = pn.static[0]
                if src[idx] != placed_out[pn.index][0]:
                    out.append(Violation("flow", where, f"getitem takes {src[idx]}, the plan says {placed_out[pn.index][0]}"))
                continue
            if len(placed_in[pn.index]) <= a:
                out.append(Violation("one_choice", pn.key, f"no placement for input {a}"))
                continue
            dst = placed_in[pn.index][a]
            r = costs.redistribute(prod.meta, src[0], dst)
            if not math.isfinite(r.us):
                out.append(Violation("flow", where, f"no redistribution from {src[0]} to {dst}"))
                continue
            if a in pn.locked_inputs and src[0] != dst:
                out.append(Violation("grad_reduce_dtype", where, f"redistributes {src[0]} -> {dst} across a mixed-precision cast"))
            comm_us += r.us
            for s in r.steps:
                slot = comm.setdefault((s.kind, s.mesh_dim), [0, 0])
                slot[0] += 1
                slot[1] += s.nbytes

    for a, b, _ in graph.equal:
        if placed_out.get(a) != placed_out.get(b):
            out.append(Violation("fwd_bwd", f"{nodes[a].key} ~ {nodes[b].key}", f"{placed_out.get(a)} != {placed_out.get(b)}"))

    # parameter memory, recomputed from the plan's parameter table
    total = 0
    params = [pn for pn in nodes if pn.kind == "placeholder" and roles.is_param(pn.role)]
    for pn in params:
        fqn = pn.role.partition(":")[2]
        if fqn not in plan.params:
            out.append(Violation("tables", fqn, "missing from the plan's parameter table"))
            continue
        pl = _placements(plan.params[fqn], names)
        if pn.index in placed_out and placed_out[pn.index][0] != pl:
            out.append(Violation("tables", fqn, f"parameter table says {pl}, its node {placed_out[pn.index][0]}"))
        total += _local_bytes(pn.meta.shape, pn.meta.dtype, pl, sizes)
    if len(plan.params) != len(params):
        out.append(Violation("tables", "params", f"the plan lists {len(plan.params)} parameters, the graph has {len(params)}"))
    if total != plan.param_memory_bytes:
        out.append(Violation("param_memory", "params", f"parameters take {total} bytes per rank, the plan says {plan.param_memory_bytes}"))
    if plan.memory_budget_bytes is not None and total > plan.memory_budget_bytes * (1 + 1e-9):
        out.append(Violation("param_memory", "params", f"{total} bytes per rank exceed the budget of {plan.memory_budget_bytes}"))
    for role, d in plan.inputs.items():
        pn = next((n for n in nodes if n.key == role), None)
        if pn is None or placed_out.get(pn.index, (None,))[0] != _placements(d, names):
            out.append(Violation("tables", role, "input table disagrees with the node"))

    by_key = {n.key: n for n in nodes}
    for name, want in (pins or {}).items():
        pn = by_key.get(name) or by_key.get(roles.param(name))
        if pn is None or placed_out.get(pn.index, (None,))[0] != tuple(want):
            out.append(Violation("pins", name, f"pinned to {tuple(want)}, placed {placed_out.get(pn.index) if pn else None}"))

    objective = compute + comm_us
    if not math.isclose(objective, plan.objective_us, rel_tol=rel_tol, abs_tol=1e-6):
        out.append(Violation("objective", "plan", f"recomputed {objective} us, the plan says {plan.objective_us} us"))
    if not math.isclose(compute, plan.compute_us, rel_tol=rel_tol, abs_tol=1e-6):
        out.append(Violation("objective", "compute", f"recomputed {compute} us, the plan says {plan.compute_us} us"))
    reported = {(k, d): [c["count"], c["bytes"]] for k, per in plan.comm.items() for d, c in per.items()}
    if reported != comm:
        out.append(Violation("objective", "comm", f"recomputed collectives {comm}, the plan says {reported}"))
    return out


def assert_plan_valid(plan: Plan, graph=None, costs=None, **kw) -> None:
    """Raise AssertionError listing every violation (graph and costs default to the plan's own)."""
    if graph is None or costs is None:
        ctx = plan._context
        if ctx is None:
            raise ValueError("the plan has no planning context (loaded from JSON?): pass graph and costs")
        graph = graph or ctx.graph
        costs = costs or ctx.costs
    violations = check_plan(plan, graph, costs, **kw)
    if violations:
        raise AssertionError(f"{len(violations)} constraint violation(s):\n" + "\n".join(str(v) for v in violations[:30]))
