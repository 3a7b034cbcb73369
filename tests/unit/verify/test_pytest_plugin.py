"""The plugin, run in throwaway projects (in this process: tests/conftest.py ``inner_pytest``): inert in a project that has not opted in; opted in, its
gates (gpu / multigpu(n) skip with a reason, --ap-require-gpu fails instead, slow tests only with
--ap-run-slow, browser tests skip where Chromium is missing and fail with --ap-require-browser), GPU CI's selection on fake device counts, $AUTOPARALLEL_DISABLE checked at start,
and no structured-trace noise in a failing test's captured log."""

import json
import logging
import textwrap
from types import SimpleNamespace

import pytest
import torch

from verify.commands.html import diff as html_diff
from verify.goldens import render_golden
from verify.goldens.cli import USAGE_LOG_ENV
from verify.pytest_plugin import OPT_IN_INI, VerifyPlugin, _GoldenUsage

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")

TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.gpu
    def test_needs_gpu():
        pass

    @pytest.mark.multigpu(2)
    def test_needs_two_gpus():
        pass

    @pytest.mark.multigpu(4)
    def test_needs_four_gpus():
        pass

    @pytest.mark.slow
    def test_slow():
        pass

    def test_plain():
        pass

    @pytest.mark.browser
    def test_in_browser():
        pass
    """
)
# no:hypothesispytest: the inner runs use no hypothesis, and its import is most of pytest's startup.
OPTED_IN = f"[pytest]\naddopts = --strict-markers -p no:hypothesispytest -p no:cacheprovider\n{OPT_IN_INI} = true\n"


@pytest.fixture
def run(inner_pytest):
    """``run(*args, env_extra=None, chromium=...)``: pytest on the project in ``pytester.path``
    (in this process: tests/conftest.py ``inner_pytest``), with ``-rs`` and no Chromium."""

    def run(*args, env_extra=None, chromium="/nonexistent/chromium"):
        return inner_pytest("-q", "-rs", "-n", "0", *args, env={"AP_CHROMIUM": chromium, **(env_extra or {})})

    return run


@pytest.fixture
def project(pytester):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "test_gates.py").write_text(TESTS)
    return pytester.path


def test_gpu_tests_skip_with_a_reason_without_cuda(project, run):
    out = run()
    assert out.returncode == 0, out.stdout
    assert "1 passed, 5 skipped" in out.stdout
    assert "needs 1 CUDA device(s), found 0" in out.stdout
    assert "needs 2 CUDA device(s), found 0" in out.stdout
    assert "slow test: run with --ap-run-slow" in out.stdout
    assert "browser test cannot run: " in out.stdout


def test_require_gpu_and_browser_turn_skips_into_failures_and_order_reverses(project, run):
    out = run("--ap-require-gpu", "--ap-require-browser", "--ap-run-slow", "--ap-order", "reverse", "-vv")
    assert out.returncode == 1
    assert "2 passed, 4 errors" in out.stdout  # failed in setup: the test cannot run here
    assert "--ap-require-gpu is set: GPU CI must not pass by skipping" in out.stdout
    assert "browser test cannot run: " in out.stdout and "--ap-require-browser is set" in out.stdout
    assert "pytest.fail(" not in out.stdout, "a gate's failure is its message, not the plugin's traceback"
    ran = [line.split("::")[1].split()[0] for line in out.stdout.splitlines() if line.startswith("test_gates.py::")]
    assert ran == ["test_in_browser", "test_plain", "test_slow", "test_needs_four_gpus", "test_needs_two_gpus",
                   "test_needs_gpu"], out.stdout


def test_order_option_rejects_nonsense(project, run):
    bad = run("--ap-order", "sideways", "--collect-only")
    assert bad.returncode == 4 and "--ap-order takes 'file', 'reverse' or 'shuffle:SEED'" in bad.stderr


@pytest.mark.parametrize(
    "gpus, ran, lacking",
    [
        (1, ["test_needs_gpu"], ["test_needs_two_gpus: needs 2 GPUs", "test_needs_four_gpus: needs 4 GPUs"]),
        (2, ["test_needs_gpu", "test_needs_two_gpus"], ["test_needs_four_gpus: needs 4 GPUs"]),
        (4, ["test_needs_gpu", "test_needs_two_gpus", "test_needs_four_gpus"], []),
    ],
)
def test_gpu_ci_runs_what_fits_and_counts_what_does_not(project, run, gpus, ran, lacking):
    """--ap-gpu-ci with a faked visible GPU count: the selected tests are trivial, so they pass."""
    out = run("--ap-gpu-ci", "--ap-gpu-count", str(gpus), "-rA")
    assert out.returncode == 0, out.stdout
    passed = [line.split("::")[1] for line in out.stdout.splitlines() if line.startswith("PASSED ")]
    assert passed == ran, out.stdout
    summary = out.stdout.split(" autoparallel GPU CI ")[1].splitlines()
    assert summary[1] == f"{len(ran)} GPU test(s) selected for {gpus} visible GPU(s)", out.stdout
    assert summary[2] == (f"{len(lacking)} multigpu test(s) could not run for lack of GPUs:" if lacking
                          else "0 multigpu tests could not run for lack of GPUs"), out.stdout
    for line in lacking:
        assert f"test_gates.py::{line}, {gpus} visible" in out.stdout


def test_gpu_ci_fails_on_a_skip_and_without_gpus(pytester, run):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "test_skips.py").write_text(textwrap.dedent(
        """
        import pytest

        @pytest.mark.gpu
        def test_skips_itself():
            pytest.skip("needs a CUDA device")

        @pytest.mark.gpu
        def test_runs():
            pass
        """
    ))
    out = run("--ap-gpu-ci", "--ap-gpu-count", "1")
    assert out.returncode == 1, out.stdout
    assert "1 passed, 1 skipped" in out.stdout
    assert "FAILED: 1 GPU test(s) skipped; GPU CI must not pass by skipping" in out.stdout
    assert "test_skips.py::test_skips_itself: Skipped: needs a CUDA device" in out.stdout
    assert "pytest.fail(" not in out.stdout
    none = run("--ap-gpu-ci")  # this machine: no CUDA
    assert none.returncode == 4 and "--ap-gpu-ci: no CUDA device is visible" in none.stderr


def test_unknown_patch_name_in_the_environment_is_a_usage_error(project, run):
    out = run("--collect-only", env_extra={"AUTOPARALLEL_DISABLE": "replay_saves_partitioner,fsdp_chain_recompte"})
    assert out.returncode == 4
    assert "unknown patch name(s) ['fsdp_chain_recompte'] in $AUTOPARALLEL_DISABLE" in out.stderr
    assert "fsdp_chain_recompute" in out.stderr  # the known names are listed
    ok = run("--collect-only", "-v", env_extra={"AUTOPARALLEL_DISABLE": "replay_saves_partitioner"})
    assert ok.returncode == 0 and "$AUTOPARALLEL_DISABLE disables patches ['replay_saves_partitioner']" in ok.stdout


FOREIGN_CONFTEST = textwrap.dedent(
    """
    import pytest

    def pytest_addoption(parser):
        parser.addoption("--run-slow", action="store_true")  # the common idiom: must not collide

    @pytest.fixture
    def golden():
        return "their own golden fixture"
    """
)
FOREIGN_TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.slow
    def test_slow_runs_here():
        pass

    @pytest.mark.gpu
    def test_gpu_marker_means_something_else_here():
        pass

    @pytest.mark.multigpu(8)
    def test_multigpu_too():
        pass

    def test_their_golden(golden):
        assert golden == "their own golden fixture"
    """
)


