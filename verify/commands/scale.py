"""``python -m verify scale``: every stage of the pipeline on graphs of real size, timed.

The stages are ``autoparallel.pipeline.STAGES`` in order, then the alternatives (each collective
pass alone on the second compile's graphs, ``<pass> (alone)``).

Graphs are built on a fake world with fake tensors, so LLaMA-3 8B shapes at 128 ranks fit on one
CPU. Per stage: wall seconds (median of ``--repeat``), process peak RSS after the stage, node
count, collectives per kind and mesh dim, saved tensors, static peak memory,
``max_consec_compute_between_rs`` and bucketing metrics. The modules the stages use are imported
(and timed, ``import_seconds``) before the first stage; ``total_seconds`` is imports + stages. ``--layers 2,8,32`` runs each size in a
fresh process and prints per-stage time ratios, so a super-linear pass stands out.
``pipeline_over_trace``: the whole pipeline (imports and the stage sequence) over its one trace
(the joint stage's, or the plan stage's for plan="auto"), taken in each run and reported as the
median of the runs' ratios: a ratio within one run holds up on a loaded machine, seconds do not.
This is a benchmark: figures go to stdout and docs/performance.md, never into timed assertions.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from autoparallel.defaults import BUCKET_CAP_MB, DEFAULT_LOWERING
from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES, metric_json
from autoparallel.pipeline import PLAN, StageResult, run_pipeline, stages_for
from autoparallel.planner.lower import LoweringReport
from verify.graphs.stats import graph_stats, human_bytes, partition_stats
from verify.stages.pipeline_run import pipeline_options, stage_tracer
from verify.stages.registry import PLANNING
from verify.stages.scenario import Scenario, check_flags


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _collectives(*graphs) -> dict:
    out: dict[str, dict[str, dict[str, int]]] = {}
    for gm in graphs:
        for kind, per in graph_stats(gm).collectives.items():
            for dim, cs in per.items():
                slot = out.setdefault(kind, {}).setdefault(dim, {"count": 0, "bytes": 0})
                slot["count"] += cs.count
                slot["bytes"] += cs.bytes
    return out


def _graph_fields(graphs) -> dict:
    if isinstance(graphs, tuple):
        fw, bw = graphs
        ps = partition_stats(fw, bw)
        return {
            "nodes": {"fwd": len(fw.graph.nodes), "bwd": len(bw.graph.nodes)},
            "collectives": {"fwd": _collectives(fw), "bwd": _collectives(bw)},
            "saved": {"count": ps.saved_count, "bytes": ps.saved_bytes},
            "static_peak_bytes": ps.static_peak_bytes,
            "max_consec_compute_between_rs": ps.bw.max_consec_compute_between_rs,
        }
    st = graph_stats(graphs)
    return {
        "nodes": st.num_nodes,
        "collectives": _collectives(graphs),
        "max_consec_compute_between_rs": st.max_consec_compute_between_rs,
    }


def _bucketing_fields(metrics) -> dict:
    return {name: metric_json(g) for name, g in metrics.graphs.items()}


def _planning_fields(report) -> dict:
    """The plan stage (plan="auto"): objective, the planner's seconds, alias round trips."""
    return {
        "objective_us": round(report.objective_us, 3),
        "proven_optimal": report.proven_optimal,
        "seconds": {k: round(v, 3) for k, v in report.seconds.items()},
        "alias_round_trips_found": len(report.aliases.round_trips),
        "alias_round_trips_removed": report.aliases.removed,
        "aliases_erased": len(report.aliases.erased),
        "solver": {k: report.solver[k] for k in ("variables_after", "constraints_after", "lp_bound_us", "gap") if k in report.solver},
    }


def lowering_fields(report) -> dict:
    """The joint stage of plan="auto" (a ``LoweringReport``): the moves written directly, those
    left to DTensor by reason, permuted copies rewritten after the trace, ops replayed."""
    return {
        "moved_inputs": report.moved_inputs,
        "direct_moves": report.direct_moves,
        "dtensor_moves": dict(sorted(report.dtensor_moves.items())),
        "layout_blind": report.layout_blind,
        "split_cats": report.split_cats,
        "replayed": report.replayed,
    }


