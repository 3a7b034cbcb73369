"""plan="auto" on a model whose trace holds calls run only for their side effect (``F.one_hot``'s
index checks, ``aten._assert_async.msg``: dbrx's router), trained on a dp=2,tp=2 gloo world (patch
side_effect_nodes, ``autoparallel.planner.side_effects``). The labels' check is pinned to each
data-parallel rank's rows (``Partial(product)``), so the lowering must move it to the whole value
before the assert runs: every stage bitwise against the plan run eagerly, the oracle passing; a
batch with one negative label on one rank's rows raises one_hot's message on every rank. CI's
slow step ("planned-parity": each rank plans, lowers and compiles)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autoparallel.mesh import build_mesh
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import JOINT, run_pipeline
from autoparallel.planner.auto import local_inputs, local_params
from autoparallel.planner.strategies import SIDE_EFFECT
from autoparallel.runtime.steps import joint_graph_executor
from verify.model_case import ModelCase
from verify.parity.ordered_collectives import run_parity_world
from verify.parity.planned import EXECUTORS, PlannedCase, eager_executor, planned_case, planned_oracle, run_planned_parity, solve
from verify.parity.runs import compare_with_eager
from verify.stages.scenario import Scenario
from verify.zoo import ONE_HOT_PARTIAL_PINS, OneHotRouter, one_hot_loss, routed_batch

MESH = "dp=2,tp=2"
ASSERT = torch.ops.aten._assert_async.msg
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("planned-parity"), pytest.mark.timeout(900)]

CASE = ModelCase("one_hot_router", OneHotRouter, one_hot_loss, routed_batch, batch_per_rank=2)


def _case() -> PlannedCase:
    return replace(planned_case(Scenario(case=CASE, plan="auto", mesh=MESH)), planner={"pins": ONE_HOT_PARTIAL_PINS})


def test_one_hot_checks_under_auto_are_bitwise_and_pass_the_oracle():
    case = _case()
    ((plan, ranks),) = run_planned_parity(case, 2)
    (key,) = ONE_HOT_PARTIAL_PINS
    assert plan.nodes[key].out == [{"dp": "P(product)", "tp": "R"}]  # the pin held: each rank's term
    checks = sorted(k for k, why in plan.fallbacks.items() if why == SIDE_EFFECT)
    assert len(checks) == 4 and all(plan.nodes[k].ins == [{"dp": "R", "tp": "R"}] for k in checks)
    for executor in EXECUTORS[1:]:
        compare_with_eager(ranks, executor).assert_bitwise()
    report = planned_oracle(case, ranks)
    assert report.passed, report.summary()


def _broken_step(rank, world_size, case, solved, batch):
    """This rank's answer to a batch with a negative label: the message each of the plan's eager
    run and the lowered joint graph raised (None where one did not raise)."""
    mesh = build_mesh(case.spec)
    run = run_pipeline(case.model("cpu"), case.loss_fn, batch, ParallelPlan.auto(solution=solved), mesh, until=JOINT, trace=None)
    joint, plan = run.joint, run.planned.solution
    assert len(joint.gm.graph.find_nodes(op="call_function", target=ASSERT)) == 4
    full = {fqn: p.detach() for fqn, p in case.model("cpu").named_parameters()}
    params, inputs = local_params(plan, full, mesh), local_inputs(plan, batch, mesh)
    steps = {"eager": eager_executor(run.planned, mesh, {}),
             "joint": joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})}
    raised = {}
    for name, step in steps.items():
        try:
            step(dict(params), inputs)
            raised[name] = None
        except RuntimeError as e:
            raised[name] = str(e).splitlines()[0]
    return mesh.coordinate(), raised


def test_a_negative_label_on_one_ranks_rows_raises_on_every_rank():
    """Negative: the label is in data-parallel rank 1's rows only. Checked on its piece (each
    rank's term of ``all``), the assert fails on those ranks alone while the others train on (or
    wait at the next collective): this test then fails naming a rank that did not raise (checked
    once by lowering the assert on the unmoved pieces). On the whole value every rank raises
    one_hot's message, in the plan's eager run and in the lowered graph."""
    case = _case()
    solved = solve(case)
    x, labels = case.batches(1)[0]
    labels[-1] = -1
    per_rank = run_parity_world(_broken_step, case.spec.world_size, args=(case, solved, (x, labels)), timeout_s=120)
    assert sorted(tuple(c.values()) for c, _ in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for coord, raised in per_rank:
        for name, message in raised.items():
            assert message is not None and "one_hot: Class values must be non-negative" in message, (coord, name, message)
