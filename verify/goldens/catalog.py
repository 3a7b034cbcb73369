"""Which goldens exist for which scenario and stage, and their text.

The golden tests and ``python -m verify report`` both go through here, so the report can say
whether each stage it shows matches its reviewed golden. Per golden scenario:

* one graph golden per stage of ``autoparallel.pipeline.STAGE_NAMES`` (:func:`golden_result`):
  the stage's own graphs, except for a collective pass, whose graph golden is that pass *alone* on
  the second compile's graphs (an alternative: what the pass does by itself);
* the collective-pass order golden (:func:`order_text`): the passes composed, in the order
  ``autoparallel_backend`` runs them, with collective counts after each and what each did;
* per scenario, also counts-only ones: one line per stage (and alternative) with its collective
  counts (:func:`counts_text`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from autoparallel.compile import SECOND_COMPILE
from autoparallel.passes.collective import COLLECTIVE_PASSES, metric_text
from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from autoparallel.pipeline import PLANNED_STAGES, STAGES, PipelineRun, Stage, StageResult
from verify import zoo
from verify.goldens.text import (
    GOLDENS_DIR,
    collective_counts_text,
    graph_golden_text,
    header_text,
    render_golden,
)
from verify.stages import plan_cases
from verify.stages.pipeline_run import run_scenario
from verify.stages.registry import ALONE, PLAN_TEXT, REGISTRY, StageChecks, golden_kinds
from verify.stages.scenario import Scenario

GOLDEN_SCENARIOS: dict[str, Scenario] = {
    "tiny-fsdp-dp8": Scenario(preset="tiny", plan="fsdp", mesh="dp=8"),
    "tiny-fsdp_tp-dp4tp2": Scenario(preset="tiny", plan="fsdp_tp", mesh="dp=4,tp=2"),
    # gradients all-reduced, no all-gathers: pre-overlap bucketing merges the grad_ar all-reduces
    "tiny-ddp-dp8": Scenario(preset="tiny", plan="ddp", mesh="dp=8"),
    # bf16 shards gathered (cast before the all-gather), gradients reduce-scattered in fp32
    "tiny-fsdp-bf16-dp8": Scenario(preset="tiny", plan="fsdp", mesh="dp=8", param_dtype="bf16", reduce_dtype="fp32"),
    # caps small enough that buckets split: by bytes in pre_overlap_bucketing, by topological
    # span in topo_span_bucketing (PIPELINE_OPTIONS; tests/golden/test_golden_scenarios.py checks)
    "tiny-fsdp-dp4-split": Scenario(preset="tiny", plan="fsdp", mesh="dp=4"),
    # uneven FSDP shards: no dim 0 divides 3, so every shard is zero-padded; the all-gathers are
    # followed by a narrow, the reduce-scatters preceded by a pad, and the stats show the padding
    "tiny-fsdp-dp3-uneven": Scenario(preset="tiny", plan="fsdp", mesh="dp=3", n_layers=1),
    # plan="auto": the planner places everything (plan stage golden: the plan text), lowered
    "tiny-auto-dp8": Scenario(preset="tiny", plan="auto", mesh="dp=8"),
    "tiny-auto-dp4tp2": Scenario(preset="tiny", plan="auto", mesh="dp=4,tp=2"),
    # not LLaMA (verify.zoo): tied embedding/head gathered once, LayerNorm, biased Linears
    "gpt2-fsdp-dp2": Scenario(case=zoo.gpt2, plan="fsdp", mesh="dp=2"),
    # qkv split as 3 chunks, rowwise biases added after the all-reduce
    "gpt2-fsdp_tp-dp2tp2": Scenario(case=zoo.gpt2, plan="fsdp_tp", mesh="dp=2,tp=2"),
}
# Pass settings of scenarios whose goldens are not at the pipeline's defaults (shown in the header).
PIPELINE_OPTIONS: dict[str, dict] = {
    "tiny-fsdp-dp4-split": {"bucket_cap_mb": 0.1, "topo_span": TopoSpanConfig(max_topo_span=60)},
}
# Scenarios that get only the collective-count golden (a one-line-per-stage table).
COUNTS_ONLY_SCENARIOS: dict[str, Scenario] = {
    "debug-fsdp-dp8": Scenario(preset="debug", plan="fsdp", mesh="dp=8"),
}
ALL_SCENARIOS: dict[str, Scenario] = {**GOLDEN_SCENARIOS, **COUNTS_ONLY_SCENARIOS}
# Where the golden tests live (tests/<MODULE>.py) and their test names; syrupy names the files.
MODULE = "golden/test_pipeline_goldens"
STAGE_TEST = "test_stage_graph"
COUNTS_TEST = "test_collective_counts"
ORDER_TEST = "test_collective_pass_order"


def golden_stage_names(stages: Sequence[Stage], registry: Mapping[Stage, StageChecks] = REGISTRY) -> tuple[str, ...]:
    """A golden slot for every stage of ``stages``, each showing what its registry entry says
    (ValueError naming a stage without an entry)."""
    return tuple(golden_kinds(stages, registry))


GRAPH_GOLDEN_STAGES: tuple[str, ...] = golden_stage_names(STAGES)  # a graph golden for every stage (hand plans)
_GOLDEN_KINDS = golden_kinds(PLANNED_STAGES)


def golden_stages(sid: str) -> tuple[str, ...]:
    """The stages with a golden for scenario ``sid``: every stage it runs (plan="auto" runs the
    plan stage too; its golden is the plan text)."""
    return golden_stage_names(PLANNED_STAGES) if GOLDEN_SCENARIOS[sid].is_auto else GRAPH_GOLDEN_STAGES


def golden_slots() -> list[tuple[str, str]]:
    """``(scenario id, stage)`` for every stage golden, scenarios in sorted order."""
    return [(sid, stage) for sid in sorted(GOLDEN_SCENARIOS) for stage in golden_stages(sid)]


def scenario_id(scenario: Scenario) -> str | None:
    for key, sc in ALL_SCENARIOS.items():
        if sc == scenario:
            return key
    return None


def run_group(scenario: Scenario) -> str:
    """The xdist group of the tests that read ``scenario``'s pipeline run (shared per process:
    ``verify.stages.pipeline_run.reuse_pipeline_runs``): the golden scenario's id, else a name made of the
    scenario's fields. Tests that read one scenario's run name its group, so it is built once
    per test run, by the first of them (the golden tests, where there are any: they collect
    first)."""
    sid = scenario_id(scenario)
    return sid if sid is not None else f"run {scenario.header()}"


def pipeline_options(scenario: Scenario) -> dict:
    """``run_scenario`` keyword arguments the scenario's goldens were made with ({} = defaults)."""
    return dict(PIPELINE_OPTIONS.get(scenario_id(scenario), {}))