def test_a_project_that_did_not_opt_in_is_untouched(pytester, run):
    """Another project in the same environment: same outcomes with and without the plugin."""
    (pytester.path / "pytest.ini").write_text("[pytest]\naddopts = -p no:hypothesispytest -p no:cacheprovider\n")
    (pytester.path / "conftest.py").write_text(FOREIGN_CONFTEST)
    (pytester.path / "test_foreign.py").write_text(FOREIGN_TESTS)
    with_plugin = run("-rA", "--run-slow")
    without = run("-rA", "--run-slow", "-p", "no:verify.pytest_plugin")
    summary = lambda out: sorted(line for line in out.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED")))  # noqa: E731
    assert summary(with_plugin) == summary(without), with_plugin.stdout
    assert len(summary(with_plugin)) == 4 and "4 passed" in with_plugin.stdout, with_plugin.stdout
    assert "CUDA" not in with_plugin.stdout and "Inductor" not in with_plugin.stdout
    markers = run("--markers").stdout
    assert "multigpu(n)" not in markers and "whole-model checks" not in markers
    fixtures = run("--fixtures", "-v").stdout
    # (other installed plugins may list fixtures from their own pytest_plugin.py: platformdirs does)
    assert "golden -- conftest.py" in fixtures and "verify/pytest_plugin.py" not in fixtures
    refused = run("--ap-run-slow")
    assert refused.returncode == 4 and f"opt in with `{OPT_IN_INI} = true`" in refused.stderr


def test_golden_outside_a_tests_directory_is_a_clear_failure(pytester, run):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "test_here.py").write_text("def test_g(golden):\n    golden.check_text('x')\n")
    out = run()
    assert out.returncode == 1
    assert "golden tests must live under a 'tests/' directory (goldens/ mirrors tests/)" in out.stdout
    assert "Traceback" not in out.stdout


