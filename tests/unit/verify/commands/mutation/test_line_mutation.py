"""verify.commands.mutation.lines (results, workdir, pytest_hook)'s parsing and reporting, on canned mutmut 3.8 output (mutmut never runs here)."""

import io
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify.__main__ import _parser, main
from verify.commands.mutation import STATES
from verify.commands.mutation import lines as L
from verify.commands.mutation import pytest_hook as H
from verify.commands.mutation import results as R
from verify.commands.mutation import workdir as W
from verify.commands.mutation.subprocess_hits import collect_subprocess_hits

RESULTS = textwrap.dedent(
    """\
    /work/venv/lib/python3.11/site-packages/mutmut/configuration.py:150: UserWarning: some warning
    \x20\x20\x20\x20autoparallel.passes.counts.xǁTallyǁsummary__mutmut_1: killed
        autoparallel.passes.counts.xǁTallyǁsummary__mutmut_5: survived
        autoparallel.passes.demo.x_walk__mutmut_1: killed
        autoparallel.passes.demo.x_walk__mutmut_2: survived
        autoparallel.passes.demo.x_walk__mutmut_3: no tests
        autoparallel.passes.demo.x__helper__mutmut_1: timeout
        autoparallel.passes.demo.x__helper__mutmut_2: suspicious
        autoparallel.passes.demo.x__helper__mutmut_3: not checked
    """
)

# `mutmut show` for two of them, batched the way show_mutants batches them (a NUL line between).
SHOWS = textwrap.dedent(
    """\
    # autoparallel.passes.counts.xǁTallyǁsummary__mutmut_5: survived
    --- autoparallel/passes/counts.py
    +++ autoparallel/passes/counts.py
    @@ -1,4 +1,4 @@
     def summary(self) -> str:
         total = self.kept + self.dropped
         share = self.kept / total if total else 1.0
    -    return f"kept {self.kept} of {total} ({share:.0%}); {self.reason or 'no reason'}"
    +    return f"kept {self.kept} of {total} ({share:.0%}); {self.reason and 'no reason'}"
    \x00
    # autoparallel.passes.demo.x_walk__mutmut_2: survived
    --- autoparallel/passes/demo.py
    +++ autoparallel/passes/demo.py
    @@ -2,5 +2,5 @@
         chain = []
         cur = start
    -    while len(cur.users) == 1:
    +    while len(cur.users) <= 1:
             chain.append(cur)
         return chain
    \x00
    """
)

COUNTS_SRC = textwrap.dedent(
    """\
    from dataclasses import dataclass


    @dataclass
    class Tally:
        # items one filter kept and dropped
        kept: int
        dropped: int
        reason: str

        def summary(self) -> str:
            total = self.kept + self.dropped
            share = self.kept / total if total else 1.0
            return f"kept {self.kept} of {total} ({share:.0%}); {self.reason or 'no reason'}"
    """
)

DEMO_SRC = textwrap.dedent(
    """\
    import os


    # walks a chain
    def walk(start):
        chain = []
        cur = start
        while len(cur.users) == 1:
            chain.append(cur)
        return chain
    """
)


def _mutants():
    mutants = R.parse_results(RESULTS)
    shows = R.parse_show(SHOWS)
    sources = {"autoparallel/passes/counts.py": COUNTS_SRC, "autoparallel/passes/demo.py": DEMO_SRC}
    for m in mutants:
        if m.name in shows:
            m.diff = shows[m.name][1]
            m.line = R.mutated_line(m.diff, sources[m.file], m.function)
    return mutants


def test_parse_key_functions_and_methods():
    assert R.parse_key("autoparallel.passes.demo.x__helper__mutmut_12") == ("autoparallel.passes.demo", "_helper", 12)
    assert R.parse_key("autoparallel.passes.counts.xǁTallyǁsummary__mutmut_1") == (
        "autoparallel.passes.counts", "Tally.summary", 1)
    with pytest.raises(ValueError, match="not a mutmut mutant name"):
        R.parse_key("autoparallel.passes.demo.walk")


