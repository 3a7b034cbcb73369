"""``python -m verify solve --iopddl FILE [--time-limit S] [--json]``: solve an IOPDDL contest instance.

The planner's solver core (:mod:`autoparallel.planner.iopddl`) plans; the independent evaluator
(:mod:`verify.commands.iopddl.check`) re-checks the plan and its claimed cost under the contest's rules
before anything is printed, so a wrong answer fails the command instead of reaching stdout.
Progress goes to stderr; stdout gets the cost (or, with ``--json``, one object).
"""

from __future__ import annotations

import json
import os
import sys
import time

from autoparallel.planner.iopddl import load, priced, solve
from autoparallel.planner.iopddl.cfn import toulbar2_available
from autoparallel.planner.iopddl.deadline import Closing
from autoparallel.planner.iopddl.solve import FULL_MIP_PAIRS, PRICED_NODES, PRICED_SHARE
from verify.commands.iopddl.check import Judge

# What follows the solve (the evaluator's check in its process, the answer's JSON both ways), as a
# multiple of the solve's measured closing work (deadline.Closing): the two are pure-Python passes
# over the same nodes and edges; measured 0.63x on D, 0.7-0.8x on B and G (docs/iopddl.md,
# "A bounded end of the run"). The reserve is then this, slowed down as this process is, x2.
AFTER_SHARE = 1.0
# Seconds kept whatever the measurement says: the evaluator's reply and the printing.
END_FLOOR = 0.5


def run(path: str, time_limit: float, say) -> dict:
    """Solve the instance at ``path`` and check the answer; the command's JSON object.

    The time limit counts from the start of reading the file and ends with the answer checked:
    the solve stops early enough for its closing and the check (deadline.Closing, measured). The evaluator reads the file in
    its own process (``json``: 3.5 CPU s on a 40k-node instance), started once the solver has
    read it, so that the two readings do not share the CPU (docs/iopddl.md, "A numpy reader")."""
    t0 = time.perf_counter()
    if not os.path.isfile(path):
        raise ValueError(f"--iopddl: no such file: {path}")
    job = _priced_early(path, t0 + PRICED_SHARE * time_limit)
    judge = None
    closing = Closing(after=AFTER_SHARE, floor=END_FLOOR)
    try:
        try:
            with closing.stretch():  # the read's wall time per CPU second: the first measure of the load
                inst = load(path)
            say(f"{os.path.basename(path)}: {inst.n} nodes, {len(inst.edge_u)} edges, read in {time.perf_counter() - t0:.1f}s")
            judge = Judge(path)
            left = time_limit - (time.perf_counter() - t0)
            result = solve(inst, max(0.0, left), progress=say, priced_job=job, closing=closing)
        finally:
            if job is not None:  # solve stops it; reading may have failed first. Not waited for (its exit is the kernel's)
                priced.stop(job, wait=False)
        seconds = time.perf_counter() - t0
        verdict = judge.verdict(result.solution, result.cost)  # raises verify.commands.iopddl.check.Rejected
        say(f"the evaluator confirmed the cost and the usage limit in {time.perf_counter() - t0 - seconds:.1f}s")
    finally:
        if judge is not None:
            judge.stop()
    return {
        "instance": os.path.basename(path), "nodes": inst.n, "edges": verdict["edges"],
        "cost": result.cost, "bound": result.bound, "optimal": result.optimal, "seconds": round(seconds, 2),
        "method": result.method, "stats": result.stats, "solution": result.solution,
    }


def _priced_early(path: str, stop: float):
    """The priced toulbar2 rounds started on the file before it is read (the child reads it in
    parallel); ``solve`` keeps them only for an instance that wants them. None without toulbar2."""
    if not toulbar2_available():
        return None
    return priced.start_file(path, stop, min_nodes=PRICED_NODES, min_pairs=FULL_MIP_PAIRS)


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0): the interpreter's start and
    the package's imports come before the command's own clock (D at load 4-6: 23 s; the command
    said 118.2 s, the shell saw 141.4 s)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def time_left(time_limit: float, age: float) -> float:
    """The time limit less the process's age, but at least half of it: a limit the imports alone
    spent cannot be met, and a solve with no time has no plan (the tests' 5 s limits on a loaded CI)."""
    return max(time_limit - age, 0.5 * time_limit)


def main(args) -> int:
    t0 = time.perf_counter()
    age = process_age()

    def say(msg: str) -> None:
        print(f"[iopddl {time.perf_counter() - t0:7.2f}s] {msg}", file=sys.stderr, flush=True)

    left = time_left(args.time_limit, age)
    say(f"{age:.1f}s since the process started (the interpreter, the imports): {left:.1f}s of the {args.time_limit:g}s left")
    out = run(args.iopddl, left, say)
    if not out["optimal"]:
        say(f"time limit reached: best plan found, NOT proven optimal; lower bound {out['bound']:.17g}")
    if args.json:
        print(json.dumps(out))
    else:
        print(out["cost"])
    return 0
