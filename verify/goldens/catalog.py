"""Which goldens exist for which scenario and stage, and their text.

The golden tests and ``python -m verify report`` both go through here, so the report can say
whether each stage it shows matches its reviewed golden.
"""

from __future__ import annotations

from pathlib import Path

from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from verify.goldens.text import (
    GOLDENS_DIR,
    collective_counts_text,
    graph_golden_text,
    header_text,
    render_golden,
)
from verify.pipeline import PipelineRun, Stage, run_pipeline
from verify.scenario import Scenario

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


def scenario_id(scenario: Scenario) -> str | None:
    for key, sc in ALL_SCENARIOS.items():
        if sc == scenario:
            return key
    return None


def pipeline_options(scenario: Scenario) -> dict:
    """``run_pipeline`` keyword arguments the scenario's goldens were made with ({} = defaults)."""
    return dict(PIPELINE_OPTIONS.get(scenario_id(scenario), {}))


def golden_run(sid: str) -> PipelineRun:
    """The pipeline run behind scenario ``sid``'s goldens."""
    return run_pipeline(ALL_SCENARIOS[sid], **PIPELINE_OPTIONS.get(sid, {}))


def _options_text(options: dict) -> str:
    parts = []
    for k, v in sorted(options.items()):
        if isinstance(v, TopoSpanConfig):
            parts += [f"max_topo_span={v.max_topo_span}", f"overlap_bucket_cap_mb={v.bucket_cap_mb}"]
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def header(scenario: Scenario, stage: str) -> dict[str, str]:
    out = {
        "preset": scenario.preset,
        "mesh": str(scenario.mesh_spec),
        "plan": scenario.plan_obj().describe(),
    }
    options = pipeline_options(scenario)
    if options:
        out["passes"] = _options_text(options)
    out["stage"] = stage
    return out


def stage_text(sid: str, stage: Stage) -> str:
    return graph_golden_text(f"{sid} {stage.name}", header(GOLDEN_SCENARIOS[sid], stage.name), stage.graphs)


def counts_text(sid: str, run: PipelineRun) -> str:
    rows = [row for s in run.stages for row in s.count_rows()]
    return render_golden(
        f"{sid} collective counts",
        [("header", header_text(header(ALL_SCENARIOS[sid], "all"))), ("collectives", collective_counts_text(rows))],
    )


def golden_path(root: Path, test: str, param_id: str) -> Path:
    return root / GOLDENS_DIR / f"{MODULE}" / f"{test}[{param_id}].txt"


def compare_with_golden(root: Path, test: str, param_id: str, text: str) -> str:
    """"matches", "differs", or "missing" for the golden of ``test[param_id]``."""
    path = golden_path(root, test, param_id)
    if not path.exists():
        return "missing"
    return "matches" if path.read_text(encoding="utf-8") == text else "differs"
