"""python -m verify report: the JSON schema the issue promises, golden status, parity, errors."""

import json

import pytest

from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.pipeline import STAGE_NAMES
from verify.__main__ import main
from verify.parity_runs import STAGE_EXECUTORS
from verify.report import GOLDENS_NOT_CHECKED, format_report, golden_status
from verify.scenario import Scenario


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
    sequence = [s["name"] for s in report["stages"] if not s["alternative"]]
    assert sequence[:3] == ["joint", "cleanup", "fsdp_tagging"]
    # the collective passes in the order the backend runs them, then each pass alone
    assert sequence[-6:] == [f"{n} {g}" for n in COLLECTIVE_PASS_NAMES for g in ("fwd", "bwd")]
    assert names[len(sequence):] == [f"{n} (alone) {g}" for n in COLLECTIVE_PASS_NAMES for g in ("fwd", "bwd")]
    joint = report["stages"][0]
    assert joint["collectives"]["all_gather"]["dp"]["count"] == 21
    assert set(joint["collectives"]["all_gather"]["dp"]) == {"count", "bytes"}
    assert set(report["goldens"].values()) == {"matches"}
    assert set(report["goldens"]) == {*STAGE_NAMES, "collective pass order", "collective counts"}
    parity = report["parity"]
    assert parity["mesh"] == "dp=2"
    assert list(parity["vs_eager"]) == [s for s in STAGE_EXECUTORS if s != "eager"]
    assert all(r["bitwise"] and r["tensors"] > 0 for r in parity["vs_eager"].values())
    assert parity["oracle"]["passed"] and parity["oracle"]["worst_ratio"] < 1
    assert 0 < parity["single_device_max_abs_diff"] < 1e-5
    assert "[verify]" in out.err, "progress goes to stderr"


def test_report_text_format():
    report = {
        "preset": "tiny", "mesh": "dp=2", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
        "stages": [{"name": "joint", "nodes": 5, "collectives": {"all_gather": {"dp": {"count": 1, "bytes": 2048}}}}],
        "goldens": None,
        "parity": {"mesh": "dp=2", "steps": 2, "seconds": 1.0, "single_device_max_abs_diff": 1e-8,
                   "vs_eager": {"joint": {"bitwise": False, "mismatches": 1, "tensors": 4, "max_abs_diff": 0.5}}},
    }
    report["stages"].append({**report["stages"][0], "name": "p (alone)", "alternative": True})
    text = format_report(report)
    row = [line for line in text.splitlines() if line.startswith("joint")][0]
    assert row.split() == ["joint", "5", "1", "/", "2.0", "KiB"]
    lines = text.splitlines()
    i = lines.index(row)
    assert lines[i + 1].startswith("alternatives: each collective pass alone") and lines[i + 2].startswith("p (alone)")
    assert "goldens: none for this scenario" in text
    assert "NOT bitwise: 1 of 4 tensors differ (max |diff| 5.00e-01)" in text


def test_golden_status_says_why_it_is_not_checked_without_goldens(tmp_path):
    from types import SimpleNamespace

    run = SimpleNamespace(results=[], alternatives=[])  # never read: the goldens are missing
    assert golden_status(Scenario(), run, root=tmp_path) == GOLDENS_NOT_CHECKED  # tiny fsdp dp=8 has goldens
    text = format_report({"preset": "tiny", "mesh": "dp=8", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
                          "stages": [], "goldens": GOLDENS_NOT_CHECKED, "parity": None})
    assert "goldens: not checked (no goldens/ directory here: run from a source checkout" in text
