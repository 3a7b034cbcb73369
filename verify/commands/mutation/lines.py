"""Line-level mutation with mutmut 3 (``python -m verify mutate --lines``): of ``autoparallel/passes``
(``--target passes``, the default), of the automatic planner (``--target planner``) or of the
verification layer itself (``--target verify``).

The patch-level harness (verify/commands/mutation/patches.py) asks "does some test notice when a whole fix is
turned off?"; this one asks it for every small edit mutmut can make inside a function of the
passes (``<`` to ``<=``, ``+ 1``, ``and`` to ``or``, a string or constant changed, a call argument
dropped, ...). Results use the same vocabulary and table layout: per file (or per function, with
``--by function``) the number of mutants that were ``killed``, ``survived``, had ``no coverage``
(no selected test reaches the function), hit the ``timeout`` or ended in an ``error`` (anything
else mutmut reports: suspicious, segfault, skipped, not checked), then a kill-rate line and every
mutant that was not killed with ``file:line`` and its diff.

What runs
    * ``--target planner``: every ``.py`` file of ``autoparallel/planner`` except ``__init__.py``,
      against :data:`PLANNER_TESTS` (the planner's unit tests and the independent plan checker's,
      which runs the planner on its cases) without the tests marked ``slow`` (``-m "not slow"``:
      whole-model traces and a fresh interpreter, seconds each, per mutant that reaches them; CI's
      slow step runs them). No property test exercises the planner.
    * ``--target verify``: the checkers (parity, canon, stats, memory, goldens, pytest_plugin), one
      mutmut run per group of :data:`VERIFY_GROUPS`, each with the narrowest tests that cover it
      (the group's own unit and negative tests), merged into one table; ``--group NAME`` runs only
      some. Tests that run pytest or python in a subprocess (the pytest plugin's, the goldens
      command's) see the mutants too: a ``sitecustomize`` bridge on their ``PYTHONPATH`` puts the
      scratch directory's ``mutants/`` first on their path and reports the functions they ran as
      coverage, and mutmut's ``MUTANT_UNDER_TEST`` reaches them through the environment
      (verify/commands/mutation/subprocess_hits.py). A test that starts a process with a scrubbed
      environment still runs the original code there.
    * A mutated module that is one of the project's own pytest plugins (a ``pytest11`` entry point
      in ``pyproject.toml``: ``verify.pytest_plugin``) is blocked (``-p no:NAME``) in the pytest
      runs that judge it (mutmut's and the baseline's), and loaded only by the pytest runs its tests
      start (pytester, in the same process: they see the mutants). Otherwise a mutant that skips
      or deselects tests would skip the very tests meant to catch it (mutmut counts the run as
      passed: "survived"), and one that makes pytest stop with a usage error or a crash in a hook
      would stop mutmut's run of them (mutmut files such a run under "timeout").
    * Mutated (``--target passes``): every ``.py`` file of ``autoparallel/passes`` except ``__init__.py`` and
      ``registry.py`` (the patch registry: every pass calls ``enabled()``, so mutating it only
      re-tests the whole suite, and the patch-level harness already covers it). mutmut only mutates
      code inside functions and skips decorated functions (except ``@staticmethod`` and
      ``@classmethod``); module-level code is never mutated.
    * Tests: ``tests/unit/autoparallel/passes/test_fsdp_recompute.py``, ``test_topo_span_bucketing.py``,
      ``test_pre_overlap_bucketing.py``, ``test_fuse_chained_allgathers.py``,
      ``test_passes_pipeline.py``, ``test_overlap_estimator.py``, ``test_graph_utils.py`` and
      ``tests/property/`` (those that exist). mutmut records once which tests reach which function
      and runs only those per mutant. Hypothesis tests run with ``max_examples`` capped
      (``--max-examples``, default 10) and derandomized, without the example database, so a
      verdict does not depend on luck or on examples an earlier mutant left behind.
    * ``--sample N [--seed S]``: mutmut generates every mutant first (in a process of its own,
      through mutmut's internals, as ``show`` is read), then ``mutmut run`` gets only ``N`` of their
      names, drawn by :func:`sample_names` (a fixed draw for a seed; all of them when ``N`` is at
      least their number). The report says so ("sample of N of M mutants, seed S") and counts the
      sampled mutants only; the draw is kept in the scratch directory for ``--report-only``.
      With several groups (``--target verify``) each group draws its own ``N``.
    * A baseline pytest run of the selected tests comes first: tests that do not pass on the
      unmutated code are deselected (and listed), because mutmut refuses to start otherwise and a
      test that already fails kills nothing.

Configuration, and what it leaves behind
    Nothing in the repository: the run happens in a scratch directory (``--workdir``, default a
    fresh temporary one that is deleted afterwards) holding a copy of ``autoparallel/``, ``tests/``
    and ``pyproject.toml`` with a generated ``[tool.mutmut]`` table appended (mutmut reads its
    config only from the working directory's ``pyproject.toml`` or ``setup.cfg``). mutmut's own
    ``mutants/`` tree lives inside that directory. With ``--workdir DIR`` it is kept, and
    ``cd DIR && mutmut browse`` / ``mutmut show <name>`` work there. The generated table uses
    ``process_isolation = "forkserver"`` (mutmut's advice for torch: forking a process that has
    started torch's thread pools is unsafe), and each mutant's wall-clock limit is mutmut's
    ``(duration of its tests + timeout_constant) * timeout_multiplier`` (defaults 5 s and 5x here).

Cost
    Not part of CI or of any pytest tier: it runs every selected test once per mutant that a test
    reaches. Measured on the shared 2-core development box (other jobs running): the default set
    (8 files, 1764 mutants) took 1 h 40 min with ``-n 2``; fsdp_recompute.py plus cleanup.py
    (214 mutants, tests/unit/autoparallel/passes/test_fsdp_recompute.py only) took 8 min with ``-n 2`` and 21 min with
    ``-n 1``. ``--target planner`` makes 6914 mutants (about a minute to generate); a sample of 150
    took 35 min with ``-n 1``. Functions that the property tests reach are the slow part (about 20 s
    of tests per surviving mutant at 10 examples). Install mutmut with ``pip install -e .[mutation]``.

Usage
    python -m verify mutate --lines                    # everything above, table on stdout
    python -m verify mutate --lines --target verify    # the checkers, group by group
    python -m verify mutate --lines --target verify --group parity --group canon
    python -m verify mutate --lines --target planner --sample 150 --seed 28 -n 1
    python -m verify mutate --lines --json -n 2        # one JSON object; -n: mutmut workers
                                                       # (0/auto: all cores); --patch and
                                                       # --timeout apply to patch-level only
    python -m verify.commands.mutation.lines --files autoparallel/passes/fsdp_recompute.py \\
        --tests tests/unit/autoparallel/passes/test_fsdp_recompute.py --by function --workdir /tmp/mm
    python -m verify.commands.mutation.lines --report-only --workdir /tmp/mm --by function   # re-report

Exit status: 0 when every mutant was killed (or timed out), 1 when any survived, had no coverage
or ended in an error, or when mutmut could not run. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from verify import repo_root
from verify.commands.mutation import STATES, run_slow_args
from verify.commands.mutation.outcome_log import ENV as OUTCOME_ENV
from verify.commands.mutation.results import Mutant, format_table, mutated_line, parse_results, parse_show
from verify.commands.mutation.workdir import (
    DEFAULT_TIMEOUT_CONSTANT,
    DEFAULT_TIMEOUT_MULTIPLIER,
    mark_args,
    mutated_pytest_plugins,
    mutmut_config,
    mutmut_env,
    outer_pytest_args,
    prepare_workdir,
    read_config,
    write_config,
)

PASSES_DIR = "autoparallel/passes"
PLANNER_DIR = "autoparallel/planner"
VERIFY_PLUGIN = "verify.pytest_plugin"  # its pytest11 entry point name (pyproject.toml)
EXCLUDED_FILES = ("__init__.py", "registry.py")
# Tests of code every stage shares; each stage's own come from verify.stages.registry.
SHARED_TESTS = (
    "tests/unit/autoparallel/passes/test_collective.py",
    "tests/unit/autoparallel/passes/test_overlap_estimator.py",
    "tests/unit/autoparallel/test_fx_utils.py",
    "tests/property",
)
# --target verify: name -> (files mutated together, the narrowest tests that cover them), one
# mutmut run each. The name is what --group takes: the module, or the package of several.
VERIFY_GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "parity": (("verify/parity/compare.py",), ("tests/unit/verify/parity/test_compare.py",)),
    "canon": (("verify/graphs/canon.py",), ("tests/unit/verify/graphs/test_canon.py", "tests/unit/verify/graphs/test_canon_negative.py")),
    "stats": (
        ("verify/graphs/stats.py", "verify/graphs/classify.py", "verify/graphs/liveness.py"),
        ("tests/unit/verify/graphs/test_stats.py", "tests/unit/verify/graphs/test_stats_negative.py"),
    ),
    "memory": (("verify/graphs/memory.py",), ("tests/unit/verify/graphs/test_memory.py", "tests/unit/verify/graphs/test_memory_negative.py")),
    "goldens": (
        ("verify/goldens/text.py", "verify/goldens/catalog.py", "verify/goldens/cli.py", "verify/goldens/syrupy_ext.py"),
        ("tests/unit/verify/goldens", "tests/golden/test_golden_workflow.py"),
    ),
    # The golden workflow's throwaway projects are where GoldenChecker (the golden fixture) runs.
    "pytest_plugin": (("verify/pytest_plugin.py",), ("tests/unit/verify/test_pytest_plugin.py", "tests/golden/test_golden_workflow.py")),
    # The independent plan checker: its negative tests on a correct plan and on tampered ones.
    "plan_check": (("verify/parity/plan_check.py", "verify/parity/plan_semantics.py"), ("tests/unit/verify/parity/test_plan_check.py",)),
}
# --target planner: what it mutates (PLANNER_DIR but these) and its tests, run without the slow ones
PLANNER_EXCLUDED = ("__init__.py",)
PLANNER_TESTS = ("tests/unit/autoparallel/planner", "tests/unit/verify/parity/test_plan_check.py")
QUICK_TIER = "not slow"  # the pytest -m expression of a target whose tests leave CI's slow step out
TARGETS = ("passes", "planner", "verify")
VERIFY_GROUP_NAMES = tuple(VERIFY_GROUPS)
SAMPLE_FILE = "ap-sample.json"  # a sampled run's draw, in its scratch directory
DEFAULT_MAX_EXAMPLES = 10


# --- running mutmut --------------------------------------------------------------------------


def default_files(root: Path, directory: str = PASSES_DIR, excluded: Sequence[str] = EXCLUDED_FILES) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / directory).glob("*.py") if p.name not in excluded)


def default_test_paths(stages=None, registry=None) -> tuple[str, ...]:
    """``--target passes``' tests: each stage's line-mutation tests (its registry entry), then
    :data:`SHARED_TESTS`. ``stages`` / ``registry``: default every stage, the registry."""
    # The registry imports torch; every `python -m verify` parser imports this module without it.
    from verify.stages import registry as R

    stages = R.PLANNED_STAGES if stages is None else stages
    return tuple(dict.fromkeys((*R.mutation_tests(stages, R.REGISTRY if registry is None else registry), *SHARED_TESTS)))


def default_tests(root: Path) -> list[str]:
    return [t for t in default_test_paths() if (root / t).exists()]



def _mutmut_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("mutmut")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mutmut")
    if not found:
        raise RuntimeError("mutmut is not installed: pip install -e .[mutation]")
    return [found]


def baseline(workdir: Path, tests: Sequence[str], max_examples: int, timeout_s: float | None = None,
             blocked_plugins: Sequence[str] = (), run_slow: Sequence[str] = (),
             markexpr: str | None = None) -> dict[str, str]:
    """Outcomes (``verify.commands.mutation.outcome_log``) of the selected tests on the unmutated copy, run
    as mutmut will run them (without ``blocked_plugins``)."""
    log = workdir / "baseline-outcomes.json"
    env = mutmut_env(max_examples)
    env[OUTCOME_ENV] = str(log)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "verify.commands.mutation.outcome_log",
           "-p", "verify.commands.mutation.pytest_hook", *run_slow, *outer_pytest_args(blocked_plugins), *mark_args(markexpr),
           "--rootdir", str(workdir), *tests]
    proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)
    if not log.exists():
        raise RuntimeError(f"baseline pytest run wrote no outcomes (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(log.read_text())


_SPINNER = re.compile(r"^[⠀-⣿] ")


def _relay(stream, progress: Callable[[str], None], every_s: float = 20.0,
           clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Forward mutmut's output as progress lines: spinner frames are dropped and its running
    count (``n/total  🎉 ...``) is shown at most every ``every_s`` seconds (the first one at
    once, the last one always). Returns all lines.

    ``clock`` has no defined origin (``time.monotonic`` counts from boot on Linux): only
    differences between two of its readings mean anything, so the first count is not compared
    with a made-up start time."""
    import codecs

    seen: list[str] = []
    last_status, shown, last_t = "", "", None
    buf = ""
    read = getattr(stream, "read1", stream.read)  # read1: what is there now, not a full 4 KiB
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        chunk = read(4096)
        if not chunk:
            break
        buf += decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        parts = re.split(r"[\r\n]", buf)
        buf = parts.pop()
        for part in parts:
            part = part.strip()
            if not part:
                continue
            seen.append(part)
            if re.match(r"^[⠀-⣿]?\s*\d+/\d+\s", part):
                last_status = _SPINNER.sub("", part)
                now = clock()
                if last_t is None or now - last_t >= every_s:
                    progress(last_status)
                    shown, last_t = last_status, now
            elif not _SPINNER.match(part):
                progress(part)
    if buf.strip():
        seen.append(buf.strip())
    if last_status and last_status != shown:
        progress(last_status)
    return seen


