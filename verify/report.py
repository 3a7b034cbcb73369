"""``python -m verify report``: every stage of the pipeline for one scenario, in one table.

Each stage is a graph (or a forward/backward pair) with its node count and collectives per kind
and mesh dim (from ``verify.pipeline``, shared with the golden tests), in the order
``autoparallel.pipeline`` runs them; then the alternatives (each collective pass alone on the
second compile's graphs); whether each matches its golden; and parity on a small real world that
keeps the plan's shape: every stage bitwise against the eager parallel program, and the eager
parallel program against single-device eager within the oracle's tolerance (pass/fail).
The model is a LLaMA preset (``--preset``) or any ``ModelCase`` (``--model package.module:name``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from autoparallel.mesh import MeshSpec
from autoparallel.pipeline import PipelineRun, StageResult
from verify.goldens import catalog as golden_catalog
from verify.parity_runs import (
    EAGER,
    STAGE_EXECUTORS,
    compare_with_eager,
    oracle_check,
    run_stage_parity,
)
from verify.pipeline import params_summary, pipeline_options, run_pipeline
from verify.scenario import Scenario, check_flags, parameter_count
from verify.stats import graph_stats, human_bytes

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def progress(msg: str) -> None:
    print(f"[verify] {msg}", file=sys.stderr, flush=True)


def stage_summaries(result: StageResult) -> list[dict]:
    """One entry per graph: ``joint``, or ``<stage> fwd`` and ``<stage> bwd`` (``<pass> (alone)``
    for an alternative, which also says ``"alternative": true``)."""
    out = []
    for name, gm in result.graph_rows():
        st = graph_stats(gm).to_dict()
        coll = {k: {} for k in COLLECTIVE_KINDS}
        coll.update(st["collectives"])
        out.append({"name": name, "nodes": st["num_nodes"], "collectives": coll, "alternative": result.alternative})
    return out


GOLDENS_NOT_CHECKED = "not checked (no goldens/ directory here: run from a source checkout, pip install -e .)"


def golden_status(scenario: Scenario, run: PipelineRun, root: Path | None = None) -> dict[str, str] | str | None:
    """Per stage: does it match its reviewed golden? None when the scenario has no goldens, and
    GOLDENS_NOT_CHECKED where the goldens are not installed (a wheel carries no goldens/).

    Plain text comparison with the files (no syrupy): the base install shows it too."""
    sid = golden_catalog.scenario_id(scenario)
    if sid is None:
        return None
    root = root if root is not None else Path(__file__).resolve().parent.parent
    if not (root / golden_catalog.GOLDENS_DIR).is_dir():
        return GOLDENS_NOT_CHECKED
    out = {}
    if sid in golden_catalog.GOLDEN_SCENARIOS:
        for stage in golden_catalog.GRAPH_GOLDEN_STAGES:
            text = golden_catalog.stage_text(sid, golden_catalog.golden_result(run, stage))
            out[stage] = golden_catalog.compare_with_golden(root, golden_catalog.STAGE_TEST, f"{sid}-{stage}", text)
        out["collective pass order"] = golden_catalog.compare_with_golden(
            root, golden_catalog.ORDER_TEST, sid, golden_catalog.order_text(sid, run)
        )
    out["collective counts"] = golden_catalog.compare_with_golden(
        root, golden_catalog.COUNTS_TEST, sid, golden_catalog.counts_text(sid, run)
    )
    return out


def parity_mesh(spec: MeshSpec) -> MeshSpec:
    """The smallest world that keeps every mesh dim non-trivial: each dim of size > 1 becomes 2."""
    return MeshSpec(tuple((n, min(s, 2)) for n, s in spec.dims))


def run_parity(scenario: Scenario, steps: int = 2, *, run: PipelineRun | None = None) -> dict:
    """Each stage against the eager parallel program on gloo (bitwise), and the eager program
    against single-device eager (the oracle, within its tolerance), on the smallest world that
    keeps the plan's shape (:func:`parity_mesh`). ``run``: the scenario's pipeline run, made
    with ``keep_compiled``, when its mesh is that world already."""
    small = dataclasses.replace(scenario, mesh=str(parity_mesh(scenario.mesh_spec)))
    progress(f"parity on a gloo world of {small.mesh_spec.world_size} ranks ({small.mesh_spec}), {steps} steps ...")
    t0 = time.perf_counter()
    collective = pipeline_options(**golden_catalog.pipeline_options(scenario)).collective
    ranks = run_stage_parity(small, steps=steps, run=run if small == scenario else None, collective=collective)
    comparisons = {stage: compare_with_eager(ranks, stage) for stage in STAGE_EXECUTORS if stage != EAGER}
    oracle = oracle_check(small, ranks)
    return {
        "mesh": str(small.mesh_spec),
        "steps": steps,
        "vs_eager": {stage: rep.to_dict() for stage, rep in comparisons.items()},
        "oracle": oracle.to_dict(),
        "oracle_summary": oracle.summary(),
        "single_device_max_abs_diff": oracle.max_abs,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def parity_passed(parity: dict | None) -> bool:
    """Every stage bitwise and the oracle within tolerance (True when parity was skipped)."""
    if parity is None:
        return True
    return all(r["bitwise"] for r in parity["vs_eager"].values()) and parity.get("oracle", {}).get("passed", False)


def build_report(scenario: Scenario, *, parity: bool = True, steps: int = 2) -> dict:
    progress(f"running the pipeline for {scenario.header()} ...")
    t0 = time.perf_counter()
    # When the mesh is already parity's world, one run serves the table, the goldens and parity.
    keep = parity and parity_mesh(scenario.mesh_spec) == scenario.mesh_spec
    run = run_pipeline(scenario, keep_compiled=keep, **golden_catalog.pipeline_options(scenario))
    progress(f"{len(run.results)} stage(s) and {len(run.alternatives)} alternative(s) in {time.perf_counter() - t0:.1f}s")
    return {
        "model": scenario.model_name,
        "preset": scenario.preset if scenario.model_case is None else None,
        "plan": scenario.plan_obj().describe(),
        "mesh": str(scenario.mesh_spec),
        "params": params_summary(run),
        "stages": [row for r in [*run.results, *run.alternatives] for row in stage_summaries(r)],
        "goldens": golden_status(scenario, run),
        "parity": run_parity(scenario, steps, run=run if keep else None) if parity else None,
    }


def _cell(cs: dict | None) -> str:
    if not cs:
        return "-"
    return f"{cs['count']} / {human_bytes(cs['bytes'])}"


def format_report(report: dict) -> str:
    model = f"preset={report['preset']}" if report.get("preset") else f"model={report.get('model')}"
    lines = [
        f"autoparallel report: {model} mesh={report['mesh']}",
        f"plan: {report['plan']}",
        f"params: {report['params']['count']} ({report['params']['fsdp_sharded']} FSDP-sharded)",
        "",
    ]
    cols = sorted({(k, d) for s in report["stages"] for k, per in s["collectives"].items() for d in per},
                  key=lambda kd: (COLLECTIVE_KINDS.index(kd[0]) if kd[0] in COLLECTIVE_KINDS else 99, kd))
    header = ["stage", "nodes"] + [f"{k}[{d}]" for k, d in cols]
    rows = [header]
    for s in report["stages"]:
        rows.append([s["name"], str(s["nodes"])] + [_cell(s["collectives"].get(k, {}).get(d)) for k, d in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    alternatives = [False] + [s.get("alternative", False) for s in report["stages"]]
    for r, alternative, after_sequence in zip(rows, alternatives, [False, *alternatives[:-1]], strict=True):
        if alternative and not after_sequence:
            lines.append("alternatives: each collective pass alone on second_compile's graphs (for review; not a sequence)")
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    lines.append("")
    goldens = report.get("goldens")
    if goldens is None:
        lines.append("goldens: none for this scenario (see verify/goldens/catalog.py)")
    elif isinstance(goldens, str):
        lines.append(f"goldens: {goldens}")
    else:
        lines.append("goldens: " + ", ".join(f"{k} {v}" for k, v in goldens.items()))
    p = report.get("parity")
    if p is None:
        lines.append("parity: skipped (--no-parity)")
    else:
        lines.append(f"parity on gloo {p['mesh']} ({p['steps']} steps with AdamW, {p['seconds']}s), each stage vs the eager parallel program:")
        width = max((len(stage) for stage in p["vs_eager"]), default=0)
        for stage, r in p["vs_eager"].items():
            verdict = "bitwise equal" if r["bitwise"] else f"NOT bitwise: {r['mismatches']} of {r['tensors']} tensors differ (max |diff| {r['max_abs_diff']:.2e})"
            lines.append(f"  {stage:<{width}} {verdict} ({r['tensors']} tensors)")
        oracle = p.get("oracle")
        if oracle is None:
            lines.append(f"  single-device eager: max |diff| {p['single_device_max_abs_diff']:.2e} (not checked against a tolerance)")
        else:
            verdict = "PASS" if oracle["passed"] else f"FAIL ({oracle['failures']} of {oracle['tensors']} tensors beyond tolerance)"
            lines.append(
                f"  single-device eager (independent oracle, step 0): {verdict}; max |diff| {oracle['max_abs_diff']:.2e}, "
                f"worst |diff|/bound {oracle['worst_ratio']:.2e}, rtol {oracle['tolerance']['rtol']:.2e} "
                f"({oracle['tolerance']['dtype']}, {oracle['tolerance']['layers']} layers x width {oracle['tolerance']['width']})"
            )
            if not oracle["passed"] and p.get("oracle_summary"):
                lines.extend("    " + line for line in p["oracle_summary"].splitlines()[1:])
    return "\n".join(lines)


# Parity runs the model for real: each gloo rank builds the whole fp32 model, and the
# single-device reference holds fp32 weights and gradients. Above this many parameters (tens of
# GB) the report refuses unless asked (--parity-anyway); LLaMA-3 8B has 8.03e9.
PARITY_MAX_PARAMS = 1_000_000_000


def parity_memory_lower_bound(scenario: Scenario, params: int) -> int:
    """Bytes parity needs at least: the full fp32 model per rank, plus weights and gradients of
    the single-device reference (activations, optimizer state and the traced runs come on top)."""
    ranks = parity_mesh(scenario.mesh_spec).world_size
    return (ranks + 2) * 4 * params


def check_parity_size(scenario: Scenario, *, anyway: bool) -> None:
    params = parameter_count(scenario)
    if params <= PARITY_MAX_PARAMS or anyway:
        return
    need = parity_memory_lower_bound(scenario, params)
    raise ValueError(
        f"--preset {scenario.preset}: parity runs the model for real ({params / 1e9:.2f} B parameters, above the "
        f"{PARITY_MAX_PARAMS / 1e9:.0f} B limit) and needs at least {human_bytes(need)} of RAM; pass --no-parity "
        f"for the graphs only, or --parity-anyway to run it"
    )


def main(args) -> int:
    scenario = Scenario(preset=args.preset, plan=args.plan, mesh=args.mesh, case=getattr(args, "model", None))
    check_flags(scenario)
    if not args.no_parity:
        check_parity_size(scenario, anyway=args.parity_anyway)
    report = build_report(scenario, parity=not args.no_parity)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_report(report))
    return 0 if parity_passed(report.get("parity")) else 1
