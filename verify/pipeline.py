"""The pipeline's stages for one scenario, as graphs: what goldens, stats and the report show.

One function builds them so that the golden tests and ``python -m verify report`` can never
describe different pipelines. A stage is one graph (the joint graph) or a (forward, backward) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from verify.scenario import Scenario

STAGE_NAMES: tuple[str, ...] = ("joint", "first_partition", "second_compile")


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

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")


def run_pipeline(scenario: Scenario) -> PipelineRun:
    """Trace, first partition and second compile (aot_eager-style) on one fake world."""
    import copy
    import warnings

    from autoparallel.mesh import fake_world
    from autoparallel.partition import apply_placement
    from verify.scenario import compile_pipeline

    with fake_world(scenario.mesh_spec) as mesh:
        jg = scenario.trace(mesh)
        params = {
            "count": len(jg.shardings),
            "fsdp_sharded": sum(1 for s in jg.shardings.values() if s.fsdp_dim is not None),
        }
        trace_seconds = jg.trace_seconds
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # GraphModule deepcopy pickles pytree specs
            joint = copy.deepcopy(jg.gm)  # apply_placement rewrites and tags jg.gm in place
        module = apply_placement(jg)
        cs = compile_pipeline(scenario, mesh=mesh, module=module)
    stages = [
        Stage("joint", joint),
        Stage("first_partition", cs.first_partition),
        Stage("second_compile", cs.second_compile),
    ]
    return PipelineRun(scenario, stages, params, trace_seconds)
