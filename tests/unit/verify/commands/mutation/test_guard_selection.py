"""Both mutation levels run the tests they name even where the quick tier marks them slow
(``verify.commands.mutation.run_slow_args``): found by CI, where three patches' guards were skipped and
reported as errors; a line group's narrowest tests may hold a slow one too (canon's hash-seed test)."""

import io
import tomllib
from pathlib import Path

from verify.commands.mutation import lines as L
from verify.commands.mutation import run_slow_args


def test_guards_run_slow_tests_in_a_project_that_opts_in(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = true\n")
    assert run_slow_args(tmp_path) == ["--ap-run-slow"]


def test_a_project_that_has_not_opted_in_gets_no_option_it_would_refuse(tmp_path):
    assert run_slow_args(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nautoparallel_verify = false\n")
    assert run_slow_args(tmp_path) == []
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert run_slow_args(tmp_path) == []


def _fake_line_run(monkeypatch, tmp_path, files: list[str]) -> dict:
    """``lines.run`` on a throwaway project that opts in (``files`` exist there), pytest and mutmut
    faked: the baseline's command line and the scratch pyproject.toml it ran under."""
    root, work = tmp_path / "project", tmp_path / "scratch"
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("X = 1\n")
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text('[project.entry-points.pytest11]\n"verify.pytest_plugin" = "verify.pytest_plugin"\n'
                                         "[tool.pytest.ini_options]\nautoparallel_verify = true\n")
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
    monkeypatch.setattr(L, "collect", lambda workdir, progress, only=None: [])
    done = L.run(root, files=files, tests=["tests/t.py"], workdir=work, max_children=1)
    assert done.mutants == [] and done.deselected == {}
    at_baseline["mutmut"] = tomllib.loads((work / "pyproject.toml").read_text())["tool"]["mutmut"]
    return at_baseline


def test_line_mutation_baseline_runs_under_the_projects_pytest_settings(monkeypatch, tmp_path):
    """Found on the first run with --ap-run-slow: the baseline ran in a scratch directory with no
    pyproject.toml yet, so the plugin the option belongs to was off and pytest refused it (exit 4).
    The baseline now runs under the project's settings, as mutmut's runs do."""
    seen = _fake_line_run(monkeypatch, tmp_path, ["verify/a.py"])
    assert "--ap-run-slow" in seen["cmd"]
    assert "autoparallel_verify = true" in seen["pyproject"]
    assert tomllib.loads(seen["pyproject"])["tool"]["mutmut"]["only_mutate"] == ["verify/a.py"]
    assert "--ap-run-slow" in seen["mutmut"]["pytest_add_cli_args"]


def test_line_mutation_of_the_plugin_itself_passes_none_of_its_options(monkeypatch, tmp_path):
    """Found next: mutating verify/pytest_plugin.py, the outer runs leave the plugin out
    (-p no:verify.pytest_plugin), so pytest did not know --ap-run-slow (nor skips a slow test)."""
    seen = _fake_line_run(monkeypatch, tmp_path, ["verify/pytest_plugin.py"])
    assert "--ap-run-slow" not in seen["cmd"] and "no:verify.pytest_plugin" in seen["cmd"]
    assert "--ap-run-slow" not in seen["mutmut"]["pytest_add_cli_args"]
