"""Lowering a plan (autoparallel/planner/lower.py) on a model that is not LLaMA, and its errors.

The two-layer MLP is planned on a fake 2x2 world (dp=2, tp=2) through the pipeline's plan
stage and lowered by its joint stage (and on an unequal 4x2 world, pinned so that each move
changes one mesh dim only): the lowered graph takes this rank's local shapes under
the plan, carries roles, descriptors and the group registry, is called like a traced joint
graph, and names for each collective the planned node it serves. Bad plans name the node.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel import patches
from autoparallel import pipeline as P
from autoparallel import roles
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner.costs import CostModel
from autoparallel.planner.graph import ALIAS
from autoparallel.planner.lower import (
    LoweringError,
    LoweringReport,
    PlacedInterpreter,
    _dim_order,
    decode,
    in_layout_of,
    local_shape,
    lower_plan,
    node_placements,
    shard_tensor,
    sink_placeholder_aliases,
)
from autoparallel.planner.moves import PATCH as DIRECT_MOVES
from autoparallel.planner.profile import get_profile
from verify.graphs.plan_lowering import (
    expected_on,
    mismatches,
    predicted_by_node,
    traced_by_node,
    traced_comm,
)
from verify.parity.plan_check import assert_plan_valid

MESH = "dp=2,tp=2"


@pytest.fixture(scope="module")
def lowered(mlp, mlp_batch):
    make_model, loss = mlp
    with torch.device("meta"):
        model = make_model()
    run = P.run_pipeline(model, loss, mlp_batch(), "auto", MESH, P.PipelineOptions(), until=P.JOINT)
    return run


def test_lowered_graph_takes_local_shapes_and_keeps_roles(lowered):
    run = lowered
    gm = run.stage(P.JOINT).graphs
    plan = run.planned.solution
    assert run.stage(P.JOINT).report.fixed_outputs == []
    with fake_world(MESH) as mesh:
        for ph in gm.graph.find_nodes(op="placeholder"):
            role = ph.meta[M.ROLE]
            placements = plan.params[roles.name(role)] if roles.is_param(role) else plan.inputs[role]
            full = next(n for n in run.planned.pg.graph.find_nodes(op="placeholder") if n.meta[M.ROLE] == role).meta[M.VAL]
            assert tuple(ph.meta[M.VAL].shape) == local_shape(full, decode(placements, plan.mesh_names), mesh), role
            assert M.DESC in ph.meta
    assert gm.meta[M.GM_GROUP_DIMS] and set(gm.meta[M.GM_GROUP_DIMS].values()) >= {"dp", "tp"}
    assert gm.graph.output_node().meta[M.ROLE][0] == "loss"
    # every collective says which planned node it moves an input for
    collectives = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.namespace == "_c10d_functional" and "wait" not in str(n.target)]
    assert collectives and all(n.meta[M.CUSTOM][M.PLANNED_NODE] in {*plan.nodes, "output"} for n in collectives)
    # the planner's block labels are not activation checkpointing: none reach the lowered graph
    assert not any(M.AC_REGION in (n.meta.get(M.CUSTOM) or {}) for n in gm.graph.nodes)


def test_lowered_graph_is_called_like_a_traced_joint_graph(lowered):
    gm = lowered.stage(P.JOINT).graphs
    primals = [torch.zeros(ph.meta[M.VAL].shape) for ph in gm.graph.find_nodes(op="placeholder") if not roles.is_tangent(ph.meta[M.ROLE])]
    code = gm.code
    assert "def forward(self, primals, tangents)" in code and len(primals) == len(lowered.joint.input_roles) - 1


def test_the_lowered_graph_returns_a_value_wherever_the_traced_graph_does(lowered):
    """Outputs are moved to their planned placements, not dropped: the lowered graph's outputs
    are values exactly where the planning trace's are (None stays None: no gradient)."""
    traced = lowered.planned.pg.graph.output_node().args[0]
    outs = lowered.stage(P.JOINT).graphs.graph.output_node().args[0]
    assert len(outs) == len(traced) and any(isinstance(a, fx.Node) for a in traced)
    assert [isinstance(a, fx.Node) for a in outs] == [isinstance(a, fx.Node) for a in traced]


def test_a_move_counts_one_redistributed_input_and_an_unchanged_placement_none():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    full = torch.arange(8.0).reshape(4, 2)
    with fake_world(MESH) as mesh:
        interp = PlacedInterpreter(gm, {}, mesh, {})
        rr = (Replicate(), Replicate())
        assert interp.move(full, full, rr, rr) is full and interp.report.moved_inputs == 0
        assert torch.equal(interp.move(full, full, rr, (Shard(0), Replicate())), full[:2])  # rank 0's half, no collective
        assert interp.report.moved_inputs == 1