# Modules the stages import lazily. Imported (and timed) before the first stage so that a
# one-off import (the Inductor passes alone take over a second) is not billed to whichever stage
# happens to import it first, which would distort the per-stage scaling ratios.
_STAGE_MODULES = (
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.fx_passes.post_grad",
    "torch._inductor.fx_passes.bucketing",
    "torch._inductor.fx_passes.fsdp",
    "torch._inductor.fx_passes.overlap_scheduling",
)


def import_stage_modules() -> float:
    """Import what the stages need; the seconds it took (about 0 once imported)."""
    import importlib

    t0 = time.perf_counter()
    for name in _STAGE_MODULES:
        importlib.import_module(name)
    return time.perf_counter() - t0


def run_once(scenario: Scenario, bucket_cap_mb: float, progress: Callable[[str], None], lowering: str = DEFAULT_LOWERING) -> list[dict]:
    """One pass over every stage, then the alternatives; a list of stage dicts (seconds, metrics).

    Stats are taken by an observer as each stage ends, on the live graphs (no copies: at 8B size
    a copy per stage would cost memory and time that no stage spends)."""
    stages: list[dict] = []
    n = len(stages_for(scenario.plan_obj())) + len(COLLECTIVE_PASS_NAMES)

    def record(result: StageResult) -> None:
        entry = {"name": result.label, "seconds": result.seconds, "rss_gib": round(_rss_gib(), 3), "alternative": result.alternative}
        if result.name in PLANNING:
            entry["planning"] = _planning_fields(result.report)
        else:
            entry.update(_graph_fields(result.graphs))
        if isinstance(result.report, LoweringReport):
            entry["lowering"] = lowering_fields(result.report)
        if result.name in COLLECTIVE_PASS_NAMES:
            entry["bucketing"] = _bucketing_fields(result.report)
        stages.append(entry)
        progress(f"[{len(stages)}/{n}] {entry['name']:<32} {result.seconds:7.2f}s  rss {entry['rss_gib']:.2f} GiB")

    options = pipeline_options(bucket_cap_mb, snapshots=False, lowering=lowering)
    run_pipeline(*scenario.pipeline_inputs(), options, observers=[record], trace=stage_tracer)
    # The alternatives run right after the second compile (they read its graphs before the
    # sequence rewrites them); the table lists the sequence first.
    return sorted(stages, key=lambda e: e["alternative"])


def trace_seconds(stages: list[dict]) -> float | None:
    """One run's trace: the plan stage's unsharded trace (plan="auto"), else the joint stage."""
    by_name = {s["name"]: s for s in stages if not s["alternative"]}
    if PLAN in by_name:
        return by_name[PLAN]["planning"]["seconds"].get("trace")
    return by_name["joint"]["seconds"] if "joint" in by_name else None


def pipeline_over_trace(stages: list[dict], import_seconds: float) -> float | None:
    """One run's whole pipeline (imports + the stage sequence, no alternatives) over its trace."""
    trace = trace_seconds(stages)
    if not trace:
        return None
    return (import_seconds + sum(s["seconds"] for s in stages if not s["alternative"])) / trace


def run_scale(scenario: Scenario, *, repeat: int = 1, bucket_cap_mb: float = BUCKET_CAP_MB, progress=lambda m: None,
              lowering: str = DEFAULT_LOWERING) -> dict:
    t0 = time.perf_counter()
    import_seconds = import_stage_modules()
    progress(f"imports {import_seconds:.2f}s (once per process, in no stage)")
    runs = []
    for i in range(repeat):
        if repeat > 1:
            progress(f"repeat {i + 1}/{repeat}")
        runs.append(run_once(scenario, bucket_cap_mb, progress, lowering))
    ratios = [r for r in (pipeline_over_trace(run, import_seconds) for run in runs) if r is not None]
    stages = runs[-1]
    for j, stage in enumerate(stages):
        samples = [run[j]["seconds"] for run in runs]
        stage["seconds"] = round(statistics.median(samples), 3)
        stage["seconds_samples"] = [round(x, 3) for x in samples]
    return {
        "preset": scenario.preset if scenario.model_case is None else None,
        "model": scenario.model_name,
        "layers": scenario.model_args().n_layers if scenario.model_case is None else None,
        "mesh": str(scenario.mesh_spec),
        "plan": scenario.plan_obj().describe(),
        "repeat": repeat,
        "bucket_cap_mb": bucket_cap_mb,
        "lowering": lowering,
        "import_seconds": round(import_seconds, 3),
        "stages": stages,
        # What one cold run costs: the imports plus every stage (median of the repeats).
        "total_seconds": round(import_seconds + sum(s["seconds"] for s in stages), 2),
        # The pipeline a user runs: the imports and the stage sequence, without the alternatives.
        "pipeline_seconds": round(import_seconds + sum(s["seconds"] for s in stages if not s["alternative"]), 2),
        # Each run's pipeline over its own trace, median of the runs (None: no trace stage ran).
        "pipeline_over_trace": round(statistics.median(ratios), 2) if ratios else None,
        "pipeline_over_trace_samples": [round(r, 2) for r in ratios],
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_gib": round(_rss_gib(), 3),
    }


