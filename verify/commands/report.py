"""``python -m verify report``: every stage of the pipeline for one scenario, in one table.

Each stage is a graph (or a forward/backward pair) with its node count and collectives per kind
and mesh dim (from ``verify.stages.pipeline_run``, shared with the golden tests), in the order
``autoparallel.pipeline`` runs them; then the alternatives (each collective pass alone on the
second compile's graphs); whether each matches its golden; and parity on a small real world that
keeps the plan's shape: every stage bitwise against the eager parallel program, and the eager
parallel program against single-device eager within the oracle's tolerance (pass/fail).
The model is a LLaMA preset (``--preset``) or any ``ModelCase`` (``--model package.module:name``).
``--html DIR`` also writes the page of ``verify.commands.html`` for the same run (parity and golden
verdicts per stage). ``--trainer``: the graph trainer's stages instead (``verify.commands.trainer_report``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from autoparallel.mesh import MeshSpec
from autoparallel.passes.collective import PipelineMetrics, upstream_info_logs
from autoparallel.runtime.launched import agree_on_status, check_world_size, launched_world
from autoparallel.pipeline import PLAN, PipelineRun, StageResult
from verify.parity.bisection import explain_not_bitwise
from verify.parity.digest import stage_digests
from verify.commands.html import write_report
from verify.commands.html.records import records_from_pipeline_run
from verify.goldens import catalog as golden_catalog
from verify.graphs.stats import graph_stats, human_bytes
from verify.parity.ordered_collectives import current_mode, native_collectives
from verify.parity.planned import EAGER as PLANNED_EAGER
from verify.parity.planned import EXECUTORS as PLANNED_EXECUTORS
from verify.parity.planned import planned_case, planned_oracle, run_planned_parity
from verify.parity.runs import (
    AS_TRACED,
    EAGER,
    STAGE_EXECUTORS,
    compare_with_eager,
    oracle_check,
    rank_inputs,
    run_stage_parity,
)
from verify.stages.pipeline_run import params_summary, pipeline_options, run_scenario, without_grad_lines
from verify.stages.scenario import Scenario, check_flags, parameter_count

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def progress(msg: str) -> None:
    """A progress line on stderr; in a launched job (torchrun), rank 0's only."""
    world = launched_world()
    if world is None or world.rank == 0:
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
    root = root if root is not None else Path(__file__).resolve().parents[2]
    if not (root / golden_catalog.GOLDENS_DIR).is_dir():
        return GOLDENS_NOT_CHECKED
    out = {}
    if sid in golden_catalog.GOLDEN_SCENARIOS:
        for stage in golden_catalog.golden_stages(sid):
            text = golden_catalog.stage_text(sid, golden_catalog.golden_result(run, stage))
            out[stage] = golden_catalog.compare_with_golden(root, golden_catalog.STAGE_TEST, f"{sid}-{stage}", text)
        out["collective pass order"] = golden_catalog.compare_with_golden(
            root, golden_catalog.ORDER_TEST, sid, golden_catalog.order_text(sid, run)
        )
    out["collective counts"] = golden_catalog.compare_with_golden(
        root, golden_catalog.COUNTS_TEST, sid, golden_catalog.counts_text(sid, run)
    )
    return out


def parity_mesh(spec: MeshSpec, *, full: bool = False) -> MeshSpec:
    """The world parity runs on: the smallest that keeps every mesh dim non-trivial (each dim of
    size > 1 becomes 2), or the whole mesh with ``full`` (``--full-mesh``; always in a launched
    job, whose world is the mesh's)."""
    if full or launched_world() is not None:
        return spec
    return MeshSpec(tuple((n, min(s, 2)) for n, s in spec.dims))


def planning_summary(run: PipelineRun) -> dict | None:
    """The plan stage of a plan="auto" run (None for a hand plan): the plan's objective, where
    the planner's seconds went, the alias round trips it removed, and what chained all-gather
    fusion did with the chains the plan's lowering made (found and fused, fw + bw)."""
    if run.planned is None:
        return None
    rep = run.stage(PLAN).report
    out = {
        "objective_us": round(rep.objective_us, 3),
        "compute_us": round(rep.compute_us, 3),
        "comm_us": round(rep.comm_us, 3),
        "proven_optimal": rep.proven_optimal,
        "given_plan": rep.given,
        "seconds": {k: round(v, 3) for k, v in rep.seconds.items()},
        "stage_seconds": round(run.stage(PLAN).seconds, 3),
        "alias_round_trips": {"found": len(rep.aliases.round_trips), "removed": rep.aliases.removed, "aliases_erased": len(rep.aliases.erased)},
    }
    # the chains chained all-gather fusion found: the one collective pass that reports chains
    chains = [g.chains for r in run.results if isinstance(r.report, PipelineMetrics)
              for g in r.report.graphs.values() if g.chains is not None]
    if chains:
        out["chained_all_gathers"] = {"found": sum(c.found for c in chains), "fused": sum(len(c.fused) for c in chains)}
    return out