def test_an_output_dtensor_places_otherwise_is_moved_to_the_plan_and_reported(mlp, mlp_batch, caplog):
    """A plan that places relu's output replicated where DTensor keeps its input's sharding:
    lowering gathers it to the plan and reports relu's key among the outputs it redistributed."""
    make_model, loss = mlp
    with torch.device("meta"):
        model = make_model()
    with fake_world(MESH) as mesh:
        run = P.run_pipeline(model, loss, mlp_batch(), "auto", mesh, P.PipelineOptions(), until=P.PLAN)
        pg, plan = run.planned.pg, run.planned.solution
        relu = next(n for n in pg.graph.nodes if n.target is torch.ops.aten.relu.default)
        key = pg.keys[relu.name]
        replicated = {"dp": "R", "tp": "R"}
        assert plan.nodes[key].out[0] != replicated
        plan.nodes[key].out[0] = replicated
        with caplog.at_level(logging.INFO, logger="autoparallel.planner.lower"):
            _, report = lower_plan(pg, plan, ParallelPlan.auto())
    assert report.fixed_outputs == [key]
    assert [r.getMessage() for r in caplog.records if r.name == "autoparallel.planner.lower"] == [
        f"lowered the plan: {report.summary()} ({report.seconds:.2f}s)"]


def test_the_lowering_report_summary():
    report = LoweringReport(moved_inputs=3, nodes_before=10, nodes_after=14)
    assert report.summary() == "10 unsharded nodes -> 14 per-rank nodes; 3 inputs redistributed"
    report.fixed_outputs = ["a", "b"]
    assert report.summary() == "10 unsharded nodes -> 14 per-rank nodes; 3 inputs redistributed, 2 outputs redistributed to the plan"


def test_a_node_the_plan_does_not_place_is_named(lowered):
    pg = lowered.planned.pg
    plan = lowered.planned.solution
    mm = next(n for n in pg.graph.nodes if n.target is torch.ops.aten.mm.default)
    key = pg.keys[mm.name]
    entry = plan.nodes.pop(key)
    try:
        with fake_world(MESH), pytest.raises(LoweringError, match=rf"node '{mm.name}' \(key '{key}'.*has no placement in the plan"):
            node_placements(pg, plan)
    finally:
        plan.nodes[key] = entry


def test_a_plan_for_another_mesh_is_refused(lowered):
    pg, plan = lowered.planned.pg, lowered.planned.solution
    mesh, plan.mesh = plan.mesh, [("x", 2), ("y", 2)]
    try:
        with pytest.raises(LoweringError, match=r"the plan is for mesh dims \['x', 'y'\], the graph's world has \['dp', 'tp'\]"):
            node_placements(pg, plan)
    finally:
        plan.mesh = mesh


def test_lowering_needs_the_export_of_the_planning_trace(lowered):
    pg = lowered.planned.pg
    assert pg.joint is None  # the joint stage consumed it
    with pytest.raises(ValueError, match=r"keep_joint=True"):
        lower_plan(pg, lowered.planned.solution, None)


def test_predicted_collectives_are_the_lowered_graphs_on_a_model_that_is_not_llama(lowered):
    """The MLP's plan is Megatron-like (up split on its outputs over both dims, down on its inputs,
    its partial product all-reduced over dp then tp): exactly what the lowered graph runs."""
    plan, gm = lowered.planned.solution, lowered.stage(P.JOINT).graphs
    with fake_world(MESH) as mesh:
        costs = CostModel(get_profile(plan.profile), mesh.spec, mesh.device_mesh)
        assert traced_comm(gm) == expected_on(plan.comm, "cpu", dict(plan.mesh)) != {}
        assert mismatches(predicted_by_node(lowered.planned.pg, plan, costs), traced_by_node(gm)) == []


def test_shard_tensor_is_this_ranks_piece():
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    with fake_world(MESH) as mesh:  # rank 0: coordinate (0, 0)
        assert torch.equal(shard_tensor(full, (Shard(0), Shard(0)), mesh), full[:2])
        assert torch.equal(shard_tensor(full, (Shard(1), Replicate()), mesh), full[:, :2])
        assert torch.equal(shard_tensor(full, (Replicate(), Replicate()), mesh), full)
        assert local_shape(full, (Shard(0), Shard(1)), mesh) == (4, 2)
        with pytest.raises(ValueError, match="Replicate/Shard placements"):
            shard_tensor(full, (Partial(), Replicate()), mesh)


