"""The pipeline's stages for one scenario, as graphs: what goldens, stats and the report show.

One function builds them so that the golden tests and ``python -m verify report`` can never
describe different pipelines. A stage is one graph (the joint graph) or a (forward, backward) pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import fx

from verify.scenario import Scenario

STAGE_NAMES: tuple[str, ...] = (
    "joint",
    "first_partition",
    "second_compile",
    "pre_overlap_bucketing",
    "topo_span_bucketing",
    "fuse_chained_allgathers",
)


def collective_stage_configs(bucket_cap_mb: float = 25.0) -> dict:
    """Each collective pass as its own stage, applied to the second compile's split graphs.

    ``pre_overlap_bucketing``: tag on the joint graph, merge at ``bucket_cap_mb``;
    ``topo_span_bucketing``: Inductor's overlap scheduler (CPU roofline estimator) whose FSDP
    pre-bucketing is topo-span bounded; ``fuse_chained_allgathers``: dp->tp chains fused.
    """
    from autoparallel.passes.collective import CollectivePassesConfig
    from autoparallel.passes.pre_overlap_bucketing import PreOverlapConfig

    return {
        "pre_overlap_bucketing": CollectivePassesConfig(
            pre_overlap=PreOverlapConfig(bucket_cap_mb=bucket_cap_mb), fuse_chained_allgathers=False
        ),
        "topo_span_bucketing": CollectivePassesConfig(
            fuse_chained_allgathers=False, pre_overlap_bucketing=False, schedule_overlap=True
        ),
        "fuse_chained_allgathers": CollectivePassesConfig(fuse_chained_allgathers=True, pre_overlap_bucketing=False),
    }


@dataclass
class Stage:
    name: str
    graphs: fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]

    @property
    def graph_list(self) -> list[fx.GraphModule]:
        return list(self.graphs) if isinstance(self.graphs, tuple) else [self.graphs]

    def count_rows(self) -> list[tuple[str, fx.GraphModule]]:
        """(row name, graph) for the collective-count golden: ``stage`` or ``stage fwd``/``stage bwd``."""
        if isinstance(self.graphs, tuple):
            fw, bw = self.graphs
            return [(f"{self.name} fwd", fw), (f"{self.name} bwd", bw)]
        return [(self.name, self.graphs)]


@dataclass
class PipelineRun:
    scenario: Scenario
    stages: list[Stage]
    params: dict[str, int]
    trace_seconds: float
    metrics: dict = field(default_factory=dict)  # stage name -> PipelineMetrics of collective passes

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")


from autoparallel.fx_utils import copy_graph_module as _copy_graph  # noqa: E402


_shared_runs: dict | None = None  # while reuse_pipeline_runs() is entered: arguments -> PipelineRun


@contextlib.contextmanager
def reuse_pipeline_runs() -> Iterator[None]:
    """Within: ``run_pipeline`` builds each (scenario, stages, bucket cap) once and then returns
    the same ``PipelineRun`` (e.g. the golden tests and the report test of one pytest process).
    Callers must treat the run as read-only. Nests; the outermost exit drops the runs."""
    global _shared_runs
    outer = _shared_runs
    if outer is None:
        _shared_runs = {}
    try:
        yield
    finally:
        _shared_runs = outer


def run_pipeline(scenario: Scenario, *, stages: tuple[str, ...] = STAGE_NAMES, bucket_cap_mb: float = 25.0) -> PipelineRun:
    """Trace, first partition, second compile (aot_eager-style) and each collective pass on the
    second compile's split graphs, on one fake world (graphs of rank 0: bucketing is rank-specific)."""
    if _shared_runs is None:
        return _run_pipeline(scenario, tuple(stages), bucket_cap_mb)
    key = (scenario, tuple(stages), bucket_cap_mb)
    if key not in _shared_runs:
        _shared_runs[key] = _run_pipeline(*key)
    return _shared_runs[key]


def _run_pipeline(scenario: Scenario, stages: tuple[str, ...], bucket_cap_mb: float) -> PipelineRun:
    from autoparallel.mesh import fake_world
    from autoparallel.partition import apply_placement
    from autoparallel.passes.collective import CollectivePassesConfig, bucket_fw_bw
    from verify.scenario import compile_pipeline

    unknown = sorted(set(stages) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages: {list(STAGE_NAMES)}")
    with fake_world(scenario.mesh_spec) as mesh:
        jg = scenario.trace(mesh)
        params = {
            "count": len(jg.shardings),
            "fsdp_sharded": sum(1 for s in jg.shardings.values() if s.fsdp_dim is not None),
        }
        trace_seconds = jg.trace_seconds
        joint = _copy_graph(jg.gm)  # apply_placement rewrites and tags jg.gm in place
        module = apply_placement(jg)
        # One second compile that tags its joint graph for bucketing and runs no pass; each
        # collective pass then runs on copies of its split graphs.
        tag_only = CollectivePassesConfig(fuse_chained_allgathers=False, pre_overlap_bucketing=False)
        cs = compile_pipeline(scenario, mesh=mesh, module=module, collective_passes=tag_only)
        out = [
            Stage("joint", joint),
            Stage("first_partition", cs.first_partition),
            Stage("second_compile", cs.second_compile),
        ]
        metrics = {}
        for name, config in collective_stage_configs(bucket_cap_mb).items():
            if name in stages:
                fw, bw = (_copy_graph(g) for g in cs.second_compile)
                fw, bw, metrics[name] = bucket_fw_bw(fw, bw, config)
                out.append(Stage(name, (fw, bw)))
    out = [s for s in out if s.name in stages]
    return PipelineRun(scenario, out, params, trace_seconds, metrics)
