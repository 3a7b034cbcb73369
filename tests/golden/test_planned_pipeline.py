"""plan="auto" through the whole pipeline, checked on the golden runs of the auto scenarios (the
pipeline runs are shared with their golden tests: same xdist group, shared_pipeline_runs).

* predicted vs traced: the plan's collectives per kind and mesh dim are the lowered joint graph's,
  node by node; a mismatch names the planned node (negative tests feed a wrong plan);
* FSDP tagging recognises planned parameter all-gathers (a placeholder -> all-gather chain over
  both mesh dims) and tags the whole chain;
* chained all-gather fusion fires on the lowered graphs, every chain it finds is fused or
  explained, and the second compile gathers exactly what the first partition gathers;
* ``python -m verify report --plan auto`` shows the plan stage beside the others.
"""

from __future__ import annotations

import copy
import json

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import ALL_GATHER
from autoparallel.mesh import fake_world
from autoparallel.passes.fsdp_recompute import is_fsdp_all_gather
from autoparallel.pipeline import PLAN, PLANNED_STAGE_NAMES
from autoparallel.planner.costs import CostModel
from autoparallel.planner.profile import get_profile
from verify.__main__ import main
from verify.goldens.catalog import golden_run
from verify.graphs.plan_lowering import (
    expected_on,
    mismatches,
    predicted_by_node,
    traced_by_node,
    traced_comm,
)
from verify.graphs.stats import graph_stats

AUTO_SIDS = ("tiny-auto-dp4tp2", "tiny-auto-dp8")


def _grouped(sids):
    return [pytest.param(s, marks=pytest.mark.xdist_group(s)) for s in sids]


def _costs(run):
    plan = run.planned.solution
    with fake_world(",".join(f"{n}={s}" for n, s in plan.mesh)) as mesh:
        return CostModel(get_profile(plan.profile), mesh.spec, mesh.device_mesh), dict(plan.mesh)


@pytest.mark.parametrize("sid", _grouped(AUTO_SIDS))
def test_predicted_collectives_are_the_lowered_graphs(sid, shared_pipeline_runs):
    run = golden_run(sid)
    assert run.names == list(PLANNED_STAGE_NAMES)
    plan, joint = run.planned.solution, run.stage("joint").graphs
    costs, sizes = _costs(run)
    assert traced_comm(joint) == expected_on(plan.comm, "cpu", sizes)
    assert plan.comm, "the plan communicates: the comparison compares something"
    predicted = predicted_by_node(run.planned.pg, plan, costs)
    assert mismatches(predicted, traced_by_node(joint)) == []
    assert sum(c["count"] for per in plan.comm.values() for c in per.values()) == sum(
        c["count"] for node in predicted.values() for per in node.values() for c in per.values()
    )


@pytest.mark.parametrize("sid", _grouped(["tiny-auto-dp4tp2"]))
def test_a_wrong_prediction_names_the_node(sid, shared_pipeline_runs):
    run = golden_run(sid)
    costs, _ = _costs(run)
    joint = run.stage("joint").graphs
    # The plan says the first parameter all-gather's consumer reads its input as it is produced.
    plan = copy.deepcopy(run.planned.solution)
    ag = next(n for n in joint.graph.nodes if n.target is ALL_GATHER)
    key = ag.meta[M.CUSTOM][M.PLANNED_NODE]
    entry = plan.nodes[key]
    pg = run.planned.pg
    node = next(n for n in pg.graph.nodes if pg.keys.get(n.name) == key)
    producer = node.args[0]
    entry.ins = [plan.nodes[pg.keys[producer.name]].out[0], *entry.ins[1:]]
    lines = mismatches(predicted_by_node(pg, plan, costs), traced_by_node(joint))
    assert len(lines) == 1 and lines[0].startswith(f"node {key}: plan predicts nothing, the lowered graph runs all_gather(")
    # A collective the lowering did not make for any planned node is filed under "?".
    g2 = copy.deepcopy(joint)
    stray = next(n for n in g2.graph.nodes if n.target is ALL_GATHER)
    stray.meta[M.CUSTOM] = {k: v for k, v in stray.meta[M.CUSTOM].items() if k != M.PLANNED_NODE}
    lines = mismatches(predicted_by_node(pg, run.planned.solution, costs), traced_by_node(g2))
    assert sorted(line.split(":")[0] for line in lines) == sorted(["node ?", f"node {key}"])


