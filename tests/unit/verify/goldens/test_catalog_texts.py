"""The golden texts the catalog writes (stage graphs, the plan stage, collective counts, the pass
order), checked exactly on hand-built pipeline runs: tiny FX graphs and pass reports stand in for
a real run's stage results, so these run in milliseconds where the golden tests run pipelines."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autoparallel import meta as M
from autoparallel.compile import SECOND_COMPILE
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.collective import GraphPassMetrics, PipelineMetrics
from autoparallel.passes.fuse_chained_allgathers import SAME_DIM, SHARED, ChainReport
from autoparallel.passes.pre_overlap_bucketing import PreOverlapResult
from autoparallel.pipeline import PLAN, PipelineRun, StageResult
from autoparallel.planner.alias_round_trips import AliasRoundTripReport
from autoparallel.planner.auto import PlanningReport
from verify.goldens import catalog, golden_sections
from verify.graphs.canon import canonicalize
from verify.graphs.stats import format_stats_table, partition_stats

c10d = torch.ops._c10d_functional
FSDP_HEADER = "preset: tiny\nmesh: dp=8\nplan: fsdp fsdp=dp reshard_after_forward=True"


def _node(g: fx.Graph, target, args, *shape) -> fx.Node:
    n = g.call_function(target, args)
    n.meta[M.VAL] = torch.empty(*shape, device="meta")
    return n


def _placeholder(g: fx.Graph, name: str, *shape) -> fx.Node:
    n = g.placeholder(name)
    n.meta[M.VAL] = torch.empty(*shape, device="meta")
    return n


def _module(g: fx.Graph) -> fx.GraphModule:
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {"1": "dp"}
    return gm


def gathered_forward() -> fx.GraphModule:
    """x [4, 16] all-gathered over dp=8, waited on, relu; returns the relu and saves x."""
    g = fx.Graph()
    x = _placeholder(g, "x", 4, 16)
    ag = _node(g, c10d.all_gather_into_tensor.default, (x, 8, "1"), 32, 16)
    wait = _node(g, c10d.wait_tensor.default, (ag,), 32, 16)
    g.output((_node(g, torch.ops.aten.relu.default, (wait,), 32, 16), x))
    return _module(g)


def scattered_backward() -> fx.GraphModule:
    """The saved x and a tangent; the tangent reduce-scattered (avg) over dp=8."""
    g = fx.Graph()
    _placeholder(g, "x", 4, 16)
    tangent = _placeholder(g, "tangents_1", 32, 16)
    rs = _node(g, c10d.reduce_scatter_tensor.default, (tangent, "avg", 8, "1"), 4, 16)
    g.output((_node(g, c10d.wait_tensor.default, (rs,), 4, 16),))
    return _module(g)


def test_stage_text_of_one_graph_is_header_stats_and_canonical_graph():
    text = catalog.stage_text("tiny-fsdp-dp8", StageResult("cleanup", gathered_forward(), 0.5))
    assert text == f"""# autoparallel golden v1
# tiny-fsdp-dp8 cleanup

== header ==
{FSDP_HEADER}
stage: cleanup

== stats ==
                                            graph
stat                           dim          count  bytes
all_gather                     dp               1  2048 (2.0 KiB)
wait_tensor                                     1
max_consec_compute_between_rs                   0
nodes                                           5
nodes                          placeholder      1
nodes                          output           1
nodes                          collective       1
nodes                          wait             1
nodes                          view             0
nodes                          compute          1
nodes                          other            0

== graph ==
arg_0: f32[4, 16]
all_gather_into_tensor_0: f32[32, 16] = _c10d_functional.all_gather_into_tensor.default(arg_0, 8, dp)
wait_tensor_0: f32[32, 16] = _c10d_functional.wait_tensor.default(all_gather_into_tensor_0)
relu_0: f32[32, 16] = aten.relu.default(wait_tensor_0)
return:
  relu_0
  arg_0
