"""Execution of per-rank graphs on real process groups."""

from autoparallel.runtime.launcher import RankFailedError, WorldTimeoutError, run_on_world

__all__ = ["RankFailedError", "WorldTimeoutError", "run_on_world"]
