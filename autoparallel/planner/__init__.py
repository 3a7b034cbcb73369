"""Automatic placement: an ILP sharding planner that runs on CPU.

``plan_model(model, mesh, example_inputs)`` traces the unsharded joint forward+loss+backward
graph on fake tensors, enumerates candidate placements per node from DTensor's op-strategy
registry, prices them for an explicit device profile (roofline compute, alpha-beta collectives
along DTensor's redistribute plans), merges identical transformer blocks, and solves an ILP with
HiGHS under a parameter-memory budget. The result is a :class:`Solution`: placements per node (by a
canonical key that survives re-tracing), per parameter and per input, by mesh-dim name, with
the predicted collectives. ``python -m verify solve`` is its command line.
"""

from autoparallel.planner.api import (
    Planner,
    PlannerConfig,
    evaluate_hand_plan,
    hand_plan_pins,
    plan_model,
)
from autoparallel.planner.ilp import InfeasiblePlanError, PlannerError, SolverTimeout
from autoparallel.planner.profile import PROFILES, DeviceProfile, Link, get_profile
from autoparallel.planner.solution import Solution, diff, parse_placement
from autoparallel.planner.strategies import NoStrategyError

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "InfeasiblePlanError",
    "Link",
    "NoStrategyError",
    "Planner",
    "PlannerConfig",
    "PlannerError",
    "Solution",
    "SolverTimeout",
    "diff",
    "evaluate_hand_plan",
    "get_profile",
    "hand_plan_pins",
    "parse_placement",
    "plan_model",
]