@pytest.mark.parametrize("sid", _grouped(["tiny-auto-dp4tp2"]))
def test_fsdp_tagging_recognises_planned_all_gather_chains(sid, shared_pipeline_runs):
    """Parameters the plan gathers are read from their placeholder through a chain of all-gathers
    (tp, then dp): both are FSDP all-gathers, tagged with the chain after them. (A sharded
    parameter may also be computed with as it is: the plan moves activations instead.)"""
    run = golden_run(sid)
    tagged = run.stage("fsdp_tagging").graphs
    report = run.stage("fsdp_tagging").report
    gathers = [n for n in tagged.graph.nodes if n.target is ALL_GATHER and is_fsdp_all_gather(n)]
    chained = [n for n in gathers if n.args[0].op != "placeholder"]
    assert chained, "the 2-D plan gathers parameters over both mesh dims"
    assert {n.name for n in gathers} == {n.name for n in report.all_gathers}
    for ag in gathers:
        assert ag.meta[M.RECOMPUTE] == CheckpointPolicy.MUST_RECOMPUTE, ag.name
        (wait,) = ag.users
        assert wait.meta[M.RECOMPUTE] == CheckpointPolicy.MUST_RECOMPUTE, wait.name
    sharded = {fqn for fqn, p in run.planned.solution.params.items() if any(v != "R" for v in p.values())}
    roots = set()
    for ag in gathers:
        src = ag.args[0]
        while src.op != "placeholder":
            src = src.all_input_nodes[0]
        roots.add(roles.name(src.meta[M.ROLE]))
    assert roots and roots <= sharded


@pytest.mark.parametrize("sid", _grouped(["tiny-auto-dp4tp2"]))
def test_chained_all_gathers_fused_on_the_planned_graphs(sid, shared_pipeline_runs):
    run = golden_run(sid)
    fused = 0
    for graph, m in run.stage("fuse_chained_allgathers").report.graphs.items():
        assert m.chains.found > 0, graph
        assert m.chains.unfused == [], f"{graph}: chains left unfused {m.chains.unfused}"
        fused += m.fused_chains
        # direct chains (no cancelling permutes between the two all-gathers): tp first, then dp
        assert all("(tp) -> " in c and c.endswith("(dp) on dp*tp") for c in m.chains.fused), m.chains.fused
    fw, bw = run.stage("fuse_chained_allgathers").graphs
    flat = sum(graph_stats(g).collectives.get("all_gather", {}).get("dp*tp").count for g in (fw, bw))
    assert flat == fused > 0
    # the seed's "357 = 357": the second compile gathers in its forward what the first partition did
    first, second = run.stage("first_partition").graphs[0], run.stage("second_compile").graphs[0]
    count = lambda g: graph_stats(g).to_dict()["collectives"]["all_gather"]  # noqa: E731
    assert count(first) == count(second)


@pytest.mark.parametrize("sid", _grouped(["tiny-auto-dp8"]))
def test_report_shows_the_plan_stage(sid, capsys, shared_pipeline_runs):
    assert main(["report", "--plan", "auto", "--no-parity", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    planning = report["planning"]
    run = golden_run(sid)
    rep = run.stage(PLAN).report
    assert planning["objective_us"] == round(rep.objective_us, 3) and planning["proven_optimal"]
    assert set(planning["seconds"]) >= {"trace", "solve"} and planning["alias_round_trips"]["removed"] == rep.aliases.removed
    assert planning["chained_all_gathers"] == {"found": 0, "fused": 0}  # a 1-D mesh has no chains
    assert report["params"] == {"count": 21, "fsdp_sharded": 21, "without_grad": {}}
    assert set(report["goldens"].values()) == {"matches"} and PLAN in report["goldens"]
    assert report["stages"][0]["name"] == "joint"  # the plan stage has no graph row
