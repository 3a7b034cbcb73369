"""``python -m verify report``: every stage of the pipeline for one scenario, in one table.

Each stage is a graph (or a forward/backward pair) with its node count and collectives per kind
and mesh dim (from ``verify.pipeline``, shared with the golden tests), whether it matches its golden,
and parity on a small real world that keeps the plan's shape.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from autoparallel.mesh import MeshSpec
from verify import golden_catalog
from verify.parity import compare_tensors, compare_traces, merge_reports
from verify.pipeline import PipelineRun, Stage, run_pipeline
from verify.scenario import Scenario, gather_full_grads, run_joint_parity, single_device_step
from verify.stats import graph_stats

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def progress(msg: str) -> None:
    print(f"[verify] {msg}", file=sys.stderr, flush=True)


def stage_summary(stage: Stage) -> dict:
    nodes = 0
    coll: dict[str, dict[str, dict[str, int]]] = {k: {} for k in COLLECTIVE_KINDS}
    for gm in stage.graph_list:
        st = graph_stats(gm).to_dict()
        nodes += st["num_nodes"]
        for kind, per_dim in st["collectives"].items():
            for dim, cs in per_dim.items():
                slot = coll.setdefault(kind, {}).setdefault(dim, {"count": 0, "bytes": 0})
                slot["count"] += cs["count"]
                slot["bytes"] += cs["bytes"]
    return {"name": stage.name, "nodes": nodes, "collectives": coll}


def golden_status(run: PipelineRun) -> dict[str, str] | None:
    """Per stage: does it match its reviewed golden? None when the scenario has no goldens."""
    sid = golden_catalog.scenario_id(run.scenario)
    if sid is None:
        return None
    root = Path(__file__).resolve().parent.parent
    out = {}
    for stage in run.stages:
        text = golden_catalog.stage_text(sid, stage)
        out[stage.name] = golden_catalog.compare_with_golden(root, golden_catalog.STAGE_TEST, f"{sid}-{stage.name}", text)
    out["collective counts"] = golden_catalog.compare_with_golden(
        root, golden_catalog.COUNTS_TEST, sid, golden_catalog.counts_text(sid, run)
    )
    return out


def parity_mesh(spec: MeshSpec) -> MeshSpec:
    """The smallest world that keeps every mesh dim non-trivial: each dim of size > 1 becomes 2."""
    return MeshSpec(tuple((n, min(s, 2)) for n, s in spec.dims))


def run_parity(scenario: Scenario) -> dict:
    small = dataclasses.replace(scenario, mesh=str(parity_mesh(scenario.mesh_spec)))
    progress(f"parity on a gloo world of {small.mesh_spec.world_size} ranks ({small.mesh_spec}) ...")
    t0 = time.perf_counter()
    ranks = run_joint_parity(small, steps=1)
    rep = merge_reports(
        [compare_traces(r.traces["eager"], r.traces["joint"], a_name="eager", b_name="joint") for r in ranks],
        [f"rank{i}" for i in range(len(ranks))],
    )
    _, grads = single_device_step(small)
    single = compare_tensors(grads, gather_full_grads(small, ranks, "joint"), a_name="single-device", b_name="joint")
    return {
        "mesh": str(small.mesh_spec),
        "steps": 1,
        "eager_vs_joint": rep.to_dict(),
        "single_device_max_abs_diff": single.max_abs,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def build_report(scenario: Scenario, *, parity: bool = True) -> dict:
    progress(f"running the pipeline for {scenario.header()} ...")
    t0 = time.perf_counter()
    run = run_pipeline(scenario)
    progress(f"{len(run.stages)} stage(s) in {time.perf_counter() - t0:.1f}s")
    return {
        "preset": scenario.preset,
        "plan": scenario.plan_obj().describe(),
        "mesh": str(scenario.mesh_spec),
        "params": run.params,
        "stages": [stage_summary(s) for s in run.stages],
        "goldens": golden_status(run),
        "parity": run_parity(scenario) if parity else None,
    }


def _cell(cs: dict | None) -> str:
    if not cs:
        return "-"
    from verify.stats import human_bytes

    return f"{cs['count']} / {human_bytes(cs['bytes'])}"


def format_report(report: dict) -> str:
    lines = [
        f"autoparallel report: preset={report['preset']} mesh={report['mesh']}",
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
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    lines.append("")
    goldens = report.get("goldens")
    if goldens is None:
        lines.append("goldens: none for this scenario (see verify/golden_catalog.py)")
    else:
        lines.append("goldens: " + ", ".join(f"{k} {v}" for k, v in goldens.items()))
    p = report.get("parity")
    if p is None:
        lines.append("parity: skipped (--no-parity)")
    else:
        ej = p["eager_vs_joint"]
        verdict = "bitwise equal" if ej["bitwise"] else f"NOT bitwise: {ej['mismatches']} of {ej['tensors']} tensors differ"
        lines.append(f"parity on gloo {p['mesh']} ({p['steps']} step, {p['seconds']}s): eager vs joint {verdict} "
                     f"({ej['tensors']} tensors); single-device max |diff| {p['single_device_max_abs_diff']:.2e}")
    return "\n".join(lines)


def main(args) -> int:
    scenario = Scenario(preset=args.preset, plan=args.plan, mesh=args.mesh)
    report = build_report(scenario, parity=not args.no_parity)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_report(report))
    p = report.get("parity")
    return 0 if p is None or p["eager_vs_joint"]["bitwise"] else 1
