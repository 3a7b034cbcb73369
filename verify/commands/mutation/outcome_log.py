"""A pytest plugin the mutation harness loads (``-p verify.commands.mutation.outcome_log``) in its subprocesses.

It writes one JSON object ``{nodeid: outcome}`` to ``$AUTOPARALLEL_OUTCOME_LOG``, where outcome is
``passed``, ``failed`` (an assertion or exception in the test body), ``error`` (setup/teardown or
collection) or ``skipped``. The harness needs this split: a guard that errors did not *kill* a patch.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pytest loads this plugin; importing it for ENV needs no pytest (see verify/__init__)
    import pytest

ENV = "AUTOPARALLEL_OUTCOME_LOG"
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _outcomes[report.nodeid] = "skipped" if report.skipped else ("passed" if report.passed else "failed")
    elif report.failed and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "error"  # setup/teardown; a failed body stays a failure
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "error"


def pytest_testnodedown(node, error) -> None:  # xdist controller: merge worker outcomes
    _outcomes.update(getattr(node, "workeroutput", {}).get("ap_outcomes", {}))


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker hands its outcomes to the controller
        workeroutput["ap_outcomes"] = dict(_outcomes)
        return
    path = os.environ.get(ENV)
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, sort_keys=True)
