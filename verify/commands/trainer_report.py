"""``python -m verify report --trainer``: the graph trainer's stages in one table (and page).

The graph trainer (``autoparallel/trainer/``) traces one single-device training step into one
graph, tags it for graph SAC and rematerializes; its stages are ``verify.parity.trainer.
TRAINER_STAGES``. Per stage: node count, static peak (the liveness walk of ``verify.graphs.stats``),
the peak of one step measured on this CPU, the golden comparison, and parity (each stage trained
against eager, bitwise). ``--html DIR`` writes the page with the measured memory timeline beside
the static one.
"""

from __future__ import annotations

import json
import time

from autoparallel import ac
from verify.commands.html import write_page
from verify.commands.html.page import build_page
from verify.commands.html.records import trainer_records
from verify.commands.html.views import stage_view
from verify.commands.report import PARITY_MAX_PARAMS, parity_lines, progress, table_lines
from verify.graphs.stats import human_bytes
from verify.parity.trainer import stage_parity
from verify.stages.scenario import Scenario, parameter_count

BATCH = 4  # the trainer goldens' and parity tests' batch: their traces are shared
PARITY_STEPS = 2


def run_parity(preset: str, *, policy: str, steps: int = PARITY_STEPS) -> dict:
    """``verify.commands.report``'s parity dict shape for the trainer's stages (one process, no mesh)."""
    progress(f"parity: each graph-trainer stage vs eager, {steps} AdamW steps ...")
    t0 = time.perf_counter()
    reports = stage_parity(preset, policy=policy, batch=BATCH, steps=steps)
    return {
        "where": "one process",
        "steps": steps,
        "vs_eager": {stage: rep.to_dict() for stage, rep in reports.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }


def build(preset: str, *, parity: bool = True, policy: str = ac.OP):
    """``(report dict, stage views)``: the views are what the page draws."""
    p = run_parity(preset, policy=policy) if parity else None
    progress(f"tracing the graph trainer's stages of preset {preset} and measuring one step each ...")
    t0 = time.perf_counter()
    views = [stage_view(r) for r in trainer_records(preset, policy=policy, batch=BATCH, parity=p)]
    progress(f"{len(views)} stages in {time.perf_counter() - t0:.1f}s")
    report = {
        "trainer": True,
        "preset": preset,
        "policy": policy,
        "batch": BATCH,
        "stages": [
            {
                "name": v.name,
                "nodes": v.num_nodes[0],
                "static_peak_bytes": v.liveness.peak_bytes,
                "measured_peak_bytes": v.measured.peak if v.measured is not None else None,
                "golden": v.golden_status,
            }
            for v in views
        ],
        "parity": p,
    }
    return report, views


def format_report(report: dict) -> str:
    lines = [f"graph trainer report: preset={report['preset']} policy={report['policy']} batch={report['batch']}", ""]
    rows = [["stage", "nodes", "static peak", "measured peak", "golden"]]
    for s in report["stages"]:
        measured = "-" if s["measured_peak_bytes"] is None else human_bytes(s["measured_peak_bytes"])
        rows.append([s["name"], str(s["nodes"]), human_bytes(s["static_peak_bytes"]), measured, s["golden"]])
    lines += [*table_lines(rows, left=(0, 4)), ""]
    p = report.get("parity")
    heading = "" if p is None else f"parity ({p['steps']} AdamW steps, {p['where']}, {p['seconds']}s), each stage vs eager:"
    lines += parity_lines(p, heading, width=14, versus=True)
    if report.get("html"):
        lines.append(f"html report: {report['html']}")
    return "\n".join(lines)


def check_size(preset: str, *, anyway: bool) -> None:
    params = parameter_count(Scenario(preset=preset))
    if params > PARITY_MAX_PARAMS and not anyway:
        raise ValueError(
            f"--trainer --preset {preset}: the graph trainer runs the training step for real (measured memory, "
            f"parity) on one process, {params / 1e9:.2f} B parameters, above the {PARITY_MAX_PARAMS / 1e9:.0f} B "
            f"limit; pass --parity-anyway to run it"
        )


def main(args) -> int:
    check_size(args.preset, anyway=args.parity_anyway)
    report, views = build(args.preset, parity=not args.no_parity)
    if args.html is not None:
        title = f"graph trainer report: preset={args.preset} policy={report['policy']} batch={BATCH}"
        path = write_page(build_page(views, title=title, subtitle="single-device training step; measured memory "
                                     "is one step on this CPU (profiler allocations)"), args.html)
        progress(f"wrote {path}")
        report["html"] = str(path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    p = report.get("parity")
    return 0 if p is None or all(r["bitwise"] for r in p["vs_eager"].values()) else 1