def test_placeholder_aliases_sink_to_their_first_user():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(ALIAS, (x,))
    n1 = g.call_function(torch.ops.aten.neg.default, (y,))
    n2 = g.call_function(torch.ops.aten.add.Tensor, (n1, a))
    n3 = g.call_function(torch.ops.aten.mul.Tensor, (n2, a))
    g.output((n3,))
    assert sink_placeholder_aliases(g) == 1
    assert [n.name for n in g.nodes][2:5] == [n1.name, a.name, n2.name]
    assert sink_placeholder_aliases(g) == 0  # already there
    g.lint()


UNEQUAL = "dp=4,tp=2"
# up.weight split over dp only, down.weight over tp only: the activation is gathered over dp and
# the weight over tp, each move changing one mesh dim while the other stays replicated.
ONE_DIM_PINS = {"up.weight": "dp:S(0),tp:R", "down.weight": "dp:R,tp:S(0)"}


def _pinned_joint(mlp, batch, pins, mesh):
    """The MLP planned with ``pins`` on ``mesh`` (no memory budget), run up to the joint stage."""
    make_model, loss = mlp
    with torch.device("meta"):
        model = make_model()
    spec = ParallelPlan.auto(pins=pins, memory_budget=float("inf"))
    return P.run_pipeline(model, loss, batch, spec, mesh, P.PipelineOptions(), until=P.JOINT)


def test_lowering_on_an_unequal_2d_mesh_with_moves_on_one_dim_only(mlp, mlp_batch):
    run = _pinned_joint(mlp, mlp_batch(), ONE_DIM_PINS, UNEQUAL)
    plan, gm, pg = run.planned.solution, run.stage(P.JOINT).graphs, run.planned.pg
    assert_plan_valid(plan)
    moved = {}  # mesh dims whose placement a move changes -> how many such moves
    for key, node in plan.nodes.items():
        for producer, want, steps in zip(_producers(pg, key), node.ins, node.comm or [[]] * len(node.ins), strict=False):
            if steps:
                changed = tuple(d for d in plan.mesh_names if plan.nodes[producer].out[0][d] != want[d])
                moved[changed] = moved.get(changed, 0) + 1
    assert moved == {("dp",): 1, ("tp",): 1}
    with fake_world(UNEQUAL) as mesh:
        costs = CostModel(get_profile(plan.profile), mesh.spec, mesh.device_mesh)
        assert traced_comm(gm) == expected_on(plan.comm, "cpu", dict(plan.mesh)) == {
            "all_gather": {"dp": {"count": 1, "bytes": 512}, "tp": {"count": 1, "bytes": 1024}}}
        assert mismatches(predicted_by_node(pg, plan, costs), traced_by_node(gm)) == []
        weights = {ph.meta[M.ROLE]: tuple(ph.meta[M.VAL].shape) for ph in gm.graph.find_nodes(op="placeholder")}
    assert weights[roles.param("up.weight")] == (8, 16) and weights[roles.param("down.weight")] == (4, 32)


def _producers(pg, key: str) -> list[str]:
    """The canonical keys of a planned node's tensor inputs."""
    node = pg.node_by_key().get(key)
    if node is None or node.op != "call_function":
        return []
    return [pg.keys[a.name] for a in node.all_input_nodes]


# --- moved pieces keep the traced value's memory layout ---------------------------------------------


def test_a_moved_piece_takes_the_traced_layout_so_the_graphs_views_still_apply():
    """OPT/ViT/BART/Starcoder2 under plan='auto': attention's output is a transposed view of a
    kernel's [B, S, H, D]-laid result, so the traced graph views it as [B, S, H*D]; a redistribution
    hands back its piece contiguous in [B, H, S, D], whose transpose cannot be viewed so ('Cannot
    view a tensor with shape [4, 8, 2, 16] and strides (256, 16, 128, 1)')."""
    traced = torch.empty(4, 8, 4, 16).transpose(1, 2)  # [B, H, S, D] laid out as [B, S, H, D]
    piece = torch.randn(4, 2, 8, 16)  # a moved piece, contiguous in its logical order
    with pytest.raises(RuntimeError, match="view"):
        piece.transpose(1, 2).view(4, 8, 32)
    laid = in_layout_of(piece, traced)
    assert torch.equal(laid, piece) and laid.stride() == (256, 16, 32, 1)
    assert laid.transpose(1, 2).view(4, 8, 32).shape == (4, 8, 32)
    assert in_layout_of(laid, traced) is laid, "a piece laid out already is not copied"
    strided = torch.randn(4, 8, 4, 16)[:, :, :2]  # an all-gather's chunk: the traced value is contiguous
    assert not strided.is_contiguous() and in_layout_of(strided, torch.empty(4, 8, 4, 16)).is_contiguous()
    assert in_layout_of(piece, 3.0) is piece and in_layout_of(torch.randn(5), torch.empty(5)).shape == (5,)