def golden_run(sid: str) -> PipelineRun:
    """The pipeline run behind scenario ``sid``'s goldens."""
    return run_scenario(ALL_SCENARIOS[sid], **PIPELINE_OPTIONS.get(sid, {}))


def _options_text(options: dict) -> str:
    parts = []
    for k, v in sorted(options.items()):
        if isinstance(v, TopoSpanConfig):
            parts += [f"max_topo_span={v.max_topo_span}", f"overlap_bucket_cap_mb={v.bucket_cap_mb}"]
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def header(scenario: Scenario, stage: str) -> dict[str, str]:
    out = {"preset": scenario.preset} if scenario.model_case is None else {"model": scenario.model_name}
    if scenario.n_layers is not None:  # only where it differs from the preset's (older goldens have none)
        out["layers"] = str(scenario.n_layers)
    out |= {
        "mesh": str(scenario.mesh_spec),
        "plan": scenario.plan_obj().describe(),
    }
    options = pipeline_options(scenario)
    if options:
        out["passes"] = _options_text(options)
    out["stage"] = stage
    return out


def golden_result(run: PipelineRun, stage: str) -> StageResult:
    """The result whose graphs a stage's graph golden shows: the stage's own, or for a collective
    pass that pass alone on the second compile's graphs (the composed run: :func:`order_text`)."""
    return run.alternative(stage) if _GOLDEN_KINDS.get(stage) == ALONE else run.stage(stage)