def test_parse_results_maps_mutmut_statuses_to_harness_states():
    mutants = R.parse_results(RESULTS)
    assert [(m.function, m.status, m.state) for m in mutants] == [
        ("Tally.summary", "killed", "killed"),
        ("Tally.summary", "survived", "survived"),
        ("walk", "killed", "killed"),
        ("walk", "survived", "survived"),
        ("walk", "no tests", "no coverage"),
        ("_helper", "timeout", "timeout"),
        ("_helper", "suspicious", "error"),
        ("_helper", "not checked", "error"),
    ]
    assert {m.file for m in mutants} == {"autoparallel/passes/counts.py", "autoparallel/passes/demo.py"}
    assert set(STATES) >= {m.state for m in mutants}


def test_parse_show_single_and_batched():
    shows = R.parse_show(SHOWS)
    assert set(shows) == {"autoparallel.passes.counts.xǁTallyǁsummary__mutmut_5",
                          "autoparallel.passes.demo.x_walk__mutmut_2"}
    status, diff = shows["autoparallel.passes.demo.x_walk__mutmut_2"]
    assert status == "survived"
    assert diff.startswith("--- autoparallel/passes/demo.py") and diff.endswith("    return chain")
    one = SHOWS.split("\x00\n")[0]  # what a single `mutmut show <name>` prints
    assert list(R.parse_show(one)) == ["autoparallel.passes.counts.xǁTallyǁsummary__mutmut_5"]


def test_mutated_line_uses_hunk_offsets_relative_to_the_function():
    m = {m.name: m for m in _mutants()}
    # the method's diff starts at `def summary` (line 11): the changed line is its 4th
    assert m["autoparallel.passes.counts.xǁTallyǁsummary__mutmut_5"].line == 14
    assert m["autoparallel.passes.demo.x_walk__mutmut_2"].line == 8
    assert m["autoparallel.passes.demo.x_walk__mutmut_2"].changed_lines() == [
        "-    while len(cur.users) == 1:", "+    while len(cur.users) <= 1:"]


def test_mutated_line_falls_back_to_searching_the_function_when_offsets_are_stale():
    diff = R.parse_show(SHOWS)["autoparallel.passes.demo.x_walk__mutmut_2"][1]
    shifted = DEMO_SRC.replace("    chain = []\n", "    chain = []\n    # a new comment\n\n")
    assert R.mutated_line(diff, shifted, "walk") == 10
    assert R.mutated_line(diff, DEMO_SRC, "no_such_function") is None
    assert R.mutated_line(diff, "def (", "walk") is None


def test_format_table_rows_totals_kill_rate_and_survivors():
    table = R.format_table(_mutants())
    lines = table.splitlines()
    assert lines[0].split() == ["file", "mutants", "killed", "survived", "no", "coverage", "timeout", "error"]
    assert lines[1].split() == ["autoparallel/passes/counts.py", "2", "1", "1", "0", "0", "0"]
    assert lines[2].split() == ["autoparallel/passes/demo.py", "6", "1", "1", "1", "1", "2"]
    assert lines[3].split() == ["total", "8", "2", "2", "1", "1", "2"]
    assert lines[4] == ("kill rate: 2/8 mutants killed (25%); "
                        "score (killed + timeout) / (mutants - error): 3/6 (50%)")
    assert lines[5] == "survived (2):"
    assert lines[6] == "  autoparallel/passes/counts.py:14 Tally.summary  (xǁTallyǁsummary__mutmut_5)"
    assert lines[7].strip().startswith("-") and "reason or 'no reason'" in lines[7]
    assert lines[8].strip().startswith("+") and "reason and 'no reason'" in lines[8]
    assert lines[9] == "  autoparallel/passes/demo.py:8 walk  (x_walk__mutmut_2)"
    assert "no coverage (1):" in lines and "timeout (1):" in lines and "error (2):" in lines
    assert "  autoparallel/passes/demo.py _helper  (x__helper__mutmut_2) [mutmut: suspicious]" in lines


def test_format_table_by_function_and_without_diffs():
    table = R.format_table(_mutants(), by="function", diffs=False)
    lines = table.splitlines()
    assert lines[0].split()[0] == "function"
    assert [ln.split()[0] for ln in lines[1:5]] == [
        "autoparallel/passes/counts.py::Tally.summary",
        "autoparallel/passes/demo.py::_helper",
        "autoparallel/passes/demo.py::walk",
        "total",
    ]
    assert not any(ln.lstrip().startswith(("-", "+")) for ln in lines)


