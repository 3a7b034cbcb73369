"""model + ParallelPlan + mesh -> per-rank joint graph with explicit collectives."""

from autoparallel.parallelize.joint import JointGraph, build_joint_graph
from autoparallel.parallelize.plan import ParallelPlan, ParamSharding
from autoparallel.parallelize.program import ParallelProgram, cross_entropy_loss, split_batch

__all__ = [
    "JointGraph",
    "ParallelPlan",
    "ParallelProgram",
    "ParamSharding",
    "build_joint_graph",
    "cross_entropy_loss",
    "split_batch",
]