def test_failing_test_shows_no_structured_trace_records(pytester, run):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    # The logger as torch._logging sets it up (always DEBUG, not propagating; pytest >= 9 attaches
    # its capture handlers to it anyway), without importing torch: Dynamo's trace_structured
    # writes one empty-message record per compile event.
    (pytester.path / "test_inner_compile.py").write_text(textwrap.dedent(
        """
        import logging

        trace_log = logging.getLogger("torch.__trace")
        trace_log.propagate = False
        trace_log.setLevel(logging.DEBUG)

        def test_fails_after_compiling():
            logging.getLogger("mine").warning("a record of the test's own")
            for _ in range(190):
                trace_log.debug("", extra={"metadata": {}, "payload": None})
            assert False

        def test_caplog_sees_no_trace_records(caplog):
            caplog.set_level(logging.DEBUG)
            trace_log.debug("", extra={"metadata": {}, "payload": None})
            logging.getLogger("mine").info("mine")
            assert [r.name for r in caplog.records] == ["mine"]
        """
    ))
    trace_log = logging.getLogger("torch.__trace")  # the inner test sets it up in this process
    propagate, level = trace_log.propagate, trace_log.level
    try:
        out = run()
    finally:
        trace_log.propagate = propagate
        trace_log.setLevel(level)
    assert out.returncode == 1 and "1 failed, 1 passed" in out.stdout, out.stdout
    assert "E       assert False" in out.stdout, "the test failed on its own assert, not in logging"
    captured = out.stdout.split("- Captured log call -")[1].splitlines()[1:3]
    assert captured[0].startswith("WARNING  mine:") and captured[0].endswith("a record of the test's own")
    assert not captured[1].startswith(("DEBUG", "WARNING")), "only the test's own record is shown"
    assert "torch.__trace" not in out.stdout


# What `pytest --help` says about the plugin, in every project (opted in or not), at a width that
# does not wrap: the options a user can pass and what each does.
HELP = """\
autoparallel verify (needs autoparallel_verify = true):
  --ap-require-gpu      fail (instead of skip) tests marked gpu/multigpu when CUDA or enough GPUs are missing
  --ap-run-slow         also run tests marked slow (cold Inductor compiles, whole-model checks); CI runs them in their own step
  --ap-require-browser  fail (instead of skip) tests marked browser when Chromium or Playwright is missing
  --ap-order=AP_ORDER   test order: 'file' (default), 'reverse', or 'shuffle:SEED'; proves tests do not depend on order
  --ap-gpu-ci           GPU CI: run only gpu and multigpu(n <= visible GPUs) tests; any skip fails the run
  --ap-gpu-count=N      the visible GPU count the gates and --ap-gpu-ci use (default: torch.cuda.device_count())
"""
INI_HELP = """\
  autoparallel_verify (bool):
                        turn on autoparallel's verify plugin (markers gpu/multigpu/slow, fixture golden, --ap-* options)
"""
MARKERS = [
    "@pytest.mark.slow: costly (cold Inductor compiles, whole-model checks); skipped unless --ap-run-slow",
    "@pytest.mark.gpu: needs a CUDA device; skipped without one unless --ap-require-gpu",
    "@pytest.mark.multigpu(n): needs n CUDA devices; skipped with fewer unless --ap-require-gpu",
    "@pytest.mark.browser: needs headless Chromium + playwright; skipped without them unless --ap-require-browser",
]


