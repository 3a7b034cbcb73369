"""python -m verify report: the JSON schema the issue promises, golden status, parity, errors."""

import json
import re
from pathlib import Path

import pytest

from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.pipeline import STAGE_NAMES
from verify.__main__ import main
from verify.commands.html.page import page_sections as sections
from verify.commands.report import GOLDENS_NOT_CHECKED, ORACLE_SKIPPED, format_report, golden_status, parity_passed
from verify.parity.runs import STAGE_EXECUTORS
from verify.stages.scenario import Scenario


def _report_and_sections(capsys, tmp_path, *flags: str) -> tuple[dict, str, dict[str, str]]:
    assert main(["report", *flags, "--json", "--html", str(tmp_path / "page")]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert "[verify]" in out.err, "progress goes to stderr"
    assert report["html"] == str(tmp_path / "page" / "index.html") and f"wrote {report['html']}" in out.err
    return report, out.err, sections(Path(report["html"]).read_text(encoding="utf-8"))


def _check_schema_goldens_and_page(report: dict, secs: dict[str, str]) -> None:
    assert set(report) >= {"preset", "plan", "mesh", "params", "stages", "parity", "goldens"}
    assert report["preset"] == "tiny" and report["mesh"] == "dp=8"
    assert report["params"] == {"count": 21, "fsdp_sharded": 21, "without_grad": {}}
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
    # the page of the same run: a section per stage and alternative
    assert list(secs) == [*STAGE_NAMES, *(f"{n} (alone)" for n in COLLECTIVE_PASS_NAMES)]
    goldens = {name: re.search(r"data-golden='(\w+)'", chunk).group(1) for name, chunk in secs.items()}
    assert goldens == {name: "none" if name in COLLECTIVE_PASS_NAMES else "matches" for name in secs}


# The report's default scenario is the golden scenario tiny-fsdp-dp8: in its xdist group, the
# pipeline run is the one the golden tests built (shared_pipeline_runs).
@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_report_json_schema_golden_status_and_page(capsys, shared_pipeline_runs, tmp_path):
    report, _, secs = _report_and_sections(capsys, tmp_path, "--no-parity")
    _check_schema_goldens_and_page(report, secs)
    assert report["parity"] is None
    assert all("parity: not run for this stage" in sec and "data-parity" not in sec for sec in secs.values())


# With its parity run: a dp=2 pipeline and a gloo world training every stage (~7 CPU-s), so in CI's
# slow step; CI's first step runs the same command (the README's main job) and checks its report.
@pytest.mark.slow
@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_report_json_schema_golden_status_parity_and_page(capsys, shared_pipeline_runs, tmp_path):
    report, _, secs = _report_and_sections(capsys, tmp_path)
    _check_schema_goldens_and_page(report, secs)
    parity = report["parity"]
    assert parity["mesh"] == "dp=2"
    assert list(parity["vs_eager"]) == [s for s in STAGE_EXECUTORS if s != "eager"]
    assert all(r["bitwise"] and r["tensors"] > 0 for r in parity["vs_eager"].values())
    assert parity["oracle"]["passed"] and parity["oracle"]["worst_ratio"] < 1
    # FSDP over dp=2 averages two slice gradients, (g0 + g1) / 2, exactly as the oracle does with
    # the unsharded model on each slice: nothing is reordered, so the two agree to the bit
    assert parity["single_device_max_abs_diff"] == 0.0 and parity["oracle"]["tensors"] > 0
    # the page: verdicts from this parity run
    for stage in parity["vs_eager"]:  # the composed collective passes: on the last pass's section
        sec = secs[COLLECTIVE_PASS_NAMES[-1] if stage == "collective_passes" else stage]
        assert "data-parity='ok'" in sec and f"{parity['vs_eager'][stage]['tensors']} tensors" in sec
    oracle = f"single-device eager (oracle) PASS: max |diff| {parity['single_device_max_abs_diff']:.2e}"
    assert oracle in secs["joint"]
    assert "parity: not run for this stage" in secs["pre_overlap_bucketing"]


def test_report_text_format():
    report = {
        "preset": "tiny", "mesh": "dp=2", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
        "stages": [{"name": "joint", "nodes": 5, "collectives": {"all_gather": {"dp": {"count": 1, "bytes": 2048}}}}],
        "goldens": None,
        "parity": {"mesh": "dp=2", "steps": 2, "collectives": "rank-ordered", "seconds": 1.0, "single_device_max_abs_diff": 1e-8,
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
    assert "parity on gloo dp=2, forked world (2 steps with AdamW, rank-ordered reductions, 1.0s)" in text
    assert "NOT bitwise: 1 of 4 tensors differ (max |diff| 5.00e-01)" in text
    oracle = {"passed": False, "failures": 2, "tensors": 4, "max_abs_diff": 1e-3, "worst_ratio": 12.5,
              "tolerance": {"rtol": 1e-5, "dtype": "float32", "layers": 3, "width": 40}}
    report["parity"].update(oracle=oracle, oracle_summary="oracle: 2 of 4\n  grad:w: |diff| 1e-3 > bound 8e-5")
    report["html"] = "out/index.html"
    text = format_report(report)
    assert ("single-device eager (independent oracle, step 0): FAIL (2 of 4 tensors beyond tolerance); max |diff| "
            "1.00e-03, worst |diff|/bound 1.25e+01, rtol 1.00e-05 (float32, 3 layers x width 40)") in text
    assert "    grad:w: |diff| 1e-3 > bound 8e-5" in text
    assert not parity_passed(report["parity"])
    report["parity"]["vs_eager"]["joint"]["bitwise"] = True
    assert not parity_passed(report["parity"]), "every stage bitwise, the oracle failing: not passed"
    oracle["passed"] = True
    assert parity_passed(report["parity"]) and parity_passed(None)
    assert text.endswith("html report: out/index.html")
    # a stage that is not bitwise says why; the model's own is_compiling() branch is no failure
    report["parity"]["vs_eager"]["joint"]["bitwise"] = False
    report["parity"]["explanations"] = {"joint": "the model branches on that flag (m.py:3 (forward))"}
    assert not parity_passed(report["parity"])
    text = format_report(report)
    assert "    why: the model branches on that flag (m.py:3 (forward))" in text.splitlines()
    report["parity"]["model_branch"] = ["joint"]
    assert parity_passed(report["parity"])
    assert "bitwise with eager as traced (the model's own branch)" in format_report(report)
    # --no-oracle (the model does not fit one process): the report says so, the stages alone decide
    report["parity"].update(oracle=None, oracle_summary=ORACLE_SKIPPED, single_device_max_abs_diff=None, world="launched")
    text = format_report(report)
    assert f"  {ORACLE_SKIPPED}" in text.splitlines() and "parity on gloo dp=2, launched world" in text
    assert parity_passed(report["parity"])
    report["parity"]["model_branch"] = []
    assert not parity_passed(report["parity"]), "no oracle: a stage that is not bitwise still fails"


def test_golden_status_says_why_it_is_not_checked_without_goldens(tmp_path):
    from types import SimpleNamespace

    run = SimpleNamespace(results=[], alternatives=[])  # never read: the goldens are missing
    assert golden_status(Scenario(), run, root=tmp_path) == GOLDENS_NOT_CHECKED  # tiny fsdp dp=8 has goldens
    text = format_report({"preset": "tiny", "mesh": "dp=8", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
                          "stages": [], "goldens": GOLDENS_NOT_CHECKED, "parity": None})
    assert "goldens: not checked (no goldens/ directory here: run from a source checkout" in text


def test_report_names_the_parameters_without_a_gradient_and_says_why():
    report = {"preset": None, "model": "m", "mesh": "dp=2", "plan": "fsdp", "stages": [], "goldens": None, "parity": None,
              "params": {"count": 5, "fsdp_sharded": 5,
                         "without_grad": {"base.bias": "frozen", "base.weight": "frozen", "pool.weight": "unreached"}}}
    lines = format_report(report).splitlines()
    i = lines.index("params: 5 (5 FSDP-sharded)")
    assert lines[i + 1:i + 3] == ["no gradient (requires_grad=False): base.bias, base.weight",
                                  "no gradient (the loss does not reach them): pool.weight"]
    report["params"]["without_grad"] = {}
    assert "no gradient" not in format_report(report)