def run_parity(scenario: Scenario, steps: int = 2, *, run: PipelineRun | None = None, full_mesh: bool = False,
               oracle: bool = True) -> dict:
    """Each stage against the eager parallel program on gloo (bitwise), and the eager program
    against single-device eager (the oracle, within its tolerance), on the smallest world that
    keeps the plan's shape, or the whole mesh (:func:`parity_mesh`). ``run``: the scenario's pipeline
    run, made with ``keep_compiled``, when its mesh is that world already. ``digests``: one per
    compared stage (``verify.parity.digest``), equal for equal runs wherever they ran. ``oracle=False``
    (``--no-oracle``: the model does not fit one process): the stages bitwise only, and the report says so."""
    small = dataclasses.replace(scenario, mesh=str(parity_mesh(scenario.mesh_spec, full=full_mesh)))
    if scenario.is_auto:
        return run_planned_parity_summary(small, steps, oracle=oracle)
    progress(f"parity on {_world_words(small)}, {steps} steps ...")
    t0 = time.perf_counter()
    collective = pipeline_options(**golden_catalog.pipeline_options(scenario)).collective
    ranks = run_stage_parity(small, steps=steps, run=run if small == scenario else None, collective=collective)
    comparisons = {stage: compare_with_eager(ranks, stage) for stage in STAGE_EXECUTORS if stage != EAGER}
    checked = oracle_check(small, ranks) if oracle else None
    explained = explain_parity(small, ranks, comparisons, run if small == scenario else None)
    return {
        **_parity_summary(small, steps, comparisons, t0),
        "digests": stage_digests(ranks, STAGE_EXECUTORS),
        **explained,
        **_oracle_fields(checked),
    }


def _oracle_fields(oracle) -> dict:
    if oracle is None:
        return {"oracle": None, "oracle_summary": ORACLE_SKIPPED, "single_device_max_abs_diff": None}
    return {"oracle": oracle.to_dict(), "oracle_summary": oracle.summary(), "single_device_max_abs_diff": oracle.max_abs}


ORACLE_SKIPPED = ("single-device eager (independent oracle): SKIPPED (--no-oracle: the model does not fit one process); "
                  "the stages above are compared bitwise with the eager parallel program only")


def explain_parity(small: Scenario, ranks, comparisons: dict, run: PipelineRun | None) -> dict:
    """``explanations`` (stage -> why it is not bitwise: ``verify.parity.bisection.explain_not_bitwise``)
    and ``model_branch`` (the stages bitwise with the eager program run as traced: the model's own
    branch on ``is_compiling()``, no failure), for the stages that are not bitwise."""
    bad = [stage for stage, rep in comparisons.items() if not rep.bitwise]
    if not bad:
        return {"explanations": {}, "model_branch": []}
    as_traced = {stage: compare_with_eager(ranks, stage, AS_TRACED) for stage in bad} if AS_TRACED in ranks[0].traces else {}
    run = run if run is not None else run_scenario(small)
    progress(f"explaining {len(bad)} stage(s) that are not bitwise (differential execution) ...")
    explanations, _ = explain_not_bitwise(run, small.mesh, bad, seed=small.seed, as_traced=as_traced,
                                          compiling_queries=run.joint.compiling_queries if run.joint is not None else (),
                                          given=rank_inputs(small))
    return {"explanations": explanations, "model_branch": [s for s, rep in as_traced.items() if rep.bitwise]}