_SHOW_SCRIPT = """
import sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
from mutmut.stats import status_by_exit_code
for name in sys.argv[1:]:
    m = find_mutant(name)
    print(f"# {name}: {status_by_exit_code[m.exit_code_by_key[name]]}")
    print(get_diff_for_mutant(name, path=m.path))
    print("\\x00")
"""


def show_mutants(workdir: Path, names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``mutmut show`` for many mutants in one process (the same calls its ``show`` command makes);
    falls back to one ``mutmut show`` per mutant if mutmut's internals moved."""
    if not names:
        return {}
    proc = subprocess.run([sys.executable, "-c", _SHOW_SCRIPT, *names], cwd=workdir, capture_output=True,
                          text=True)
    if proc.returncode == 0:
        return parse_show(proc.stdout)
    out = {}
    for name in names:
        p = subprocess.run([*_mutmut_cmd(), "show", name], cwd=workdir, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        out.update(parse_show(p.stdout))
    return out


# Generates every mutant the way ``mutmut run`` starts (same calls, same order) and prints their
# names: what --sample draws from before ``mutmut run`` gets the drawn names.
_GENERATE_SCRIPT = """
import os
import mutmut.__main__ as mm
from mutmut.mutation.data import SourceFileMutationData
from mutmut.utils.file_utils import walk_mutatable_files
mm.set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
mm.copy_src_dir()
mm.copy_also_copy_files()
mm.setup_source_paths()
mm.store_lines_covered_by_tests()
mm.create_mutants(1)
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    for name in data.exit_code_by_key:
        print("mutant:", name)
"""


def generate_mutants(workdir: Path) -> list[str]:
    """The names of every mutant mutmut makes of the configured files in ``workdir`` (left in its
    ``mutants/``, where ``mutmut run`` finds them unchanged and does not make them again)."""
    proc = subprocess.run([sys.executable, "-c", _GENERATE_SCRIPT], cwd=workdir, env=mutmut_env(DEFAULT_MAX_EXAMPLES),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    names = [ln.removeprefix("mutant: ") for ln in proc.stdout.splitlines() if ln.startswith("mutant: ")]
    if proc.returncode != 0 or not names:
        raise RuntimeError(f"mutmut generated no mutants to sample from (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return names


@dataclass(frozen=True)
class Sample:
    """A sampled run: ``size`` mutants drawn with ``seed`` out of the ``total`` mutmut made."""

    size: int
    total: int
    seed: int

    def describe(self) -> str:
        return f"sample of {self.size} of {self.total} mutants, seed {self.seed}"


def check_sample_size(n: int) -> int:
    if n <= 0:
        raise ValueError(f"--sample {n}: the number of mutants to run must be positive")
    return n


def sample_names(names: Iterable[str], n: int, seed: int) -> list[str]:
    """``n`` of ``names`` (all of them when there are no more), drawn with ``random.Random(seed)``
    from their sorted list: the same draw for a seed whatever order mutmut lists them in. Sorted."""
    check_sample_size(n)
    pool = sorted(set(names))
    if n >= len(pool):
        return pool
    return sorted(random.Random(seed).sample(pool, n))


def save_sample(workdir: Path, names: Sequence[str], sample: Sample) -> None:
    (workdir / SAMPLE_FILE).write_text(json.dumps({"names": list(names), "total": sample.total, "seed": sample.seed}))


def load_sample(workdir: Path) -> tuple[list[str], Sample] | None:
    """The draw a sampled run kept in ``workdir``, or None for a run of every mutant."""
    path = workdir / SAMPLE_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["names"], Sample(len(data["names"]), data["total"], data["seed"])


@dataclass
class LineMutationRun:
    mutants: list[Mutant]
    files: list[str]
    tests: list[str]
    deselected: dict[str, str]
    seconds: float
    workdir: Path
    mutmut_exit: int
    mutmut_tail: str = ""
    sample: Sample | None = None


def collect(workdir: Path, progress: Callable[[str], None] = lambda msg: None,
            only: Iterable[str] | None = None) -> list[Mutant]:
    """Every mutant of a finished ``mutmut run`` in ``workdir`` (``only``: those named, a sample's),
    with diff and line for those not killed."""
    res = subprocess.run([*_mutmut_cmd(), "results", "--all", "true"], cwd=workdir, env=mutmut_env(DEFAULT_MAX_EXAMPLES),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mutants = parse_results(res.stdout)
    if only is not None:
        chosen = set(only)
        mutants = [m for m in mutants if m.name in chosen]
    not_killed = [m for m in mutants if m.state != "killed"]
    if not_killed:
        progress(f"reading the diffs of {len(not_killed)} mutant(s) that were not killed ...")
    shows = show_mutants(workdir, [m.name for m in not_killed])
    sources: dict[str, str] = {}
    for m in not_killed:
        m.diff = shows.get(m.name, ("", ""))[1]
        if m.file not in sources:
            path = workdir / m.file
            sources[m.file] = path.read_text() if path.exists() else ""
        m.line = mutated_line(m.diff, sources[m.file], m.function)
    return mutants


def run(root: Path, *, files: Sequence[str], tests: Sequence[str], workdir: Path, max_children: int,
        max_examples: int = DEFAULT_MAX_EXAMPLES, timeout_multiplier: float = DEFAULT_TIMEOUT_MULTIPLIER,
        timeout_constant: float = DEFAULT_TIMEOUT_CONSTANT, skip_baseline: bool = False,
        markexpr: str | None = None, sample: int | None = None, seed: int = 0,
        progress: Callable[[str], None] = lambda msg: None) -> LineMutationRun:
    t0 = time.perf_counter()
    progress(f"scratch directory {workdir}; mutating {len(files)} file(s): {' '.join(files)}")
    progress(f"tests: {' '.join(tests)}")
    prepare_workdir(root, workdir)
    blocked = mutated_pytest_plugins(root, files)
    # --ap-run-slow is the verify plugin's option: where the outer runs leave that plugin out (it is
    # under mutation), pytest would refuse it, and nothing skips a slow test there anyway
    slow = [] if VERIFY_PLUGIN in blocked else run_slow_args(root)
    if blocked:
        progress(f"pytest plugins under mutation, left out of the runs that judge them: {' '.join(blocked)}")
    deselected: dict[str, str] = {}

    def configure(deselect: Sequence[str]) -> None:
        write_config(root, workdir, mutmut_config(files, tests, deselect, blocked_plugins=blocked, run_slow=slow,
                                                  markexpr=markexpr, timeout_multiplier=timeout_multiplier,
                                                  timeout_constant=timeout_constant))

    if not skip_baseline:
        # the project's pytest settings (its plugin opt-in, markers) for the baseline too, as mutmut will run
        configure(())
        progress("baseline: running the selected tests on the unmutated code ...")
        outcomes = baseline(workdir, tests, max_examples, blocked_plugins=blocked, run_slow=slow, markexpr=markexpr)
        deselected = {nid: o for nid, o in outcomes.items() if o in ("failed", "error")}
        bad_files = sorted({nid for nid in deselected if "::" not in nid})
        tests = [t for t in tests if not any(t == f or f.startswith(t.rstrip("/") + "/") for f in bad_files)]
        passed = sum(o == "passed" for o in outcomes.values())
        progress(f"baseline: {passed} passed, {len(deselected)} deselected (not passing unmutated)")
        for nid, o in sorted(deselected.items()):
            progress(f"  deselected: {nid} ({o})")
        if not tests:
            raise RuntimeError("no selected test file collects on the unmutated code")
    configure([nid for nid in deselected if "::" in nid])
    chosen, drawn = None, None
    (workdir / SAMPLE_FILE).unlink(missing_ok=True)
    if sample is not None:
        progress("generating the mutants to sample from ...")
        every = generate_mutants(workdir)
        chosen = sample_names(every, sample, seed)
        drawn = Sample(len(chosen), len(set(every)), seed)
        save_sample(workdir, chosen, drawn)
        progress(drawn.describe())
    progress(f"mutmut run --max-children {max_children} ...")
    proc = subprocess.Popen([*_mutmut_cmd(), "run", "--max-children", str(max_children), *(chosen or ())], cwd=workdir,
                            env=mutmut_env(max_examples, workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = _relay(proc.stdout, progress)
    rc = proc.wait()
    mutants = collect(workdir, progress, only=chosen)
    return LineMutationRun(mutants, list(files), list(tests), deselected, time.perf_counter() - t0, workdir, rc,
                           "\n".join(seen[-30:]), drawn)


def _max_children(workers) -> int:
    w = str(workers)
    if w in ("0", "auto", ""):
        return os.cpu_count() or 1
    return max(1, int(w))


def groups(args, root: Path) -> list[tuple[list[str], list[str]]]:
    """``[(files, tests)]``, one mutmut run each: ``--files``/``--tests`` as given, else the
    target's defaults (``passes``, ``planner``: one run; ``verify``: :data:`VERIFY_GROUPS`)."""
    target = getattr(args, "target", None) or "passes"
    if target not in TARGETS:
        raise ValueError(f"--target {target!r}: choose from {list(TARGETS)}")
    files, tests = getattr(args, "files", None), getattr(args, "tests", None)
    chosen = getattr(args, "group", None)
    if chosen and (target != "verify" or files):
        raise ValueError("--group selects among the groups of --target verify (and not with --files)")
    unknown = sorted(set(chosen or ()) - set(VERIFY_GROUP_NAMES))
    if unknown:
        raise ValueError(f"--group {unknown}: choose from {list(VERIFY_GROUP_NAMES)}")
    if target == "verify" and not files:
        if tests:
            raise ValueError("--tests with --target verify needs --files too (each group has its own tests)")
        return [(list(f), list(t)) for name, (f, t) in VERIFY_GROUPS.items() if not chosen or name in chosen]
    if target == "planner":
        return [(list(files or default_files(root, PLANNER_DIR, PLANNER_EXCLUDED)),
                 list(tests or [t for t in PLANNER_TESTS if (root / t).exists()]))]
    return [(list(files or default_files(root)), list(tests or default_tests(root)))]


def markexpr_of(args) -> str | None:
    """The pytest ``-m`` expression of the target's runs: :data:`QUICK_TIER` for ``planner``."""
    return QUICK_TIER if getattr(args, "target", None) == "planner" else None


def merge_runs(runs: Sequence[LineMutationRun]) -> LineMutationRun:
    """One run's worth of results out of several (one table); sampled runs' samples add up."""
    out = LineMutationRun([], [], [], {}, 0.0, runs[0].workdir, 0)
    for r in runs:
        if r.sample is not None:
            before = out.sample or Sample(0, 0, r.sample.seed)
            out.sample = Sample(before.size + r.sample.size, before.total + r.sample.total, r.sample.seed)
        out.mutants += r.mutants
        out.files += r.files
        out.tests += [t for t in r.tests if t not in out.tests]
        out.deselected.update(r.deselected)
        out.seconds += r.seconds
        out.mutmut_exit = out.mutmut_exit or r.mutmut_exit
        out.mutmut_tail = "\n".join(x for x in (out.mutmut_tail, r.mutmut_tail) if x)
    return out


def main(args) -> int:
    root = repo_root()

    def progress(msg: str) -> None:
        print(f"[mutate --lines] {msg}", file=sys.stderr, flush=True)

    if getattr(args, "patch", None):
        progress("--patch selects patch-level mutants; it is ignored with --lines")
    plan = groups(args, root)
    sample = getattr(args, "sample", None)
    if sample is not None:
        check_sample_size(sample)
    for f in [x for files, tests in plan for x in (*files, *tests)]:
        if not (root / f).exists():
            raise ValueError(f"{f} does not exist under {root}")
    keep = getattr(args, "workdir", None)

    def workdir_of(i: int) -> Path | None:
        if not keep:
            return None
        return Path(keep).resolve() / f"group{i}" if len(plan) > 1 else Path(keep).resolve()

    if getattr(args, "report_only", False):
        if not keep:
            raise ValueError("--report-only needs --workdir (a directory a previous run kept)")
        t0 = time.perf_counter()
        runs = []
        for i in range(len(plan)):
            wd = workdir_of(i)
            if not (wd / "pyproject.toml").exists():
                continue
            files, tests, deselect = read_config(wd)
            kept = load_sample(wd)
            names, drawn = kept if kept else (None, None)
            runs.append(LineMutationRun(collect(wd, progress, only=names), files, tests,
                                        dict.fromkeys(deselect, "deselected"), 0.0, wd, 0, sample=drawn))
        if not runs:
            raise ValueError(f"--workdir {keep} holds no kept run")
        r = merge_runs(runs)
        r.seconds = time.perf_counter() - t0
        return _report(args, r)
    runs = []
    for i, (files, tests) in enumerate(plan):
        if len(plan) > 1:
            progress(f"group {i + 1} of {len(plan)}")
        wd = workdir_of(i) or Path(tempfile.mkdtemp(prefix="ap-mutmut-"))
        try:
            runs.append(run(root, files=files, tests=tests, workdir=wd, max_children=_max_children(getattr(args, "workers", 0)),
                            max_examples=getattr(args, "max_examples", DEFAULT_MAX_EXAMPLES),
                            timeout_multiplier=getattr(args, "timeout_multiplier", DEFAULT_TIMEOUT_MULTIPLIER),
                            timeout_constant=getattr(args, "timeout_constant", DEFAULT_TIMEOUT_CONSTANT),
                            skip_baseline=getattr(args, "no_baseline", False), markexpr=markexpr_of(args),
                            sample=sample, seed=getattr(args, "seed", 0), progress=progress))
        except (RuntimeError, subprocess.SubprocessError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            if not keep:
                shutil.rmtree(wd, ignore_errors=True)
        if keep:
            progress(f"kept {wd}: `cd {wd} && mutmut browse` or `mutmut show <name>`")
    return _report(args, merge_runs(runs))


def _report(args, r: LineMutationRun) -> int:
    if not r.mutants:
        print(f"mutmut produced no results (exit {r.mutmut_exit}):\n{r.mutmut_tail}", file=sys.stderr)
        return 1
    by = getattr(args, "by", "file")
    if getattr(args, "json", False):
        counts = {s: sum(m.state == s for m in r.mutants) for s in STATES}
        sample = None if r.sample is None else {"size": r.sample.size, "total": r.sample.total, "seed": r.sample.seed}
        print(json.dumps({"files": r.files, "tests": r.tests, "deselected": r.deselected,
                          "mutants": [m.to_dict() for m in r.mutants], "total": len(r.mutants), **counts,
                          "sample": sample, "seconds": round(r.seconds, 1), "mutmut_exit": r.mutmut_exit}, indent=2))
    else:
        if r.sample is not None:
            print(f"{r.sample.describe()}: the counts and the kill rate are of the sampled mutants only")
        print(format_table(r.mutants, by=by))
        if r.deselected:
            print(f"deselected (not passing on the unmutated code): {' '.join(sorted(r.deselected))}")
        print(f"total: {r.seconds:.1f}s")
    undetected = any(m.state not in ("killed", "timeout") for m in r.mutants)
    return 1 if undetected or r.mutmut_exit != 0 else 0



def add_sample_args(p: argparse.ArgumentParser) -> None:
    """``--sample N`` and ``--seed S`` (this module's parser and ``python -m verify mutate``'s)."""
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="run only N mutants, drawn at random after mutmut made them all (default: every mutant)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="with --sample: the draw's seed (default: 0)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify.commands.mutation.lines", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=TARGETS, default="passes",
                   help="passes: autoparallel/passes; planner: autoparallel/planner; verify: the checkers, group by group "
                   "(default: passes)")
    p.add_argument("--group", action="append", choices=VERIFY_GROUP_NAMES,
                   help="with --target verify: only this group (repeatable; default: all)")
    p.add_argument("--files", nargs="+", help=f"files to mutate (default: {PASSES_DIR}/*.py except {', '.join(EXCLUDED_FILES)})")
    p.add_argument("--tests", nargs="+", help="test files or directories (default: each stage's line-mutation tests from "
                   "verify.stages.registry, then SHARED_TESTS)")
    p.add_argument("--by", choices=["file", "function"], default="file", help="one table row per file or per function")
    add_sample_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-n", dest="workers", default="auto", help="mutmut --max-children (default: all cores)")
    p.add_argument("--max-examples", type=int, default=DEFAULT_MAX_EXAMPLES, help="cap on Hypothesis examples per test")
    p.add_argument("--timeout-multiplier", type=float, default=DEFAULT_TIMEOUT_MULTIPLIER)
    p.add_argument("--timeout-constant", type=float, default=DEFAULT_TIMEOUT_CONSTANT)
    p.add_argument("--workdir", help="scratch directory to use and keep (default: a temporary one, deleted)")
    p.add_argument("--report-only", action="store_true", help="only report the results kept in --workdir")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline run (every selected test must pass)")
    return p


if __name__ == "__main__":
    try:
        sys.exit(main(_parser().parse_args()))
    except ValueError as e:  # a file that does not exist, --report-only without --workdir
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
