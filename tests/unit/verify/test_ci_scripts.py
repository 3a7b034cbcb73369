"""The CI scripts: both README lines are found between their markers (the main job installs no
test extra), the main job's report check rejects incomplete reports, and .ci/gpu refuses a torch
without CUDA and overlays a venv interpreter's packages (its selection is tested in test_pytest_plugin.py with faked GPU counts)."""

import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from autoparallel.pipeline import STAGE_NAMES
from verify.commands.html.browser import unavailable_reason
from verify.commands.report import format_report

ROOT = Path(__file__).resolve().parents[3]


def readme_line(marker: str) -> str:
    """The line .ci/run runs (its readme_line function), through bash itself."""
    script = ROOT / ".ci" / "run"
    body = script.read_text()
    fn = body[body.index("readme_line() {"):body.index("main_line=")]
    out = subprocess.run(["bash", "-c", f"{fn}\nreadme_line {marker}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_both_readme_lines_are_found_and_the_main_job_is_the_base_install():
    main = readme_line("ci-main-command")
    tests = readme_line("ci-test-command")
    assert main.startswith("python3 -m venv .venv && ") and main.endswith(".venv/bin/python -m verify report")
    assert "-e . " in main and "[test]" not in main, "the main job must install no test extra"
    assert "-e '.[test]'" in tests and tests.endswith(".venv/bin/pytest -n auto")
    assert "-c constraints.txt" in main and "-c constraints.txt" in tests


def sample_report(**changes) -> str:
    stages = [{"name": "joint", "nodes": 5, "collectives": {}}]
    stages += [{"name": f"{s} {half}", "nodes": 5, "collectives": {}} for s in STAGE_NAMES[1:] for half in ("fwd", "bwd")]
    report = {
        "preset": "tiny", "mesh": "dp=8", "plan": "fsdp", "params": {"count": 1, "fsdp_sharded": 1},
        "stages": stages,
        "goldens": {**dict.fromkeys(STAGE_NAMES, "matches"), "collective counts": "matches"},
        "parity": {"mesh": "dp=2", "steps": 2, "collectives": "rank-ordered", "seconds": 1.0, "single_device_max_abs_diff": 1e-8,
                   "vs_eager": {s: {"bitwise": True, "mismatches": 0, "tensors": 4, "max_abs_diff": 0.0}
                                for s in ("joint", "first_partition", "second_compile")}},
    }
    report.update(changes)
    return format_report(report)


def check(text: str, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``python .ci/check_report.py < text``, run as ``__main__`` in this process (the script's
    whole main path: stdin, messages, exit status; a fresh interpreter would add ~3 s of imports)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / ".ci" / "check_report.py"), run_name="__main__")
    out = capsys.readouterr()
    return subprocess.CompletedProcess([], exit_.value.code, out.out, out.err)


def test_report_check_accepts_a_complete_report():
    assert runpy.run_path(str(ROOT / ".ci" / "check_report.py"))["problems"](sample_report()) == []


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith("topo_span_bucketing")),
         "no table row for stage 'topo_span_bucketing'"),
        (lambda t: t.replace("first_partition matches", "first_partition differs"), "goldens do not all match"),
        (lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith("goldens:")), "no 'goldens:' line"),
        (lambda t: t.replace("parity on gloo", "skipped").replace("bitwise equal", "?"),
         "parity of 'joint' is not reported bitwise equal"),
        (lambda t: "", "no 'autoparallel report:' header line"),
    ],
)
def test_report_check_rejects_an_incomplete_report(mutate, problem):
    problems = runpy.run_path(str(ROOT / ".ci" / "check_report.py"))["problems"]
    found = problems(mutate(sample_report()))
    assert any(problem in p for p in found), found


def test_report_check_exits_1_naming_the_problem(monkeypatch, capsys):
    out = check(sample_report(goldens={"joint": "differs"}), monkeypatch, capsys)
    assert out.returncode == 1 and "ci: main job report: goldens do not all match" in out.stderr
    ok = check(sample_report(), monkeypatch, capsys)
    assert ok.returncode == 0 and "ci: main job report complete" in ok.stdout and not ok.stderr


@pytest.mark.slow  # .ci/gpu imports torch in a fresh interpreter (~1.7 s): CI's slow step
def test_gpu_ci_refuses_a_torch_without_cuda(tmp_path):
    out = subprocess.run(["bash", str(ROOT / ".ci" / "gpu")], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert out.returncode == 1
    assert "sees no CUDA device; GPU CI needs one" in out.stderr
    assert not (ROOT / ".venv-gpu").exists(), "nothing is installed before the check"


@pytest.mark.slow  # makes two venvs and runs three fresh interpreters (~1.1 s): CI's slow step
def test_gpu_overlay_venv_sees_the_packages_of_an_interpreter_that_is_itself_a_venv(tmp_path):
    """Found on the GPU machine (python3 there is /opt/torch/.venv/bin/python3): a venv made from a
    venv with --system-site-packages sees the base interpreter's packages, not torch or pytest, so
    .ci/gpu tried to install everything and failed offline. This test's interpreter is a venv too."""
    assert sys.prefix != sys.base_prefix, "this test needs to run in a virtual environment"
    has = "import importlib.util as u, sys; print(sys.prefix, u.find_spec('torch') is not None)"
    plain = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(plain)],
                   check=True, timeout=60)
    assert subprocess.run([str(plain / "bin" / "python"), "-c", has], capture_output=True, text=True,
                          check=True).stdout.split()[1] == "False", "the failure this overlay exists for"
    overlay = tmp_path / "overlay"
    subprocess.run(["bash", str(ROOT / ".ci" / "overlay_venv"), sys.executable, str(overlay)], check=True,
                   timeout=120)
    prefix, found = subprocess.run([str(overlay / "bin" / "python"), "-c", has], capture_output=True,
                                   text=True, check=True).stdout.split()
    assert (prefix, found) == (str(overlay), "True")
    pip = subprocess.run([str(overlay / "bin" / "python"), "-m", "pip", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert pip.returncode == 0, pip.stderr


def test_browser_step_says_plainly_when_it_cannot_run(monkeypatch):
    """.ci/browser without Chromium (and told to install nothing): one line saying why, exit 0,
    so CI goes on; with Chromium it runs the browser tests with --ap-require-browser. The why is
    the tests' own check (playwright missing comes first where the browser extra is absent)."""
    import os

    monkeypatch.setenv("AP_CHROMIUM", "/nonexistent/chromium")
    why = unavailable_reason()
    assert why in ("AP_CHROMIUM=/nonexistent/chromium does not exist",
                   "the Python package playwright is not installed (pip install -e '.[browser]')")
    venv = Path(sys.executable).parent.parent
    env = {**os.environ, "CI_BROWSER_INSTALL": "0", "AP_CHROMIUM": "/nonexistent/chromium"}
    out = subprocess.run(["bash", str(ROOT / ".ci" / "browser"), str(venv)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ci: browser test NOT run: {why}"
    assert "--ap-require-browser" in (ROOT / ".ci" / "browser").read_text()
    assert "bash .ci/browser .venv" in (ROOT / ".ci" / "run").read_text()