def stage_text(sid: str, result: StageResult) -> str:
    if _GOLDEN_KINDS.get(result.name) == PLAN_TEXT:
        return plan_stage_text(sid, result)
    return graph_golden_text(f"{sid} {result.name}", header(GOLDEN_SCENARIOS[sid], result.name), result.graphs)


def plan_stage_text(sid: str, result: StageResult) -> str:
    """The plan stage's golden: the canonical plan text (alias round trips removed) and what the
    round-trip pass did, consumer by consumer."""
    report = result.report
    trips = report.aliases
    lines = [trips.summary()]
    lines += [f"rewired {r}" for r in trips.rewired]
    lines += [f"erased {a}" for a in trips.erased]
    lines += [f"left {r}" for r in trips.round_trips if r not in set(trips.rewired)]
    return render_golden(
        f"{sid} {result.name}",
        [
            ("header", header_text(header(GOLDEN_SCENARIOS[sid], result.name))),
            ("alias round trips", "\n".join(lines)),
            ("plan", report.solution.text()),
        ],
    )


def counts_text(sid: str, run: PipelineRun) -> str:
    """Every stage in order, then the alternatives (``<pass> (alone)``), one line per graph."""
    rows = [row for r in [*run.results, *run.alternatives] for row in r.graph_rows()]
    return render_golden(
        f"{sid} collective counts",
        [("header", header_text(header(ALL_SCENARIOS[sid], "all"))), ("collectives", collective_counts_text(rows))],
    )


def _metrics_lines(name: str, metrics) -> list[str]:
    """What one pass did to each graph (its PipelineMetrics), as deterministic text."""
    lines = []
    for graph, m in metrics.graphs.items():
        parts = metric_text(m)
        lines.append(f"{name} {graph}: " + ("; ".join(parts) or "nothing to do"))
    return lines


def order_text(sid: str, run: PipelineRun) -> str:
    """The collective passes composed, as ``autoparallel_backend`` runs them: which run (in order),
    collective counts after each (from the second compile's graphs on), and what each did."""
    ran = [p for p in COLLECTIVE_PASSES if p.name in run.names]
    order = [f"0. {SECOND_COMPILE}: the partitioner tags the bucketable collectives of its joint graph (tag_joint)"]
    order += [f"{i}. {p.name}: {p.summary}" for i, p in enumerate(ran, 1)]
    order += [f"-. {p.name}: off in this configuration" for p in COLLECTIVE_PASSES if p not in ran]
    results = [run.stage(SECOND_COMPILE), *(run.stage(p.name) for p in ran)]
    rows = [row for r in results for row in r.graph_rows()]
    metrics = [line for p in ran for line in _metrics_lines(p.name, run.stage(p.name).report)]
    return render_golden(
        f"{sid} collective pass order",
        [
            ("header", header_text(header(GOLDEN_SCENARIOS[sid], "collective passes (composed)"))),
            ("order", "\n".join(order)),
            ("collectives", collective_counts_text(rows)),
            ("what each pass did", "\n".join(metrics)),
        ],
    )


def golden_path(root: Path, test: str, param_id: str) -> Path:
    return root / GOLDENS_DIR / f"{MODULE}" / f"{test}[{param_id}].txt"


def compare_with_golden(root: Path, test: str, param_id: str, text: str) -> str:
    """"matches", "differs", or "missing" for the golden of ``test[param_id]``, byte for
    byte: a golden checked out with CRLF line ends differs (its golden test calls it corrupt)."""
    path = golden_path(root, test, param_id)
    if not path.exists():
        return "missing"
    return "matches" if path.read_bytes() == text.encode() else "differs"


def plan_case_text(name: str) -> str:
    """Header and canonical plan text of a golden planning case (``verify.stages.plan_cases``)."""

    case = plan_cases.GOLDEN_CASES[name]
    header = {"case": name, "model": case.preset, "layers": case.layers or "preset", "batch": case.batch, "mesh": case.mesh, "profile": case.profile}
    return render_golden(f"plan {name}", [("header", header_text(header)), ("plan", plan_cases.plan_case(case).text())])
