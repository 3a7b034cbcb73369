"""python -m verify report --trainer: the graph trainer's stages with measured memory, goldens and
parity, as a table, JSON and a page (the measured CPU timeline beside the static one)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from verify.__main__ import main
from verify.commands.html.page import page_sections
from verify.commands.trainer_report import format_report
from verify.parity.trainer import TRAINER_STAGES

pytestmark = [pytest.mark.xdist_group("trainer"), pytest.mark.usefixtures("one_thread")]  # the cached debug traces


def figures(chunk: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", chunk, re.S)]


# The whole command: traces, profiled steps and parity runs of the debug preset (~2.5 s), in CI's
# slow step; the tier keeps the pieces it is made of (trainer goldens, parity, memory, format_report).
@pytest.mark.slow
def test_trainer_report_json_page_measured_memory_goldens_and_parity(capsys, tmp_path):
    assert main(["report", "--trainer", "--json", "--html", str(tmp_path)]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert (report["preset"], report["policy"], report["batch"]) == ("debug", "op", 4)
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(TRAINER_STAGES)
    assert all(s["measured_peak_bytes"] > 0 and s["static_peak_bytes"] > 0 for s in stages.values())
    # remat frees activations: both the static estimate and the measured step say so
    assert stages["after_remat"]["static_peak_bytes"] < stages["before_remat"]["static_peak_bytes"]
    assert stages["after_remat"]["measured_peak_bytes"] < stages["before_remat"]["measured_peak_bytes"]
    assert stages["after_remat"]["nodes"] > stages["before_remat"]["nodes"]  # recomputed ops duplicated
    assert {n: s["golden"] for n, s in stages.items()} == {"traced_step": "none", "before_remat": "matches",
                                                            "after_remat": "matches"}
    vs = report["parity"]["vs_eager"]
    assert {n: (r["a"], r["bitwise"]) for n, r in vs.items()} == {
        "traced_step": ("eager", True), "before_remat": ("eager", True), "after_remat": ("eager+apply_ac(op)", True)}
    assert all(r["tensors"] == 2 * (1 + 21) for r in vs.values())  # 2 steps x (loss + 21 parameter grads)

    secs = page_sections(Path(report["html"]).read_text(encoding="utf-8"))
    assert list(secs) == list(TRAINER_STAGES)
    for name, chunk in secs.items():
        figs = figures(chunk)
        assert [f.get("data-figure") for f in figs] == ["memory", "measured-memory"], name
        phases = {e.get("class") for e in figs[0].iter() if (e.get("class") or "").startswith("phase ")}
        assert phases == {"phase phase-forward", "phase phase-backward"}, name
        assert "data-parity='ok'" in chunk and "bitwise equal to eager (44 tensors, one process, 2 steps)" in chunk
        assert f"data-golden='{stages[name]['golden']}'" in chunk, name
    assert "data-same-as-previous" not in secs["after_remat"]  # remat duplicates recomputed ops


def test_trainer_report_text():
    row = {"nodes": 540, "static_peak_bytes": 2**20, "measured_peak_bytes": None, "golden": "none"}
    report = {"preset": "debug", "policy": "op", "batch": 4,
              "stages": [{"name": "traced_step", **row}, {"name": "after_remat", **row, "golden": "differs"}],
              "parity": {"steps": 2, "where": "one process", "seconds": 1.0, "vs_eager": {
                  "after_remat": {"a": "eager+apply_ac(op)", "bitwise": False, "tensors": 88, "mismatches": 2,
                                  "max_abs_diff": 1e-3}}}}
    lines = format_report(report).splitlines()
    assert lines[0] == "graph trainer report: preset=debug policy=op batch=4"
    assert lines[2].split() == ["stage", "nodes", "static", "peak", "measured", "peak", "golden"]
    assert lines[3].split() == ["traced_step", "540", "1.0", "MiB", "-", "none"]
    assert lines[4].endswith("differs")
    assert lines[-1] == ("  after_remat    vs eager+apply_ac(op): NOT bitwise: 2 of 88 tensors differ "
                         "(max |diff| 1.00e-03) (88 tensors)")
    report["parity"] = None
    assert format_report(report).splitlines()[-1] == "parity: skipped (--no-parity)"
