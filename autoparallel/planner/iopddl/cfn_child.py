"""The toulbar2 child process of cfn.py: reads a plain pickled network, solves it, writes each
better solution to a file. It imports nothing from autoparallel (importing the package pulls in
torch: tens of seconds on a loaded machine), so cfn.py runs it by its path.

Usage: python cfn_child.py MODEL.pkl SOLUTION.txt DONE.json CPU_SECONDS
"""

import json
import pickle
import sys
import time

import numpy as np


def build(model: dict):
    """A variable per node, a unary function per node, a binary one per edge (forbidden entries at
    ``top``, the initial upper bound), a ``sum usage <= limit`` constraint per live set."""
    import pytoulbar2

    top = model["top"]
    cfn = pytoulbar2.CFN(top, verbose=0)  # its progress lines go to stderr (see cfn.solve_cfn)
    for i, c in enumerate(model["cost"]):
        cfn.AddVariable(f"x{i}", list(range(len(c))))
    for i, c in enumerate(model["cost"]):
        cfn.AddFunction([i], np.where(np.isfinite(c), c, top).astype(np.int64).tolist())
    for u, v, m in zip(model["edge_u"], model["edge_v"], model["edge_cost"]):
        cfn.AddFunction([int(u), int(v)], np.where(np.isfinite(m), m, top).astype(np.int64).ravel().tolist())
    for nodes in model["live_sets"]:
        terms = [(i, k, u) for i in nodes for k, u in enumerate(model["usage"][i].tolist()) if u > 0]
        if terms:
            cfn.AddGeneralizedLinearConstraint(terms, "<=", model["limit"])
    return cfn


def main(args) -> None:
    src, sol, done, seconds = args[0], args[1], args[2], float(args[3])
    with open(src, "rb") as f:
        cfn = build(pickle.load(f))
    limit = max(1, int(seconds))
    import pytoulbar2

    pytoulbar2.tb2.option.writeSolution("1")  # the file's format: values (Solve sets it only when it prints them)
    res = cfn.Solve(timeLimit=limit, writeSolution=sol)
    # toulbar2 stops on its CPU-time limit or when its search is complete (the answer proven)
    with open(done, "w") as f:
        json.dump({"solution": None if res is None else [int(v) for v in res[0]],
                   "optimal": res is not None and time.process_time() < limit - 0.5}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
