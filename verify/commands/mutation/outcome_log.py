"""A pytest plugin the mutation harness loads (``-p verify.commands.mutation.outcome_log``) in its subprocesses.

It writes one JSON object ``{nodeid: outcome}`` to ``$AUTOPARALLEL_OUTCOME_LOG``, where outcome is
``passed``, ``failed`` (an assertion or exception in the test body), ``error`` (setup/teardown or
collection) or ``skipped``. The harness needs this split: a guard that errors did not *kill* a patch.
The verify plugin also loads it wherever that variable is set (CI's tier and slow step: the
harness's recorded baseline).

One recorder per pytest session, not per process: a session run inside another's process
(pytester's in-process runs) records only its own tests, and the outer session keeps its own.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pytest loads this plugin; importing it for ENV needs no pytest (see verify/__init__)
    import pytest

ENV = "AUTOPARALLEL_OUTCOME_LOG"


class _Recorder:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.outcomes[report.nodeid] = "skipped" if report.skipped else ("passed" if report.passed else "failed")
        elif report.failed and self.outcomes.get(report.nodeid) != "failed":
            self.outcomes[report.nodeid] = "error"  # setup/teardown; a failed body stays a failure
        elif report.skipped and report.nodeid not in self.outcomes:
            self.outcomes[report.nodeid] = "skipped"

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "error"

    def pytest_testnodedown(self, node, error) -> None:  # xdist controller: merge worker outcomes
        self.outcomes.update(getattr(node, "workeroutput", {}).get("ap_outcomes", {}))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker hands its outcomes to the controller
            workeroutput["ap_outcomes"] = dict(self.outcomes)
            return
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.outcomes, f, sort_keys=True)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Recorder(os.environ.get(ENV)), "ap-outcome-log")