"""


def test_stage_text_of_a_forward_backward_pair_shows_both_graphs_and_the_partition_stats():
    fw, bw = gathered_forward(), scattered_backward()
    text = catalog.stage_text("tiny-fsdp-dp4-split", StageResult("first_partition", (fw, bw), 0.5))
    sections = {name: "\n".join(lines) for name, _, lines in golden_sections(text)}
    assert list(sections) == ["", "header", "stats", "forward", "backward"]
    assert sections[""] == "# autoparallel golden v1\n# tiny-fsdp-dp4-split first_partition"
    assert sections["header"] == (
        "\n== header ==\npreset: tiny\nmesh: dp=4\nplan: fsdp fsdp=dp reshard_after_forward=True\n"
        "passes: bucket_cap_mb=0.1 max_topo_span=60 overlap_bucket_cap_mb=None\nstage: first_partition"
    )
    # the partition's stats (forward and backward columns, saved for backward, static peak)
    stats = format_stats_table(partition_stats(fw, bw)).rstrip("\n")
    assert sections["stats"] == f"\n== stats ==\n{stats}"
    assert "saved for backward      1  256 (256 B)" in stats
    assert sections["forward"] == f"\n== forward ==\n{canonicalize(fw).rstrip()}"
    assert sections["backward"] == "\n".join([
        "", "== backward ==",
        "arg_0: f32[4, 16]",
        "arg_1: f32[32, 16]",
        "reduce_scatter_tensor_0: f32[4, 16] = _c10d_functional.reduce_scatter_tensor.default(arg_1, 'avg', 8, dp)",
        "wait_tensor_0: f32[4, 16] = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_0)",
        "return:",
        "  wait_tensor_0",
    ])
    assert text.endswith("  wait_tensor_0\n")


class _Solution:
    def text(self) -> str:
        return "model: Transformer\nmesh: dp=8\n\n## parameters\nw  dp:S(0)\n"


def _plan_result(aliases: AliasRoundTripReport) -> StageResult:
    report = PlanningReport(objective_us=1.0, compute_us=0.5, comm_us=0.5, proven_optimal=True, given=False,
                            aliases=aliases, solution=_Solution())
    return StageResult(PLAN, None, 0.5, report=report)


def test_plan_stage_text_lists_each_round_trip_rewired_erased_or_left_then_the_plan():
    aliases = AliasRoundTripReport(
        aliases_checked=3,
        round_trips=["mm_1[0] <- view_2", "mm_3[1] <- t_4", "add_5[0] <- view_6"],
        rewired=["mm_1[0] <- view_2", "add_5[0] <- view_6"],
        erased=["view_2"],
        saved_us=1.25,
    )
    assert catalog.stage_text("tiny-auto-dp8", _plan_result(aliases)) == """# autoparallel golden v1
# tiny-auto-dp8 plan

== header ==
preset: tiny
mesh: dp=8
plan: auto
stage: plan

== alias round trips ==
3 aliases placed apart from their producer: 3 round trips, 2 rewired to the producer, 1 aliases erased, 1.250 us of predicted communication saved
rewired mm_1[0] <- view_2
rewired add_5[0] <- view_6
erased view_2
left mm_3[1] <- t_4

== plan ==
model: Transformer
mesh: dp=8

## parameters
w  dp:S(0)
"""


def test_plan_stage_text_without_round_trips_has_the_summary_line_only():
    text = catalog.plan_stage_text("tiny-auto-dp4tp2", _plan_result(AliasRoundTripReport(aliases_checked=7)))
    assert "\n== alias round trips ==\n7 aliases placed apart from their producer: 0 round trips, 0 rewired to the " \
           "producer, 0 aliases erased, 0.000 us of predicted communication saved\n\n== plan ==\n" in text
    assert "mesh: dp=4,tp=2\nplan: auto\nstage: plan\n" in text


def _run(results: list[StageResult], alternatives: list[StageResult] = ()) -> PipelineRun:
    return PipelineRun(list(results), list(alternatives), joint=None, module=None, compiled=None, group_dims={})


def test_counts_text_has_a_row_per_graph_of_every_stage_then_the_alternatives():
    pair = (gathered_forward(), scattered_backward())
    run = _run(
        [
            StageResult(PLAN, None, 0.1),  # a stage without graphs has no row
            StageResult("joint", gathered_forward(), 0.1),
            StageResult("first_partition", pair, 0.1),
        ],
        [StageResult("pre_overlap_bucketing", pair, 0.1, alternative=True)],
    )
    assert catalog.counts_text("debug-fsdp-dp8", run) == """# autoparallel golden v1
