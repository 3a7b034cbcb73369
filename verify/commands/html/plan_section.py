"""The plan stage on the page (``plan="auto"``): it has no graph of its own, so it gets its own
section, written for a reader, not for the solver: first the objective (the predicted step time and
whether the solver proved it), then what was placed where (parameters grouped by placement, and
every op replicated by the fallback or a lifted constant, with why), then the costliest nodes with
``Solution.explain`` (where a reader asks "why this placement?" first). The solver's own statistics
and seconds are collapsed under one details element at the end."""

from __future__ import annotations

from collections import defaultdict
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


def _objective(plan: Any, report: Any) -> str:
    """One sentence: what the planner minimised and how sure it is."""
    return (f"<p class=plan-objective>The planner chose the placements that minimise the predicted step time on "
            f"{escape(str(plan.profile))}: <b>{report.objective_us:.3f} us per step</b> ({report.compute_us:.3f} us "
            f"compute, {report.comm_us:.3f} us communication); {escape(_verdict(report))}.</p>")


def _placed(plan: Any) -> str:
    """Parameters grouped by their placement per mesh dim, largest group first, then every node
    the planner replicated whole and why."""
    names = plan.mesh_names
    groups: dict[str, list[str]] = defaultdict(list)
    for fqn, placements in plan.params.items():
        groups[", ".join(f"{placements.get(n, 'R')} on {n}" for n in names)].append(fqn)
    rows = [_row(["placement", "parameters", "for example"], "th")]
    rows += [_row([key, str(len(fqns)), ", ".join(fqns[:3]) + (", ..." if len(fqns) > 3 else "")])
             for key, fqns in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    out = ["<h3>what was placed where</h3>",
           "<p>S(d): split along dim d over that mesh dim; R: replicated; P: partial sums.</p>",
           "<table class=plan-groups>", *rows, "</table>"]
    whole = [(key, why) for key, why in sorted(plan.fallbacks.items())]
    whole += [(key, f"a tensor constant made in forward ({attr}), replicated") for key, attr in sorted(plan.constants.items())]
    if whole:
        out += [f"<p>{len(whole)} node(s) run whole on every rank, not sharded:</p><table class=plan-whole>",
                _row(["node", "because"], "th"), *(_row([k, w]) for k, w in whole), "</table>"]
    return "".join(out)


def _internals(plan: Any, report: Any) -> str:
    """The solver's statistics, seconds and the alias clean-up, collapsed: for whoever tunes it."""
    rows = []
    gap = plan.gap
    if plan.lp_bound_us is not None:
        rows.append(["LP bound", f"{plan.lp_bound_us:.3f} us" + ("" if gap is None else f" (gap {gap:.2%})")])
    rows += [[f"solve: {k}", f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in sorted(plan.stats.items())]
    rows += [[f"seconds: {k}", f"{v:.3f}"] for k, v in report.seconds.items()]
    rows.append(["alias round trips removed", f"{report.aliases.removed} ({len(report.aliases.erased)} aliases erased)"])
    return ("<details class=plan-internals><summary>solver internals</summary><table class=plan-stats>"
            + "".join(_row(r) for r in rows) + "</table></details>")


def _params_table(plan: Any) -> str:
    names = plan.mesh_names
    rows = [_row(["parameter", *names], "th")]
    rows += [_row([fqn, *(placements.get(n, "R") for n in names)]) for fqn, placements in plan.params.items()]
    return ("<details class=plan-every-param><summary>every parameter, per mesh dim</summary><table class=plan-params>"
            + "".join(rows) + "</table></details>")


def _explained(plan: Any, n: int) -> str:
    try:
        costliest = plan.costliest(n)
    except ValueError as e:  # a plan loaded from JSON has no planning context
        return f"<p>explain: not available ({escape(str(e))})</p>"
    out = [f"<h3>the {len(costliest)} costliest nodes, and why each got its placement</h3>"]
    for key, us in costliest:
        out.append(f"<details class=explain><summary>{escape(key)}: {us:.3f} us</summary><pre>{escape(plan.explain(key))}</pre></details>")
    return "".join(out)


def plan_section(report: Any, *, costliest: int = COSTLIEST) -> str:
    """The section's HTML for a ``PlanningReport`` whose ``solution`` is set (the stage's output)."""
    plan = report.solution
    if plan is None:
        raise ValueError("the plan stage's report carries no plan: nothing to show")
    return "".join([
        f"<section class=plan id={SECTION_ID}><h2>plan</h2>",
        _objective(plan, report),
        _placed(plan), _params_table(plan),
        _explained(plan, costliest),
        _internals(plan, report),
        "</section>",
    ])


__all__ = ["COSTLIEST", "SECTION_ID", "plan_section"]
