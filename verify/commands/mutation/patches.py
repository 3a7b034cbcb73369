"""Patch-level mutation: disable each registered patch and require its guard tests to fail.

States (Stryker's vocabulary): ``killed`` (a guard ran and failed with the patch disabled),
``survived`` (every guard still passed), ``no coverage`` (the patch names no guard), ``timeout``
(the disabled run exceeded the per-patch limit) and ``error`` (a guard failed, errored, was
skipped or missing with the patch *enabled*, or only errored when disabled: a crash during
collection or setup does not count as a kill, and neither does a guard that did not run at all
with the patch disabled; only a guard that ran and failed kills).

All guards first run once together with every patch enabled (on ``jobs`` xdist workers when no
``workers`` are given: nothing else runs then); then each patch's guards run in a fresh pytest
process with ``AUTOPARALLEL_DISABLE=<patch>`` (``python -m pytest``, or forked from a zygote with
``preload``: verify.commands.mutation.zygote; ``jobs`` of them at once: the patches are
independent, each run sees only its own variable). ``baselines``: outcome files of earlier runs
on this same tree (CI's tier and slow step, recorded through ``$AUTOPARALLEL_OUTCOME_LOG``); a
guard they hold an outcome for (a skip is no outcome) is not run again with every patch enabled.
A disabled run stops at its first failing guard
(``-x``): one failure is a kill, and the guards after it would only cost time. When it stopped
without a failure (an error, which is not a kill) it runs again whole, so a later guard that fails
still kills the patch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from verify.commands.mutation import run_slow_args
from verify.commands.mutation.outcome_log import ENV as OUTCOME_ENV
from verify.commands.mutation.zygote import Zygote

DISABLE_ENV = "AUTOPARALLEL_DISABLE"


@dataclass
class GuardRun:
    """Outcomes of one pytest subprocess over some guard ids."""

    outcomes: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    tail: str = ""

    def for_guard(self, guard: str) -> list[str]:
        """Outcomes of the tests a guard id selects (a parametrized id selects all its cases)."""
        return [o for nid, o in self.outcomes.items() if nid == guard or nid.startswith(guard + "[") or nid.startswith(guard + "::")]

    def collection_errors(self) -> list[str]:
        return [nid for nid, o in self.outcomes.items() if o == "error" and "::" not in nid]


@dataclass
class PatchResult:
    name: str
    guards: tuple[str, ...]
    state: str
    enabled: str
    disabled: str
    seconds: float
    detail: str = ""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "state": self.state,
            "guards": list(self.guards),
            "seconds": round(self.seconds, 2),
            "enabled": self.enabled,
            "disabled": self.disabled,
            "detail": self.detail,
        }


def run_guards(
    guards: Sequence[str], *, disable: str = "", workers: str | int = 0, timeout_s: float = 300.0, cwd: Path | None = None,
    stop_at_first_failure: bool = False, zygote: Zygote | None = None,
) -> GuardRun:
    """Run ``guards`` in a fresh pytest process (its own process group; killed on timeout):
    ``python -m pytest``, or forked from ``zygote`` (verify.commands.mutation.zygote: the same
    run without paying its imports again); ``stop_at_first_failure``: pytest's ``-x``."""
    with tempfile.TemporaryDirectory(prefix="ap-mutate-") as tmp:
        log = Path(tmp) / "outcomes.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST_"))}
        env[OUTCOME_ENV] = str(log)
        env[DISABLE_ENV] = disable
        args = ["-q", "-p", "no:cacheprovider", "-p", "verify.commands.mutation.outcome_log",
                "--snapshot-warn-unused", *run_slow_args(cwd or Path.cwd()), "-n", str(workers),
                *(["-x"] if stop_at_first_failure else []), *guards]
        t0 = time.perf_counter()
        run = GuardRun()
        if zygote is not None:
            run.returncode, run.timed_out, out = zygote.run(args, env, cwd or Path.cwd(), timeout_s)
        else:
            run.returncode, run.timed_out, out = _pytest_subprocess(args, env, cwd, timeout_s)
        run.seconds = time.perf_counter() - t0
        run.tail = "\n".join((out or "").splitlines()[-25:])
        if log.exists():
            run.outcomes = json.loads(log.read_text())
        return run