# debug-fsdp-dp8 collective counts

== header ==
preset: debug
mesh: dp=8
plan: fsdp fsdp=dp reshard_after_forward=True
stage: all

== collectives ==
stage                              all_gather  reduce_scatter  all_reduce
joint                              dp:1/2048B  -               -
first_partition fwd                dp:1/2048B  -               -
first_partition bwd                -           dp:1/2048B      -
pre_overlap_bucketing (alone) fwd  dp:1/2048B  -               -
pre_overlap_bucketing (alone) bwd  -           dp:1/2048B      -
"""


def _bucketing(candidates: int, buckets: int, bucketed: int, span: int, topo: int | None = None) -> BucketingMetrics:
    return BucketingMetrics(num_candidates=candidates, num_buckets=buckets, num_bucketed=bucketed,
                            max_observed_span=span, closed_by_bytes=1, closed_by_span=2, skipped_dependent=3,
                            max_topo_span=topo)


def composed_run(*, fuse: bool = True) -> PipelineRun:
    """second_compile, then the collective passes with what each did (fuse_chained_allgathers
    only when ``fuse``): every kind of line the "what each pass did" section has."""
    pair = (gathered_forward(), scattered_backward())
    fused = PipelineMetrics({
        "fw": GraphPassMetrics({}, fused_chains=2, chains=ChainReport(
            fused=["a", "b"], unfused=[("c", SAME_DIM), ("d", SHARED), ("e", SAME_DIM)])),
        "bw": GraphPassMetrics({}, chains=ChainReport()),  # found nothing: nothing to do
    })
    pre = PipelineMetrics({
        "fw": GraphPassMetrics({}, pre_overlap=PreOverlapResult(True, {}, {}, {
            "all_gather": _bucketing(4, 1, 3, 9),
            "reduce_scatter": BucketingMetrics(),  # no candidates of a kind: not mentioned
        })),
    })
    topo = PipelineMetrics({
        "fw": GraphPassMetrics({}, overlap_bucketing=[_bucketing(3, 1, 2, 5, 60), _bucketing(0, 0, 0, 0, 60)],
                               max_consec_compute_between_rs=0),
        "bw": GraphPassMetrics({}, max_consec_compute_between_rs=4),
    })
    results = [StageResult(SECOND_COMPILE, pair, 0.1)]
    if fuse:
        results.append(StageResult("fuse_chained_allgathers", pair, 0.1, report=fused))
    results += [StageResult("pre_overlap_bucketing", pair, 0.1, report=pre),
                StageResult("topo_span_bucketing", pair, 0.1, report=topo)]
    return _run([StageResult("joint", gathered_forward(), 0.1), *results])


def test_order_text_numbers_the_passes_run_counts_after_each_and_what_each_did():
    assert catalog.order_text("tiny-fsdp-dp8", composed_run()) == f"""# autoparallel golden v1
# tiny-fsdp-dp8 collective pass order

== header ==
{FSDP_HEADER}
stage: collective passes (composed)

== order ==
0. second_compile: the partitioner tags the bucketable collectives of its joint graph (tag_joint)
1. fuse_chained_allgathers: dp->tp all-gather chains -> one all-gather on the flattened group
2. pre_overlap_bucketing: merge the collectives tagged on the joint graph into byte-capped buckets
3. topo_span_bucketing: Inductor's overlap scheduler (CPU roofline) with topo-span-bounded FSDP bucketing

== collectives ==
stage                        all_gather  reduce_scatter  all_reduce
second_compile fwd           dp:1/2048B  -               -
second_compile bwd           -           dp:1/2048B      -
fuse_chained_allgathers fwd  dp:1/2048B  -               -
fuse_chained_allgathers bwd  -           dp:1/2048B      -
pre_overlap_bucketing fwd    dp:1/2048B  -               -
pre_overlap_bucketing bwd    -           dp:1/2048B      -
topo_span_bucketing fwd      dp:1/2048B  -               -
topo_span_bucketing bwd      -           dp:1/2048B      -