def test_one_file_has_no_total_row():
    mutants = [m for m in _mutants() if m.file.endswith("counts.py")]
    assert not any(ln.startswith("total") for ln in R.format_table(mutants).splitlines())


def test_generated_config_is_valid_toml_and_replaces_an_existing_table(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.mutmut]\nsource_paths = ["old"]\n\n[tool.mutmut.extra]\na = 1\n\n'
        '[tool.pytest.ini_options]\naddopts = "-ra"\n'
    )
    config = W.mutmut_config(["autoparallel/passes/a.py"], ["tests/unit/test_a.py"], ["tests/unit/test_a.py::test_x"],
                             timeout_multiplier=3, timeout_constant=2)
    W.write_config(root, tmp_path, config)
    data = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    mm = data["tool"]["mutmut"]
    assert mm["source_paths"] == ["autoparallel"]
    assert mm["only_mutate"] == ["autoparallel/passes/a.py"]
    assert mm["pytest_add_cli_args_test_selection"] == [
        "tests/unit/test_a.py", "--deselect", "tests/unit/test_a.py::test_x"]
    assert mm["process_isolation"] == "forkserver"
    assert (mm["timeout_multiplier"], mm["timeout_constant"]) == (3.0, 2.0)
    assert "extra" not in mm
    assert W.read_config(tmp_path) == (["autoparallel/passes/a.py"], ["tests/unit/test_a.py"],
                                       ["tests/unit/test_a.py::test_x"])
    assert data["project"]["name"] == "x" and data["tool"]["pytest"]["ini_options"]["addopts"] == "-ra"


def test_default_files_skip_registry_and_init(tmp_path):
    passes = tmp_path / "autoparallel" / "passes"
    passes.mkdir(parents=True)
    for name in ("__init__.py", "registry.py", "b.py", "a.py"):
        (passes / name).write_text("")
    assert L.default_files(tmp_path) == ["autoparallel/passes/a.py", "autoparallel/passes/b.py"]


class _Trickle(io.BytesIO):
    """A pipe that hands over 5 bytes at a time (multi-byte characters get split)."""

    def read1(self, n=-1):
        return super().read1(5)


MUTMUT_OUTPUT = (
    "⠋ Generating mutants⠙ Generating mutants\r    done in 10ms\n"
    "⠋ 1/3  🎉 1 🫥 0  ⏰ 0  🤔 0  🙁 0  🔇 0  🧙 0\r⠙ 2/3  🎉 1 🫥 0  ⏰ 0  🤔 0  🙁 1  🔇 0  🧙 0\r"
    "⠹ 3/3  🎉 2 🫥 0  ⏰ 0  🤔 0  🙁 1  🔇 0  🧙 0\n0.45 mutations/second\n"
)


# A monotonic clock has no defined origin: on Linux it is seconds since boot, so a machine booted
# a minute ago reads about 60. The relay must behave the same at any origin.
@pytest.mark.parametrize("origin", [0.0, 59.0, 1e6])
def test_relay_drops_spinner_frames_and_throttles_the_running_count(origin):
    said = []
    seen = L._relay(_Trickle(MUTMUT_OUTPUT.encode()), said.append, every_s=3600, clock=lambda: origin)
    assert said == [
        "done in 10ms",
        "1/3  🎉 1 🫥 0  ⏰ 0  🤔 0  🙁 0  🔇 0  🧙 0",
        "0.45 mutations/second",
        "3/3  🎉 2 🫥 0  ⏰ 0  🤔 0  🙁 1  🔇 0  🧙 0",  # the last count, always
    ]
    assert seen[-1] == "0.45 mutations/second"


@pytest.mark.parametrize("origin", [0.0, 1e6])
def test_relay_shows_a_count_again_once_every_s_has_passed(origin):
    ticks = iter([origin, origin + 5, origin + 25])  # one reading per running count
    said = []
    L._relay(_Trickle(MUTMUT_OUTPUT.encode()), said.append, every_s=10, clock=lambda: next(ticks))
    counts = [line.split()[0] for line in said if "/" in line.split()[0]]
    assert counts == ["1/3", "3/3"]  # 2/3 came 5 s after 1/3; 3/3 is not repeated at the end


