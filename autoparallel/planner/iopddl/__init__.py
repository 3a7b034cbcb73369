"""The planner's solver core on the IOPDDL contest's problem form (ASPLOS 2025, google/iopddl).

A problem is nodes (each with strategies: a cost and a memory usage, and a half-open live
interval [start, end)), edges (a cost for every pair of their nodes' strategies) and a usage
limit at every time step. :func:`solve` returns one strategy per node: a feasible start, local
search, then HiGHS MIPs (the whole problem when it is small, neighbourhoods of it otherwise).
The evaluator that checks its answers lives apart, in :mod:`verify.commands.iopddl.check`, and shares no
code with this package.
"""

from autoparallel.planner.iopddl.instance import Instance, from_dict, load
from autoparallel.planner.iopddl.solve import Result, solve

__all__ = ["Instance", "Result", "from_dict", "load", "solve"]
