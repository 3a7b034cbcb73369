"""Mutation testing of the compile stack: does some test notice when code is changed?

``patches`` disables one registered patch at a time (``AUTOPARALLEL_DISABLE``) and requires its
guard tests to fail; ``lines`` runs mutmut's line-level mutants over source files;
``outcome_log`` is the pytest plugin both load in their subprocesses; ``cli`` is
``python -m verify mutate``. Both levels report in the same states, below.
"""

# Stryker's vocabulary: a guard failed (killed), every guard still passed (survived), nothing
# guards it (no coverage), the run exceeded its limit (timeout), or the run itself is broken (error).
STATES = ("killed", "survived", "no coverage", "timeout", "error")