@pytest.mark.parametrize("surviving, expected", [(True, 1), (False, 0)])
def test_verify_cli_exit_status_and_table(monkeypatch, capsys, surviving, expected):
    """`python -m verify mutate --lines` reaches line_mutation.main with the `mutate` namespace."""
    mutants = [R.Mutant("autoparallel.passes.demo.x_walk__mutmut_1", "killed"),
               R.Mutant("autoparallel.passes.demo.x_walk__mutmut_2", "survived" if surviving else "timeout")]
    seen = {}

    def fake_run(root, **kw):
        seen.update(kw)
        return L.LineMutationRun(mutants, kw["files"], kw["tests"], {}, 1.0, kw["workdir"], 0)

    monkeypatch.setattr(L, "run", fake_run)
    assert main(["mutate", "--lines", "-n", "2"]) == expected
    assert seen["max_children"] == 2 and seen["max_examples"] == L.DEFAULT_MAX_EXAMPLES
    assert "autoparallel/patches.py" not in seen["files"]
    assert "autoparallel/passes/fsdp_recompute.py" in seen["files"]
    assert "tests/unit/autoparallel/passes/test_fsdp_recompute.py" in seen["tests"]
    assert not seen["workdir"].exists()  # the temporary scratch directory is removed
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["autoparallel/passes/demo.py", "2"]


def test_hypothesis_cap_plugin_limits_examples(monkeypatch):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    calls = []

    @settings(max_examples=50, database=None)
    @given(st.integers())
    def prop(x):
        calls.append(x)

    item = SimpleNamespace(obj=prop)
    monkeypatch.delenv(H.MAX_EXAMPLES_ENV, raising=False)
    H.pytest_collection_modifyitems([item, SimpleNamespace(obj=lambda: None)])
    assert prop._hypothesis_internal_use_settings.max_examples == 50
    monkeypatch.setenv(H.MAX_EXAMPLES_ENV, "3")
    H.pytest_collection_modifyitems([item, SimpleNamespace(obj=lambda: None)])
    prop()
    assert len(calls) <= 3
    assert prop._hypothesis_internal_use_settings.derandomize


def test_verify_target_runs_each_checker_group_with_its_own_tests(tmp_path):
    plan = L.groups(SimpleNamespace(target="verify", files=None, tests=None), tmp_path)
    assert [files for files, _ in plan][:4] == [["verify/parity/compare.py"], ["verify/graphs/canon.py"],
                                                ["verify/graphs/stats.py", "verify/graphs/classify.py", "verify/graphs/liveness.py"],
                                                ["verify/graphs/memory.py"]]
    assert {f for files, _ in plan for f in files} >= {"verify/pytest_plugin.py", "verify/goldens/text.py"}
    assert plan[0][1] == ["tests/unit/verify/parity/test_compare.py"]
    assert all(tests for _, tests in plan)
    one = L.groups(SimpleNamespace(target="verify", files=["verify/graphs/canon.py"], tests=["t.py"]), tmp_path)
    assert one == [(["verify/graphs/canon.py"], ["t.py"])]
    with pytest.raises(ValueError, match="--tests with --target verify needs --files too"):
        L.groups(SimpleNamespace(target="verify", files=None, tests=["t.py"]), tmp_path)
    with pytest.raises(ValueError, match=r"--target 'lines': choose from \['passes', 'planner', 'verify'\]"):
        L.groups(SimpleNamespace(target="lines", files=None, tests=None), tmp_path)


def test_group_selects_named_verify_groups(tmp_path):
    assert L.VERIFY_GROUP_NAMES == ("parity", "canon", "stats", "memory", "goldens", "pytest_plugin", "plan_check")
    two = L.groups(SimpleNamespace(target="verify", files=None, tests=None, group=["canon", "goldens"]), tmp_path)
    assert [files[0] for files, _ in two] == ["verify/graphs/canon.py", "verify/goldens/text.py"]
    with pytest.raises(ValueError, match=r"--group \['nope'\]: choose from"):
        L.groups(SimpleNamespace(target="verify", files=None, tests=None, group=["nope"]), tmp_path)
    with pytest.raises(ValueError, match="--group selects among the groups of --target verify"):
        L.groups(SimpleNamespace(target="passes", files=None, tests=None, group=["canon"]), tmp_path)
    args = _parser().parse_args(["mutate", "--lines", "--target", "verify", "--group", "parity", "--group", "memory"])
    assert args.group == ["parity", "memory"]


