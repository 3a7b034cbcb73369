"""What the page is built from: one ``StageRecord`` per pipeline stage, and adapters that make
them from what the project produces today (``verify.stages.pipeline_run.run_scenario``, the graph
trainer's stages, ``verify.commands.report``'s parity dict).

A record holds graphs and pass metrics as the pipeline left them; ``verify.commands.html.views`` turns it
into plain data and ``verify.commands.html.page`` into HTML. A pipeline driver with a per-stage observer
builds one record per callback and hands the list to ``verify.commands.html.write_report``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from autoparallel import ac
from autoparallel.passes.collective import PipelineMetrics
from autoparallel.trainer import run_traced
from verify.goldens import catalog
from verify.goldens.text import read_golden
from verify.graphs.memory import memory_timeline
from verify.parity.trainer import (
    TRAINER_STAGES,
    intra_op_threads,
    make_batches,
    make_model,
    stage_step,
)
from verify.stages.registry import (
    COLLECTIVE_PASSES_EXECUTOR,
    HTML_PASS,
    HTML_PLANNING,
    html_sections,
)

__all__ = [
    "ALONE",
    "Parity",
    "StageRecord",
    "parity_from_report",
    "records_from_pipeline_run",
    "trainer_records",
]

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]


@dataclass
class Parity:
    """Parity of one stage. ``bitwise``: losses and grads equal to the eager parallel program
    (None: not compared); ``oracle_max_abs_diff``: against single-device eager, with the
    independent oracle's verdict ``oracle_passed`` (each tensor within its own bound: ``verify.parity.compare.oracle_check``)."""

    bitwise: bool | None
    tensors: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0
    where: str = ""  # what ran it: "gloo dp=2", "one process"
    steps: int = 0
    oracle_max_abs_diff: float | None = None
    oracle_passed: bool | None = None

    @property
    def ok(self) -> bool | None:
        if self.bitwise is False or self.oracle_passed is False:
            return False
        return self.bitwise

    def describe(self) -> str:
        parts = []
        if self.bitwise is True:
            parts.append(f"bitwise equal to eager ({self.tensors} tensors, {self.where}, {self.steps} steps)")
        elif self.bitwise is False:
            parts.append(
                f"NOT bitwise: {self.mismatches} of {self.tensors} tensors differ "
                f"(max |diff| {self.max_abs_diff:.2e})"
            )
        if self.oracle_passed is not None:
            verdict = "PASS" if self.oracle_passed else "FAIL"
            parts.append(f"single-device eager (oracle) {verdict}: max |diff| {self.oracle_max_abs_diff:.2e}")
        elif self.oracle_max_abs_diff is not None:
            parts.append(f"single-device eager max |diff| {self.oracle_max_abs_diff:.2e}")
        return "; ".join(parts) or "not compared"


@dataclass
class StageRecord:
    """One stage of a pipeline run, as the page shows it.

    ``graphs``: the stage's graph or (forward, backward) pair; ``metrics``: the collective passes'
    ``PipelineMetrics`` when the stage ran them; ``inputs``: the graphs the stage's pass ran on
    (names bucket members by parameter / gradient); ``golden``: the text of the stage's reviewed
    golden file, None when it has none; ``parity``; ``measured_memory``: a
    ``verify.graphs.memory.MemoryTimeline`` of running the stage for real (graph trainer);
    ``refresh_vals``: re-propagate fake values before the static liveness walk (graphs whose
    passes copied a value onto duplicated nodes, see ``verify.graphs.memory.static_peak``);
    ``previous``: the record whose graphs this one's "against the previous stage" diff compares
    with (default: the record before it; an alternative compares with the graphs it ran on).
    """

    name: str
    graphs: Graphs
    metrics: Any = None
    inputs: Graphs | None = None
    golden: str | None = None
    parity: Parity | None = None
    measured_memory: Any = None
    refresh_vals: bool = False
    previous: str | None = None

    @property
    def graph_list(self) -> list[tuple[str, fx.GraphModule]]:
        if isinstance(self.graphs, tuple):
            fw, bw = self.graphs
            return [("forward", fw), ("backward", bw)]
        return [("graph", self.graphs)]


# parity of the collective passes composed (one executor), shown on the last one
COMPOSED_PASSES = COLLECTIVE_PASSES_EXECUTOR


def parity_from_report(parity: Mapping[str, Any] | None) -> dict[str, Parity]:
    """Per stage, from ``verify.commands.report.run_parity``'s dict (the joint stage also gets the
    single-device comparison, which is made against it). ``"where"`` says what ran the
    comparison (default: gloo on ``"mesh"``)."""
    if not parity:
        return {}
    out = {}
    for stage, r in parity["vs_eager"].items():
        out[stage] = Parity(
            bitwise=bool(r["bitwise"]),
            tensors=int(r["tensors"]),
            mismatches=int(r["mismatches"]),
            max_abs_diff=float(r["max_abs_diff"]),
            where=str(parity.get("where") or f"gloo {parity.get('mesh', '')}"),
            steps=int(parity.get("steps", 0)),
        )
    single = parity.get("single_device_max_abs_diff")
    if single is not None and "joint" in out:
        out["joint"].oracle_max_abs_diff = float(single)
        if "oracle" in parity:
            out["joint"].oracle_passed = bool(parity["oracle"]["passed"])
    return out


