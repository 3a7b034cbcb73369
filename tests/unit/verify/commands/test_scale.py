"""python -m verify scale keeps working (tiny sizes here; the 8B figures are a benchmark)."""

import json

import pytest

from autoparallel.defaults import DEFAULT_LOWERING
from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.pipeline import STAGE_NAMES
from autoparallel.planner.lower import LoweringReport
from verify.__main__ import main
from verify.commands.scale import format_scaling, lowering_fields, pipeline_over_trace


@pytest.mark.xdist_group("scale-benchmark")  # tests/conftest.py SLOW_GROUPS: CI's slow step
def test_scale_json_has_every_stage_and_field(capsys):
    assert main(["scale", "--preset", "tiny", "--layers", "1", "--mesh", "dp=4,tp=2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    alternatives = [f"{name} (alone)" for name in COLLECTIVE_PASS_NAMES]
    assert [s["name"] for s in result["stages"]] == [*STAGE_NAMES, *alternatives]
    assert result["layers"] == 1 and result["mesh"] == "dp=4,tp=2" and result["lowering"] == DEFAULT_LOWERING
    for stage in result["stages"]:
        assert {"seconds", "rss_gib", "nodes", "collectives", "max_consec_compute_between_rs"} <= set(stage)
        assert stage["seconds"] >= 0
    by_name = {s["name"]: s for s in result["stages"]}
    second = by_name["second_compile"]
    first = by_name["first_partition"]
    fwd_ag = lambda s: sum(c["count"] for c in s["collectives"]["fwd"]["all_gather"].values())  # noqa: E731
    assert fwd_ag(second) == fwd_ag(first) == 12  # the seed's "357 = 357" property: 9 per block + 3
    assert fwd_ag(by_name["pre_overlap_bucketing"]) < fwd_ag(second)
    assert fwd_ag(by_name["pre_overlap_bucketing (alone)"]) < fwd_ag(second)
    assert "bucketing" in by_name["topo_span_bucketing"] and "bucketing" in by_name["topo_span_bucketing (alone)"]
    assert result["total_seconds"] > 0 and result["peak_rss_gib"] > 0
    stage_sum = sum(s["seconds"] for s in result["stages"])
    assert result["import_seconds"] >= 0
    assert abs(result["total_seconds"] - (result["import_seconds"] + stage_sum)) < 0.02
    trace = by_name["joint"]["seconds"]
    # the JSON rounds seconds to 0.01 s and the ratio to 0.01: recomputed from the rounded seconds,
    # the ratio can differ by up to 0.005 * (1 + ratio) / trace, plus the ratio's own rounding
    ratio = result["pipeline_seconds"] / trace
    assert result["pipeline_over_trace"] == pytest.approx(ratio, abs=0.005 * (1 + ratio) / trace + 0.005 + 1e-9)
    assert result["pipeline_over_trace_samples"] == [result["pipeline_over_trace"]]


def test_an_unknown_lowering_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["scale", "--preset", "tiny", "--lowering", "fast"])
    assert exit_info.value.code == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if "--lowering" in x and "invalid choice" in x)
    assert "'fast'" in line and "dtensor" in line and "replay" in line


def test_scaling_table_ratios():
    def result(layers, secs):
        return {"layers": layers, "stages": [{"name": "trace", "seconds": secs}]}

    table = format_scaling([result(2, 1.0), result(8, 4.0), result(32, 18.0)])
    assert "x8/2" in table and "x32/8" in table
    row = [line for line in table.splitlines() if line.startswith("trace")][0]
    assert row.split()[-2:] == ["4.00", "4.50"]
    assert "peak RSS" not in table  # no row for a figure the results lack


def test_scaling_table_has_each_sizes_trace_ratio_and_peak_rss():
    def result(layers, ratio, rss):
        return {"layers": layers, "stages": [], "pipeline_over_trace": ratio, "peak_rss_gib": rss}

    lines = format_scaling([result(8, 3.5, 0.5), result(32, 3.25, 1.5)]).splitlines()
    assert [x for x in lines if x.startswith("pipeline / trace")][0].split()[-2:] == ["3.50", "3.25"]
    assert [x for x in lines if x.startswith("peak RSS GiB")][0].split()[-2:] == ["0.50", "1.50"]


def test_the_trace_ratio_is_each_runs_own_then_the_median():
    def stages(joint, rest):
        return [{"name": "joint", "seconds": joint, "alternative": False},
                {"name": "cleanup", "seconds": rest, "alternative": False},
                {"name": "x (alone)", "seconds": 100.0, "alternative": True}]  # not the pipeline

    assert pipeline_over_trace(stages(2.0, 4.0), import_seconds=2.0) == 4.0
    planned = [{"name": "plan", "seconds": 9.0, "alternative": False, "planning": {"seconds": {"trace": 3.0}}},
               *stages(1.0, 2.0)]
    assert pipeline_over_trace(planned, import_seconds=0.0) == 4.0  # the plan stage's trace


def test_the_joint_stage_of_a_plan_reports_its_moves_by_kind():
    report = LoweringReport(moved_inputs=3, direct_moves=2, dtensor_moves={"S(0) -> S(1): shard to shard (all-to-all)": 1})
    fields = lowering_fields(report)
    assert fields["direct_moves"] == 2 and fields["dtensor_moves"] == {"S(0) -> S(1): shard to shard (all-to-all)": 1}
    assert fields["moved_inputs"] == fields["direct_moves"] + sum(fields["dtensor_moves"].values())
