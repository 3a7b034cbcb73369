"""What a user sees when a golden is missing, corrupt, changed or unused (in a throwaway project;
its pytest runs in this process: tests/conftest.py ``inner_pytest``)."""

import contextlib
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify.goldens import FORMAT_LINE, UPDATE_COMMAND, cli, golden_dir_for, render_golden
from verify.goldens.cli import USAGE_LOG_ENV, run_goldens

TEST_FILE = textwrap.dedent(
    """
    from verify.goldens import render_golden

    BODY = {body!r}

    def {name}(golden):
        golden.check_text(render_golden("t", [("graph", BODY)]))
    """
)


def make_project(root: Path) -> Path:
    # no:hypothesispytest: the inner runs use no hypothesis, and its import is most of their startup.
    (root / "pytest.ini").write_text(
        "[pytest]\ntestpaths = tests\naddopts = -p no:cacheprovider -p no:hypothesispytest\n"
        "autoparallel_verify = true\n"
    )
    (root / "tests").mkdir()
    return root


@pytest.fixture
def cli_project(pytester, inner_pytest, monkeypatch):
    """A project for ``run_goldens``, whose pytest subprocess runs in this process instead: the
    command line the CLI builds (checked to be ``python -m pytest ...``), in the directory it
    names, with the usage-log variable it sets. Its output is dropped, as the subprocess's never
    reached this test's stdout."""
    root = make_project(pytester.path)

    def call(cmd, *, cwd, env):
        assert cmd[:3] == [sys.executable, "-m", "pytest"] and Path(cwd) == root, (cmd, cwd)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return inner_pytest(*cmd[3:], env={USAGE_LOG_ENV: env[USAGE_LOG_ENV]}).returncode

    monkeypatch.setattr(cli, "subprocess", SimpleNamespace(call=call, run=subprocess.run))
    return root


def write_test(project: Path, body: str, name: str = "test_one") -> None:
    (project / "tests" / "test_a.py").write_text(TEST_FILE.format(body=body, name=name))


def test_missing_changed_corrupt_and_unused_goldens(pytester, inner_pytest):
    # inner_pytest hides this run's xdist worker variables: an inner pytest that sees them behaves
    # like a worker (syrupy then leaves unused-golden detection to a controller that does not exist).
    project = make_project(pytester.path)
    pytest_run = lambda *args: inner_pytest("-q", "-n", "0", *args)  # noqa: E731
    golden = project / "goldens" / "test_a" / "test_one.txt"
    write_test(project, "mm_0 = aten.mm(a, b)")

    missing = pytest_run()
    assert missing.returncode == 1
    assert f"golden file {golden} is missing" in missing.stdout
    assert "pytest.fail(" not in missing.stdout, "the message, not the plugin's traceback"
    assert UPDATE_COMMAND in missing.stdout

    created = pytest_run("--snapshot-update")
    assert created.returncode == 0, created.stdout
    assert golden.read_text() == render_golden("t", [("graph", "mm_0 = aten.mm(a, b)")])
    assert golden.read_text().startswith(FORMAT_LINE)
    assert pytest_run().returncode == 0

    write_test(project, "mm_0 = aten.mm(b, a)")
    changed = pytest_run()
    assert changed.returncode == 1
    assert f"graph changed: golden file {golden} differs" in changed.stdout
    assert UPDATE_COMMAND in changed.stdout
    assert "aten.mm(a, b)" in changed.stdout and "aten.mm(b, a)" in changed.stdout
    assert "pytest.fail(" not in changed.stdout
    # a page beside it, in pytest's tmp dir: the same two texts, side by side
    page = Path(re.search(r"side-by-side HTML diff: (\S+\.html)", changed.stdout).group(1))
    assert page.name == "golden-diff-test_one.html" and "pytest-of-" in str(page)
    data = json.loads(re.search(r"<script type='application/json' id=ap-data>(.*?)</script>", page.read_text(), re.S).group(1))
    assert data["texts"] == [golden.read_text(), render_golden("t", [("graph", "mm_0 = aten.mm(b, a)")])]
    assert [op[0] for op in data["diffs"][0]["ops"]] == ["e", "r"] and "<details class='diff diff-golden' data-diff='0' open>" in page.read_text()
    assert f"{golden} (left) against what the code produces now (right)" in page.read_text()

    golden.write_bytes(b"\xff\xfe not a golden")
    corrupt = pytest_run()
    assert corrupt.returncode == 1
    assert f"golden file {golden} is corrupt" in corrupt.stdout
    assert "pytest.fail(" not in corrupt.stdout
    assert "During handling of the above exception" not in corrupt.stdout, "said once, not again as a chained exception"
    assert "CorruptGoldenError" not in corrupt.stdout, "a failure with the message, not syrupy's read raising it"
    golden.write_text("some other text\n")
    assert "is corrupt: first line is 'some other text'" in pytest_run().stdout
    assert golden.read_text() == "some other text\n", "a failing run must never rewrite a golden"

    write_test(project, "mm_0 = aten.mm(a, b)", name="test_two")  # test_one renamed: its golden is unused
    assert pytest_run("--snapshot-update").returncode == 0
    stale = golden.parent.joinpath("test_stale.txt")
    stale.write_text(render_golden("t", []))
    assert pytest_run().returncode == 0, "without --ap-run-slow no golden is judged unused"
    assert golden.exists(), "nor deleted by --snapshot-update"
    unused = pytest_run("--ap-run-slow")
    assert unused.returncode == 1
    assert "2 unused golden(s): no test reads them" in unused.stdout
    assert "  goldens/test_a/test_one.txt\n  goldens/test_a/test_stale.txt" in unused.stdout
    assert stale.exists(), "only an explicit update deletes goldens"
    deleted = pytest_run("--ap-run-slow", "--snapshot-update")
    assert deleted.returncode == 0 and "deleted unused golden goldens/test_a/test_stale.txt" in deleted.stdout
    assert not stale.exists() and not golden.exists() and golden.parent.joinpath("test_two.txt").exists()
    assert "unused goldens: none (every one of the 1 golden files was read)" in pytest_run("--ap-run-slow").stdout