def test_every_verify_group_names_files_and_tests_that_exist():
    root = Path(__file__).resolve().parents[5]
    missing = [p for files, tests in L.VERIFY_GROUPS.values() for p in (*files, *tests) if not (root / p).exists()]
    assert missing == []


def test_config_mutates_the_packages_of_its_files_and_copies_goldens():
    cfg = tomllib.loads(W.mutmut_config(["verify/parity/compare.py", "verify/goldens/text.py"], ["tests/t.py"]))["tool"]["mutmut"]
    assert cfg["source_paths"] == ["verify"] and cfg["also_copy"] == ["goldens"]
    assert W.source_packages(["autoparallel/passes/a.py", "verify/graphs/canon.py"]) == ["autoparallel", "verify"]


def test_merged_runs_make_one_table(tmp_path):
    a = L.LineMutationRun([R.Mutant("verify.parity.compare.x_f__mutmut_1", "killed")], ["verify/parity/compare.py"], ["t1"], {},
                          1.0, tmp_path, 0, "a")
    b = L.LineMutationRun([R.Mutant("verify.graphs.canon.x_g__mutmut_1", "survived")], ["verify/graphs/canon.py"], ["t1", "t2"],
                          {"t2::x": "failed"}, 2.0, tmp_path, 1, "b")
    m = L.merge_runs([a, b])
    assert [x.file for x in m.mutants] == ["verify/parity/compare.py", "verify/graphs/canon.py"]
    assert (m.files, m.tests, m.deselected, m.seconds, m.mutmut_exit, m.mutmut_tail) == (
        ["verify/parity/compare.py", "verify/graphs/canon.py"], ["t1", "t2"], {"t2::x": "failed"}, 3.0, 1, "a\nb")


def test_processes_a_test_starts_report_the_mutated_functions_they_ran(tmp_path):
    """The sitecustomize bridge, in a real subprocess, as mutmut's coverage run would start it."""
    pytest.importorskip("mutmut")
    bridge, hits = tmp_path / W.BRIDGE_DIR, tmp_path / W.HITS_DIR
    bridge.mkdir()
    hits.mkdir()
    (bridge / "sitecustomize.py").write_text(W.SUBPROCESS_BRIDGE)
    env = {**W.mutmut_env(1, tmp_path), "AP_MUTATION_HITS": str(hits), "MUTANT_UNDER_TEST": "stats"}
    (tmp_path / "mutants").mkdir()
    code = ("import sys, mutmut.mutation.trampoline as t; "
            f"assert sys.path.index({str(tmp_path / 'mutants')!r}) <= 1, sys.path; "  # after '' (python -c), before the rest
            "t.record_trampoline_hit('verify.parity.compare.x_diff_tensors'); t.record_trampoline_hit('verify.graphs.canon.x_f')")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)
    assert collect_subprocess_hits(hits) == {"verify.parity.compare.x_diff_tensors", "verify.graphs.canon.x_f"}
    assert list(hits.iterdir()) == []  # read once
    env["MUTANT_UNDER_TEST"] = "verify.parity.compare.x_diff_tensors__mutmut_1"  # a mutant run: mutmut's own hook
    untouched = "import sys, mutmut.mutation.trampoline as t; sys.exit(t.record_trampoline_hit.__module__ != 'mutmut.stats')"
    subprocess.run([sys.executable, "-c", untouched], cwd=tmp_path, env=env, check=True, timeout=120)
    assert collect_subprocess_hits(hits) == set()