def _golden_text(scenario, stage_name: str) -> str | None:
    """The text of ``scenario``'s graph golden of stage ``stage_name`` (None: it has none)."""

    sid = catalog.scenario_id(scenario) if scenario is not None else None
    if sid is None or sid not in catalog.GOLDEN_SCENARIOS:
        return None
    root = Path(__file__).resolve().parents[3]
    path = catalog.golden_path(root, catalog.STAGE_TEST, f"{sid}-{stage_name}")
    return read_golden(path) if path.exists() else None


ALONE = " (alone)"  # the label of a collective pass run alone on the second compile's graphs


def records_from_pipeline_run(
    run, *, scenario=None, parity: Mapping[str, Any] | None = None, goldens: bool = True, alternatives: bool = True
) -> list[StageRecord]:
    """One record per stage of an ``autoparallel.pipeline.PipelineRun``, in order, then (with
    ``alternatives``) one per collective pass run alone, labelled ``<pass> (alone)``.

    A collective pass's record carries its ``PipelineMetrics`` and the graphs it ran on (bucket
    members are named by parameter / gradient from them). ``scenario`` (a ``verify.stages.scenario``
    value) finds the stage goldens when ``goldens``: a collective pass's graph golden is the pass
    alone (``verify.goldens.catalog``), so it goes with the alternative's record, and a composed
    pass's record has none. ``parity``: ``verify.commands.report.run_parity``'s dict."""

    verdicts = parity_from_report(parity)
    sections = html_sections()
    unknown = [name for name in run.names if name not in sections]
    if unknown:
        raise ValueError(f"stage(s) {unknown} have no entry in verify.stages.registry.REGISTRY: "
                         "how the page shows them (html) is not known")
    passes = {name for name, section in sections.items() if section == HTML_PASS}
    composed = [r.name for r in run.results if r.name in passes]
    if COMPOSED_PASSES in verdicts and composed:  # every pass in sequence: the last one's output
        verdicts[composed[-1]] = verdicts.pop(COMPOSED_PASSES)
    unknown = sorted(set(verdicts) - set(run.names))
    if unknown:
        raise ValueError(
            f"parity names stage(s) {unknown} that the run does not have "
            f"(stages: {run.names}); run the pipeline with those stages"
        )

    def record(result, name: str, golden_stage: str | None) -> StageRecord:
        metrics = result.report if isinstance(result.report, PipelineMetrics) else None
        inputs = None
        if metrics is not None and result.input is not None:
            inputs = run.stage(result.input).graphs
        return StageRecord(
            name=name,
            graphs=result.graphs,
            metrics=metrics,
            inputs=inputs,
            golden=_golden_text(scenario, golden_stage) if goldens and golden_stage else None,
            parity=verdicts.get(name),
            previous=result.input if result.alternative else None,
        )

    out = [
        record(r, r.name, None if r.name in passes else r.name)
        for r in run.results
        if sections.get(r.name) != HTML_PLANNING and r.graphs is not None
    ]
    if alternatives:
        out += [record(r, r.name + ALONE, r.name) for r in run.alternatives]
    return out


# The graph trainer's goldens (tests/golden/test_trainer_goldens.py): debug preset, op SAC,
# sac_graphs' batch of 4, one file per stage.
_TRAINER_GOLDEN = ("debug", ac.OP, 4)
_TRAINER_GOLDEN_FILE = "goldens/golden/test_trainer_goldens/test_op_sac_traced_step[{stage}].txt"


def _trainer_golden(stage: str, key: tuple) -> str | None:
    if key != _TRAINER_GOLDEN or stage == "traced_step":
        return None
    path = Path(__file__).resolve().parents[3] / _TRAINER_GOLDEN_FILE.format(stage=stage)
    return read_golden(path) if path.exists() else None


def trainer_records(
    preset: str = "debug", *, policy: str = ac.OP, batch: int = 4, measure: bool = True,
    parity: Mapping[str, Any] | None = None,
) -> list[StageRecord]:
    """The graph trainer's stages of ``preset`` (``traced_step``; ``before_remat``: graph SAC
    tags; ``after_remat``), each with its measured CPU memory timeline (one step run for real)
    when ``measure``, its golden where one exists (debug, op SAC, batch 4), and its parity
    verdict from ``parity`` (``{"vs_eager": {stage: ParityReport.to_dict()}, ...}``)."""

    steps = {name: stage_step(name, preset, policy=policy, batch=batch) for name in TRAINER_STAGES}
    verdicts = parity_from_report(parity)
    out = []
    inputs = make_batches(preset, steps=1, batch=batch)[0]
    for name, step in steps.items():
        measured = None
        if measure:
            model = make_model(preset)

            def one_step(step=step, model=model):
                model.zero_grad(set_to_none=True)  # the measured step allocates its gradients
                run_traced(step, model, inputs)

            with intra_op_threads(1):
                measured = memory_timeline(one_step)
        golden = _trainer_golden(name, (preset, policy, batch))
        out.append(StageRecord(name, step.gm, golden=golden, parity=verdicts.get(name), measured_memory=measured,
                               refresh_vals=True))
    return out
