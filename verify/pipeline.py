"""The pipeline's stages for one scenario, as graphs: what goldens, stats and the report show.

One function builds them so that the golden tests and ``python -m verify report`` can never
describe different pipelines. A stage is one graph (the joint graph) or a (forward, backward) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from verify.scenario import Scenario

STAGE_NAMES: tuple[str, ...] = ("joint",)


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
    with scenario.trace() as jg:
        stages = [Stage("joint", jg.gm)]
        params = {
            "count": len(jg.shardings),
            "fsdp_sharded": sum(1 for s in jg.shardings.values() if s.fsdp_dim is not None),
        }
        return PipelineRun(scenario, stages, params, jg.trace_seconds)