def _count(coll: dict, kind: str) -> int:
    return sum(cs["count"] for cs in coll.get(kind, {}).values())


def format_scale(result: dict) -> str:
    lines = [
        (f"scale: preset={result['preset']} layers={result['layers']}" if result["preset"] else f"scale: model={result['model']}")
        + f" mesh={result['mesh']} plan={result['plan']}",
        f"{'stage':<32} {'seconds':>8} {'rss GiB':>8} {'nodes':>12} {'AG fwd/bwd':>11} {'RS':>5} {'AR':>5} "
        f"{'saved':>14} {'static peak':>12} {'maxRS':>5}",
    ]
    for s in result["stages"]:
        if "planning" in s:
            lines.append(f"{s['name']:<32} {s['seconds']:>8.2f} {s['rss_gib']:>8.2f} {'-':>12}")
            continue
        nodes = s["nodes"]
        coll = s["collectives"]
        if isinstance(nodes, dict):
            nodes_txt = f"{nodes['fwd']}/{nodes['bwd']}"
            ag = f"{_count(coll['fwd'], 'all_gather')}/{_count(coll['bwd'], 'all_gather')}"
            rs = _count(coll["bwd"], "reduce_scatter")
            ar = _count(coll["fwd"], "all_reduce") + _count(coll["bwd"], "all_reduce")
            saved = f"{s['saved']['count']} {human_bytes(s['saved']['bytes'])}"
            peak = human_bytes(s["static_peak_bytes"])
        else:
            nodes_txt, ag = str(nodes), str(_count(coll, "all_gather"))
            rs, ar = _count(coll, "reduce_scatter"), _count(coll, "all_reduce")
            saved, peak = "-", "-"
        lines.append(
            f"{s['name']:<32} {s['seconds']:>8.2f} {s['rss_gib']:>8.2f} {nodes_txt:>12} {ag:>11} {rs:>5} {ar:>5} "
            f"{saved:>14} {peak:>12} {s['max_consec_compute_between_rs']:>5}"
        )
    lines.append(f"total {result['total_seconds']:.1f}s (imports {result['import_seconds']:.1f}s + stages, "
                 f"median of {result['repeat']}); peak RSS {result['peak_rss_gib']:.2f} GiB")
    lines += trace_ratio_lines(result)
    lines += planning_lines(result)
    return "\n".join(lines)


def trace_ratio_lines(result: dict) -> list[str]:
    """The whole pipeline as a multiple of its one trace (median of the runs' own ratios)."""
    if result.get("pipeline_over_trace") is None:
        return []
    samples = ", ".join(f"{r:.2f}" for r in result["pipeline_over_trace_samples"])
    return [f"pipeline {result['pipeline_seconds']:.1f}s (imports + stages, no alternatives) = "
            f"{result['pipeline_over_trace']:.2f} x one trace (median of runs: {samples})"]


