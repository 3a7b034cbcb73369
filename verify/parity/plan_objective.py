"""Re-price a plan: its reported objective and collectives, recomputed from its placements.

This is the one plan check that must share something with the planner: the *prices*. Whether a
placement is valid is decided without the planner (``verify.parity.plan_check``); whether the number the
solver reports is the sum of what its placements cost can only be recomputed with the plan's own
cost model (``graph`` and ``costs``: the planner's nodes and cost model, ``plan._context``). A
formulation bug (a wrong count of identical blocks, an edge priced twice) shows up here as:

* ``one_choice``: a node's placement matches none (or several) of the candidates it was priced as;
* ``objective``: compute + communication, node by node and edge by edge, differs from the
  reported objective, compute, or communication summary.
"""

from __future__ import annotations

import math

from verify.parity.plan_check import Violation, decode


def check_objective(plan, graph, costs, *, rel_tol: float = 1e-6) -> list[Violation]:
    """Every way the plan's reported prices differ from its placements' (see the module docstring)."""
    names = plan.mesh_names
    out: list[Violation] = []
    nodes = graph.nodes
    placed: dict[int, tuple] = {}
    compute = 0.0
    for pn in nodes:
        entry = plan.nodes.get(pn.key)
        if entry is None:
            out.append(Violation("one_choice", pn.key, "the plan does not place this node"))
            continue
        outs = tuple(decode(o, names) for o in entry.out)
        ins = [decode(i, names) for i in entry.ins]
        placed[pn.index] = outs
        same_outs = [j for j, c in enumerate(pn.candidates) if c.outs == outs]
        matches = same_outs if pn.kind == "getitem" else [j for j in same_outs if list(pn.candidates[j].ins) == ins]
        if not matches:
            out.append(Violation("one_choice", pn.key, f"out={entry.out} in={entry.ins} is none of its {len(pn.candidates)} candidates"))
        elif len(matches) > 1 and pn.kind != "getitem":
            out.append(Violation("one_choice", pn.key, f"placement matches {len(matches)} candidates"))
        else:
            compute += float(pn.compute_us[matches[0]])
    comm_us = 0.0
    comm: dict[tuple[str, str], list[int]] = {}
    for pn in nodes:
        if pn.index not in placed or pn.kind == "getitem":
            continue
        for a, p in enumerate(pn.inputs):
            if p not in placed or a >= len(plan.nodes[pn.key].ins):
                continue
            r = costs.redistribute(nodes[p].meta, placed[p][0], decode(plan.nodes[pn.key].ins[a], names))
            comm_us += r.us
            for s in r.steps:
                slot = comm.setdefault((s.kind, s.mesh_dim), [0, 0])
                slot[0] += 1
                slot[1] += s.nbytes
    objective = compute + comm_us
    if not math.isclose(objective, plan.objective_us, rel_tol=rel_tol, abs_tol=1e-6):
        out.append(Violation("objective", "plan", f"recomputed {objective} us, the plan says {plan.objective_us} us"))
    if not math.isclose(compute, plan.compute_us, rel_tol=rel_tol, abs_tol=1e-6):
        out.append(Violation("objective", "compute", f"recomputed {compute} us, the plan says {plan.compute_us} us"))
    reported = {(k, d): [c["count"], c["bytes"]] for k, per in plan.comm.items() for d, c in per.items()}
    if reported != comm:
        out.append(Violation("objective", "comm", f"recomputed collectives {comm}, the plan says {reported}"))
    return out