def test_help_spells_out_the_options_and_the_opt_in(pytester, run):
    (pytester.path / "pytest.ini").write_text("[pytest]\naddopts = -p no:hypothesispytest -p no:cacheprovider\n")
    out = run("--help", env_extra={"COLUMNS": "200"})
    assert out.returncode == 0
    assert HELP in out.stdout + "\n", out.stdout
    assert INI_HELP in out.stdout + "\n", out.stdout


def test_markers_say_what_each_gate_needs(project, run):
    listed = run("--markers").stdout.splitlines()
    assert [line for line in listed if line in MARKERS] == MARKERS, listed


def test_opting_out_explicitly_keeps_the_plugin_off(pytester, run):
    """``autoparallel_verify = false`` is a bool, not a non-empty (truthy) string."""
    (pytester.path / "pytest.ini").write_text(OPTED_IN.replace("= true", "= false"))
    (pytester.path / "test_gates.py").write_text(TESTS)
    refused = run("--ap-run-slow")
    assert refused.returncode == 4 and "--ap-run-slow: autoparallel's verify plugin is off in this project" in refused.stderr
    assert "6 passed" in run().stdout  # no gate skips anything
    both = run("--ap-run-slow", "--ap-require-gpu")
    assert both.returncode == 4
    assert "--ap-require-gpu, --ap-run-slow: autoparallel's verify plugin is off" in both.stderr, "every option given, named"


@pytest.mark.parametrize("given", ["-1", "two"])
def test_gpu_count_takes_a_count(project, run, given):
    out = run("--ap-gpu-count", given, "--collect-only")
    assert out.returncode == 4
    assert f"argument --ap-gpu-count: takes an int >= 0, got '{given}'" in out.stderr


def test_gpu_count_zero_is_a_count(project, pytester, run):
    out = run("--ap-gpu-count", "0")
    assert out.returncode == 0 and "needs 1 CUDA device(s), found 0" in out.stdout, out.stdout
    (pytester.path / "pytest.ini").write_text("[pytest]\naddopts = -p no:hypothesispytest -p no:cacheprovider\n")
    refused = run("--ap-gpu-count", "0")  # off in this project: even 0 is refused, not ignored
    assert refused.returncode == 4 and "--ap-gpu-count: autoparallel's verify plugin is off" in refused.stderr


def test_misused_multigpu_marker_is_an_error_naming_the_test(pytester, run):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "test_m.py").write_text(textwrap.dedent(
        """
        import pytest

        @pytest.mark.multigpu
        def test_no_n():
            pass

        @pytest.mark.multigpu(0)
        def test_zero():
            pass

        @pytest.mark.multigpu(True)
        def test_bool():
            pass

        @pytest.mark.multigpu("2")
        def test_str():
            pass

        @pytest.mark.multigpu(1)
        def test_one():
            pass
        """
    ))
    out = run()
    assert out.returncode == 1 and "1 skipped, 4 errors" in out.stdout, out.stdout
    for name in ("test_no_n", "test_zero", "test_bool", "test_str"):
        assert f"UsageError: test_m.py::{name}: use @pytest.mark.multigpu(n) with an int n >= 1" in out.stdout
    assert "SKIPPED [1] " in out.stdout and "needs 1 CUDA device(s), found 0" in out.stdout


