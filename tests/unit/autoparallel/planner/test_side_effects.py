"""plan="auto" on a model whose trace holds calls run only for their side effect: ``F.one_hot``'s
index checks (``aten._assert_async.msg``, no output, no users: dbrx's router). The planner places
each as a replicated fallback with no output (patch side_effect_nodes,
``autoparallel.planner.side_effects``), the lowered graph keeps it and runs it on the whole value;
a batch that breaks the check raises its message. Small models of our own (``verify.zoo.OneHotRouter``),
planned on fake worlds; a gloo dp=2,tp=2 world of the same model, and a broken batch raising on
every rank: tests/parity/test_side_effects_parity.py (slow step)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import fx
from torch.distributed.tensor.placement_types import Partial, Replicate

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import JOINT, run_pipeline
from autoparallel.planner import Solution
from autoparallel.planner.auto import plan_for_pipeline
from autoparallel.planner.side_effects import PATCH, is_side_effect
from autoparallel.planner.strategies import SIDE_EFFECT, out_metas
from autoparallel.runtime.steps import joint_graph_executor
from verify.parity.plan_check import check_plan, traced_graph
from verify.parity.plan_semantics import simulate
from verify.zoo import ONE_HOT_PARTIAL_PINS, OneHotRouter, one_hot_loss, routed_batch

MESH = "dp=2,tp=2"
REPLICATED = {"dp": "R", "tp": "R"}
ASSERT = torch.ops.aten._assert_async.msg


def _model(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return OneHotRouter()


def _batch(n=8, seed=0):
    torch.manual_seed(seed)
    return routed_batch(n)


def _planned():
    with fake_world(MESH) as mesh:
        planned = plan_for_pipeline(_model(), one_hot_loss, _batch(), mesh, ParallelPlan.auto())
        planned.pg.joint.close()
    return planned


def test_an_assert_is_a_replicated_fallback_with_no_output():
    """one_hot's two checks, of the router's argmax and of the labels: each on the whole value
    (its one element Replicate: a Partial piece of ``all`` is one rank's term, not the value), no
    output placed, explained, and the independent plan checker finds nothing wrong."""
    planned = _planned()
    plan, pg = planned.solution, planned.pg
    keys = [pg.keys[n.name] for n in pg.gm.graph.find_nodes(op="call_function", target=ASSERT)]
    assert len(keys) == 4  # non-negative and smaller than num_classes, router and loss
    assert sorted(k for k, why in plan.fallbacks.items() if why == SIDE_EFFECT) == sorted(keys)
    for key in keys:
        assert plan.nodes[key].out == [], key
        assert plan.nodes[key].ins == [REPLICATED], key
        assert f"the replicated fallback: {SIDE_EFFECT}" in plan.explain(key)
    pn = next(n for n in plan._context.graph.nodes if n.key == keys[0])
    assert len(pn.candidates) == 1 and pn.candidates[0].outs == ()
    check = check_plan(plan, *traced_graph(plan))
    assert not check.violations, check


def test_without_the_patch_the_model_is_refused_at_the_assert():
    """What the sweep saw on dbrx: the first value-less node refuses the plan, named."""
    with patches.disabled(PATCH), pytest.raises(ValueError, match=r"node '_assert_async' .* has no tensor meta\['val'\]"):
        _planned()


def test_a_node_without_a_value_that_is_read_is_still_refused_naming_it_and_its_module():
    """Only a call nothing reads is a side effect: a node some other node reads needs its value
    (negative: the error names the node and its module)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta[M.VAL] = torch.zeros(2)
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    relu.meta[M.CUSTOM] = {M.MODULE_PATH: "router.gate"}
    graph.output((relu,))
    assert not is_side_effect(relu)
    with pytest.raises(ValueError, match=r"node 'relu_default' .* in module 'router.gate' has no tensor meta\['val'\] and 1 users"):
        out_metas(relu)
    alone = graph.call_function(ASSERT, (x, "checked"))  # no users, no value: a side effect
    assert is_side_effect(alone) and out_metas(alone) == ()
    with patches.disabled(PATCH):
        assert not is_side_effect(alone)


def _lowered_step(batch):
    """plan="auto" on a one-rank world, traced on the first batch; the lowered joint graph run on
    ``batch``: (joint, loss, grads)."""
    model = _model()
    with fake_world("dp=1") as mesh:
        joint = run_pipeline(model, one_hot_loss, _batch(), ParallelPlan.auto(), mesh, until="joint", trace=None).joint
        step = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
        loss, grads = step({k: v.detach().clone() for k, v in model.named_parameters()}, batch)
    return joint, loss, grads


def test_the_lowered_graph_keeps_the_assert_and_is_bitwise_with_eager():
    batch = _batch(seed=1)
    joint, loss, grads = _lowered_step(batch)
    assert len(joint.gm.graph.find_nodes(op="call_function", target=ASSERT)) == 4
    model = _model()
    want_loss = one_hot_loss(model(*batch[:-1]), batch[-1])
    want_loss.backward()
    assert torch.equal(loss, want_loss.detach())
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())


