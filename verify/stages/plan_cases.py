"""Named planning cases (preset, mesh, batch, budget, ...) and their plans, built once per process.

Tracing is the planner's expensive step, so one traced :class:`Planner` serves every mesh,
profile, budget and pin set of a model (cached per process); plans are cached per case. The
goldens, the planner tests and ``python -m verify solve`` build models and inputs here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from autoparallel.mesh import fake_world
from autoparallel.models.llama3 import build_model, model_args
from autoparallel.planner import Planner, PlannerConfig
from verify.stages.scenario import Scenario, parse_dtype


@dataclass(frozen=True)
class PlanCase:
    preset: str = "tiny"
    mesh: str = "dp=8"
    batch: int = 8
    layers: int | None = None
    profile: str = "h100"
    memory_budget: float | None = None  # bytes
    cluster: bool = True
    trace_blocks: int | None = None
    pins: tuple[tuple[str, str], ...] = field(default=())
    seq: int | None = None

    def header(self) -> str:
        layers = f" layers={self.layers}" if self.layers else ""
        budget = "fully sharded" if self.memory_budget is None else f"{int(self.memory_budget)} bytes"
        return f"preset={self.preset}{layers} batch={self.batch} mesh={self.mesh} profile={self.profile} budget={budget}"


def model_and_inputs(preset: str, layers: int | None, batch: int, seq: int | None = None):
    args = model_args(preset, **({"n_layers": layers} if layers else {}))
    model = build_model(args, device="meta")
    tokens = torch.zeros(batch, seq or args.max_seq_len, dtype=torch.long, device="meta")
    return model, (tokens, tokens)


_PLANNERS: dict[tuple, object] = {}


def planner(
    preset: str,
    layers: int | None = None,
    batch: int = 8,
    trace_blocks: int | None = None,
    param_dtype: str | None = None,
    seq: int | None = None,
    progress=None,
):
    """A traced Planner, once per process and model (the trace runs on a fake world of 8 ranks;
    plan on any mesh later: the unsharded graph does not depend on the world)."""

    key = (preset, layers, batch, trace_blocks, param_dtype, seq)
    if key in _PLANNERS:
        if progress is not None:
            progress("reusing this process's trace of the model")
        return _PLANNERS[key]
    model, inputs = model_and_inputs(preset, layers, batch, seq)
    n_layers = len(model.layers)
    description = f"llama3 {preset} layers={n_layers} batch={batch} seq={inputs[0].shape[1]}" + (f" param_dtype={param_dtype}" if param_dtype else "")
    with fake_world("dp=8") as mesh:
        _PLANNERS[key] = Planner.trace(
            model,
            mesh,
            inputs,
            param_dtype=parse_dtype(param_dtype) if param_dtype else None,
            trace_blocks=trace_blocks,
            description=description,
            progress=progress,
        )
    return _PLANNERS[key]


def case_planner(case, mesh: str, trace_blocks: int | None = None, param_dtype: str | None = None, progress=None):
    """A traced Planner of a model case (a ``ModelCase`` or a reference to one) with its own loss
    and a global batch for ``mesh`` (the case's batch per data-parallel rank)."""
    scenario = Scenario(case=case, plan="auto", mesh=mesh)
    model, loss_fn, inputs, _, spec = scenario.pipeline_inputs()
    description = f"{scenario.model_name} batch={inputs[0].shape[0]}" + (f" param_dtype={param_dtype}" if param_dtype else "")
    with fake_world(spec) as world:
        return Planner.trace(model, world, inputs, loss_fn=loss_fn, param_dtype=parse_dtype(param_dtype) if param_dtype else None,
                             trace_blocks=trace_blocks, description=description, progress=progress)


@functools.cache
def plan_case(case: PlanCase):
    """The plan of ``case`` (read-only: shared by every test of this process)."""

    p = planner(case.preset, case.layers, case.batch, case.trace_blocks, None, case.seq)
    config = PlannerConfig(profile=case.profile, memory_budget=case.memory_budget, cluster=case.cluster, pins=dict(case.pins))
    with fake_world(case.mesh) as mesh:
        return p.plan(mesh, config)


GOLDEN_CASES = {
    "tiny-dp8": PlanCase("tiny", "dp=8"),
    "tiny-dp4tp2": PlanCase("tiny", "dp=4,tp=2"),
    "debug-dp8": PlanCase("debug", "dp=8"),
    "debug-dp4tp2": PlanCase("debug", "dp=4,tp=2"),
}

