"""The mutation harness's verdicts, without subprocesses: only a guard that ran and failed with the
patch disabled kills it; a guard that always passes makes it survive; errors, skips, guards that
did not run and timeouts are never kills."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from verify.commands.mutation import outcome_log
from verify.commands.mutation import patches as harness
from verify.commands.mutation.patches import GuardRun, classify

A = "tests/test_x.py::test_a"
B = "tests/test_x.py::test_b"
C = "tests/test_x.py::test_c"
BASE = GuardRun(outcomes={A: "passed", B: "passed", A + "b": "passed"}, returncode=0)


def run(**outcomes) -> GuardRun:
    names = {"a": A, "b": B, "ab": A + "b", "module": "tests/test_x.py"}
    return GuardRun(outcomes={names[k]: v for k, v in outcomes.items()}, returncode=1, tail="...")


@pytest.mark.parametrize(
    "guards, disabled, state",
    [
        ((A,), run(a="passed"), "survived"),  # a guard that always passes
        ((A, B), run(a="passed", b="passed"), "survived"),
        ((A,), run(a="failed"), "killed"),
        ((A, B), run(a="passed", b="failed"), "killed"),  # one failing guard is enough
        ((A, B), run(a="error", b="failed"), "killed"),
        ((A,), run(a="error"), "error"),  # an erroring guard is not a kill
        ((A, B), run(a="error", b="passed"), "error"),  # ... and not a survival either
        ((A,), run(a="skipped"), "error"),
        ((A, B), run(a="passed"), "error"),  # B did not run with the patch off: proves nothing
        ((A, B), run(a="passed", module="error"), "error"),  # B's module failed to import
        ((A,), run(ab="failed"), "error"),  # test_ab is not test_a
        ((A,), GuardRun(), "error"),  # nothing ran at all
    ],
)
def test_verdicts(guards, disabled, state):
    assert classify(guards, BASE, disabled)[0] == state


def test_a_guard_that_did_not_run_is_named_with_the_collection_errors():
    state, detail = classify((A, B), BASE, run(a="passed", module="error"))
    assert state == "error"
    assert f"not run with the patch disabled: ['{B}']" in detail and "collection errors: ['tests/test_x.py']" in detail


def test_timeout_wins_over_partial_results():
    timed_out = GuardRun(outcomes={A: "failed"}, timed_out=True, seconds=301)
    assert classify((A,), BASE, timed_out) == ("timeout", "disabled run exceeded the time limit after 301s")


def test_enabled_run_must_pass_every_guard_first():
    bad_base = GuardRun(outcomes={A: "passed", B: "failed"}, returncode=1)
    assert classify((A, B), bad_base, run(a="failed"))[0] == "error"
    assert classify((), BASE, None) == ("no coverage", "the patch names no guard tests")


def test_parametrized_guard_id_selects_its_cases_only():
    r = GuardRun(outcomes={A + "[1]": "passed", A + "[2]": "failed", A + "b[1]": "failed", A + "::inner": "passed"})
    assert r.for_guard(A) == ["passed", "failed", "passed"]
    assert classify((A,), GuardRun(outcomes={A + "[1]": "passed"}), r)[0] == "killed"


def _report(nodeid, when, outcome):
    return SimpleNamespace(nodeid=nodeid, when=when, passed=outcome == "passed", failed=outcome == "failed", skipped=outcome == "skipped")


@pytest.mark.parametrize(
    "phases, recorded",
    [
        ([("setup", "passed"), ("call", "passed"), ("teardown", "passed")], "passed"),
        ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], "failed"),
        ([("setup", "failed"), ("teardown", "passed")], "error"),  # setup error: not a failure
        ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], "error"),
        ([("setup", "passed"), ("call", "failed"), ("teardown", "failed")], "failed"),  # the body failed
        ([("setup", "skipped"), ("teardown", "passed")], "skipped"),
    ],
)
def test_outcome_log_records_what_the_harness_needs(phases, recorded):
    log = outcome_log._Recorder(None)
    for when, outcome in phases:
        log.pytest_runtest_logreport(_report(A, when, outcome))
    assert log.outcomes == {A: recorded}


def test_recorded_outcomes_merge_files_and_leave_skips_out(tmp_path):
    """The tier skips a slow guard that the slow step runs: its skip is no outcome, whatever the
    order of the files."""
    tier, slow = tmp_path / "tier.json", tmp_path / "slow.json"
    tier.write_text(json.dumps({A: "skipped", B: "passed"}))
    slow.write_text(json.dumps({A: "passed"}))
    assert harness.recorded_outcomes([slow, tier]) == harness.recorded_outcomes([tier, slow]) == {A: "passed", B: "passed"}
    only_skipped = tmp_path / "skip.json"
    only_skipped.write_text(json.dumps({A: "skipped"}))
    assert harness.recorded_outcomes([only_skipped]) == {}
    for bad in ("[1, 2]", "not json"):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ValueError, match="not an outcome file"):
            harness.recorded_outcomes([tmp_path / "bad.json"])
    with pytest.raises(ValueError, match="not an outcome file"):
        harness.recorded_outcomes([tmp_path / "missing.json"])


def test_recorded_guards_are_not_run_again_and_a_recorded_failure_is_an_error(monkeypatch, tmp_path):
    """With a recorded baseline only the guards it lacks run with every patch enabled; a guard it
    records as failing makes its patch an error, as a failing baseline run would."""
    ran: list[tuple[tuple[str, ...], str]] = []

    def run_guards(guards, *, disable="", **kw):
        ran.append((tuple(guards), disable))
        return GuardRun(outcomes={g: "failed" if disable else "passed" for g in guards}, returncode=0)

    monkeypatch.setattr(harness, "run_guards", run_guards)
    recorded = tmp_path / "tier.json"
    recorded.write_text(json.dumps({A: "passed", B: "failed"}))
    patches = [SimpleNamespace(name="p_a", guards=(A, C)), SimpleNamespace(name="p_b", guards=(B,))]
    out = {r.name: r for r in harness.mutate(patches, baselines=[recorded])}
    assert ran[0] == ((C,), "")  # the baseline: C only
    assert out["p_a"].state == "killed" and out["p_a"].enabled == "2 passed"
    assert out["p_b"].state == "error" and "do not pass with the patch enabled" in out["p_b"].detail
    assert [d for _, d in ran[1:]] == ["p_a"]  # p_b's disabled run is never started


@pytest.mark.parametrize("jobs", [1, 3])
def test_jobs_run_that_many_disabled_runs_at_once_and_keep_the_patches_order(monkeypatch, jobs):
    """Each patch's disabled run only waits on its subprocess; ``jobs`` of them overlap, the
    results come back in the patches' order (the slowest first here) whatever finishes first."""
    lock, active, most = threading.Lock(), [0], [0]

    def run_guards(guards, *, disable="", **kw):
        if not disable:  # the baseline: every guard passes
            return GuardRun(outcomes={g: "passed" for g in guards}, returncode=0)
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05 * (5 - int(disable[1:])))  # p0 slowest: later patches finish first
        with lock:
            active[0] -= 1
        return GuardRun(outcomes={g: "failed" if disable == "p1" else "passed" for g in guards}, returncode=1)

    monkeypatch.setattr(harness, "run_guards", run_guards)
    patches = [SimpleNamespace(name=f"p{i}", guards=(f"tests/test_x.py::test_{i}",)) for i in range(4)]
    results = harness.mutate(patches, jobs=jobs)
    assert [r.name for r in results] == ["p0", "p1", "p2", "p3"]
    assert [r.state for r in results] == ["survived", "killed", "survived", "survived"]
    assert most[0] == jobs


def test_jobs_below_one_are_refused():
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        harness.mutate([], jobs=0)
