"""Execution of per-rank graphs on real process groups."""

from autoparallel.runtime.launcher import RankFailedError, WorldTimeoutError, run_on_world, to_cpu

__all__ = ["RankFailedError", "WorldTimeoutError", "run_on_world", "to_cpu"]
