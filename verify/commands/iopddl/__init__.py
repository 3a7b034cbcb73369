"""The IOPDDL contest instances (ASPLOS 2025, google/iopddl) against the planner's solver core.

``cli``: ``python -m verify solve --iopddl FILE``; ``check``: the contest's evaluator, sharing no
code with the solver; ``bench``: every instance of a directory, one table.
"""
