"""Adaptive penalties solved by toulbar2 (priced_child.py), for instances whose network with the
usage constraints is too large for cfn.py.

The child runs beside the caller (which goes on with its own descent meanwhile) and is stopped at
a wall-clock deadline; :func:`collect` returns its cheapest feasible plan and the unpriced
problem's dual bound. The caller checks the plan against the limit and its cost again.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from autoparallel.planner.iopddl.instance import Instance, arrays

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "priced_child.py")
# toulbar2 CPU seconds a priced round may take at most, 0 for none: the rounds are sized by
# backtracks (priced_child.ROUND_BACKTRACKS); a CPU cap of 8 s left D without any plan at load
ROUND_CPU = 0
DONOR = "donor.json"  # beside the child's output: a plan the caller hands it (offer)


@dataclass
class Priced:
    proc: subprocess.Popen
    tmp: tempfile.TemporaryDirectory
    out: str
    stop: float
    collected: tuple | None = None  # collect's answer: a second collect returns it (the file is gone)


def _spawn(src: str, tmp: tempfile.TemporaryDirectory, stop: float, options: dict) -> Priced:
    out = os.path.join(tmp.name, "best.json")
    # stdout too goes to stderr: `plan --iopddl --json` keeps stdout for its one object
    try:
        err = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (pytest's capsys) has none
        err = subprocess.DEVNULL
    # the child sizes its rounds by the time it has (priced_child.RoundSize, ROUND0_SHARE)
    options = {**options, "seconds": max(0.0, stop - time.perf_counter())}
    proc = subprocess.Popen([sys.executable, "-P", CHILD, src, out, json.dumps(options)], stdout=err, stderr=err)
    return Priced(proc, tmp, out, stop)


def start(inst: Instance, stop: float, clock=time.perf_counter, rounds: int = 40, growth: float = 4.0,
          relax: float = 0.8, round_cpu: float = ROUND_CPU) -> Priced:
    """Start the priced rounds in a child process, to be collected at ``stop`` (wall clock)."""
    tmp = tempfile.TemporaryDirectory(prefix="iopddl-priced-")
    src = os.path.join(tmp.name, "model.pkl")
    with open(src, "wb") as f:
        pickle.dump(arrays(inst), f)
    return _spawn(src, tmp, stop, {"rounds": rounds, "growth": growth, "relax": relax, "round_cpu": round_cpu})


def start_file(path: str, stop: float, min_nodes: int, min_pairs: int, rounds: int = 40, growth: float = 4.0,
               relax: float = 0.8, round_cpu: float = ROUND_CPU) -> Priced:
    """Start the priced rounds on the instance file itself, before the caller has read it: the
    child parses it in parallel with the caller (on a loaded machine reading a 40k-node instance
    took 30-56 s of the 120, and a second process gets its own share of the CPU). The child
    exits at once when the instance has fewer than ``min_nodes`` nodes, no usage limit or at most
    ``min_pairs`` strategy pairs; the caller stops it when its own finer test says no."""
    tmp = tempfile.TemporaryDirectory(prefix="iopddl-priced-")
    return _spawn(os.path.abspath(path), tmp, stop, {"rounds": rounds, "growth": growth, "relax": relax,
                                                    "round_cpu": round_cpu, "min_nodes": min_nodes, "min_pairs": min_pairs})


# Seconds between two looks at the child's file while following it (collect's ``polish``).
POLL = 0.5


def collect(job: Priced, clock=time.perf_counter, say=lambda m: None, wait: bool = True, polish=None):
    """Wait for the child until its stop time (``wait``; else not at all: past the solve's hard
    deadline), stop it, and return (plan or None, bound or None). The child replaces its file
    atomically, so it is read whole whether the child still runs or not. Collected again, the
    same answer: the solve's deadline handler collects once more when the alarm came before the
    first collect's plan was kept (D at load 10-18 lost a 1.66x plan so). ``polish``: while
    waiting, called with each plan the child writes and the child's stop time (follow)."""
    if job.collected is not None:
        return job.collected
    if wait and polish is not None:
        follow(job, clock, polish)
    try:
        job.proc.wait(timeout=max(0.1, job.stop - clock()) if wait else 0)
    except subprocess.TimeoutExpired:
        stop(job, wait=wait)
        say("priced toulbar2 rounds stopped at their deadline")
    try:
        with open(job.out) as f:
            found = json.load(f)
    except (OSError, ValueError):
        found = {}
    finally:
        job.tmp.cleanup()
    x = found.get("solution")
    job.collected = (None if x is None else np.array(x, dtype=np.int64)), found.get("bound")
    return job.collected


def follow(job: Priced, clock, polish) -> None:
    """Until the child exits or its stop time, hand each plan it writes to ``polish`` (with the
    stop time): the caller waited idle there for 50-85 s on K and U while its polish of the
    child's last plan (star moves and descent, 2-6 %) got the 5-10 s after the stop."""
    seen = None
    while job.proc.poll() is None and clock() < job.stop - POLL:
        try:
            stamp = os.stat(job.out).st_mtime_ns
        except OSError:
            stamp = None
        if stamp is not None and stamp != seen:
            seen = stamp
            try:
                with open(job.out) as f:
                    x = json.load(f).get("solution")
            except (OSError, ValueError):
                x = None
            if x is not None:
                polish(np.array(x, dtype=np.int64), job.stop)
                continue
        try:
            job.proc.wait(timeout=POLL)
        except subprocess.TimeoutExpired:
            pass


def offer(job: Priced, x) -> None:
    """Give the child a plan within the limit (the caller's polish of one of its plans): it
    joins the child's donors for the recombination (priced_child.restore, recombine)."""
    path = os.path.join(job.tmp.name, DONOR)
    with open(path + ".tmp", "w") as f:
        json.dump([int(v) for v in x], f)
    os.replace(path + ".tmp", path)


def stop(job: Priced, wait: bool = True) -> None:
    """Stop the child if it still runs (collected or not: a solve that fails must not leave it).
    Without ``wait`` it is killed and reaped later (by a ``stop`` that waits, or by the
    interpreter): on D at load 15 waiting for the killed child's exit took 2.5 s past the deadline."""
    if job.proc.poll() is None:
        job.proc.kill()
    if wait:
        job.proc.wait()
