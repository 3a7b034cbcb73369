"""A guard run forked from the mutation zygote is a fresh pytest process in every way a guard can see."""

import os
import textwrap
import time

import pytest

from verify.commands.mutation.zygote import Zygote, _alive

GUARDS = textwrap.dedent(
    """
    import os
    import signal
    import subprocess
    import sys
    import time

    def test_fresh_process():
        assert os.getsid(0) == os.getpid(), "its own session: a timeout kills its whole group"
        assert os.environ.get("RUN_MARK") == "yes" and "PARENT_ONLY" not in os.environ, "exactly the run's environment"
        assert os.getcwd() == os.environ["RUN_CWD"]
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
        # the zygote ignores SIGCHLD to reap its children; inherited, every exit code would read 0
        assert subprocess.run([sys.executable, "-c", "raise SystemExit(3)"]).returncode == 3

    def test_fails():
        assert False

    def test_hangs():
        with open("hang.pid", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    """
)


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:hypothesispytest -p no:cacheprovider\n")
    (root / "tests" / "test_guards.py").write_text(GUARDS)
    return root


def _env(root):
    return {"PATH": os.environ.get("PATH", ""), "RUN_MARK": "yes", "RUN_CWD": str(root)}


def test_a_forked_run_is_a_fresh_pytest_process_with_its_exit_code(project, tmp_path, monkeypatch):
    monkeypatch.setenv("PARENT_ONLY", "1")  # in the zygote's environment, not the run's
    with Zygote(("pytest",), tmp=tmp_path) as zygote:
        code, timed_out, out = zygote.run(["-q", "tests/test_guards.py::test_fresh_process"], _env(project), project, 60)
        assert (code, timed_out) == (0, False), out
        code, timed_out, out = zygote.run(["-q", "tests/test_guards.py::test_fails"], _env(project), project, 60)
        assert (code, timed_out) == (1, False) and "1 failed" in out
        code, _, out = zygote.run(["-q", "tests/test_gone.py"], _env(project), project, 60)
        assert code == 4, out  # pytest's "file not found": the codes are pytest's own


def test_a_run_past_its_limit_is_killed_and_has_no_exit_code(project, tmp_path):
    with Zygote(("pytest",), tmp=tmp_path) as zygote:
        t0 = time.monotonic()
        code, timed_out, _ = zygote.run(["-q", "tests/test_guards.py::test_hangs"], _env(project), project, 2.0)
    assert (code, timed_out) == (None, True)
    assert time.monotonic() - t0 < 30
    assert not _alive(int((project / "hang.pid").read_text())), "the hanging run is gone"


def test_runs_outside_the_with_block_are_refused(tmp_path):
    zygote = Zygote(("pytest",), tmp=tmp_path)
    with pytest.raises(RuntimeError, match="outside its with block"):
        zygote.run(["-q"], {}, tmp_path, 1)
