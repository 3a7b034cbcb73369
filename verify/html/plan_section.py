"""The plan stage on the page (``plan="auto"``): it has no graph of its own, so it gets its own
section, built from the stage's ``PlanningReport``: the objective and whether the solver proved
it, the solve statistics, where the seconds went, every parameter's placement per mesh dim, and
``Plan.explain`` for the costliest nodes (where a reader asks "why this placement?" first)."""

from __future__ import annotations

from html import escape
from typing import Any

COSTLIEST = 5  # nodes explained on the page
SECTION_ID = "plan-stage"


def _row(cells: list[str], tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{escape(c)}</{tag}>" for c in cells) + "</tr>"


def _verdict(report: Any) -> str:
    if report.given:
        return "given plan (not solved here)"
    return "proven optimal" if report.proven_optimal else "NOT proven optimal: the solver's time limit returned its best plan so far"


def _stats_rows(plan: Any, report: Any) -> list[str]:
    rows = [
        ["objective", f"{report.objective_us:.3f} us per step"],
        ["compute / communication", f"{report.compute_us:.3f} / {report.comm_us:.3f} us"],
        ["solver", _verdict(report)],
    ]
    gap = plan.gap
    if plan.lp_bound_us is not None:
        rows.append(["LP bound", f"{plan.lp_bound_us:.3f} us" + ("" if gap is None else f" (gap {gap:.2%})")])
    rows += [[f"solve: {k}", f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in sorted(plan.stats.items())]
    rows += [[f"seconds: {k}", f"{v:.3f}"] for k, v in report.seconds.items()]
    rows.append(["alias round trips removed", f"{report.aliases.removed} ({len(report.aliases.erased)} aliases erased)"])
    return [_row(r) for r in rows]


def _params_table(plan: Any) -> str:
    names = plan.mesh_names
    rows = [_row(["parameter", *names], "th")]
    rows += [_row([fqn, *(placements.get(n, "R") for n in names)]) for fqn, placements in plan.params.items()]
    return "<table class=plan-params>" + "".join(rows) + "</table>"


def _explained(plan: Any, n: int) -> str:
    try:
        costliest = plan.costliest(n)
    except ValueError as e:  # a plan loaded from JSON has no planning context
        return f"<p>explain: not available ({escape(str(e))})</p>"
    out = [f"<h3>the {len(costliest)} costliest nodes, explained</h3>"]
    for key, us in costliest:
        out.append(f"<details><summary>{escape(key)}: {us:.3f} us</summary><pre>{escape(plan.explain(key))}</pre></details>")
    return "".join(out)


def plan_section(report: Any, *, costliest: int = COSTLIEST) -> str:
    """The section's HTML for a ``PlanningReport`` whose ``plan`` is set (the stage's output)."""
    plan = report.plan
    if plan is None:
        raise ValueError("the plan stage's report carries no plan: nothing to show")
    return "".join([
        f"<section class=plan id={SECTION_ID}><h2>plan</h2>",
        "<table class=plan-stats>", *_stats_rows(plan, report), "</table>",
        "<h3>parameters: placement per mesh dim</h3>", _params_table(plan),
        _explained(plan, costliest),
        "</section>",
    ])


__all__ = ["COSTLIEST", "SECTION_ID", "plan_section"]
