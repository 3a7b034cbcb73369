"""python -m verify report: the JSON schema the issue promises, golden status, parity, errors."""

import json

import pytest

from verify.__main__ import main


# The report's default scenario is the golden scenario tiny-fsdp-dp8: in its xdist group, the
# pipeline run is the one the golden tests built (shared_pipeline_runs).
@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_report_json_schema_golden_status_and_parity(capsys, shared_pipeline_runs):
    assert main(["report", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert set(report) >= {"preset", "plan", "mesh", "params", "stages", "parity", "goldens"}
    assert report["preset"] == "tiny" and report["mesh"] == "dp=8"
    assert report["params"] == {"count": 21, "fsdp_sharded": 21}
    names = [s["name"] for s in report["stages"]]
    assert names[0] == "joint" and "second_compile fwd" in names and "pre_overlap_bucketing bwd" in names
    joint = report["stages"][0]
    assert joint["collectives"]["all_gather"]["dp"]["count"] == 21
    assert set(joint["collectives"]["all_gather"]["dp"]) == {"count", "bytes"}
    assert report["goldens"]["joint"] == "matches"
    assert report["goldens"]["collective counts"] == "matches"
    parity = report["parity"]
    assert parity["mesh"] == "dp=2"
    assert set(parity["vs_eager"]) == {"joint", "first_partition", "second_compile"}
    assert all(r["bitwise"] and r["tensors"] > 0 for r in parity["vs_eager"].values())
    assert 0 < parity["single_device_max_abs_diff"] < 1e-5
    assert "[verify]" in out.err, "progress goes to stderr"


def test_report_text_format():
    from verify.report import format_report

    report = {
        "preset": "tiny", "mesh": "dp=2", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
        "stages": [{"name": "joint", "nodes": 5, "collectives": {"all_gather": {"dp": {"count": 1, "bytes": 2048}}}}],
        "goldens": None,
        "parity": {"mesh": "dp=2", "steps": 2, "seconds": 1.0, "single_device_max_abs_diff": 1e-8,
                   "vs_eager": {"joint": {"bitwise": False, "mismatches": 1, "tensors": 4, "max_abs_diff": 0.5}}},
    }
    text = format_report(report)
    row = [line for line in text.splitlines() if line.startswith("joint")][0]
    assert row.split() == ["joint", "5", "1", "/", "2.0", "KiB"]
    assert "goldens: none for this scenario" in text
    assert "NOT bitwise: 1 of 4 tensors differ (max |diff| 5.00e-01)" in text


def test_golden_status_says_why_it_is_not_checked_without_goldens(tmp_path):
    from types import SimpleNamespace

    from verify.report import GOLDENS_NOT_CHECKED, format_report, golden_status
    from verify.scenario import Scenario

    run = SimpleNamespace(scenario=Scenario(), stages=[])  # a golden scenario: tiny fsdp dp=8
    assert golden_status(run, root=tmp_path) == GOLDENS_NOT_CHECKED
    text = format_report({"preset": "tiny", "mesh": "dp=8", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
                          "stages": [], "goldens": GOLDENS_NOT_CHECKED, "parity": None})
    assert "goldens: not checked (no goldens/ directory here: run from a source checkout" in text
