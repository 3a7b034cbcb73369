"""An independent evaluator of IOPDDL solutions, applying the contest's rules (google/iopddl's
``Evaluate``), that shares no code with the solver in :mod:`autoparallel.planner.iopddl`.

Rules: a solution holds one strategy index per node, each in range; its cost is the sum of the
chosen node costs plus, for every edge, the entry at index s_first * n_strategies(second) +
s_second; at every time step t the usage of the nodes whose half-open interval [start, end)
holds t must not exceed the usage limit. Pure Python integers throughout (the contest's
evaluator sums in 128 bits), so nothing overflows or rounds.

The command runs it as its own process (:class:`Judge`, ``python -P check.py FILE``): it reads
the file with ``json`` beside the solve, which reads it with its own numpy reader, and checks
the one answer it is then sent.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys


class Rejected(ValueError):
    """A solution that breaks one of the contest's rules."""


def read_problem(path: str) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)["problem"]


def evaluate(problem: dict, solution) -> int:
    """The contest cost of ``solution`` on ``problem`` (the ``"problem"`` object); raise
    :class:`Rejected` when the solution is malformed or over the usage limit."""
    nodes, edges = problem["nodes"], problem["edges"]
    costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
    if len(solution) != len(costs):
        raise Rejected(f"solution has {len(solution)} entries for {len(costs)} nodes")
    total = 0
    horizon = max((iv[1] for iv in intervals), default=0)
    delta = [0] * (horizon + 1)
    for i, s in enumerate(solution):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(costs[i]):
            raise Rejected(f"node {i}: strategy {s!r} is not in 0..{len(costs[i]) - 1}")
        total += costs[i][s]
        start, end = intervals[i]
        if start < end:
            delta[start] += usages[i][s]
            delta[end] -= usages[i][s]
    for k, (pair, table) in enumerate(zip(edges["nodes"], edges["costs"])):
        index = 0
        for node in pair:
            index = index * len(costs[node]) + solution[node]
        total += table[index]
    limit = problem.get("usage_limit")
    if limit is not None:
        used = 0
        for t in range(horizon):
            used += delta[t]
            if used > limit:
                raise Rejected(f"usage {used} exceeds the limit {limit} at time step {t}")
    return total


def check(problem: dict, solution, claimed_cost: int) -> int:
    """Evaluate and require the claimed cost to be the contest's cost."""
    actual = evaluate(problem, solution)
    if actual != claimed_cost:
        raise Rejected(f"claimed cost {claimed_cost} but the contest's rules give {actual}")
    return actual


class Judge:
    """This evaluator in a child process started on the instance file (it reads the file while
    the caller solves; the solver's reader shares nothing with it); :meth:`verdict` sends it the
    answer and returns the contest cost, or raises :class:`Rejected` with its reason."""

    def __init__(self, path: str):
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), os.path.abspath(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def verdict(self, solution, claimed_cost: int) -> dict:
        """The evaluator's answer: ``cost`` and the file's ``edges``; raises Rejected."""
        out, err = self.proc.communicate(json.dumps({"solution": [int(v) for v in solution], "cost": int(claimed_cost)}).encode())
        try:
            answer = json.loads(out)
        except ValueError:
            raise ValueError(f"the evaluator failed (exit {self.proc.returncode}): {err.decode(errors='replace')[-2000:]}") from None
        if "rejected" in answer:
            raise Rejected(answer["rejected"])
        return answer

    def stop(self) -> None:
        """Stop the child if it still runs (the solve failed before an answer) and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()


def _serve(path: str) -> None:
    """The child's side of :class:`Judge`: read the file, then one answer from stdin."""
    problem = read_problem(path)
    answer = json.load(sys.stdin)
    try:
        verdict = {"cost": check(problem, answer["solution"], answer["cost"]), "edges": len(problem["edges"]["nodes"])}
    except Rejected as e:
        verdict = {"rejected": str(e)}
    json.dump(verdict, sys.stdout)


if __name__ == "__main__":
    _serve(sys.argv[1])