# A project shaped like this repository: quick and slow golden tests (a slow one shares its test
# function with a quick one, as the golden scenarios do), a test with no golden, the plugin on.
WORKFLOW_PROJECT = {
    "tests/golden/test_g.py": """
        import pytest
        from verify.goldens import render_golden

        def test_quick(golden):
            golden.check_text(render_golden("t", [("graph", "quick")]))

        @pytest.mark.slow
        def test_slow(golden):
            golden.check_text(render_golden("t", [("graph", "slow")]))

        @pytest.mark.parametrize("sid", ["a", pytest.param("b", marks=pytest.mark.slow)])
        def test_scenario(sid, golden):
            golden.check_text(render_golden("t", [("graph", sid)]))
        """,
    "tests/unit/test_plain.py": """
        def test_plain():
            pass
        """,
}
# pytest's own workflows (issue 25): each must exit 0 and leave every golden as it was.
PLAIN_WORKFLOWS = [(), ("-n", "0"), ("tests/golden",), ("-k", "quick or plain"), ("--snapshot-update",),
                   ("-n", "2", "--snapshot-update")]


def _goldens_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "goldens").rglob("*")) if p.is_file()}


def test_pytests_own_workflows_never_fail_on_nor_delete_a_skipped_tests_goldens(pytester, inner_pytest):
    """Plain ``pytest`` (the quick tier: slow tests skipped), with and without xdist, a path, ``-k``
    and ``--snapshot-update``: all exit 0 and leave goldens/ byte for byte as it was. syrupy called
    the skipped tests' goldens unused (exit 1), and its advice, ``--snapshot-update``, deleted them."""
    root = pytester.path
    (root / "pytest.ini").write_text(
        "[pytest]\ntestpaths = tests\naddopts = -p no:cacheprovider -p no:hypothesispytest --dist loadgroup\n"
        "autoparallel_verify = true\n")
    for rel, text in WORKFLOW_PROJECT.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    made = inner_pytest("-q", "--ap-run-slow", "--snapshot-update")
    assert made.returncode == 0, made.stdout
    before = _goldens_bytes(root)
    assert sorted(before) == [f"goldens/golden/test_g/{n}.txt" for n in
                              ("test_quick", "test_scenario[a]", "test_scenario[b]", "test_slow")]
    for args in PLAIN_WORKFLOWS:
        res = inner_pytest("-q", *args)
        assert res.returncode == 0, (args, res.stdout)
        assert _goldens_bytes(root) == before, f"pytest {' '.join(args)} touched goldens/"
        if "--snapshot-update" in args:
            assert "unused goldens: not looked for without --ap-run-slow, none deleted" in res.stdout, (args, res.stdout)
    # A golden no test reads is not deleted by the quick tier's --snapshot-update either (syrupy did).
    stray = root / "goldens" / "golden" / "test_g" / "test_gone.txt"
    stray.write_text(render_golden("t", []))
    kept = inner_pytest("-q", "--snapshot-update")
    assert kept.returncode == 0 and stray.exists(), kept.stdout
    stray.unlink()
    # With --ap-run-slow a narrowed or skipping run deletes nothing either, and says why.
    narrowed = inner_pytest("-q", "--ap-run-slow", "--snapshot-update", "-k", "quick")
    assert narrowed.returncode == 0 and _goldens_bytes(root) == before
    assert "unused goldens: not looked for, none deleted (3 golden test(s) did not pass" in narrowed.stdout
    # Every tier, whole tree, every golden test passing: a golden no test reads is unused, also
    # when the workers' records reach the controller through xdist.
    stray.write_text(render_golden("t", []))
    found = inner_pytest("-q", "--ap-run-slow", "-n", "2")
    assert found.returncode == 1 and "goldens/golden/test_g/test_gone.txt" in found.stdout, found.stdout
    assert inner_pytest("-q", "--ap-run-slow", "-n", "2", "--snapshot-update").returncode == 0
    assert not stray.exists() and _goldens_bytes(root) == before


