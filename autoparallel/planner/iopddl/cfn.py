"""The whole problem as a cost function network, solved by toulbar2 (``pytoulbar2``) in a child process.

A variable per node (its strategies), a unary cost function per node, a binary one per edge
(forbidden choices cost more than the start's cost, which is the initial upper bound, so
toulbar2 never keeps them), and one generalized linear constraint ``sum usage <= limit`` per
maximal set of nodes live together. This is the winning entry's solver (OpenReview xvzwLMgX3U);
it suits instances with few nodes and many strategy pairs, where the HiGHS MIP's pair variables
are too many (V: 816 nodes, 1.6M pairs, see docs/iopddl.md).

toulbar2's time limit counts CPU seconds, which on a loaded machine run far slower than the
wall clock, and its search holds the interpreter: so it runs in a child process
(cfn_child.py, fed the network as plain data) that writes each better solution to a file, and
the parent stops it at the wall-clock deadline and reads the last one. The caller checks the
plan (feasibility, cost) before using it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import numpy as np

from autoparallel.planner.iopddl.instance import Instance

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cfn_child.py")
CFN_ENTRIES = 8_000_000  # edge-table entries + usage terms (all stretches) up to which toulbar2 is tried


def toulbar2_available() -> bool:
    """Whether ``pytoulbar2`` imports here (the child needs it); the solve goes on without it."""
    return importlib.util.find_spec("pytoulbar2") is not None


def model_size(inst: Instance) -> int:
    """Entries the network would hold: every edge table, plus each stretch's live strategies (an
    upper bound on the usage constraints' terms, cheap: a difference array over the live intervals)."""
    size = sum(m.size for m in inst.edge_cost)
    if inst.limit is not None:
        live = inst.starts < inst.ends
        diff = np.zeros(inst.horizon + 1, dtype=np.int64)
        np.add.at(diff, inst.starts[live], inst.sizes()[live])
        np.add.at(diff, inst.ends[live], -inst.sizes()[live])
        cuts = np.unique(np.concatenate([inst.starts[live], inst.ends[live]]))
        size += int(np.cumsum(diff)[cuts[:-1]].sum()) if len(cuts) > 1 else 0
    return size


def maximal_live_sets(inst: Instance) -> list:
    """The sets of nodes live at once that no other such set contains (one usage row each).

    Live intervals are contiguous, so a stretch's set inside another stretch's is inside its
    neighbour's: a stretch is maximal when a node starts at its left end (it is not inside the
    previous one) and a node ends at its right end (nor the next one)."""
    live = inst.starts < inst.ends
    s, e = inst.starts[live], inst.ends[live]
    cuts = np.unique(np.concatenate([s, e]))
    keep = np.flatnonzero(np.isin(cuts[:-1], s) & np.isin(cuts[1:], e))
    nodes = np.flatnonzero(live)
    return [nodes[(s <= cuts[k]) & (cuts[k] < e)].tolist() for k in keep]


def model(inst: Instance, upper: float) -> dict:
    """The network as plain data for cfn_child.py; ``upper`` is a known plan's cost (``inf`` if none)."""
    # no plan free of forbidden choices costs more than every node's and edge's dearest finite cost
    cap = sum(float(c[np.isfinite(c)].max(initial=0)) for c in inst.cost + inst.edge_cost)
    return {"top": int(min(upper, cap)) + 1, "cost": inst.cost, "usage": inst.usage, "edge_u": inst.edge_u,
            "edge_v": inst.edge_v, "edge_cost": inst.edge_cost, "limit": inst.limit,
            "live_sets": [] if inst.limit is None else maximal_live_sets(inst)}


def solve_cfn(inst: Instance, upper: float, deadline: float, clock=time.perf_counter, say=lambda m: None):
    """Run toulbar2 until it stops or ``deadline`` (wall clock); return (plan or None, optimal)."""
    with tempfile.TemporaryDirectory(prefix="iopddl-cfn-") as tmp:
        src, sol, done = (os.path.join(tmp, n) for n in ("instance.pkl", "solution.txt", "done.json"))
        with open(src, "wb") as f:
            pickle.dump(model(inst, upper), f)
        cmd = [sys.executable, "-P", CHILD, src, sol, done, str(deadline - clock())]
        # stdout too goes to stderr: `plan --iopddl --json` keeps stdout for its one object
        proc = subprocess.Popen(cmd, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno())
        try:
            proc.wait(timeout=max(0.1, deadline - clock()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            say("toulbar2 stopped at the deadline")
        if os.path.exists(done):  # it stopped by itself: its last answer (None: no plan below upper)
            with open(done) as f:
                out = json.load(f)
            x = out["solution"]
            return (None if x is None else np.array(x, dtype=np.int64)), bool(out["optimal"])
        return read_solution(sol, inst.n), False


def read_solution(path: str, n: int):
    """The last complete solution line of toulbar2's solution file (``n`` values), or None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [ln.split() for ln in f.read().splitlines()]
    for parts in reversed(lines):
        if len(parts) == n and all(p.isdigit() for p in parts):
            return np.array([int(p) for p in parts], dtype=np.int64)
    return None

