"""``python -m verify goldens``: the pytest command it runs, what it says about unused goldens, and
after ``--update`` which golden files git sees changed. The golden tests' pytest is stubbed (it
writes the usage records the ``golden`` fixture would and rewrites goldens as an update would);
git is real, on a throwaway repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify import repo_root
from verify.__main__ import main as verify_main
from verify.goldens import cli
from verify.goldens.cli import USAGE_LOG_ENV, run_goldens

GOLDEN_A = "goldens/golden/test_x/test_a.txt"
GOLDEN_B = "goldens/golden/test_x/test_b.txt"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A git repository with two committed goldens (made once; each test gets a copy)."""
    root = tmp_path_factory.mktemp("goldens-cli") / "repo"
    for rel in (GOLDEN_A, GOLDEN_B):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("old\n")
    _git(root, "init", "-q", "--template=")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "goldens")
    return root


@pytest.fixture
def project(committed, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # nothing above it is looked at
    return Path(shutil.copytree(committed, tmp_path / "repo"))


def stub_pytest(monkeypatch, root: Path, *, rc: int = 0, read=(GOLDEN_A, GOLDEN_B), rewrite=()) -> list:
    """Stands in for the golden tests' pytest: every golden test passed (rc aside), read the
    goldens ``read``, and (an update) rewrote those in ``rewrite``. Returns the calls it saw."""
    calls = []

    def call(cmd, *, cwd, env):
        log = Path(env[USAGE_LOG_ENV])
        calls.append(SimpleNamespace(cmd=cmd, cwd=cwd, env=env, log_existed=log.is_dir()))
        record = {"worker": "", "whole_tree": True, "tests": ["t::a"], "passed": ["t::a"],
                  "used": [str((root / r).resolve()) for r in read]}
        (log / "usage-main.json").write_text(json.dumps(record))
        for rel in rewrite:
            (root / rel).write_text("new\n")
        return rc

    monkeypatch.setattr(cli, "subprocess", SimpleNamespace(call=call, run=subprocess.run))
    return calls


def test_update_runs_the_golden_tests_and_lists_the_goldens_git_sees_changed(project, monkeypatch, capsys):
    calls = stub_pytest(monkeypatch, project, rewrite=[GOLDEN_A])
    assert run_goldens(project, update=True, workers="3", pytest_args=["-k", "llama"]) == 0
    (call,) = calls
    assert call.cmd == [sys.executable, "-m", "pytest", "-q", "-m", "syrupy_snapshot", "--ap-run-slow", "-n", "3",
                        "--snapshot-update", "-k", "llama"]
    assert call.cwd == project and call.log_existed
    assert call.env["PATH"] == os.environ["PATH"]  # the caller's environment, plus the log directory
    log = Path(call.env[USAGE_LOG_ENV])  # a temporary directory, named for whoever finds one left over
    assert log.name.startswith("ap-goldens-") and not log.exists()
    out, err = capsys.readouterr()
    assert err == "[verify] pytest -q -m syrupy_snapshot --ap-run-slow -n 3 --snapshot-update -k llama\n"
    assert out == (
        "unused goldens: none (every one of the 2 golden files was read)\n"
        "goldens changed (review with `git diff goldens/`, commit with the change):\n"
        f" M {GOLDEN_A}\n\n"
    )


def test_update_deletes_unused_goldens_and_git_shows_them_deleted(project, monkeypatch, capsys):
    stub_pytest(monkeypatch, project, read=[GOLDEN_A])
    assert run_goldens(project, update=True) == 0
    assert not (project / GOLDEN_B).exists() and (project / GOLDEN_A).exists()
    assert capsys.readouterr().out == (
        f"deleted unused golden {GOLDEN_B} (no test reads it)\n"
        "goldens changed (review with `git diff goldens/`, commit with the change):\n"
        f" D {GOLDEN_B}\n\n"
    )


def test_update_that_changed_nothing_says_so(project, monkeypatch, capsys):
    stub_pytest(monkeypatch, project)
    assert run_goldens(project, update=True) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "goldens unchanged"


def test_failed_update_and_check_runs_do_not_report_git_changes(project, monkeypatch, capsys):
    stub_pytest(monkeypatch, project, rc=1, rewrite=[GOLDEN_A])
    assert run_goldens(project, update=True) == 1
    assert "goldens changed" not in capsys.readouterr().out
    calls = stub_pytest(monkeypatch, project, rewrite=[GOLDEN_A])
    assert run_goldens(project, update=False, workers="0") == 0
    assert calls[0].cmd[3:] == ["-q", "-m", "syrupy_snapshot", "--ap-run-slow", "-n", "0"]  # --check: no --snapshot-update
    assert capsys.readouterr().out == "unused goldens: none (every one of the 2 golden files was read)\n"


def test_check_names_unused_goldens_and_fails_keeping_pytests_own_failure(project, monkeypatch, capsys):
    calls = stub_pytest(monkeypatch, project, read=[GOLDEN_A])
    assert run_goldens(project, update=False) == 1
    assert calls[0].cmd[-2:] == ["-n", "auto"]  # xdist's worker count by default
    assert capsys.readouterr().out == (
        "1 unused golden(s): no test reads them; `python -m verify goldens --update` deletes them:\n"
        f"  {GOLDEN_B}\n"
    )
    assert (project / GOLDEN_B).exists()
    stub_pytest(monkeypatch, project, rc=3, read=[GOLDEN_A])
    assert run_goldens(project, update=False) == 3


def test_update_outside_a_git_checkout_says_it_cannot_tell_what_changed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    (tmp_path / GOLDEN_A).parent.mkdir(parents=True)
    (tmp_path / GOLDEN_A).write_text("old\n")
    stub_pytest(monkeypatch, tmp_path, read=[GOLDEN_A], rewrite=[GOLDEN_A])
    assert run_goldens(tmp_path, update=True) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("goldens changed or not: `git status` could not tell (exit status 128: fatal: not a git")
    assert last.endswith("); compare goldens/ by hand")


def test_goldens_command_without_the_test_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "syrupy", None)
    with pytest.raises(ValueError) as e:
        run_goldens(Path("."), update=False)
    assert str(e.value) == "python -m verify goldens runs the golden tests and needs syrupy: pip install -e '.[test]'"


def test_python_m_verify_goldens_passes_mode_workers_and_pytest_args(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run_goldens", lambda root, **kw: seen.append((root, kw)) or 7)
    assert verify_main(["goldens", "--update", "-n", "2", "--", "-k", "fsdp"]) == 7
    assert verify_main(["goldens", "--check"]) == 7
    assert seen == [
        (repo_root(), {"update": True, "workers": "2", "pytest_args": ["-k", "fsdp"]}),
        (repo_root(), {"update": False, "workers": "auto", "pytest_args": []}),
    ]