@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4), data=st.data())
@settings(max_examples=50, deadline=None)
def test_in_layout_of_keeps_values_and_takes_the_traced_dim_order(shape, data):
    n = len(shape)
    traced_perm = data.draw(st.permutations(range(n)))
    piece_perm = data.draw(st.permutations(range(n)))
    physical = [shape[d] for d in traced_perm]
    traced = torch.empty(physical).permute(sorted(range(n), key=traced_perm.__getitem__))
    piece = torch.randn([shape[d] for d in piece_perm]).permute(sorted(range(n), key=piece_perm.__getitem__))
    assert list(traced.shape) == shape == list(piece.shape)
    laid = in_layout_of(piece, traced)
    assert torch.equal(laid, piece)
    assert laid.permute(_dim_order(traced)).is_contiguous(), "dense, in the traced dims' memory order"
    assert laid.is_contiguous() or not traced.is_contiguous()


def test_a_piece_laid_out_already_adds_no_node_to_the_lowered_graph():
    """The lowered graph is traced through the interpreter: checking the layout must not record an
    op (a permute made to ask is_contiguous() lands in every golden), and an identity order copies
    with contiguous() alone."""
    traced = torch.empty(4, 6)
    dense = make_fx(lambda t: in_layout_of(t, traced))(torch.randn(4, 6))
    assert [n.op for n in dense.graph.nodes] == ["placeholder", "output"]
    strided = make_fx(lambda t: in_layout_of(t[:, :3], torch.empty(4, 3)))(torch.randn(4, 6))
    ops = [n.target for n in strided.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.permute.default not in ops and torch.ops.aten.clone.default in ops


# --- gathers and scatters of a dim other than 0: one permuted copy each ------------------------------

# The hand FSDP+TP placements of the MLP (up colwise, down rowwise): gathering down.weight's tp
# shard is a gather of dim 1, which DTensor traces as split -> W getitems -> cat.
HAND_PINS = {"up.weight": "dp:S(0),tp:S(0)", "down.weight": "dp:S(0),tp:S(1)"}


def test_the_lowered_graph_has_no_split_cat_move(mlp, mlp_batch):
    """The moves are written directly (planner/moves.py): a dim-1 gather is traced as one permuted
    copy after the all-gather, so no split -> getitems -> cat is traced and none is left for
    permuted_split_cat to rewrite."""
    run = _pinned_joint(mlp, mlp_batch(), HAND_PINS, MESH)
    gm, report = run.stage(P.JOINT).graphs, run.stage(P.JOINT).report
    targets = [n.target for n in gm.graph.nodes]
    assert report.split_cats == 0 and report.direct_moves >= 1 and report.dtensor_moves == {}
    assert "written directly" in report.summary()
    assert torch.ops.aten.cat.default not in targets and torch.ops.aten.split.Tensor not in targets
    # each gathered dim-1 piece: all_gather -> wait -> view -> permute -> contiguous clone -> view
    perm = [n for n in gm.graph.nodes if n.target is torch.ops.aten.permute.default]
    assert perm and all(p.args[0].args[0].target is torch.ops._c10d_functional.wait_tensor.default for p in perm)
    with fake_world(MESH) as mesh:
        costs = CostModel(get_profile(run.planned.solution.profile), mesh.spec, mesh.device_mesh)
        assert mismatches(predicted_by_node(run.planned.pg, run.planned.solution, costs), traced_by_node(gm)) == []


def _code_is_current(gm: fx.GraphModule) -> bool:
    return gm.code == gm.graph.python_code(root_module="self").src


def test_the_lowered_module_runs_its_final_graph_with_and_without_split_cat_rewrites(lowered, mlp, mlp_batch):
    """lower_plan edits the traced graph (placeholder names, unused getitems, permuted copies) and
    recompiles once after its last edit: the module's code is its final graph's, whether or not
    permuted_split_cat acted (it recompiles itself only when it did)."""
    with patches.disabled(DIRECT_MOVES):  # DTensor's moves: split -> cat chains for the pass to rewrite
        pinned = _pinned_joint(mlp, mlp_batch(), HAND_PINS, MESH)
    assert pinned.stage(P.JOINT).report.split_cats >= 1 and lowered.stage(P.JOINT).report.split_cats == 0
    # the live modules (a stage's snapshot is a copy, recompiled when copied)
    assert _code_is_current(pinned.joint.gm) and _code_is_current(lowered.joint.gm)


def test_a_graph_edited_after_its_last_recompile_is_seen_as_stale():
    """The negative of the check above: a placeholder renamed without a recompile is caught."""
    gm = fx.symbolic_trace(torch.nn.ReLU())
    assert _code_is_current(gm)
    next(iter(gm.graph.find_nodes(op="placeholder"))).name = "renamed_without_recompile"
    assert not _code_is_current(gm)
    gm.recompile()
    assert _code_is_current(gm)
