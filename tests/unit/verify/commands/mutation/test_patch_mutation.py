"""The mutation harness classifies throwaway patches correctly (in a temporary project)."""

import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from verify.commands.mutation import patches as harness
from verify.commands.mutation.patches import GuardRun, classify, format_table, mutate

pytestmark = pytest.mark.xdist_group("mutation-harness")  # one worker runs the module fixture

GUARDS = textwrap.dedent(
    """
    import os
    import time

    def _disabled(name):
        return name in os.environ.get("AUTOPARALLEL_DISABLE", "").split(",")

    def test_strong():
        assert not _disabled("p_strong"), "the patch is off: behaviour changed"

    def test_weak():
        pass  # asserts nothing about any patch

    def test_slow():
        if _disabled("p_slow"):
            time.sleep(60)

    def test_hangs():
        time.sleep(60)

    def test_broken():
        assert False, "fails even with every patch enabled"

    def test_crashes_when_disabled(request):
        pass

    import pytest

    @pytest.fixture
    def fixture_that_crashes():
        if _disabled("p_setup_error") or _disabled("p_error_then_kill"):
            raise RuntimeError("setup blew up")

    def test_setup(fixture_that_crashes):
        pass

    def test_fails_when_first_or_later_disabled():
        assert not (_disabled("p_first") or _disabled("p_error_then_kill"))

    def test_sleeps_when_first_disabled():
        if _disabled("p_first"):
            time.sleep(60)

    @pytest.mark.parametrize("x", [1, 2])
    def test_param(x):
        assert not (_disabled("p_param") and x == 2)
    """
)


@dataclass
class FakePatch:
    name: str
    guards: tuple[str, ...]


# Runs that must hang (a guard that sleeps 60 s) get a short limit; every other run a generous
# one. One limit for all (it was 4 s) made each expected timeout cost its full limit and left a
# normal run on a loaded machine little margin. The harness code is unchanged: the runs are real
# pytest processes, killed at their limit and classified from what that left.
HANG_LIMIT_S = 1.0
LIMIT_S = 60.0


def _hangs(guards, disable) -> bool:
    return disable == "p_slow" or any(g.endswith("::test_hangs") for g in guards)


@pytest.fixture(scope="module")
def short_limit_for_hanging_runs():
    real = harness.run_guards

    def run_guards(guards, *, disable="", timeout_s, **kw):
        return real(guards, disable=disable, timeout_s=HANG_LIMIT_S if _hangs(guards, disable) else timeout_s, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "run_guards", run_guards)
        yield


@pytest.fixture(scope="module", params=["subprocess", "zygote"])
def results(request, tmp_path_factory, short_limit_for_hanging_runs):
    """Every state, with each run a ``python -m pytest`` subprocess and forked from the zygote
    (``verify mutate``'s default, verify/commands/mutation/zygote.py): the same classification."""
    root: Path = tmp_path_factory.mktemp("mutproj")
    # no:hypothesispytest: the guard runs use no hypothesis, and its import is most of their startup.
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\naddopts = -p no:hypothesispytest\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_guards.py").write_text(GUARDS)
    g = "tests/test_guards.py::"
    patches = [
        FakePatch("p_strong", (g + "test_strong", g + "test_weak")),
        FakePatch("p_weak", (g + "test_weak",)),
        FakePatch("p_none", ()),
        FakePatch("p_slow", (g + "test_slow",)),
        FakePatch("p_broken", (g + "test_broken",)),
        FakePatch("p_setup_error", (g + "test_setup",)),
        FakePatch("p_param", (g + "test_param",)),
        FakePatch("p_first", (g + "test_fails_when_first_or_later_disabled", g + "test_sleeps_when_first_disabled")),
        FakePatch("p_error_then_kill", (g + "test_setup", g + "test_fails_when_first_or_later_disabled")),
    ]
    preload = ("pytest",) if request.param == "zygote" else None
    out = mutate(patches, workers=0, timeout_s=LIMIT_S, cwd=root, jobs=2, preload=preload)  # two runs at once, as CI runs it
    return {r.name: r for r in out}, out, root


@pytest.mark.parametrize(
    "name, state",
    [
        ("p_strong", "killed"),
        ("p_weak", "survived"),
        ("p_none", "no coverage"),
        ("p_slow", "timeout"),
        ("p_broken", "error"),
        ("p_setup_error", "error"),
        ("p_param", "killed"),
        ("p_first", "killed"),
        ("p_error_then_kill", "killed"),
    ],
)
def test_states(results, name, state):
    by_name, _, _ = results
    assert by_name[name].state == state, by_name[name].detail


def test_table_reports_kill_rate_and_reasons(results):
    _, out, _ = results
    table = format_table(out)
    assert "kill rate: 4/9 patches killed (44%)" in table
    assert "p_weak: survived: every guard passed with the patch disabled" in table
    assert "p_broken: error: guard(s) do not pass with the patch enabled" in table


def test_a_disabled_run_stops_at_its_first_failing_guard(results):
    """One failure kills the patch: the guard after it (which would sleep 60 s) never runs."""
    by_name, _, _ = results
    assert (by_name["p_first"].enabled, by_name["p_first"].disabled) == ("2 passed", "1 failed")


def test_a_run_stopped_by_an_error_runs_again_whole_and_a_later_failure_kills(results):
    """An error is not a kill, so the stop it caused cannot hide the failing guard after it."""
    by_name, _, _ = results
    assert by_name["p_error_then_kill"].disabled == "1 failed 1 error"


def test_baseline_that_times_out_is_a_timeout_not_a_missing_guard(results, short_limit_for_hanging_runs):
    """A guard that hangs with every patch enabled: the patch is reported as a timeout of its
    baseline, and the other patch (run in the same combined baseline first) is still classified."""
    _, _, root = results
    g = "tests/test_guards.py::"
    out = mutate([FakePatch("p_hangs", (g + "test_hangs",)), FakePatch("p_strong", (g + "test_strong",))],
                 workers=0, timeout_s=LIMIT_S, cwd=root)
    by_name = {r.name: r for r in out}
    assert by_name["p_hangs"].state == "timeout", by_name["p_hangs"].detail
    assert "baseline run (every patch enabled) exceeded the time limit" in by_name["p_hangs"].detail
    assert by_name["p_strong"].state == "killed", by_name["p_strong"].detail
    state, detail = classify((g + "test_hangs",), GuardRun(timed_out=True, seconds=9.0), None)
    assert state == "timeout" and "not found" not in detail


def test_missing_guard_id_is_an_error_not_a_kill():
    g = "tests/test_x.py::test_gone"
    baseline = GuardRun(outcomes={"tests/test_x.py::test_other": "passed"}, returncode=4)
    state, detail = classify((g,), baseline, None)
    assert state == "error" and "not found" in detail and g in detail


def test_collection_error_when_disabled_is_an_error_not_a_kill():
    g = "tests/test_x.py::test_a"
    baseline = GuardRun(outcomes={g: "passed"}, returncode=0)
    disabled = GuardRun(outcomes={g: "error"}, returncode=1)
    assert classify((g,), baseline, disabled)[0] == "error"
    assert classify((g,), baseline, GuardRun(outcomes={g: "failed"}, returncode=1))[0] == "killed"
    assert classify((g,), baseline, GuardRun(outcomes={g: "skipped"}, returncode=0))[0] == "error"