@pytest.mark.parametrize("available, count, passed", [(True, 2, 3), (False, 2, 1)])
def test_gates_count_the_gpus_torch_can_use(project, run, monkeypatch, available, count, passed):
    """Without --ap-gpu-count the gates ask torch (the inner run is in this process). NVML can see
    GPUs that CUDA cannot use (``device_count()`` > 0, ``is_available()`` False): then none count."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    out = run()
    assert f"{passed} passed" in out.stdout, out.stdout
    assert f"needs 4 CUDA device(s), found {count if available else 0}" in out.stdout


def test_shuffle_order_follows_its_seed(project, run):
    import random

    names = ["test_needs_gpu", "test_needs_two_gpus", "test_needs_four_gpus", "test_slow", "test_plain",
             "test_in_browser"]
    out = run("--ap-order", "shuffle:3", "--collect-only")
    listed = [line.split("::")[1] for line in out.stdout.splitlines() if line.startswith("test_gates.py::")]
    random.Random(3).shuffle(names)
    assert listed == names, out.stdout
    for bad in ("shuffle", "shuffle:x", "File"):
        refused = run("--ap-order", bad, "--collect-only")
        assert refused.returncode == 4 and f"got {bad!r}" in refused.stderr


@pytest.mark.parametrize("available", [False, True])
def test_gpu_ci_header_names_torch_and_cuda(project, run, monkeypatch, available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    out = run("--ap-gpu-ci", "--ap-gpu-count", "2", "--collect-only", "-v")  # -q -v: the header shows
    cuda = "available" if available else "not available"
    assert f"autoparallel GPU CI: 2 visible GPU(s), torch {torch.__version__}, CUDA {cuda}\n" in out.stdout, out.stdout


def test_gpu_ci_runs_slow_gpu_tests_and_names_xfails(pytester, run):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "test_ci.py").write_text(textwrap.dedent(
        """
        import pytest

        @pytest.mark.gpu
        @pytest.mark.slow
        def test_slow_on_gpu():
            pass

        @pytest.mark.gpu
        @pytest.mark.xfail(reason="kernel not there yet")
        def test_expected_to_fail():
            assert False
        """
    ))
    out = run("--ap-gpu-ci", "--ap-gpu-count", "1")
    assert out.returncode == 1 and "1 passed, 1 xfailed" in out.stdout, out.stdout  # slow runs without --ap-run-slow
    assert "FAILED: 1 GPU test(s) skipped; GPU CI must not pass by skipping" in out.stdout
    assert "  test_ci.py::test_expected_to_fail: xfail: kernel not there yet" in out.stdout.splitlines()


GOLDEN_TESTS = textwrap.dedent(
    """
    from verify.goldens import render_golden

    def test_named(golden):
        golden.check_text(render_golden("t", [("a", "one")]), name="first")
        golden.check_text(render_golden("t", [("a", "two")]), name="second")

    def test_failing_golden(golden):
        golden.check_text(render_golden("t", [("a", "three")]))
        assert False

    def test_plain():
        pass
    """
)


def test_golden_usage_record_for_the_goldens_command(pytester, run, tmp_path_factory):
    """What ``python -m verify goldens`` reads: golden tests collected, those that passed (in their
    call, not their setup), the files they read, and whether the whole tree was collected."""
    (pytester.path / "pytest.ini").write_text(OPTED_IN + "testpaths = tests\n")
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_g.py").write_text(GOLDEN_TESTS)
    assert run("--snapshot-update").returncode == 1  # test_failing_golden's own assert
    goldens = pytester.path / "goldens" / "test_g"
    assert sorted(p.name for p in goldens.iterdir()) == ["test_failing_golden.txt", "test_named[first].txt",
                                                         "test_named[second].txt"]
    assert (goldens / "test_named[second].txt").read_text() == render_golden("t", [("a", "two")])
    log = tmp_path_factory.mktemp("usage")
    run(env_extra={USAGE_LOG_ENV: str(log)})
    (record_file,) = log.iterdir()
    assert record_file.name.startswith("usage-") and record_file.suffix == ".json"
    assert json.loads(record_file.read_text()) == {
        "worker": False, "whole_tree": True,
        "tests": ["tests/test_g.py::test_failing_golden", "tests/test_g.py::test_named"],
        "passed": ["tests/test_g.py::test_named", "tests/test_g.py::test_plain"],  # calls that passed
        "used": sorted(str(p.resolve()) for p in goldens.iterdir()),
    }
    record_file.unlink()
    run("tests/test_g.py", "-k", "named", env_extra={USAGE_LOG_ENV: str(log)})
    (record_file,) = log.iterdir()
    assert json.loads(record_file.read_text())["whole_tree"] is False  # given paths: not the whole tree


def test_golden_usage_passes_over_items_that_have_no_fixtures(tmp_path):
    """A doctest or another plugin's item has no ``fixturenames``: it is no golden test, and the
    usage record must not fail on it."""
    usage = _GoldenUsage(SimpleNamespace(), str(tmp_path))
    items = [SimpleNamespace(nodeid="m.txt::m.txt"), SimpleNamespace(nodeid="t.py::test_g", fixturenames=["golden"]),
             SimpleNamespace(nodeid="t.py::test_p", fixturenames=["tmp_path"])]
    usage.collected(items)
    assert usage.tests == {"t.py::test_g"}


def test_an_xdist_worker_leaves_the_verdict_to_the_controller(monkeypatch, tmp_path):
    """A worker's session never fails GPU CI on its own skips (the controller sums them up), and
    its usage record says it is a worker; it also hands the record to the controller (xdist's
    workeroutput), which judges unused goldens when no goldens command asked for the records."""
    monkeypatch.setenv(USAGE_LOG_ENV, str(tmp_path))
    options = {"ap_gpu_ci": True, "ap_gpu_count": 1}
    worker = SimpleNamespace(getoption=options.get, workerinput={}, workeroutput={},
                             args_source=pytest.Config.ArgsSource.ARGS)
    controller = SimpleNamespace(getoption=options.get, args_source=pytest.Config.ArgsSource.ARGS)
    for config, is_worker, status in ((worker, True, 0), (controller, False, pytest.ExitCode.TESTS_FAILED)):
        plugin = VerifyPlugin(config)
        plugin._skipped["t.py::test_x"] = "Skipped: no"
        session = SimpleNamespace(exitstatus=0)
        plugin.pytest_sessionfinish(session)
        assert session.exitstatus == status
        (record,) = tmp_path.iterdir()
        assert json.loads(record.read_text())["worker"] is is_worker
        record.unlink()
    assert worker.workeroutput[_GoldenUsage.WORKER_KEY]["worker"] is True


def test_a_golden_diff_page_that_cannot_be_written_does_not_hide_the_failure(pytester, run, monkeypatch):
    (pytester.path / "pytest.ini").write_text(OPTED_IN)
    (pytester.path / "tests").mkdir()
    test_file = "from verify.goldens import render_golden\n\ndef test_one(golden):\n    golden.check_text(render_golden('t', [('graph', {!r})]))\n"
    (pytester.path / "tests" / "test_g.py").write_text(test_file.format("old"))
    assert run("--snapshot-update").returncode == 0
    (pytester.path / "tests" / "test_g.py").write_text(test_file.format("new"))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(html_diff, "build_diff_page", broken)
    out = run()
    assert out.returncode == 1
    assert "(no HTML diff: OSError: disk full)" in out.stdout
    assert "--- golden test_one.txt" in out.stdout and "graph changed: golden file" in out.stdout


def test_outcomes_are_recorded_where_the_variable_asks_for_them(project, run, tmp_path):
    """$AUTOPARALLEL_OUTCOME_LOG (CI's tier and slow step, for ``verify mutate --baseline``): this
    session's tests and nothing else, though it runs inside another pytest's process."""
    log = tmp_path / "outcomes.json"
    run(env_extra={"AUTOPARALLEL_OUTCOME_LOG": str(log)})
    outcomes = json.loads(log.read_text())
    assert set(outcomes) == {f"test_gates.py::{t}" for t in ("test_needs_gpu", "test_needs_two_gpus", "test_needs_four_gpus",
                                                            "test_slow", "test_plain", "test_in_browser")}
    assert outcomes["test_gates.py::test_plain"] == "passed" and outcomes["test_gates.py::test_slow"] == "skipped"
    log.unlink()
    run()
    assert not log.exists()
