"""What users' models make that DTensor has no rule for, planned: lifted tensor constants, ops
with no sharding strategy (the replicated fallback), random ops that are not dropout.

Small models of our own, planned on a fake dp=2,tp=2 world; every plan is re-checked by the
independent plan checker (``verify.parity.plan_check``: placements re-derived from the graph, each
op run on simulated ranks), which must also catch a fallback that forgets to gather.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import Solution, plan_model
from autoparallel.planner.auto import plan_for_pipeline
from autoparallel.planner.lower import LoweringError, check_replicated_fallbacks
from autoparallel.planner.problem import CONSTANT, OP
from autoparallel.planner.strategies import NO_STRATEGY, RANDOM_OP
from verify.parity.plan_check import check_plan, traced_graph
from verify.zoo import DropPath, MaskFromPythonData, Prototypes
from verify.zoo import mse_loss as mse

MESH = "dp=2,tp=2"


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop_path = nn.Linear(16, 32), nn.Linear(32, 16), DropPath(0.5)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(x + self.drop_path(self.fc2(torch.relu(self.fc1(x)))))


def _plan(model_cls, out=8) -> Solution:
    with fake_world(MESH) as mesh:
        with torch.device("meta"):
            model = model_cls()
        return plan_model(model, mesh, (torch.randn(8, 16), torch.randn(8, out)), loss_fn=mse)


def _checked(plan: Solution):
    gm, roles = traced_graph(plan)
    return check_plan(plan, gm, roles)


def _tampered(plan: Solution, edit) -> Solution:
    copy = Solution.from_json(json.loads(json.dumps(plan.to_json())))
    copy._context = plan._context
    edit(copy)
    return copy


def test_a_lifted_constant_is_placed_replicated_costed_and_shown_in_the_plan():
    plan = _plan(MaskFromPythonData, out=16)
    assert list(plan.constants.values()) == ["_tensor_constant0"]
    (key,) = plan.constants
    assert key == "-/fwd/constant#0"
    assert plan.nodes[key].out == [{"dp": "R", "tp": "R"}] and plan.nodes[key].ins == []
    assert "## constants" in plan.text() and key in plan.text()
    assert "tensor constants (1, replicated)" in plan.summary()
    assert Solution.from_json(json.loads(json.dumps(plan.to_json()))).constants == plan.constants
    graph = plan._context.graph
    (pn,) = [n for n in graph.nodes if n.kind == CONSTANT]
    assert pn.compute_us.tolist() == [0.0]  # held, not computed; its consumers pay any move
    assert "a tensor constant lifted from forward" in plan.explain(key)
    assert not _checked(plan).violations


class _NoFallback(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x)


def test_a_plan_without_fallbacks_or_constants_keeps_its_text():
    plan = _plan(_NoFallback)
    assert not plan.fallbacks and not plan.constants
    assert "## replicated fallbacks" not in plan.text() and "## constants" not in plan.text()


def test_an_op_with_no_strategy_takes_the_fallback_whose_cost_is_the_whole_op_plus_its_gathers():
    plan = _plan(Prototypes)
    fwd = "-/fwd/aten._cdist_forward.default#0"
    assert plan.fallbacks[fwd] == NO_STRATEGY
    assert {k for k, why in plan.fallbacks.items() if why == NO_STRATEGY} >= {fwd, "-/bwd/aten._cdist_backward.default#0"}
    assert "replicated fallback" in plan.summary() and fwd in plan.summary() and "## replicated fallbacks" in plan.text()
    entry = plan.nodes[fwd]
    assert entry.out == [{"dp": "R", "tp": "R"}] and all(i == {"dp": "R", "tp": "R"} for i in entry.ins)
    ctx = plan._context
    pn = next(n for n in ctx.graph.nodes if n.key == fwd)
    assert pn.kind == OP and pn.fallback == NO_STRATEGY
    assert f"the replicated fallback: {NO_STRATEGY}" in plan.explain(fwd)
    (node,) = traced_graph(plan)[0].graph.find_nodes(op="call_function", target=torch.ops.aten._cdist_forward.default)
    assert pn.compute_us.tolist() == [ctx.costs.global_compute_us(node)]  # the whole op on every rank: no split
    # The gather into it is priced: from a batch-sharded activation, Replicate costs an all-gather.
    prod = ctx.graph.nodes[pn.inputs[0]]
    sharded = next(c.outs[0] for c in prod.candidates if any(p.is_shard() for p in c.outs[0]))
    gather = ctx.costs.redistribute(prod.meta, sharded, pn.candidates[0].ins[0])
    assert gather.us > 0 and any(s.kind == "all_gather" for s in gather.steps)
    assert pn.compute_us[0] > 0
    assert not _checked(plan).violations


def test_the_plan_checker_catches_a_fallback_that_forgets_to_gather():
    plan = _plan(Prototypes)
    fwd = "-/fwd/aten._cdist_forward.default#0"

    def forget(p):  # the prototypes' rows left sharded over dp: each rank measures half of them
        p.nodes[fwd].ins[1] = {"dp": "S(0)", "tp": "R"}

    bad = _checked(_tampered(plan, forget))
    assert any(v.group == "semantics" and v.where == fwd for v in bad.violations), bad


def test_a_random_op_that_is_not_dropout_is_replicated_and_listed():
    plan = _plan(Residual)
    (key,) = [k for k, why in plan.fallbacks.items() if why == RANDOM_OP]
    assert "aten.bernoulli" in key
    assert all(i == {"dp": "R", "tp": "R"} for i in plan.nodes[key].ins)
    check = _checked(plan)
    assert not check.violations and check.unchecked[key] == "random op"


def test_a_random_op_planned_on_a_shard_is_refused_naming_the_module_and_the_op():
    with fake_world(MESH) as mesh:
        with torch.device("meta"):
            model = Residual()
        planned = plan_for_pipeline(model, mse, (torch.randn(8, 16), torch.randn(8, 8)), mesh, ParallelPlan.auto())
        planned.pg.joint.close()
        check_replicated_fallbacks(planned.pg, planned.solved)  # as planned: replicated
        (key,) = [k for k, why in planned.solved.fallbacks.items() if why == RANDOM_OP]

        def shard(p):  # its input sharded on dim 1, not the batch
            p.nodes[key].ins[0] = {"dp": "R", "tp": "S(1)"}
            p.fallbacks.pop(key)  # and no longer listed: the op itself is still refused

        with pytest.raises(LoweringError, match=r"a random op that is not a dropout, aten\.bernoulli\.default at node .* "
                                                r"in module 'drop_path'.*input 0 \(Replicate\(\), Shard\(dim=1\)\)"):
            check_replicated_fallbacks(planned.pg, _tampered(planned.solved, shard))


def test_a_fallback_planned_on_a_shard_is_refused():
    with fake_world(MESH) as mesh:
        with torch.device("meta"):
            model = Prototypes()
        planned = plan_for_pipeline(model, mse, (torch.randn(8, 16), torch.randn(8, 8)), mesh, ParallelPlan.auto())
        planned.pg.joint.close()
        fwd = "-/fwd/aten._cdist_forward.default#0"

        def shard(p):
            p.nodes[fwd].ins[0] = {"dp": "S(0)", "tp": "R"}

        with pytest.raises(LoweringError, match=r"a replicated fallback, aten\._cdist_forward\.default .*input 0"):
            check_replicated_fallbacks(planned.pg, _tampered(planned.solved, shard))


def test_the_plan_checker_reads_the_constant_and_names_one_the_plan_leaves_out():
    plan = _plan(MaskFromPythonData, out=16)
    (key,) = plan.constants
    assert not _checked(plan).violations
    bad = _checked(_tampered(plan, lambda p: p.nodes.pop(key)))
    assert any(v.group == "structure" and v.where == key for v in bad.violations), bad