== what each pass did ==
fuse_chained_allgathers fw: fused chains 2; 5 chained all-gathers found, 2 fused; left: 1 x an intermediate value has other users, 2 x both all-gathers on one mesh dim
fuse_chained_allgathers bw: nothing to do
pre_overlap_bucketing fw: all_gather: 1 buckets (3 of 4 collectives), max_span=9, closed (bytes=1, span=2), skipped dependent=3, max_topo_span=None
topo_span_bucketing fw: overlap bucketing: 1 buckets (2 of 3 collectives), max_span=5, closed (bytes=1, span=2), skipped dependent=3, max_topo_span=60; overlap bucketing: 0 buckets (0 of 0 collectives), max_span=0, closed (bytes=1, span=2), skipped dependent=3, max_topo_span=60; max_consec_compute_between_rs=0
topo_span_bucketing bw: max_consec_compute_between_rs=4
"""


def test_order_text_names_a_pass_that_did_not_run_as_off_after_those_that_did():
    text = catalog.order_text("tiny-ddp-dp8", composed_run(fuse=False))
    sections = {name: lines for name, _, lines in golden_sections(text)}
    assert sections["order"][2:] == [
        "0. second_compile: the partitioner tags the bucketable collectives of its joint graph (tag_joint)",
        "1. pre_overlap_bucketing: merge the collectives tagged on the joint graph into byte-capped buckets",
        "2. topo_span_bucketing: Inductor's overlap scheduler (CPU roofline) with topo-span-bounded FSDP bucketing",
        "-. fuse_chained_allgathers: off in this configuration",
    ]
    assert [row.split()[:2] for row in sections["collectives"][3:]] == [
        ["second_compile", "fwd"], ["second_compile", "bwd"], ["pre_overlap_bucketing", "fwd"],
        ["pre_overlap_bucketing", "bwd"], ["topo_span_bucketing", "fwd"], ["topo_span_bucketing", "bwd"],
    ]
    assert [ln.split(":")[0] for ln in sections["what each pass did"][2:]] == [
        "pre_overlap_bucketing fw", "topo_span_bucketing fw", "topo_span_bucketing bw"]


@pytest.mark.parametrize("sid", ["tiny-fsdp-dp4-split", "debug-fsdp-dp8", "tiny-fsdp-dp8"])
def test_golden_run_runs_the_scenario_with_the_pass_settings_its_goldens_were_made_with(sid, monkeypatch):
    calls = []
    monkeypatch.setattr(catalog, "run_scenario", lambda scenario, **kw: calls.append((scenario, kw)) or "the run")
    assert catalog.golden_run(sid) == "the run"
    assert calls == [(catalog.ALL_SCENARIOS[sid], catalog.PIPELINE_OPTIONS.get(sid, {}))]
    if sid == "tiny-fsdp-dp4-split":
        assert calls[0][1]["bucket_cap_mb"] == 0.1 and calls[0][1]["topo_span"].max_topo_span == 60


def test_metrics_lines_of_passes_composed_in_one_report_list_everything_in_pass_order():
    # bucket_fw_bw with every pass on (autoparallel_backend's run) records them all in one
    # graph's metrics: fused chains, pre-overlap buckets, overlap buckets, then the schedule.
    metrics = PipelineMetrics({"fw": GraphPassMetrics(
        {}, fused_chains=1, chains=ChainReport(fused=["a"], unfused=[("b", SHARED)]),
        pre_overlap=PreOverlapResult(True, {}, {}, {"all_gather": _bucketing(2, 1, 2, 4)}),
        overlap_bucketing=[_bucketing(3, 1, 2, 5, 60)], max_consec_compute_between_rs=2,
    )})
    assert catalog._metrics_lines("composed", metrics) == [
        "composed fw: fused chains 1; 2 chained all-gathers found, 1 fused; left: 1 x an intermediate value has "
        "other users; all_gather: 1 buckets (2 of 2 collectives), max_span=4, closed (bytes=1, span=2), skipped "
        "dependent=3, max_topo_span=None; overlap bucketing: 1 buckets (2 of 3 collectives), max_span=5, closed "
        "(bytes=1, span=2), skipped dependent=3, max_topo_span=60; max_consec_compute_between_rs=2"
    ]
