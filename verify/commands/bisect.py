"""``python -m verify bisect``: name the first pass whose graphs compute other values.

Two questions, one answer:

* **One configuration** (a parity run failed): every graph-in/graph-out stage of the pipeline
  is run against its own input on the same random inputs (:mod:`verify.parity.differential`, on every
  rank of the mesh, simulated in this process). The first stage whose output computes values
  that differ from its input's is the pass that broke parity; the trace itself is checked by
  the joint parity run (``tests/parity/test_joint_parity.py``), not here.
* **Two configurations** A and B, e.g. a patch disabled vs enabled (``--disable NAME``; this is
  also how two commits' code paths differ, through ``AUTOPARALLEL_DISABLE``): the pipeline runs
  for both; stage by stage, A's output and B's output run on the same inputs; the first stage
  where they differ is named.

Either way the answer names the stage, its first differing output (by role, e.g.
``grad:layers.0.attention.wq.weight@rank3``) and the first differing node (by name and op,
forward before backward), each with both values. Stages whose graphs have the same code as
the graphs they are compared with are equal by construction and are not run.

``bisect_steps`` takes any list of ``(name, before, after)``: hand-built or generated graphs
through a list of passes, as the tests do.
"""

from __future__ import annotations

import json
import sys
import time

from autoparallel import patches
from autoparallel import pipeline as P
from verify.parity.bisection import (
    ONE_RUN,
    TWO_RUNS,
    BisectResult,
    bisect_run,
    bisect_runs,
    bisect_steps,
    explain_not_bitwise,
    run_steps,
    same_code,
)
from verify.stages.pipeline_run import pipeline_options
from verify.stages.scenario import Scenario, check_flags


def _progress(msg: str) -> None:
    print(f"[bisect] {msg}", file=sys.stderr, flush=True)


def _scenario(args) -> Scenario:
    sc = Scenario(preset=args.preset, plan=args.plan, mesh=args.mesh, param_dtype=args.param_dtype,
                  reduce_dtype=args.reduce_dtype, case=getattr(args, "model", None))
    check_flags(sc)
    return sc


def _pipeline(scenario: Scenario, bucket_cap_mb: float) -> P.PipelineRun:
    options = pipeline_options(bucket_cap_mb, alternatives=False)
    return P.run_pipeline(*scenario.pipeline_inputs(), options)


def main(args) -> int:
    scenario = _scenario(args)
    spec = scenario.mesh_spec
    disabled = list(args.disable or ())
    _progress(f"running the pipeline for {scenario.header()} ...")
    t0 = time.perf_counter()
    run_b = _pipeline(scenario, args.bucket_cap_mb)
    _progress(f"{len(run_b.results)} stages in {time.perf_counter() - t0:.1f}s")
    if disabled:
        label = f"disabled {','.join(disabled)}"
        _progress(f"running it again with {label} ...")
        with patches.disabled(*disabled):
            run_a = _pipeline(scenario, args.bucket_cap_mb)
        _progress(f"comparing stage by stage on {spec.world_size} simulated ranks ...")
        result = bisect_runs(run_a, run_b, spec, a=label, b="as configured", seed=args.seed, progress=_progress)
    else:
        _progress(f"checking every pass against its input on {spec.world_size} simulated ranks ...")
        result = bisect_run(run_b, spec, seed=args.seed, progress=_progress)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.summary())
    return 0 if result.first is None else 1


__all__ = [
    "BisectResult",
    "ONE_RUN",
    "TWO_RUNS",
    "bisect_run",
    "bisect_runs",
    "bisect_steps",
    "explain_not_bitwise",
    "main",
    "run_steps",
    "same_code",
]