def test_a_mutated_pytest_plugin_is_left_out_of_the_runs_that_judge_it(tmp_path, monkeypatch):
    """The project's own pytest plugin, mutated, must not load in mutmut's pytest (nor in the
    baseline's): a mutant that skips tests there skips the tests meant to catch it."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[project.entry-points.pytest11]\n"pkg.plug" = "pkg.plug"\nother = "pkg.other:hooks"\n'
    )
    assert W.mutated_pytest_plugins(tmp_path, ["pkg/plug.py", "pkg/a.py"]) == ["pkg.plug"]
    assert W.mutated_pytest_plugins(tmp_path, ["pkg/other.py", "pkg/plug.py"]) == ["other", "pkg.plug"]
    assert W.mutated_pytest_plugins(tmp_path, ["pkg/a.py"]) == []
    assert W.mutated_pytest_plugins(tmp_path / "nowhere", ["pkg/plug.py"]) == []
    root = Path(__file__).resolve().parents[5]
    blocked = {name: W.mutated_pytest_plugins(root, files) for name, (files, _) in L.VERIFY_GROUPS.items()}
    assert blocked == {"parity": [], "canon": [], "stats": [], "memory": [], "goldens": [],
                       "pytest_plugin": ["verify.pytest_plugin"], "plan_check": []}

    cfg = tomllib.loads(W.mutmut_config(["pkg/plug.py"], ["tests/t.py"], blocked_plugins=["pkg.plug"]))["tool"]["mutmut"]
    assert cfg["pytest_add_cli_args"][-2:] == ["-p", "no:pkg.plug"]
    assert "no:pkg.plug" not in W.mutmut_config(["pkg/a.py"], ["tests/t.py"])

    cmd, outcomes = _baseline_command(monkeypatch, tmp_path, blocked_plugins=["pkg.plug"])
    assert outcomes == {"tests/t.py::test_a": "passed"}
    i = cmd.index("no:pkg.plug")
    assert cmd[i - 1] == "-p" and cmd[-1] == "tests/t.py"


def _baseline_command(monkeypatch, tmp_path, **kw) -> tuple[list[str], dict]:
    """The pytest command ``L.baseline(tmp_path, ["tests/t.py"], 1, **kw)`` starts, and the outcomes it
    reads back (one test passed)."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        Path(kw["env"][L.OUTCOME_ENV]).write_text('{"tests/t.py::test_a": "passed"}')
        return SimpleNamespace(returncode=0, stdout="")

    monkeypatch.setattr(L.subprocess, "run", fake_run)
    outcomes = L.baseline(tmp_path, ["tests/t.py"], 1, **kw)
    return seen[0], outcomes


# --- --target planner --------------------------------------------------------------------------


def test_planner_target_mutates_the_planner_against_its_own_quick_tests(tmp_path):
    planner = tmp_path / "autoparallel" / "planner"
    planner.mkdir(parents=True)
    for name in ("__init__.py", "ilp.py", "api.py", "notes.txt"):
        (planner / name).write_text("")
    (tmp_path / "tests" / "unit" / "autoparallel" / "planner").mkdir(parents=True)
    args = SimpleNamespace(target="planner", files=None, tests=None)
    assert L.groups(args, tmp_path) == [(["autoparallel/planner/api.py", "autoparallel/planner/ilp.py"],
                                         ["tests/unit/autoparallel/planner"])]  # plan_check's test is not in tmp_path
    assert L.markexpr_of(args) == "not slow"
    assert L.markexpr_of(SimpleNamespace(target="passes")) is None and L.markexpr_of(SimpleNamespace(target="verify")) is None
    with pytest.raises(ValueError, match="--group selects among the groups of --target verify"):
        L.groups(SimpleNamespace(target="planner", files=None, tests=None, group=["canon"]), tmp_path)
    root = Path(__file__).resolve().parents[5]
    files, tests = L.groups(args, root)[0]
    assert tests == list(L.PLANNER_TESTS)  # both exist in the repository
    assert "autoparallel/planner/ilp.py" in files and "autoparallel/planner/__init__.py" not in files
    assert len(files) == len(list((root / L.PLANNER_DIR).glob("*.py"))) - 1


