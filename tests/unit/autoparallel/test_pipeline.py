"""The pipeline driver (autoparallel/pipeline.py) on a model that is not LLaMA: a two-layer MLP with
a custom loss under FSDP on dp=2.

What it promises: one stage list made of the sub-lists that apply_placement and bucket_fw_bw run;
the composed collective passes are exactly what autoparallel_backend runs in one go; each stage
has a name, an input and its own copy of its graphs; observers see every stage as it ends; a stage
can be inserted ahead of the trace (a planner) and ``until`` stops early; bad input names the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import pipeline as P
from autoparallel.compile import SECOND_COMPILE
from autoparallel.fx_utils import ALL_GATHER, ALL_GATHER_OUT
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.partition import (
    PLACEMENT_STEP_NAMES,
    STEP_CLEANUP,
    STEP_FIRST_PARTITION,
    STEP_FSDP_TAGS,
)
from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES, CollectivePassesConfig
from autoparallel.patches import PATCHES
from verify.canon import canonicalize

MESH = "dp=2"


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def _run(mlp, options=None, plan=None, **kw):
    make_model, loss = mlp
    return P.run_pipeline(make_model(), loss, _inputs(), plan or ParallelPlan.fsdp("dp"), MESH, options, **kw)


@pytest.fixture(scope="module")
def observed(mlp):
    """One run of every stage (and the alternatives), with what an observer saw."""
    seen = []
    run = _run(mlp, P.PipelineOptions(alternatives=True), observers=[lambda r: seen.append((r.label, r.input))])
    return run, seen


def _ags(gm):
    return sum(1 for n in gm.graph.nodes if n.target in (ALL_GATHER, ALL_GATHER_OUT))


def test_one_stage_list_made_of_the_sub_lists_the_product_runs():
    assert P.STAGE_NAMES == (P.JOINT, *PLACEMENT_STEP_NAMES, SECOND_COMPILE, *COLLECTIVE_PASS_NAMES)
    assert P.STAGE_NAMES == (
        "joint", "cleanup", "fsdp_tagging", "first_partition", "second_compile",
        "fuse_chained_allgathers", "pre_overlap_bucketing", "topo_span_bucketing",
    )
    for stage in P.STAGES:
        assert stage.summary and all(p in PATCHES for p in stage.patches), stage.name


def test_every_stage_runs_in_order_with_its_input(observed):
    run, seen = observed
    assert run.names == list(P.STAGE_NAMES)
    inputs = [r.input for r in run.results]
    assert inputs == [None, *P.STAGE_NAMES[:-1]]
    assert run.input_of(STEP_CLEANUP) is run.stage(P.JOINT) and run.input_of(P.JOINT) is None
    assert all(r.seconds >= 0 for r in run.results)
    # observers: every stage, as it ends; the alternatives right after the second compile
    alone = [(f"{n} (alone)", SECOND_COMPILE) for n in COLLECTIVE_PASS_NAMES]
    i = P.STAGE_NAMES.index(SECOND_COMPILE) + 1
    assert seen == [*((r.name, r.input) for r in run.results[:i]), *alone, *((r.name, r.input) for r in run.results[i:])]
    assert [r.label for r in run.alternatives] == [label for label, _ in alone]


def test_each_stage_keeps_its_own_graphs(observed):
    run, _ = observed
    cleaned, tagged = run.stage(STEP_CLEANUP).graphs, run.stage(STEP_FSDP_TAGS).graphs
    assert cleaned is not tagged
    tags = lambda gm: [n.meta.get(M.RECOMPUTE) for n in gm.graph.nodes if n.target is ALL_GATHER]  # noqa: E731
    assert tags(cleaned) == [None, None]  # the tagging stage wrote on its own graph
    assert tags(tagged) == [CheckpointPolicy.MUST_RECOMPUTE] * 2
    assert run.stage(STEP_CLEANUP).report.nodes_after == len(cleaned.graph.nodes)
    fw, bw = run.stage(SECOND_COMPILE).graphs
    assert _ags(fw) == 2  # not merged by the bucketing stages that ran after it
    assert _ags(run.stage("pre_overlap_bucketing").graphs[0]) == 1
    assert fw.meta[M.GM_STAGE] == "second_compile/forward"
    assert run.stage("pre_overlap_bucketing").graphs[1].meta[M.GM_STAGE] == "pre_overlap_bucketing/backward"


def test_rewriting_the_second_compiles_graphs_leaves_the_kept_module_as_compiled(observed, mlp):
    """Failed before second_compile handed out copies with keep_compiled. The collective stages
    rewrite their input in place, and the kept module ran whatever they left, so the parity row
    'second_compile' tested the last collective stage's graphs instead (with T5's dropout, it
    showed that stage's reordered masks as a second-compile failure)."""
    run, _ = observed
    with fake_world(MESH) as mesh:
        local = P.PipelineState(mlp[0](), mlp[1], _inputs(), ParallelPlan.fsdp("dp"), mesh, P.PipelineOptions()).local_inputs()
        try:
            kept = P.second_compile(run.module, mesh, local, keep_compiled=True)
            loss = kept.compiled(*local).detach()
            out = kept.fw.graph.output_node()
            with kept.fw.graph.inserting_before(out):
                doubled = kept.fw.graph.call_function(torch.ops.aten.mul.Tensor, (out.args[0][0], 2.0))
            out.args = ((doubled, *out.args[0][1:]),)
            kept.fw.recompile()
            assert torch.equal(kept.compiled(*local), loss)
        finally:
            torch._dynamo.reset()