def _pytest_subprocess(args: list[str], env: dict[str, str], cwd: Path | None, timeout_s: float) -> tuple[int | None, bool, str]:
    """``python -m pytest *args`` in its own session: (exit code, None when killed at the limit;
    timed out; output)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, False, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, True, out


def recorded_outcomes(paths: Sequence[Path]) -> dict[str, str]:
    """The outcomes in ``paths`` (outcome_log's JSON files), skips left out: a test the tier skips
    as slow runs in the slow step, whose file may come first or not at all."""
    merged: dict[str, str] = {}
    for path in paths:
        try:
            outcomes = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--baseline {path}: not an outcome file ({e})") from None
        if not isinstance(outcomes, dict):
            raise ValueError(f"--baseline {path}: not an outcome file (a JSON object of node id -> outcome)")
        merged.update({nid: o for nid, o in outcomes.items() if o != "skipped"})
    return merged


def _summarize(outcomes: Iterable[str]) -> str:
    outcomes = list(outcomes)
    if not outcomes:
        return "not run"
    counts = {o: outcomes.count(o) for o in ("passed", "failed", "error", "skipped") if o in outcomes}
    return " ".join(f"{n} {o}" for o, n in counts.items())


def classify(guards: Sequence[str], baseline: GuardRun, disabled: GuardRun | None) -> tuple[str, str]:
    """(state, detail) for one patch from its enabled and disabled runs."""
    if not guards:
        return "no coverage", "the patch names no guard tests"
    base = {g: baseline.for_guard(g) for g in guards}
    missing = [g for g, o in base.items() if not o]
    if missing and baseline.timed_out:
        return "timeout", (f"the baseline run (every patch enabled) exceeded the time limit after "
                           f"{baseline.seconds:.0f}s before these guards finished: {missing}")
    if missing:
        return "error", f"guard(s) not found or not run with the patch enabled: {missing}"
    bad = [g for g, o in base.items() if any(x != "passed" for x in o)]
    if bad:
        return "error", f"guard(s) do not pass with the patch enabled: {bad}"
    if disabled is None:
        return "error", "disabled run missing"
    if disabled.timed_out:
        return "timeout", f"disabled run exceeded the time limit after {disabled.seconds:.0f}s"
    outs = [o for g in guards for o in disabled.for_guard(g)]
    if any(o == "failed" for o in outs):
        return "killed", ""
    not_run = [g for g in guards if not disabled.for_guard(g)]
    if not_run:  # e.g. its module failed to import with the patch off: it proved nothing
        errors = disabled.collection_errors()
        return "error", (
            f"guard(s) not run with the patch disabled: {not_run}"
            + (f"; collection errors: {errors}" if errors else "") + f"\n{disabled.tail}"
        )
    if all(o == "passed" for o in outs):
        return "survived", "every guard passed with the patch disabled"
    return "error", f"disabled run: {_summarize(outs)} (errors are not kills)\n{disabled.tail}"


def mutate(
    patches: Sequence,
    *,
    workers: str | int = 0,
    timeout_s: float = 300.0,
    cwd: Path | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    jobs: int = 1,
    baselines: Sequence[Path] = (),
    preload: Sequence[str] | None = None,
) -> list[PatchResult]:
    """Classify each patch (objects with ``name`` and ``guards``), in ``patches``' order.
    ``jobs``: how many patches' disabled runs (separate pytest processes) run at once;
    ``baselines``: outcome files of earlier runs on this tree (see the module docstring);
    ``preload``: fork every run from a zygote that imported these modules once
    (verify.commands.mutation.zygote; None: each run is ``python -m pytest``)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    with contextlib.ExitStack() as stack:
        zygote = None
        if preload is not None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ap-mutate-zygote-"))
            zygote = stack.enter_context(Zygote(tuple(preload), tmp=Path(tmp)))
            progress(f"zygote: {len(tuple(preload))} module(s) imported once, every run forked from it")
        return _mutate(patches, workers=workers, timeout_s=timeout_s, cwd=cwd, progress=progress, jobs=jobs,
                       baselines=baselines, zygote=zygote)


def _mutate(patches, *, workers, timeout_s, cwd, progress, jobs, baselines, zygote) -> list[PatchResult]:
    all_guards = list(dict.fromkeys(g for p in patches for g in p.guards))
    recorded = GuardRun(outcomes=recorded_outcomes(baselines), returncode=0)
    to_run = [g for g in all_guards if not recorded.for_guard(g)]
    if baselines:
        progress(f"baseline: {len(all_guards) - len(to_run)} of {len(all_guards)} guard id(s) recorded in {len(baselines)} file(s)")
    baseline = recorded
    if to_run:
        baseline_workers = jobs if str(workers) == "0" and jobs > 1 else workers
        progress(f"baseline: {len(to_run)} guard id(s) with every patch enabled, {baseline_workers} worker(s) ...")
        baseline = run_guards(to_run, workers=baseline_workers, timeout_s=timeout_s * max(1, len(patches)), cwd=cwd, zygote=zygote)
        progress(f"baseline: {_summarize(baseline.outcomes.values())} in {baseline.seconds:.1f}s")
        baseline.outcomes = {**recorded.outcomes, **baseline.outcomes}
    # pytest refuses the whole run when one id does not exist (exit 4), and one hanging guard
    # stops the whole run at the limit: then each patch gets its own baseline, so one stale or
    # slow guard cannot hide the others' results.
    missing_id = baseline.returncode == 4 and not baseline.timed_out
    per_patch_baseline = (missing_id or baseline.timed_out) and len(patches) > 1
    if per_patch_baseline:
        why = "a guard id does not exist" if missing_id else "the combined run timed out"
        progress(f"baseline: {why}; running baselines per patch")

    def one(i: int, patch) -> PatchResult:
        guards = tuple(patch.guards)
        base = baseline
        if per_patch_baseline and guards:
            base = run_guards(guards, workers=workers, timeout_s=timeout_s, cwd=cwd, zygote=zygote)
            base.outcomes = {**recorded.outcomes, **base.outcomes}
        state, detail = classify(guards, base, None)
        disabled_run = None
        t0 = time.perf_counter()
        if state == "error" and detail == "disabled run missing":
            progress(f"[{i}/{len(patches)}] {patch.name}: disabling, running {len(guards)} guard(s) ...")
            disabled_run = run_guards(guards, disable=patch.name, workers=workers, timeout_s=timeout_s, cwd=cwd,
                                      stop_at_first_failure=True, zygote=zygote)
            state, detail = classify(guards, base, disabled_run)
            if state != "killed" and not disabled_run.timed_out and any(not disabled_run.for_guard(g) for g in guards):
                progress(f"[{i}/{len(patches)}] {patch.name}: stopped without a failure; running every guard ...")
                disabled_run = run_guards(guards, disable=patch.name, workers=workers, timeout_s=timeout_s, cwd=cwd,
                                          zygote=zygote)
                state, detail = classify(guards, base, disabled_run)
        seconds = time.perf_counter() - t0
        enabled = _summarize(o for g in guards for o in base.for_guard(g)) if guards else "-"
        disabled = _summarize(o for g in guards for o in disabled_run.for_guard(g)) if disabled_run else "-"
        if disabled_run is not None and disabled_run.timed_out:
            disabled = "timeout"
        progress(f"[{i}/{len(patches)}] {patch.name}: {state} ({seconds:.1f}s)")
        return PatchResult(patch.name, guards, state, enabled, disabled, seconds, detail)

    # Each run is a pytest process of its own: threads only wait on them.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, range(1, len(patches) + 1), patches))


def format_table(results: Sequence[PatchResult]) -> str:
    rows = [("patch", "guards", "enabled", "disabled", "state", "seconds")]
    for r in results:
        rows.append((r.name, str(len(r.guards)), r.enabled, r.disabled, r.state, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    killed = sum(r.state == "killed" for r in results)
    rate = 100.0 * killed / len(results) if results else 0.0
    lines.append(f"kill rate: {killed}/{len(results)} patches killed ({rate:.0f}%)")
    for r in results:
        if r.state != "killed" and r.detail:
            lines.append(f"  {r.name}: {r.state}: {r.detail.splitlines()[0]}")
    return "\n".join(lines)