def test_quick_tier_marker_reaches_every_pytest_run_mutmut_and_the_baseline_make(tmp_path, monkeypatch):
    cfg = tomllib.loads(W.mutmut_config(["autoparallel/planner/a.py"], ["tests/t"], markexpr=L.QUICK_TIER))["tool"]["mutmut"]
    assert cfg["pytest_add_cli_args"][-2:] == ["-m", "not slow"]
    assert cfg["pytest_add_cli_args_test_selection"] == ["tests/t"]  # read_config still reads the tests back
    assert "-m" not in tomllib.loads(W.mutmut_config(["a/b.py"], ["t"]))["tool"]["mutmut"]["pytest_add_cli_args"]
    cmd, _ = _baseline_command(monkeypatch, tmp_path, markexpr="not slow")
    i = cmd.index("not slow")
    assert cmd[i - 1] == "-m" and cmd[-1] == "tests/t.py"
    assert "not slow" not in _baseline_command(monkeypatch, tmp_path)[0]


# --- --sample N --seed S -----------------------------------------------------------------------

NAMES = [f"autoparallel.planner.ilp.x_solve__mutmut_{i}" for i in range(1, 41)]


def test_a_sample_is_a_fixed_draw_of_exactly_n_names_for_a_seed():
    a = L.sample_names(NAMES, 7, seed=28)
    assert len(a) == 7 == len(set(a)) and set(a) <= set(NAMES) and a == sorted(a)
    assert L.sample_names(reversed(NAMES), 7, seed=28) == a  # mutmut's listing order does not matter
    assert L.sample_names(NAMES + NAMES[:5], 7, seed=28) == a  # nor a name listed twice
    assert L.sample_names(NAMES, 7, seed=29) != a
    assert L.sample_names(NAMES, 8, seed=28) != a
    draws = {tuple(L.sample_names(NAMES, 7, seed=s)) for s in range(10)}
    assert len(draws) > 5  # the seed draws, the names are not just cut


@pytest.mark.parametrize("n", [40, 41, 1000])
def test_a_sample_of_at_least_every_mutant_is_every_mutant(n):
    assert L.sample_names(NAMES, n, seed=3) == sorted(NAMES)


@pytest.mark.parametrize("n", [0, -1])
def test_a_sample_must_have_a_positive_size(n):
    with pytest.raises(ValueError, match=rf"--sample {n}: the number of mutants to run must be positive"):
        L.sample_names(NAMES, n, seed=0)
    with pytest.raises(ValueError, match=rf"--sample {n}"):  # before any scratch directory is made
        L.main(SimpleNamespace(target="planner", files=None, tests=None, sample=n, seed=0))
    assert main(["mutate", "--lines", "--target", "planner", "--sample", str(n)]) == 2


def test_the_verify_cli_takes_the_planner_target_a_sample_and_a_seed():
    args = _parser().parse_args(["mutate", "--lines", "--target", "planner", "--sample", "150", "--seed", "28"])
    assert (args.target, args.sample, args.seed) == ("planner", 150, 28)
    args = _parser().parse_args(["mutate", "--lines"])
    assert (args.target, args.sample, args.seed) == ("passes", None, 0)
    own = L._parser().parse_args(["--target", "planner", "--sample", "5"])
    assert (own.target, own.sample, own.seed) == ("planner", 5, 0)


def test_a_sampled_run_hands_mutmut_only_the_drawn_names(tmp_path, monkeypatch):
    root, wd = tmp_path / "root", tmp_path / "wd"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    monkeypatch.setattr(L, "generate_mutants", lambda workdir: list(NAMES))
    monkeypatch.setattr(L, "_mutmut_cmd", lambda: ["mutmut"])  # the test extra has no mutmut
    started, asked = [], {}

    class FakeMutmut:
        def __init__(self, cmd, **kw):
            started.append(cmd)
            self.stdout = io.BytesIO(b"")

        def wait(self):
            return 0

    def fake_collect(workdir, progress, only=None):
        asked["only"] = only
        return [R.Mutant(n, "killed") for n in only or NAMES]

    monkeypatch.setattr(L.subprocess, "Popen", FakeMutmut)
    monkeypatch.setattr(L, "collect", fake_collect)
    r = L.run(root, files=["autoparallel/planner/ilp.py"], tests=["tests/t"], workdir=wd, max_children=1,
              skip_baseline=True, sample=5, seed=28)
    drawn = L.sample_names(NAMES, 5, seed=28)
    assert started[0][-5:] == drawn and started[0][-7:-5] == ["--max-children", "1"]
    assert asked["only"] == drawn and [m.name for m in r.mutants] == drawn
    assert r.sample == L.Sample(5, 40, 28)
    assert L.load_sample(wd) == (drawn, L.Sample(5, 40, 28))  # kept for --report-only
    L.run(root, files=["autoparallel/planner/ilp.py"], tests=["tests/t"], workdir=wd, max_children=1, skip_baseline=True)
    assert started[1][-2:] == ["--max-children", "1"]  # no sample: every mutant, as before
    assert asked["only"] is None and L.load_sample(wd) is None  # the old draw is not read back