def test_composed_passes_are_what_the_backend_runs(observed, mlp):
    """The sequence the pipeline shows, one stage per pass, gives the graphs the backend gives when
    it runs the same passes inside one compile."""
    run, _ = observed
    config = P.PipelineOptions().collective
    with fake_world(MESH) as mesh:  # names its groups as the run's world did
        local = P.PipelineState(mlp[0](), mlp[1], _inputs(), ParallelPlan.fsdp("dp"), mesh, P.PipelineOptions()).local_inputs()
        once = P.second_compile(run.module, mesh, local, collective_passes=config)
    last = run.stage(COLLECTIVE_PASS_NAMES[-1]).graphs
    assert [canonicalize(g) for g in last] == [canonicalize(once.fw), canonicalize(once.bw)]
    assert once.metrics.counts["fw"]["all_gather"] == (2, 1)


def test_a_pass_switched_off_is_no_stage_and_until_stops(mlp):
    config = CollectivePassesConfig(schedule_overlap=False)
    run = _run(mlp, P.PipelineOptions(collective=config, snapshots=False), until="pre_overlap_bucketing")
    assert run.names == list(P.STAGE_NAMES[: P.STAGE_NAMES.index("pre_overlap_bucketing") + 1])
    assert run.alternatives == [] and run.compiled is None
    with pytest.raises(KeyError, match=r"no stage 'topo_span_bucketing' in this run; stages: \['joint'"):
        run.stage("topo_span_bucketing")
    run = _run(mlp, P.PipelineOptions(collective=config), until=STEP_FIRST_PARTITION)
    assert run.names[-1] == STEP_FIRST_PARTITION and run.module is not None


def test_a_planner_stage_goes_ahead_of_the_trace(mlp):
    def plan_stage(state):
        state.plan = ParallelPlan.fsdp("dp")  # what a planner decides for plan="auto"
        return None, "planned"

    stages = P.insert_stage(P.STAGES, P.Stage("plan", plan_stage, "choose placements"), before=P.JOINT)
    run = _run(mlp, plan="auto", stages=stages, until=P.JOINT)
    assert run.names == ["plan", P.JOINT]
    assert run.stage("plan").graphs is None and run.stage("plan").report == "planned"
    assert run.stage(P.JOINT).input is None  # the planner made no graph to read
    with pytest.raises(ValueError, match=r"plan='other' is not a ParallelPlan.*insert_stage\(STAGES, planner_stage, before='joint'\)"):
        _run(mlp, plan="other", until=P.JOINT)


def test_plan_auto_runs_the_planned_stage_list(mlp):
    """plan="auto" runs the planner's stage ahead of the trace by default; forced through the
    hand stage list, the trace says what is missing."""
    assert P.stages_for("auto") == P.PLANNED_STAGES == P.stages_for(ParallelPlan.auto())
    assert P.stages_for(ParallelPlan.fsdp()) == P.STAGES
    assert P.PLANNED_STAGE_NAMES == (P.PLAN, *P.STAGE_NAMES)
    with pytest.raises(ValueError, match=r"plan='auto' needs the plan stage ahead of 'joint'"):
        _run(mlp, plan="auto", stages=P.STAGES, until=P.JOINT)


def test_bad_arguments_name_the_stages(mlp):
    with pytest.raises(ValueError, match=r"until='nope' is no stage; stages: \['joint', 'cleanup'"):
        _run(mlp, until="nope")
    with pytest.raises(ValueError, match=r"no stage 'nope' to insert 'x' before"):
        P.insert_stage(P.STAGES, P.Stage("x", lambda s: (None, None), "x"), before="nope")
    with pytest.raises(ValueError, match=r"a stage named 'joint' is already in the list"):
        P.insert_stage(P.STAGES, P.STAGES[0], before="cleanup")


def test_every_patch_is_applied_by_a_stage_or_belongs_to_the_graph_trainer():
    """A patch of pipeline steps 3-6 names its stage (Stage.patches); the graph trainer, a second
    front end, has its own (its guards are trainer tests)."""
    staged = {p for stage in P.PLANNED_STAGES for p in stage.patches}
    trainer = {n for n, patch in PATCHES.items() if all(g.startswith("tests/unit/autoparallel/trainer/") for g in patch.guards)}
    assert staged.isdisjoint(trainer)
    assert set(PATCHES) == staged | trainer, f"patches in no stage: {sorted(set(PATCHES) - staged - trainer)}"