def _parity_summary(small: Scenario, steps: int, comparisons: dict, t0: float) -> dict:
    return {
        "mesh": str(small.mesh_spec),
        "steps": steps,
        "world": "launched" if launched_world() is not None else "forked",  # torchrun's ranks, or forked here
        "collectives": current_mode(),  # verify.parity.ordered_collectives: rank-ordered or native reductions
        "vs_eager": {stage: rep.to_dict() for stage, rep in comparisons.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }


def run_planned_parity_summary(small: Scenario, steps: int, *, oracle: bool = True) -> dict:
    """Parity of plan="auto" on the small world (each rank lowers the plan for itself)."""
    progress(f"planned parity on {_world_words(small)}, {steps} steps ...")
    t0 = time.perf_counter()
    case = planned_case(small)
    ((_, ranks),) = run_planned_parity(case, steps)
    comparisons = {
        ex: compare_with_eager(ranks, ex) for ex in PLANNED_EXECUTORS if ex != PLANNED_EAGER
    }
    checked = planned_oracle(case, ranks) if oracle else None  # the same bound as a hand plan's, the case's own loss
    return {
        **_parity_summary(small, steps, comparisons, t0),
        "digests": stage_digests(ranks, PLANNED_EXECUTORS),
        **_oracle_fields(checked),
    }


def _world_words(small: Scenario) -> str:
    world = launched_world()
    where = "the launched world" if world is not None else "a forked gloo world"
    return f"{where} of {small.mesh_spec.world_size} ranks ({small.mesh_spec})"


def parity_passed(parity: dict | None) -> bool:
    """Every stage bitwise and the oracle passed (True when parity was skipped)."""
    if parity is None:
        return True
    branch = set(parity.get("model_branch", ()))
    oracle_ok = parity["oracle"] is None or bool(parity["oracle"]["passed"])  # None: skipped (--no-oracle)
    return all(r["bitwise"] or s in branch for s, r in parity["vs_eager"].items()) and oracle_ok


def build_report(scenario: Scenario, *, parity: bool = True, steps: int = 2, full_mesh: bool = False, oracle: bool = True) -> dict:
    return report_and_run(scenario, parity=parity, steps=steps, full_mesh=full_mesh, oracle=oracle)[0]


def report_and_run(scenario: Scenario, *, parity: bool = True, steps: int = 2, full_mesh: bool = False,
                   oracle: bool = True) -> tuple[dict, PipelineRun]:
    """The report's dict and the pipeline run it describes (the HTML page draws the run)."""
    progress(f"running the pipeline for {scenario.header()} ...")
    t0 = time.perf_counter()
    # When the mesh is already parity's world, one run serves the table, the goldens and parity
    # (plan="auto" excepted: each rank of its parity world lowers the plan itself).
    keep = parity and not scenario.is_auto and parity_mesh(scenario.mesh_spec, full=full_mesh) == scenario.mesh_spec
    run = run_scenario(scenario, keep_compiled=keep, **golden_catalog.pipeline_options(scenario))
    progress(f"{len(run.results)} stage(s) and {len(run.alternatives)} alternative(s) in {time.perf_counter() - t0:.1f}s")
    return {
        "model": scenario.model_name,
        "preset": scenario.preset if scenario.model_case is None else None,
        "plan": scenario.plan_obj().describe(),
        "mesh": str(scenario.mesh_spec),
        "params": params_summary(run),
        "planning": planning_summary(run),
        "stages": [row for r in [*run.results, *run.alternatives] for row in stage_summaries(r)],
        "goldens": golden_status(scenario, run),
        "parity": run_parity(scenario, steps, run=run if keep else None, full_mesh=full_mesh, oracle=oracle) if parity else None,
    }, run


def write_html(scenario: Scenario, run: PipelineRun, report: dict, out_dir: Path) -> Path:
    """The page of ``run`` under ``out_dir`` (``index.html``): every stage and alternative, each
    with its golden comparison and, where parity ran, its verdict (the joint stage also the
    single-device oracle's)."""
    t0 = time.perf_counter()
    records = records_from_pipeline_run(run, scenario=scenario, parity=report.get("parity"))
    goldens = report.get("goldens")
    if isinstance(goldens, dict):
        golden_line = "goldens: " + ", ".join(f"{k} {v}" for k, v in goldens.items())
    else:
        golden_line = f"goldens: {goldens or 'none for this scenario'}"
    p = report.get("parity")
    parity_line = "parity: skipped (--no-parity)" if p is None else (
        f"parity on gloo {p['mesh']}, {p['steps']} AdamW steps, each stage vs the eager parallel program")
    planning = run.stage(PLAN).report if run.planned is not None else None
    path = write_report(records, out_dir, title=f"autoparallel report: {scenario.header()}",
                        subtitle=f"{golden_line}. {parity_line}.", mesh=scenario.mesh_spec, planning=planning)
    progress(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f}s)")
    return path


