"""An op DTensor has no registered strategy for but a decomposition of (``log_sigmoid_forward``):
the planner takes its candidates from DTensor's decomposition strategy, and the lowering runs the
op itself on the rank's pieces (``strategies.planned_by_decomposition``), since DTensor's own
dispatch of it fails at run time (the sweep's "does not have a sharding strategy registered").
A small model of our own planned and lowered on a fake dp=2,tp=2 world; its gloo parity is in
tests/parity/test_planned_fallbacks_parity.py (slow step)."""

from __future__ import annotations

import torch

from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import run_pipeline
from autoparallel.planner.strategies import PLANNER_RULES, planned_by_decomposition
from verify.zoo import LogSigmoidGate
from verify.zoo import mse_loss as mse

aten = torch.ops.aten
LOG_SIGMOID = aten.log_sigmoid_forward.default


def test_only_an_op_without_a_strategy_or_rule_is_planned_by_its_decomposition():
    assert planned_by_decomposition(LOG_SIGMOID)
    assert not planned_by_decomposition(aten.mm.default)  # a registered strategy
    assert not planned_by_decomposition(next(iter(PLANNER_RULES)))  # the planner's own rule
    assert not planned_by_decomposition(aten._cdist_forward.default)  # no decomposition: the replicated fallback


def test_an_op_planned_by_its_decomposition_is_lowered_to_a_call_on_the_local_pieces():
    with fake_world("dp=2,tp=2") as mesh:
        with torch.device("meta"):
            model = LogSigmoidGate()
        run = run_pipeline(model, mse, (torch.randn(8, 16), torch.randn(8, 8)), ParallelPlan.auto(), mesh,
                           until="joint", trace=None)
    plan, pg = run.planned.solution, run.planned.pg
    (node,) = pg.gm.graph.find_nodes(op="call_function", target=LOG_SIGMOID)
    assert pg.keys[node.name] not in plan.fallbacks  # placed by its candidates, not replicated
    (lowered,) = run.joint.gm.graph.find_nodes(op="call_function", target=LOG_SIGMOID)
    placed = plan.nodes[pg.keys[node.name]].ins[0]  # e.g. {"dp": "S(0)", "tp": "R"}
    split = [1, 1]
    for dim, p in placed.items():
        if p.startswith("S("):
            split[int(p[2:-1])] *= 2
    assert list(lowered.args[0].meta["val"].shape) == [8 // split[0], 32 // split[1]]  # the rank's piece