def planning_lines(result: dict) -> list[str]:
    """plan="auto": the plan stage beside the others (objective, solve time, alias round trips)
    and what fusion did with the chained all-gathers the lowering made."""
    by_name = {s["name"]: s for s in result["stages"] if not s.get("alternative")}
    if PLAN not in by_name:
        return []
    p = by_name[PLAN]["planning"]
    secs = ", ".join(f"{k} {v:.2f}s" for k, v in p["seconds"].items())
    lines = [
        f"plan: objective {p['objective_us'] / 1e3:.3f} ms per step ({'optimal' if p['proven_optimal'] else 'NOT proven optimal'}); {secs}",
        f"  whole planned pipeline {result['pipeline_seconds']:.1f}s (imports, planning, every stage; no alternatives)",
        f"  alias round trips: {p['alias_round_trips_found']} found, {p['alias_round_trips_removed']} removed, {p['aliases_erased']} aliases erased",
    ]
    fuse = by_name.get("fuse_chained_allgathers")
    if fuse is not None:
        b = fuse["bucketing"]
        found = sum(g.get("chains_found", 0) for g in b.values())
        fused = sum(g["fused_chains"] for g in b.values())
        left = [c for g in b.values() for c in g.get("chains_unfused", [])]
        lines.append(f"  chained all-gathers (fw + bw): {found} found, {fused} fused" + (f"; left: {len(left)} ({left[0]['reason']}, ...)" if left else ""))
    return lines


def format_scaling(results: list[dict]) -> str:
    sizes = [r["layers"] for r in results]
    head = f"{'stage':<32}" + "".join(f"{f'{n} layers':>12}" for n in sizes)
    head += "".join(f"{f'x{b}/{a}':>10}" for a, b in zip(sizes, sizes[1:], strict=False))
    lines = ["per-stage seconds and time ratio between sizes (linear in layers = the size ratio)", head]
    for j, name in enumerate(s["name"] for s in results[0]["stages"]):
        secs = [r["stages"][j]["seconds"] for r in results]
        row = f"{name:<32}" + "".join(f"{x:>12.2f}" for x in secs)
        row += "".join(f"{(b / a if a > 0 else float('nan')):>10.2f}" for a, b in zip(secs, secs[1:], strict=False))
        lines.append(row)
    lines += _size_rows(results, "pipeline / trace", "pipeline_over_trace", "{:>12.2f}")
    lines += _size_rows(results, "peak RSS GiB", "peak_rss_gib", "{:>12.2f}")
    return "\n".join(lines)


def _size_rows(results: list[dict], label: str, key: str, fmt: str) -> list[str]:
    """One row of a per-size figure (no row where a result lacks it)."""
    if any(r.get(key) is None for r in results):
        return []
    return [f"{label:<32}" + "".join(fmt.format(r[key]) for r in results)]


def main(args) -> int:
    layers = args.layers or [None]  # parsed and checked by verify.__main__

    def progress(msg: str) -> None:
        print(f"[scale] {msg}", file=sys.stderr, flush=True)

    if len(layers) > 1:
        results = []
        for n in layers:
            progress(f"--- {n} layers (fresh process) ---")
            cmd = [sys.executable, "-m", "verify", "scale", "--preset", args.preset, "--layers", str(n),
                   "--mesh", args.mesh, "--plan", args.plan, "--repeat", str(args.repeat),
                   "--bucket-cap-mb", str(args.bucket_cap_mb), "--lowering", args.lowering, "--json"]
            for flag, value in (("--param-dtype", args.param_dtype), ("--reduce-dtype", args.reduce_dtype)):
                if value:
                    cmd += [flag, value]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
            results.append(json.loads(out))
        if args.json:
            print(json.dumps({"sizes": results}, indent=2))
        else:
            for r in results:
                print(format_scale(r) + "\n")
            print(format_scaling(results))
        return 0
    scenario = Scenario(
        preset=args.preset,
        plan=args.plan,
        mesh=args.mesh,
        n_layers=layers[0],
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        case=getattr(args, "model", None),
    )
    check_flags(scenario)
    progress(f"{scenario.header()}: {len(stages_for(scenario.plan_obj()))} stages and {len(COLLECTIVE_PASS_NAMES)} alternatives")
    result = run_scale(scenario, repeat=args.repeat, bucket_cap_mb=args.bucket_cap_mb, progress=progress, lowering=args.lowering)
    print(json.dumps(result, indent=2) if args.json else format_scale(result))
    return 0