def _cell(cs: dict | None) -> str:
    if not cs:
        return "-"
    return f"{cs['count']} / {human_bytes(cs['bytes'])}"


def format_planning(p: dict) -> list[str]:
    """The plan stage as report lines (the row of the stage table has no graph to show)."""
    how = "given plan" if p["given_plan"] else ("optimal" if p["proven_optimal"] else "NOT proven optimal (time limit)")
    secs = ", ".join(f"{k} {v:.2f}s" for k, v in p["seconds"].items())
    trips = p["alias_round_trips"]
    lines = [
        f"plan stage ({p['stage_seconds']:.2f}s: {secs}): objective {p['objective_us'] / 1e3:.3f} ms per step "
        f"(compute {p['compute_us'] / 1e3:.3f}, communication {p['comm_us'] / 1e3:.3f}), {how}",
        f"  alias round trips: {trips['found']} found, {trips['removed']} removed, {trips['aliases_erased']} aliases erased",
    ]
    chains = p.get("chained_all_gathers")
    if chains is not None:
        lines.append(f"  chained all-gathers (fw + bw): {chains['found']} found, {chains['fused']} fused")
    return lines


def format_report(report: dict) -> str:
    model = f"preset={report['preset']}" if report.get("preset") else f"model={report.get('model')}"
    lines = [
        f"autoparallel report: {model} mesh={report['mesh']}",
        f"plan: {report['plan']}",
        f"params: {report['params']['count']} ({report['params']['fsdp_sharded']} FSDP-sharded)",
        *without_grad_lines(report["params"].get("without_grad") or {}),
        *(f"specialised read (guarded): {r}" for r in report["params"].get("specialised_reads") or []),
        "",
    ]
    planning = report.get("planning")
    if planning:
        lines[-1:-1] = format_planning(planning)
    cols = sorted({(k, d) for s in report["stages"] for k, per in s["collectives"].items() for d in per},
                  key=lambda kd: (COLLECTIVE_KINDS.index(kd[0]) if kd[0] in COLLECTIVE_KINDS else 99, kd))
    header = ["stage", "nodes"] + [f"{k}[{d}]" for k, d in cols]
    rows = [header]
    for s in report["stages"]:
        rows.append([s["name"], str(s["nodes"])] + [_cell(s["collectives"].get(k, {}).get(d)) for k, d in cols])
    alternatives = [False] + [s.get("alternative", False) for s in report["stages"]]
    for line, alternative, after_sequence in zip(table_lines(rows), alternatives, [False, *alternatives[:-1]], strict=True):
        if alternative and not after_sequence:
            lines.append("alternatives: each collective pass alone on second_compile's graphs (for review; not a sequence)")
        lines.append(line)
    lines.append("")
    goldens = report.get("goldens")
    if goldens is None:
        lines.append("goldens: none for this scenario (see verify/goldens/catalog.py)")
    elif isinstance(goldens, str):
        lines.append(f"goldens: {goldens}")
    else:
        lines.append("goldens: " + ", ".join(f"{k} {v}" for k, v in goldens.items()))
    p = report.get("parity")
    heading = "" if p is None else (f"parity on gloo {p['mesh']}, {p.get('world', 'forked')} world ({p['steps']} steps with AdamW, {p['collectives']} "
                                    f"reductions, {p['seconds']}s), "
                                    "each stage vs the eager parallel program:")
    width = max((len(stage) for stage in (p or {}).get("vs_eager", {})), default=0)
    lines += parity_lines(p, heading, width=width + 1)
    oracle = None if p is None else p.get("oracle")
    if p is not None and oracle is None:
        lines.append(f"  {ORACLE_SKIPPED}")
    if oracle is not None:
        verdict = "PASS" if oracle["passed"] else f"FAIL ({oracle['failures']} of {oracle['tensors']} tensors beyond tolerance)"
        tol = oracle["tolerance"]
        lines.append(
            f"  single-device eager (independent oracle, step 0): {verdict}; max |diff| {oracle['max_abs_diff']:.2e}, "
            f"worst |diff|/bound {oracle['worst_ratio']:.2e}, rtol {tol['rtol']:.2e} "
            f"({tol['dtype']}, {tol['layers']} layers x width {tol['width']})"
        )
        if not oracle["passed"] and p.get("oracle_summary"):
            lines.extend("    " + line for line in p["oracle_summary"].splitlines()[1:])
    if report.get("html"):
        lines.append(f"html report: {report['html']}")
    return "\n".join(lines)


