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

from autoparallel.planner.iopddl.instance import Instance

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "priced_child.py")
ROUND_CPU = 8  # toulbar2 CPU seconds per priced round (D: unpriced optimum proven in 7)


@dataclass
class Priced:
    proc: subprocess.Popen
    tmp: tempfile.TemporaryDirectory
    out: str
    stop: float


def start(inst: Instance, stop: float, clock=time.perf_counter, rounds: int = 40, growth: float = 4.0,
          relax: float = 0.8, round_cpu: float = ROUND_CPU) -> Priced:
    """Start the priced rounds in a child process, to be collected at ``stop`` (wall clock)."""
    tmp = tempfile.TemporaryDirectory(prefix="iopddl-priced-")
    src, out = os.path.join(tmp.name, "model.pkl"), os.path.join(tmp.name, "best.json")
    model = {"cost": inst.cost, "usage": inst.usage, "edge_u": inst.edge_u, "edge_v": inst.edge_v,
             "edge_cost": inst.edge_cost, "starts": inst.starts, "ends": inst.ends, "limit": inst.limit,
             "horizon": inst.horizon, "rounds": rounds, "growth": growth, "relax": relax}
    with open(src, "wb") as f:
        pickle.dump(model, f)
    # stdout too goes to stderr: `plan --iopddl --json` keeps stdout for its one object
    proc = subprocess.Popen([sys.executable, "-P", CHILD, src, out, str(round_cpu)],
                            stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno())
    return Priced(proc, tmp, out, stop)


def collect(job: Priced, clock=time.perf_counter, say=lambda m: None):
    """Wait for the child until its stop time, stop it, and return (plan or None, bound or None)."""
    try:
        job.proc.wait(timeout=max(0.1, job.stop - clock()))
    except subprocess.TimeoutExpired:
        stop(job)
        say("priced toulbar2 rounds stopped at their deadline")
    try:
        with open(job.out) as f:
            found = json.load(f)
    except (OSError, ValueError):
        found = {}
    finally:
        job.tmp.cleanup()
    x = found.get("solution")
    return (None if x is None else np.array(x, dtype=np.int64)), found.get("bound")


def stop(job: Priced) -> None:
    """Stop the child if it still runs (collected or not: a solve that fails must not leave it)."""
    if job.proc.poll() is None:
        job.proc.kill()
        job.proc.wait()
