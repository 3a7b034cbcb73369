"""python -m verify scale keeps working (tiny sizes here; the 8B figures are a benchmark)."""

import json

import pytest

from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.pipeline import STAGE_NAMES
from verify.__main__ import main
from verify.commands.scale import format_scaling


@pytest.mark.xdist_group("scale-benchmark")  # tests/conftest.py SLOW_GROUPS: CI's slow step
def test_scale_json_has_every_stage_and_field(capsys):
    assert main(["scale", "--preset", "tiny", "--layers", "1", "--mesh", "dp=4,tp=2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    alternatives = [f"{name} (alone)" for name in COLLECTIVE_PASS_NAMES]
    assert [s["name"] for s in result["stages"]] == [*STAGE_NAMES, *alternatives]
    assert result["layers"] == 1 and result["mesh"] == "dp=4,tp=2"
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


def test_scaling_table_ratios():
    def result(layers, secs):
        return {"layers": layers, "stages": [{"name": "trace", "seconds": secs}]}

    table = format_scaling([result(2, 1.0), result(8, 4.0), result(32, 18.0)])
    assert "x8/2" in table and "x32/8" in table
    row = [line for line in table.splitlines() if line.startswith("trace")][0]
    assert row.split()[-2:] == ["4.00", "4.50"]