def table_lines(rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """``rows`` as aligned columns: the ``left`` ones left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


def parity_verdict(r: dict) -> str:
    """One comparison (``ParityReport.to_dict()``) in words."""
    if r["bitwise"]:
        return "bitwise equal"
    return f"NOT bitwise: {r['mismatches']} of {r['tensors']} tensors differ (max |diff| {r['max_abs_diff']:.2e})"


def parity_lines(p: dict | None, heading: str, *, width: int = 16, versus: bool = False) -> list[str]:
    """``heading``, then one line per stage of a parity dict (``"vs_eager"``); ``versus`` names
    each stage's reference run."""
    if p is None:
        return ["parity: skipped (--no-parity)"]
    out = [heading]
    why, branch = p.get("explanations", {}), set(p.get("model_branch", ()))
    for stage, r in p["vs_eager"].items():
        vs = f" vs {r['a']}:" if versus else ""
        verdict = parity_verdict(r) + ("; bitwise with eager as traced (the model's own branch)" if stage in branch else "")
        out.append(f"  {stage:<{width}}{vs} {verdict} ({r['tensors']} tensors)")
        if stage in why:
            out.append(f"    why: {why[stage]}")
    return out


# Parity runs the model for real: each gloo rank builds the whole fp32 model, and the
# single-device reference holds fp32 weights and gradients. Above this many parameters (tens of
# GB) the report refuses unless asked (--parity-anyway); LLaMA-3 8B has 8.03e9.
PARITY_MAX_PARAMS = 1_000_000_000


def parity_memory_lower_bound(scenario: Scenario, params: int, *, full_mesh: bool = False) -> int:
    """Bytes parity needs at least: the full fp32 model per rank, plus weights and gradients of
    the single-device reference (activations, optimizer state and the traced runs come on top).
    In a launched job each process is one rank: the model once, plus the reference."""
    ranks = 1 if launched_world() is not None else parity_mesh(scenario.mesh_spec, full=full_mesh).world_size
    return (ranks + 2) * 4 * params


def check_parity_size(scenario: Scenario, *, anyway: bool, full_mesh: bool = False) -> None:
    params = parameter_count(scenario)
    if params <= PARITY_MAX_PARAMS or anyway:
        return
    need = parity_memory_lower_bound(scenario, params, full_mesh=full_mesh)
    raise ValueError(
        f"--preset {scenario.preset}: parity runs the model for real ({params / 1e9:.2f} B parameters, above the "
        f"{PARITY_MAX_PARAMS / 1e9:.0f} B limit) and needs at least {human_bytes(need)} of RAM; pass --no-parity "
        f"for the graphs only, or --parity-anyway to run it"
    )


def main(args) -> int:
    """The report; in a launched job (torchrun) every rank runs it, rank 0 prints it, and every
    rank exits with the same status."""
    scenario = Scenario(preset=args.preset, plan=args.plan, mesh=args.mesh, case=getattr(args, "model", None))
    check_flags(scenario)
    world = launched_world()
    if world is not None and not args.no_parity:
        check_world_size(world, scenario.mesh_spec.world_size, f"--mesh {scenario.mesh_spec}")
    full_mesh = getattr(args, "full_mesh", False)
    if not args.no_parity:
        check_parity_size(scenario, anyway=args.parity_anyway, full_mesh=full_mesh)
    with native_collectives(getattr(args, "native_collectives", False)), upstream_info_logs(getattr(args, "verbose", False)):
        report, run = report_and_run(scenario, parity=not args.no_parity, full_mesh=full_mesh,
                                     oracle=not getattr(args, "no_oracle", False))
    if world is None or world.rank == 0:
        if args.html is not None:
            report["html"] = str(write_html(scenario, run, report, args.html))
        print(json.dumps(report, indent=2, sort_keys=False) if args.json else format_report(report), flush=True)
    return agree_on_status(0 if parity_passed(report.get("parity")) else 1)
