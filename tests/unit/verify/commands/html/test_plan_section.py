"""The plan stage's section of the HTML page (plan="auto"): placements per parameter and mesh dim,
the objective and the solver's verdict, solve statistics, and explain for the costliest nodes."""

from __future__ import annotations

import dataclasses
import re
from html import escape

import pytest

from autoparallel.pipeline import PLAN
from autoparallel.planner.solution import Solution
from verify.commands.html import build_report_page, records_from_pipeline_run
from verify.commands.html.page import page_sections
from verify.commands.html.plan_section import COSTLIEST, plan_section
from verify.goldens.catalog import GOLDEN_SCENARIOS, golden_run

# The tier's golden run of plan="auto" (tiny LLaMA on dp=8), shared with the golden tests on its
# worker: no planning of its own.
pytestmark = pytest.mark.xdist_group("tiny-auto-dp8")


@pytest.fixture(scope="module")
def planned_run(shared_pipeline_runs):
    return golden_run("tiny-auto-dp8")


def test_the_section_shows_every_parameter_per_mesh_dim_and_explains_the_costliest_nodes(planned_run):
    report = planned_run.stage(PLAN).report
    plan = report.solution
    html = plan_section(report)
    table = html.split("plan-params")[1].split("</table>")[0]
    assert re.findall(r"<th>([^<]+)</th>", table) == ["parameter", "dp"]
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td></tr>", table)
    assert {fqn: {"dp": dp} for fqn, dp in rows} == {fqn: {"dp": p.get("dp", "R")} for fqn, p in plan.params.items()}
    assert len(rows) == len(plan.params) == len(list(planned_run.module.local_parameters())) > 0
    assert "proven optimal" in html and f"{report.objective_us:.3f} us per step" in html
    assert "solve: status" in html and "seconds: solve" in html
    explained = re.findall(r"<details class=explain><summary>([^<]+): ([0-9.]+) us</summary>", html)
    costliest = plan.costliest(COSTLIEST)
    assert [(k, float(us)) for k, us in explained] == [(escape(k), round(us, 3)) for k, us in costliest]
    assert [us for _, us in costliest] == sorted((us for _, us in costliest), reverse=True)
    assert html.count("why: ") == COSTLIEST


def test_the_section_reads_objective_then_placements_then_why_and_collapses_the_solver(planned_run):
    report = planned_run.stage(PLAN).report
    plan = report.solution
    html = plan_section(report)
    order = ["class=plan-objective", "what was placed where", "class=plan-every-param", "class=explain", "class=plan-internals"]
    assert [html.index(k) for k in order] == sorted(html.index(k) for k in order)
    internals = html.split("<details class=plan-internals>")[1].split("</details>")[0]
    assert "<summary>solver internals</summary>" in internals and "solve: status" in internals
    assert "solve: " not in html.split("<details class=plan-internals>")[0], "solver statistics outside the collapsed part"
    groups = re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td><td>[^<]*</td></tr>",
                        html.split("class=plan-groups>")[1].split("</table>")[0])
    assert sum(int(n) for _, n in groups) == len(plan.params)
    assert [int(n) for _, n in groups] == sorted((int(n) for _, n in groups), reverse=True)
    assert {key for key, _ in groups} == {", ".join(f"{p.get(d, 'R')} on {d}" for d in plan.mesh_names) for p in plan.params.values()}
    assert "class=plan-whole" not in html  # tiny LLaMA needs no replicated fallback
    whole = dataclasses.replace(plan, fallbacks={"layers.0/fwd/aten.cdist#0": "no sharding strategy"},
                                constants={"layers.0/fwd/constant#0": "_tensor_constant0"})
    html = plan_section(dataclasses.replace(report, solution=whole))
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td></tr>", html.split("class=plan-whole>")[1].split("</table>")[0])
    assert rows == [("layers.0/fwd/aten.cdist#0", "no sharding strategy"),
                    ("layers.0/fwd/constant#0", "a tensor constant made in forward (_tensor_constant0), replicated")]


def test_the_costliest_nodes_are_the_dearest_chosen_placements(planned_run):
    plan = planned_run.stage(PLAN).report.solution
    every = plan.costliest(10**6)
    assert len(every) > COSTLIEST and plan.costliest(3) == every[:3]
    assert every[0][1] > 0 and every[-1][1] <= every[0][1]


def test_a_time_limited_plan_says_it_is_not_proven_and_a_plan_from_json_cannot_explain(planned_run):
    report = planned_run.stage(PLAN).report
    limited = dataclasses.replace(report, proven_optimal=False)
    assert escape("NOT proven optimal: the solver's time limit returned its best plan so far") in plan_section(limited)
    loaded = dataclasses.replace(report, solution=Solution.from_json(report.solution.to_json()))
    html = plan_section(loaded)
    assert "explain: not available" in html and "class=explain" not in html
    with pytest.raises(ValueError, match="carries no plan"):
        plan_section(dataclasses.replace(report, solution=None))


def test_the_page_carries_the_plan_section_ahead_of_the_stages_and_links_it(planned_run):
    records = records_from_pipeline_run(planned_run, alternatives=False, goldens=False)[:1]  # the joint stage
    mesh = GOLDEN_SCENARIOS["tiny-auto-dp8"].mesh_spec  # group sizes once the fake world is gone
    page = build_report_page(records, title="t", mesh=mesh, planning=planned_run.stage(PLAN).report)
    assert page.index("id=plan-stage") < page.index("<section class=stage ")
    assert "href='#plan-stage'" in page
    assert "plan" not in page_sections(page), "the stage sections' parser still sees only stages"
    assert "id=plan-stage" not in build_report_page(records, title="t", mesh=mesh), "a hand plan has no plan section"


def test_on_a_2d_mesh_each_parameter_has_a_column_per_mesh_dim(planned_run):
    """The shared run is 1-D: the same plan with a tp dim added (a placement on it for one
    parameter, Replicate left implicit for the others) shows both columns in mesh order."""
    report = planned_run.stage(PLAN).report
    data = report.solution.to_json()
    data["mesh"] = [*data["mesh"], ["tp", 2]]
    first = next(iter(data["params"]))
    data["params"][first] = {**data["params"][first], "tp": "S(1)"}
    html = plan_section(dataclasses.replace(report, solution=Solution.from_json(data)))
    table = html.split("plan-params")[1].split("</table>")[0]
    assert re.findall(r"<th>([^<]+)</th>", table) == ["parameter", "dp", "tp"]
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td></tr>", table)
    assert rows[0] == (first, data["params"][first].get("dp", "R"), "S(1)")
    assert {tp for _, _, tp in rows[1:]} == {"R"} and len(rows) == len(data["params"])

