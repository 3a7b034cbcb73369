"""pytest plugin of the equivalence layer (``pytest11`` entry point ``verify.pytest_plugin``).

Installing this package puts the plugin into every pytest run of the environment, so it is inert
unless the project opts in with the ini setting ``autoparallel_verify = true`` (this repository
sets it in ``pyproject.toml``; ``-o autoparallel_verify=true`` opts in for one run). In a project
that has not opted in it registers that ini key and its ``--ap-*`` options (namespaced, so they
cannot collide with a project's own ``--run-slow``) and nothing else: no marker, no fixture, no
skip, no reordering. Passing an ``--ap-*`` option there is a usage error that says how to opt in.
``-p verify.pytest_plugin`` is harmless where the package is installed (the entry point has the
module's name, so pytest sees one plugin) and loads it where the checkout is only on the path.

Opted in:

* markers ``gpu`` and ``multigpu(n)`` skip, with a reason, where CUDA or enough GPUs are missing;
  ``--ap-require-gpu`` turns those skips into failures;
* tests marked ``slow`` (cold Inductor compiles, whole-model planner checks) run only with ``--ap-run-slow``;
* tests marked ``browser`` (the HTML report in headless Chromium) skip, with the reason, where
  Chromium or Playwright is missing; ``--ap-require-browser`` turns that skip into a failure for
  a CI step that installed them;
* ``--ap-order reverse|shuffle:SEED`` reorders the tests (they must not depend on order);
* ``--ap-gpu-ci`` (what ``.ci/gpu`` runs): only the ``gpu`` tests and the ``multigpu(n)`` tests
  with ``n`` <= the visible GPU count run, any skip among them fails the run, and the summary
  says how many ``multigpu`` tests could not run for lack of GPUs (``--ap-gpu-count N``
  overrides the visible count the gates and the selection use);
* fixture ``model_check`` (``verify.check.check_model``: any model through every stage, parity
  and the oracle; fails the test with the summary; ``golden=golden`` adds a golden per stage);
* fixture ``golden`` (``verify.goldens``); the goldens no test read are judged by one rule
  (``_GoldenUsage``): only a ``--ap-run-slow`` run of the whole tree with every golden test
  passing calls a golden unused (and ``--snapshot-update`` then deletes it), so the quick tier
  never fails on, nor deletes, the goldens of the slow tests it skips; ``python -m verify
  goldens`` applies the same rule to the records each process writes (``$AUTOPARALLEL_GOLDENS_LOG``);
* ``$AUTOPARALLEL_DISABLE`` is checked before any test runs (an unknown patch name is a usage
  error) and shown in the header;
* PyTorch's structured-trace records (logger ``torch.__trace``: empty messages whose payload is
  meant for tlparse) stay out of captured logs; pytest >= 9 attaches its handlers to that
  logger, and a failing test printed hundreds of empty ``DEBUG`` lines.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

OPT_IN_INI = "autoparallel_verify"
REQUIRE_GPU = "--ap-require-gpu"
RUN_SLOW = "--ap-run-slow"
REQUIRE_BROWSER = "--ap-require-browser"
ORDER = "--ap-order"
GPU_CI = "--ap-gpu-ci"
GPU_COUNT = "--ap-gpu-count"
_OPTIONS = {REQUIRE_GPU: "ap_require_gpu", RUN_SLOW: "ap_run_slow", REQUIRE_BROWSER: "ap_require_browser",
            ORDER: "ap_order", GPU_CI: "ap_gpu_ci", GPU_COUNT: "ap_gpu_count"}
_ACTIVE = "autoparallel-verify-active"
_TRACE_LOGGER = "torch.__trace"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        OPT_IN_INI,
        type="bool",
        default=False,
        help="turn on autoparallel's verify plugin (markers gpu/multigpu/slow, fixture golden, --ap-* options)",
    )
    group = parser.getgroup("autoparallel-verify", "autoparallel verify (needs autoparallel_verify = true)")
    group.addoption(REQUIRE_GPU, action="store_true", default=False,
                    help="fail (instead of skip) tests marked gpu/multigpu when CUDA or enough GPUs are missing")
    group.addoption(RUN_SLOW, action="store_true", default=False,
                    help="also run tests marked slow (cold Inductor compiles, whole-model checks); CI runs them in their own step")
    group.addoption(REQUIRE_BROWSER, action="store_true", default=False,
                    help="fail (instead of skip) tests marked browser when Chromium or Playwright is missing")
    group.addoption(ORDER, default=None,
                    help="test order: 'file' (default), 'reverse', or 'shuffle:SEED'; proves tests do not depend on order")
    group.addoption(GPU_CI, action="store_true", default=False,
                    help="GPU CI: run only gpu and multigpu(n <= visible GPUs) tests; any skip fails the run")
    group.addoption(GPU_COUNT, type=_gpu_count, default=None, metavar="N",
                    help="the visible GPU count the gates and --ap-gpu-ci use (default: torch.cuda.device_count())")


def _gpu_count(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"takes an int >= 0, got {text!r}")
    return n


def pytest_configure(config: pytest.Config) -> None:
    if not config.getini(OPT_IN_INI):
        given = [flag for flag, dest in _OPTIONS.items() if config.getoption(dest) not in (None, False)
                 or config.getoption(dest) == 0 and dest == "ap_gpu_count"]
        if given:
            raise pytest.UsageError(
                f"{', '.join(given)}: autoparallel's verify plugin is off in this project; opt in with "
                f"`{OPT_IN_INI} = true` in its pytest ini (or -o {OPT_IN_INI}=true)"
            )
        return
    config.pluginmanager.register(VerifyPlugin(config), _ACTIVE)
    _record_outcomes_when_asked(config)


def _record_outcomes_when_asked(config: pytest.Config) -> None:
    """With ``$AUTOPARALLEL_OUTCOME_LOG`` set, every test's outcome goes to that file (the
    mutation harness's plugin): CI records its tier and slow step so that ``python -m verify
    mutate --baseline FILE`` need not run every guard again with every patch enabled. Loaded by
    name, so a run that also passes ``-p`` for it (the harness's own) registers it once."""
    from verify.commands.mutation.outcome_log import ENV

    if os.environ.get(ENV):
        config.pluginmanager.import_plugin("verify.commands.mutation.outcome_log")


def cuda_device_count(config: pytest.Config) -> int:
    """The visible GPU count: ``--ap-gpu-count`` if given, else what torch sees."""
    forced = config.getoption("ap_gpu_count")
    if forced is not None:
        return forced
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_needed(item: pytest.Item) -> int:
    """How many CUDA devices ``item`` needs: 1 for ``gpu``, n for ``multigpu(n)``, else 0."""
    needed = 1 if item.get_closest_marker("gpu") is not None else 0
    marker = item.get_closest_marker("multigpu")
    if marker is not None:
        n = marker.args[0] if marker.args else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.multigpu(n) with an int n >= 1")
        needed = max(needed, n)
    return needed


def gpu_ci_selection(items, have: int) -> tuple[list, list, list]:
    """(run, lacking, other): the GPU tests that fit ``have`` GPUs, the multigpu tests that need
    more, and every test that needs no GPU."""
    run, lacking, other = [], [], []
    for item in items:
        needed = gpus_needed(item)
        if not needed:
            other.append(item)
        elif needed <= have:
            run.append(item)
        else:
            lacking.append(item)
    return run, lacking, other


class _DropStructuredTrace(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != _TRACE_LOGGER


class VerifyPlugin:
    """Everything the plugin does, registered only in projects that opted in."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self._have: int | None = None
        self._trace_filter = _DropStructuredTrace()
        self._filtered: list[logging.Handler] = []
        self._gpu_ci_lacking: list[tuple[str, int]] = []
        self._gpu_ci_run = 0
        self._skipped: dict[str, str] = {}
        self._goldens = _GoldenUsage.from_env(config)

    # --- set-up ---------------------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        # Called when registered (pytest_configure is historic).
        from autoparallel.patches import disabled_from_env

        try:
            disabled_from_env()
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        config.addinivalue_line("markers", f"slow: costly (cold Inductor compiles, whole-model checks); skipped unless {RUN_SLOW}")
        config.addinivalue_line("markers", f"gpu: needs a CUDA device; skipped without one unless {REQUIRE_GPU}")
        config.addinivalue_line("markers", f"multigpu(n): needs n CUDA devices; skipped with fewer unless {REQUIRE_GPU}")
        config.addinivalue_line(
            "markers", f"browser: needs headless Chromium + playwright; skipped without them unless {REQUIRE_BROWSER}"
        )
        order = config.getoption("ap_order") or "file"
        kind, _, seed = order.partition(":")
        if order not in ("file", "reverse") and not (kind == "shuffle" and seed.isdigit()):
            raise pytest.UsageError(f"{ORDER} takes 'file', 'reverse' or 'shuffle:SEED', got {order!r}")
        # Unused goldens are judged by _GoldenUsage, never by syrupy (see there).
        if hasattr(config.option, "disable_unused_snapshots"):
            config.option.disable_unused_snapshots = True
        if config.getoption("ap_gpu_ci") and self.have() == 0:
            raise pytest.UsageError(
                f"{GPU_CI}: no CUDA device is visible ({_torch_description()}); GPU CI needs at least one GPU"
            )

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # pytest's logging plugin is registered after pytest_configure (trylast); by now it is.
        logging_plugin = session.config.pluginmanager.get_plugin("logging-plugin")
        for name in ("caplog_handler", "report_handler"):
            handler = getattr(logging_plugin, name, None)
            if handler is not None:
                handler.addFilter(self._trace_filter)
                self._filtered.append(handler)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        for handler in self._filtered:
            handler.removeFilter(self._trace_filter)
        self._filtered.clear()

    def have(self) -> int:
        if self._have is None:
            self._have = cuda_device_count(self.config)
        return self._have

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        from autoparallel.patches import ENV_VAR, disabled_from_env

        lines = []
        off = disabled_from_env()
        if off:
            lines.append(f"autoparallel: ${ENV_VAR} disables patches {sorted(off)}")
        if config.getoption("ap_gpu_ci"):
            lines.append(f"autoparallel GPU CI: {self.have()} visible GPU(s), {_torch_description()}")
        return lines

    # --- collection -----------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # tryfirst: before -k/-m deselect anything, so the goldens log sees every golden test.
        self._goldens.collected(items)
        if config.getoption("ap_gpu_ci"):
            run, lacking, other = gpu_ci_selection(items, self.have())
            self._gpu_ci_run = len(run)
            self._gpu_ci_lacking = [(item.nodeid, gpus_needed(item)) for item in lacking]
            if lacking or other:
                config.hook.pytest_deselected(items=lacking + other)
            items[:] = run
        order = config.getoption("ap_order") or "file"
        if order == "reverse":
            items.reverse()
        elif order.startswith("shuffle:"):
            import random

            random.Random(int(order.partition(":")[2])).shuffle(items)

    # --- running --------------------------------------------------------------------------------

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        gpu_ci = self.config.getoption("ap_gpu_ci")
        if item.get_closest_marker("slow") is not None and not (gpu_ci or self.config.getoption("ap_run_slow")):
            pytest.skip(f"slow test: run with {RUN_SLOW}; .ci/run runs these in their own step")
        if item.get_closest_marker("browser") is not None:
            from verify.commands.html.browser import unavailable_reason

            why = unavailable_reason()
            if why is not None:
                if self.config.getoption("ap_require_browser"):
                    pytest.fail(f"browser test cannot run: {why}, and {REQUIRE_BROWSER} is set", pytrace=False)
                pytest.skip(f"browser test cannot run: {why}")
        needed = gpus_needed(item)
        if not needed or needed <= self.have():
            return
        reason = f"needs {needed} CUDA device(s), found {self.have()}"
        if gpu_ci or self.config.getoption("ap_require_gpu"):
            pytest.fail(f"{reason} and {REQUIRE_GPU} is set: GPU CI must not pass by skipping", pytrace=False)
        pytest.skip(reason)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:  # an xfail is reported as skipped too, with the failure as its longrepr
            why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else f"xfail: {report.wasxfail}"
            self._skipped.setdefault(report.nodeid, str(why))
        if report.when == "call" and report.passed:
            self._goldens.passed(report.nodeid)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        # xdist's controller: a worker's golden usage record (see _GoldenUsage.finish)
        record = getattr(node, "workeroutput", {}).get(_GoldenUsage.WORKER_KEY)
        if record is not None:
            self._goldens.worker_records.append(record)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._goldens.finish(session, is_worker=hasattr(self.config, "workerinput"))
        if self.config.getoption("ap_gpu_ci") and self._skipped and not hasattr(self.config, "workerinput"):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after syrupy's snapshot report, whose unused line it explains
    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        if self._goldens.summary:
            tr.section("autoparallel goldens")
            for line in self._goldens.summary:
                tr.write_line(line)
        if not self.config.getoption("ap_gpu_ci"):
            return
        have = self.have()
        tr.section("autoparallel GPU CI")
        tr.write_line(f"{self._gpu_ci_run} GPU test(s) selected for {have} visible GPU(s)")
        if self._gpu_ci_lacking:
            tr.write_line(f"{len(self._gpu_ci_lacking)} multigpu test(s) could not run for lack of GPUs:")
            for nodeid, needed in self._gpu_ci_lacking:
                tr.write_line(f"  {nodeid}: needs {needed} GPUs, {have} visible")
        else:
            tr.write_line("0 multigpu tests could not run for lack of GPUs")
        if self._skipped:
            tr.write_line(f"FAILED: {len(self._skipped)} GPU test(s) skipped; GPU CI must not pass by skipping:")
            for nodeid, why in self._skipped.items():
                tr.write_line(f"  {nodeid}: {why}")

    # --- goldens --------------------------------------------------------------------------------

    @pytest.fixture
    def golden(self, request: pytest.FixtureRequest, snapshot) -> GoldenChecker:
        """Golden files under goldens/ (one per test); see verify.goldens."""
        # ``snapshot`` (syrupy's fixture) as a parameter: syrupy marks the test syrupy_snapshot,
        # which is how ``python -m verify goldens`` selects the golden tests.
        from verify.goldens import golden_dir_for

        try:
            golden_dir_for(request.path)
        except ValueError as e:
            pytest.fail(f"{e} (goldens/ mirrors tests/)", pytrace=False)
        return GoldenChecker(snapshot, request, self._goldens)

    # --- any model through every stage ----------------------------------------------------------

    @pytest.fixture
    def model_check(self):
        """``model_check(model, loss_fn, batch, plan=..., mesh=..., golden=None, **kw)``: runs
        ``verify.check.check_model`` and fails the test with its summary unless every stage is
        bitwise equal to the eager parallel program and the oracle passes. ``golden=golden``
        (the ``golden`` fixture) also compares each stage's canonical text with its golden file
        (one per stage, named after the test and the stage). Returns the ``ModelCheck``."""

        def check(*args, golden: GoldenChecker | None = None, **kwargs):
            from verify.check import check_model

            result = check_model(*args, goldens=golden is not None, **kwargs)
            if not result.ok:
                pytest.fail(f"{result.scenario.header()}:\n" + "\n".join(result.failures()), pytrace=False)
            if golden is not None:
                for stage, text in result.golden_texts().items():
                    golden.check_text(text, name=stage)
            return result

        return check


def _torch_description() -> str:
    import torch

    return f"torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}"


class _GoldenUsage:
    """Which goldens a run used, and the one rule for unused ones (``verify.goldens.cli``
    ``unused_goldens``): the golden tests collected (before any deselection), those that passed,
    the golden files they read, and whether the whole test tree was collected. Each process keeps
    a record; xdist workers hand theirs to the controller (``workeroutput``).

    Under ``python -m verify goldens`` (``$AUTOPARALLEL_GOLDENS_LOG`` set) each process writes its
    record there and the command judges. Any other run judges here: only with ``--ap-run-slow``
    (the quick tier skips slow tests, which own goldens too), on the whole tree, with every golden
    test passing, is a golden that no test read unused: the run fails naming it, and
    ``--snapshot-update`` deletes it. Otherwise nothing is deleted, and ``--snapshot-update`` says
    why in one line. syrupy's own unused detection is off (it would call a skipped test's goldens
    unused, and ``--snapshot-update`` deleted them)."""

    WORKER_KEY = "ap_golden_usage"

    def __init__(self, config: pytest.Config, directory: str | None):
        self.config = config
        self.directory = directory
        self.tests: set[str] = set()
        self.passed_tests: set[str] = set()
        self.used: set[str] = set()
        self.worker_records: list[dict] = []
        self.summary: list[str] = []  # lines for the terminal summary

    @classmethod
    def from_env(cls, config: pytest.Config) -> _GoldenUsage:
        from verify.goldens.cli import USAGE_LOG_ENV

        return cls(config, os.environ.get(USAGE_LOG_ENV) or None)

    def collected(self, items) -> None:
        self.tests.update(i.nodeid for i in items if "golden" in getattr(i, "fixturenames", ()))

    def passed(self, nodeid: str) -> None:
        self.passed_tests.add(nodeid)

    def use(self, path) -> None:
        self.used.add(str(path))

    def record(self, *, is_worker: bool) -> dict:
        return {
            "worker": is_worker,
            "whole_tree": self.config.args_source in (pytest.Config.ArgsSource.TESTPATHS,
                                                      pytest.Config.ArgsSource.INVOCATION_DIR),
            "tests": sorted(self.tests),
            "passed": sorted(self.passed_tests),
            "used": sorted(self.used),
        }

    def finish(self, session, *, is_worker: bool) -> None:
        record = self.record(is_worker=is_worker)
        if is_worker:
            self.config.workeroutput[self.WORKER_KEY] = record
        if self.directory:
            path = os.path.join(self.directory, f"usage-{os.getpid()}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(record, f)
            return  # python -m verify goldens judges
        if not is_worker:
            self._judge(session, [record, *self.worker_records])

    def _judge(self, session, records: list[dict]) -> None:
        """One line (or the list of unused goldens) for the terminal summary: it also explains
        syrupy's "Unused snapshot detection is disabled" line, printed just above it."""
        from pathlib import Path

        from verify.goldens.cli import unused_goldens
        from verify.goldens.text import CHECK_COMMAND, UPDATE_COMMAND

        if not any(r["tests"] for r in records):
            return  # no golden test collected
        updating = bool(getattr(self.config.option, "update_snapshots", False))
        none_deleted = ", none deleted" if updating else ""
        if not self.config.getoption("ap_run_slow"):
            self.summary.append(
                f"unused goldens: not looked for without {RUN_SLOW}{none_deleted} (the slow tests skipped here own "
                f"goldens too; `{CHECK_COMMAND}` checks every golden)")
            return
        root = Path(self.config.rootpath)
        check = unused_goldens(root, records)
        if check.not_checked:
            self.summary.append(f"unused goldens: not looked for{none_deleted} ({check.not_checked})")
        elif check.unused and updating:
            for p in check.unused:
                p.unlink()
                self.summary.append(f"deleted unused golden {p.relative_to(root)} (no test reads it)")
        elif check.unused:
            self.summary.append(f"{len(check.unused)} unused golden(s): no test reads them; "
                                f"`pytest {RUN_SLOW} --snapshot-update` or `{UPDATE_COMMAND}` deletes them:")
            self.summary += [f"  {p.relative_to(root)}" for p in check.unused]
            session.exitstatus = session.exitstatus or pytest.ExitCode.TESTS_FAILED
        else:
            self.summary.append(f"unused goldens: none (every one of the {check.files} golden files was read)")


# verify.* is imported inside the functions below, on use: this plugin is loaded by every pytest
# run where the package is installed (pytest11), which must not import torch or syrupy.
class GoldenChecker:
    """Compares text against its golden file; failures name the file and the update command."""

    def __init__(self, snapshot, request: pytest.FixtureRequest, usage: _GoldenUsage | None = None):
        from verify.goldens.syrupy_ext import GoldenTextExtension

        self._snapshot = snapshot.use_extension(GoldenTextExtension)
        self._request = request
        self._usage = usage

    def path_for(self, name: str | None = None):
        from pathlib import Path

        snap = self._snapshot(name=name) if name else self._snapshot
        return Path(snap.extension.get_location(test_location=snap.test_location, index=snap.index))

    def check_text(self, text: str, *, name: str | None = None) -> None:
        from verify.goldens import UPDATE_COMMAND, CorruptGoldenError, read_golden

        snap = self._snapshot(name=name) if name else self._snapshot
        path = self.path_for(name)
        if self._usage is not None:
            self._usage.use(path.resolve())
        updating = bool(self._request.config.option.update_snapshots)
        if not updating and not path.exists():
            pytest.fail(
                f"golden file {path} is missing. Generate it with `{UPDATE_COMMAND}` "
                f"(or `pytest --snapshot-update`), review it, and commit it with the change that needs it.",
                pytrace=False,
            )
        corrupt = None
        if path.exists():
            try:
                read_golden(path)
            except CorruptGoldenError as e:
                corrupt = str(e)
        if corrupt is not None:
            if not updating:  # outside the except block: the message is shown once, not chained twice
                pytest.fail(corrupt, pytrace=False)
            path.unlink()  # an explicit update replaces a corrupt golden
        matched = snap == text
        if not matched:
            diff = _unified_diff(path, text)
            page = self._html_diff(path, text)
            pytest.fail(
                f"graph changed: golden file {path} differs from what the code produces now.\n"
                f"{page}\n"
                f"If the change is intended, run `{UPDATE_COMMAND}`, review the diff and explain it in the "
                f"commit message.\n{diff}",
                pytrace=False,
            )

    def _html_diff(self, path, text: str) -> str:
        """Write the side-by-side diff of the golden file and ``text`` as a page in the test's
        tmp dir; the line that says where it is (or why it could not be written)."""
        from verify.commands.html.diff import build_diff_page
        from verify.goldens import read_golden

        try:
            out = self._request.getfixturevalue("tmp_path") / f"golden-diff-{path.stem}.html"
            out.write_text(build_diff_page(read_golden(path), text, title=f"golden {path.name}",
                                           note=f"{path} (left) against what the code produces now (right)"),
                           encoding="utf-8")
        except Exception as e:  # the golden's failure is the news: never hide it behind this one
            return f"(no HTML diff: {type(e).__name__}: {e})"
        return f"side-by-side HTML diff: {out}"


def _unified_diff(path, text: str) -> str:
    """Summary of changed sections, then the stats table's diff, then the graphs' (uncut)."""
    from verify.goldens import golden_diff, read_golden

    return golden_diff(read_golden(path), text, name=path.name)
