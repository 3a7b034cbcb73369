"""Both mutation levels run the tests they name even where the quick tier marks them slow
(``verify.mutation.run_slow_args``): found by CI, where three patches' guards were skipped and
reported as errors; a line group's narrowest tests may hold a slow one too (canon's hash-seed test)."""

import io
import tomllib
from pathlib import Path

from verify.mutation import lines as L
from verify.mutation import run_slow_args


def test_guards_run_slow_tests_in_a_project_that_opts_in(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = true\n")
    assert run_slow_args(tmp_path) == ["--ap-run-slow"]


def test_a_project_that_has_not_opted_in_gets_no_option_it_would_refuse(tmp_path):
    assert run_slow_args(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = false\n")
    assert run_slow_args(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert run_slow_args(tmp_path) == []


def test_line_mutation_runs_pass_the_option_to_mutmuts_pytest():
    cfg = tomllib.loads(L.mutmut_config(["pkg/a.py"], ["tests/t.py"], run_slow=["--ap-run-slow"]))["tool"]["mutmut"]
    assert "--ap-run-slow" in cfg["pytest_add_cli_args"]
    assert "--ap-run-slow" not in L.mutmut_config(["pkg/a.py"], ["tests/t.py"])


def test_line_mutation_baseline_runs_the_slow_tests_mutmut_will_run(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        (tmp_path / "baseline-outcomes.json").write_text('{"tests/t.py::test_a": "passed"}')
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(L.subprocess, "run", fake_run)
    assert L.baseline(tmp_path, ["tests/t.py"], 1, run_slow=["--ap-run-slow"]) == {"tests/t.py::test_a": "passed"}
    assert L.baseline(tmp_path, ["tests/t.py"], 1) == {"tests/t.py::test_a": "passed"}
    assert "--ap-run-slow" in seen[0] and "--ap-run-slow" not in seen[1]


def test_line_mutation_baseline_runs_under_the_projects_pytest_settings(monkeypatch, tmp_path):
    """Found on the first run with --ap-run-slow: the baseline ran in a scratch directory with no
    pyproject.toml yet, so the plugin the option belongs to was off and pytest refused it (exit 4).
    The baseline now runs under the project's settings, as mutmut's runs do."""
    root, work = tmp_path / "project", tmp_path / "scratch"
    (root / "verify").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "verify" / "a.py").write_text("X = 1\n")
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = true\n")
    at_baseline = {}

    def fake_run(cmd, **kw):
        at_baseline["cmd"] = cmd
        at_baseline["pyproject"] = (work / "pyproject.toml").read_text()
        Path(kw["env"][L.OUTCOME_ENV]).write_text('{"tests/t.py::test_a": "passed"}')
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    class FakeMutmut:
        stdout = io.StringIO()

        def __init__(self, cmd, **kw):
            self.cmd = cmd

        def wait(self):
            return 0

    monkeypatch.setattr(L.subprocess, "run", fake_run)
    monkeypatch.setattr(L.subprocess, "Popen", FakeMutmut)
    monkeypatch.setattr(L, "_mutmut_cmd", lambda: ["mutmut"])
    monkeypatch.setattr(L, "collect", lambda workdir, progress: [])
    done = L.run(root, files=["verify/a.py"], tests=["tests/t.py"], workdir=work, max_children=1)
    assert "--ap-run-slow" in at_baseline["cmd"]
    assert "autoparallel_verify = true" in at_baseline["pyproject"]
    assert tomllib.loads(at_baseline["pyproject"])["tool"]["mutmut"]["only_mutate"] == ["verify/a.py"]
    assert done.mutants == [] and done.deselected == {}