def test_goldens_command_finds_and_deletes_unused_goldens(cli_project, capsys):
    """`python -m verify goldens`: a stray golden fails --check (named), and --update deletes it;
    a narrowed run cannot tell, says so and deletes nothing."""

    write_test(cli_project, "mm_0 = aten.mm(a, b)")
    # A test without a golden, as in this repository: `-m syrupy_snapshot` deselects it, and then
    # syrupy's own unused detection is off (the case this command exists for).
    (cli_project / "tests" / "test_plain.py").write_text("def test_plain():\n    pass\n")
    assert run_goldens(cli_project, update=True, workers="0") == 0
    kept = cli_project / "goldens" / "test_a" / "test_one.txt"
    assert kept.exists()
    assert run_goldens(cli_project, update=False, workers="0") == 0
    assert "unused goldens: none (every one of the 1 golden files was read)" in capsys.readouterr().out
    stray = cli_project / "goldens" / "test_a" / "test_removed_long_ago.txt"
    stray.write_text(render_golden("t", []))
    capsys.readouterr()

    assert run_goldens(cli_project, update=False, workers="0") == 1
    out = capsys.readouterr().out
    assert "1 unused golden(s): no test reads them" in out
    assert "goldens/test_a/test_removed_long_ago.txt" in out and "test_one" not in out
    assert stray.exists(), "--check never deletes"

    assert run_goldens(cli_project, update=False, workers="0", pytest_args=["-k", "nothing_matches"]) == 5
    assert "unused goldens: not checked (1 golden test(s) did not pass" in capsys.readouterr().out
    run_goldens(cli_project, update=False, workers="0", pytest_args=["tests/test_a.py"])
    assert "unused goldens: not checked (the run was given paths" in capsys.readouterr().out
    assert stray.exists()

    assert run_goldens(cli_project, update=True, workers="0") == 0
    assert "deleted unused golden goldens/test_a/test_removed_long_ago.txt" in capsys.readouterr().out
    assert not stray.exists() and kept.exists()
    assert run_goldens(cli_project, update=False, workers="0") == 0


def test_goldens_live_under_a_tests_directory(tmp_path):
    assert golden_dir_for(tmp_path / "tests" / "golden" / "test_x.py") == tmp_path / "goldens" / "golden" / "test_x"
    with pytest.raises(ValueError, match="must live under a 'tests/' directory"):
        golden_dir_for(tmp_path / "elsewhere" / "test_x.py")


def test_an_inner_pytest_leaves_syrupys_session_to_the_outer_run(pytester, inner_pytest):
    """syrupy records each test's outcome in a module global; an in-process pytest replaced it, and
    the outer run then called the goldens of its skipped tests unused (``inner_pytest`` restores it)."""
    import syrupy
    from syrupy.extensions.base import SnapshotCollectionStorage

    outer = syrupy._syrupy, SnapshotCollectionStorage.snapshot_dirname
    make_project(pytester.path)
    write_test(pytester.path, "x")
    inner_pytest("-q", "-n", "0", "--snapshot-update")
    assert (syrupy._syrupy, SnapshotCollectionStorage.snapshot_dirname) == outer