def test_collect_reports_only_the_sampled_mutants(tmp_path, monkeypatch):
    (tmp_path / "autoparallel" / "passes").mkdir(parents=True)
    (tmp_path / "autoparallel/passes/demo.py").write_text(DEMO_SRC)
    (tmp_path / "autoparallel/passes/counts.py").write_text(COUNTS_SRC)

    def fake_run(cmd, **kw):
        return SimpleNamespace(returncode=0, stdout=RESULTS if "results" in cmd else SHOWS)

    monkeypatch.setattr(L.subprocess, "run", fake_run)
    monkeypatch.setattr(L, "_mutmut_cmd", lambda: ["mutmut"])  # the test extra has no mutmut
    assert len(L.collect(tmp_path)) == 8  # "not checked" too: every mutant was meant to run
    only = ["autoparallel.passes.demo.x_walk__mutmut_1", "autoparallel.passes.demo.x_walk__mutmut_2"]
    got = L.collect(tmp_path, only=only)
    assert [(m.name, m.state, m.line) for m in got] == [(only[0], "killed", None), (only[1], "survived", 8)]


def test_the_report_of_a_sample_says_so_and_counts_the_sample(capsys, tmp_path):
    mutants = [R.Mutant("autoparallel.planner.ilp.x_solve__mutmut_1", "killed"),
               R.Mutant("autoparallel.planner.ilp.x_solve__mutmut_2", "survived")]
    r = L.LineMutationRun(mutants, ["autoparallel/planner/ilp.py"], ["t"], {}, 1.0, tmp_path, 0, sample=L.Sample(2, 90, 7))
    assert L._report(SimpleNamespace(), r) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sample of 2 of 90 mutants, seed 7: the counts and the kill rate are of the sampled mutants only"
    assert "kill rate: 1/2 mutants killed (50%)" in out[3]
    L._report(SimpleNamespace(json=True), r)
    data = json.loads(capsys.readouterr().out)
    assert data["sample"] == {"size": 2, "total": 90, "seed": 7} and (data["total"], data["killed"]) == (2, 1)
    r.sample = None
    L._report(SimpleNamespace(), r)
    assert not capsys.readouterr().out.startswith("sample")
    L._report(SimpleNamespace(json=True), r)
    assert json.loads(capsys.readouterr().out)["sample"] is None


def test_merged_sampled_runs_add_their_samples(tmp_path):
    a = L.LineMutationRun([], ["a.py"], [], {}, 1.0, tmp_path, 0, sample=L.Sample(3, 30, 5))
    b = L.LineMutationRun([], ["b.py"], [], {}, 1.0, tmp_path, 0, sample=L.Sample(4, 8, 5))
    assert L.merge_runs([a, b]).sample == L.Sample(7, 38, 5)
    assert L.merge_runs([L.LineMutationRun([], [], [], {}, 0.0, tmp_path, 0)]).sample is None


def test_mutmut_generates_the_names_a_sample_draws_from(tmp_path):
    """generate_mutants drives the installed mutmut's internals: a two-function module, for real."""
    pytest.importorskip("mutmut")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("def f(a):\n    return a + 1\n\n\ndef g(a):\n    return a < 2\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n' + W.mutmut_config(["pkg/mod.py"], ["tests"]))
    names = L.generate_mutants(tmp_path)
    assert {R.parse_key(n)[:2] for n in names} == {("pkg.mod", "f"), ("pkg.mod", "g")}
    assert len(names) == len(set(names)) >= 4
    assert sorted(L.generate_mutants(tmp_path)) == sorted(names)  # mutmut run finds them made, the same
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n' + W.mutmut_config(["pkg/none.py"], ["tests"]))
    with pytest.raises(RuntimeError, match="mutmut generated no mutants to sample from"):
        L.generate_mutants(tmp_path)