def test_a_batch_that_breaks_the_check_raises_its_message():
    """Negative: a negative label raises one_hot's message, as eager does (the assert was kept)."""
    x, labels = _batch(seed=1)
    labels[-1] = -1
    with pytest.raises(RuntimeError, match="Class values must be non-negative"):
        one_hot_loss(_model()(x), labels)
    with pytest.raises(RuntimeError, match="one_hot: Class values must be non-negative"):
        _lowered_step((x, labels))


def test_the_plan_checker_catches_an_assert_given_a_piece():
    """Negative: the same plan with one assert's input edited to a rank's term of ``all``
    (``Partial``) or to its rows (``Shard``) is caught by the independent checker, which runs the
    call on every simulated rank and wants the whole value there."""
    plan = _planned().solution
    key = sorted(k for k, why in plan.fallbacks.items() if why == SIDE_EFFECT)[0]
    gm, roles = traced_graph(plan)
    for piece in ({"dp": "P(sum)", "tp": "R"}, {"dp": "S(0)", "tp": "R"}):
        tampered = Solution.from_json(json.loads(json.dumps(plan.to_json())))
        tampered.nodes[key].ins = [piece]
        check = check_plan(tampered, gm, roles)
        assert any(v.where == key for v in check.violations), (piece, check)


def test_the_checker_wants_the_whole_input_of_a_call_with_no_output():
    """The checker's own rule, on one assert: Replicate passes; a Partial input (each rank a term
    of the value, not the value: here every term is nonzero, so each rank's check would pass
    whatever the sum) is named as not the whole value."""
    graph = fx.Graph()
    cond = graph.placeholder("cond")
    check = graph.call_function(ASSERT, (cond, "checked"))
    values = {cond: torch.tensor([1.5]), check: None}
    coords = [(0,), (1,)]
    assert simulate(check, values, [(Replicate(),)], [], [2], coords, seed=0) is None
    problem = simulate(check, values, [(Partial(),)], [], [2], coords, seed=0)
    assert problem and problem.startswith("input 0: rank (0,) passes a piece") and "not the whole value" in problem, problem


def test_every_stage_keeps_the_asserts_in_its_forward_and_a_per_rank_all_is_reduced_first():
    """dp=2,tp=2 (fake world), the labels' ``all`` pinned per data-parallel rank
    (``ONE_HOT_PARTIAL_PINS``): in the lowered graph that assert reads an all-reduce (product) of
    the ranks' terms, and every later stage's forward graph still holds the four asserts."""
    with fake_world(MESH) as mesh:
        run = run_pipeline(_model("meta"), one_hot_loss, _batch(), ParallelPlan.auto(pins=ONE_HOT_PARTIAL_PINS), mesh, trace=None)
    reduced = [n for n in run.stage(JOINT).graphs.graph.find_nodes(op="call_function", target=ASSERT)
               if n.args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    assert len(reduced) == 1 and "non-negative" in reduced[0].args[1]
    (reduce,) = reduced[0].args[0].args
    assert reduce.target is torch.ops._c10d_functional.all_reduce.default and reduce.args[1] == "product"
    for result in run.results:
        rows = result.graph_rows()
        if rows:  # the plan stage has no graph; a split stage's forward holds them
            assert len(rows[0][1].graph.find_nodes(op="call_function", target=ASSERT)) == 4, result.label
