"""The pipeline in PyTorch's structured trace (autoparallel/trace.py), on the MLP (not LLaMA).

What it promises: with a trace handler (what ``TORCH_TRACE=dir`` installs) every stage's graphs,
report and a stage summary are artifacts named so they sort in pipeline order, alternatives
branching off the second compile; a stage that makes no graph (a planner) still shows its report;
the graphs-only stop is no failed compile (no ``dynamo_error``, no ``fail_type``); tlparse's
index lists our stages in order and the second compile as a success; ``TORCH_LOGS=autoparallel``
names our loggers; a payload that fails is logged and named, and the run goes on.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._logging import _internal as torch_logging

from autoparallel import pipeline as P
from autoparallel.compile import SECOND_COMPILE
from autoparallel.parallelize import ParallelPlan
from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES
from autoparallel.trace import (
    ARTIFACT_PREFIX,
    StageTracer,
    artifact_name,
    jsonable,
    structured_trace_listens,
)

pytestmark = pytest.mark.xdist_group("stage-trace")  # one worker builds the traced run

MESH = "dp=2"
ORDER = ["plan", *P.STAGE_NAMES[: P.STAGE_NAMES.index(SECOND_COMPILE) + 1],
         *(f"{n} (alone)" for n in COLLECTIVE_PASS_NAMES), *COLLECTIVE_PASS_NAMES]


@dataclass
class _Solution:
    """Stands for the planner's Solution: anything with ``to_json()``."""

    placements: dict = field(default_factory=lambda: {"up.weight": "S(0)", "down.weight": "S(0)"})

    def to_json(self) -> dict:
        return {"schema": "test-plan", "params": self.placements}


def _plan_stage(state):
    state.plan = ParallelPlan.fsdp("dp")
    return None, _Solution()


def _parse_trace(path: Path) -> list[tuple[dict, str | None]]:
    """(metadata, payload) per record of a TORCH_TRACE file: a glog prefix, a JSON object, then
    the payload's lines, each starting with a tab."""
    out: list[tuple[dict, str | None]] = []
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            meta, payload = out[-1]
            out[-1] = (meta, (payload + "\n" if payload is not None else "") + line[1:])
            continue
        out.append((json.loads(line[line.index("] ") + 2:]), None))
    return out


@pytest.fixture(scope="module")
def traced(mlp, tmp_path_factory):
    """One MLP run (a planner stage first, alternatives on) written to a trace file by the handler
    ``TORCH_TRACE`` uses, with the ``autoparallel`` loggers' records."""
    directory = tmp_path_factory.mktemp("trace")
    handler = torch_logging.LazyTraceHandler(str(directory))
    handler.setFormatter(torch_logging.TorchLogsFormatter(trace=True))
    logs: list[logging.LogRecord] = []
    collect = logging.Handler(logging.INFO)
    collect.emit = logs.append
    ours = logging.getLogger("autoparallel")
    level = ours.level
    make_model, loss = mlp
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    stages = P.insert_stage(P.STAGES, P.Stage("plan", _plan_stage, "choose placements"), before=P.JOINT)
    torch_logging.trace_log.addHandler(handler)
    ours.addHandler(collect)
    ours.setLevel(logging.INFO)
    try:
        run = P.run_pipeline(make_model(), loss, inputs, "auto", MESH, P.PipelineOptions(alternatives=True), stages=stages)
    finally:
        torch_logging.trace_log.removeHandler(handler)
        handler.close()
        ours.removeHandler(collect)
        ours.setLevel(level)
    (path,) = directory.glob("*.log")
    return run, path, logs


def _ours(records) -> list[tuple[str, str | None]]:
    return [(m["artifact"]["name"], p) for m, p in records
            if "artifact" in m and m["artifact"]["name"].startswith(ARTIFACT_PREFIX + "_")]


def test_every_stage_in_the_trace_named_in_pipeline_order(traced):
    run, path, _ = traced
    ours = _ours(_parse_trace(path))
    positions_emitted = [n.split("_")[1] for n, _ in ours]
    assert positions_emitted == sorted(positions_emitted), "artifact names must sort in the order the stages ran"
    summaries = [json.loads(p) for n, p in ours if n.endswith("_stage")]
    assert [s["label"] for s in summaries] == ORDER
    positions = [s["position"] for s in summaries]
    assert positions[:6] == ["00", "01", "02", "03", "04", "05"]
    assert positions[6:9] == ["05a", "05b", "05c"]  # each pass alone, branching off second_compile
    assert positions[9:] == ["06", "07", "08"]
    by_name = dict(ours)
    for s in summaries:
        result = run.alternative(s["stage"]) if s["alternative"] else run.stage(s["stage"])
        assert s["input"] == result.input and s["seconds"] == round(result.seconds, 6)
        graphs = {"graph"} if not isinstance(result.graphs, tuple) else {"forward_graph", "backward_graph"}
        if result.graphs is None:
            graphs = set()
        for what in graphs:
            text = by_name[artifact_name(s["position"], s["label"], what)]
            assert text.startswith("class ") and "torch.ops." in text, (s["label"], what)  # FX's readable code
        assert set(s["nodes"]) == graphs
        assert (artifact_name(s["position"], s["label"], "report") in by_name) == (result.report is not None)


def test_a_stage_without_graphs_shows_its_report(traced):
    _, path, _ = traced
    ours = dict(_ours(_parse_trace(path)))
    assert json.loads(ours["autoparallel_00_plan_report"]) == {
        "schema": "test-plan", "params": {"up.weight": "S(0)", "down.weight": "S(0)"}}
    assert not any(n.startswith("autoparallel_00_plan_") and n.endswith("graph") for n in ours)
    cleanup = json.loads(ours["autoparallel_02_cleanup_report"])  # a pass report: its dataclass fields
    assert set(cleanup) == {"nodes_before", "nodes_after", "removed", "views_to_reshape"}
    assert cleanup["nodes_after"] <= cleanup["nodes_before"]


def test_graphs_only_stop_is_no_failed_compile(traced):
    _, path, _ = traced
    records = _parse_trace(path)
    assert not any(m.get("artifact", {}).get("name") == "dynamo_error" for m, _ in records)
    metrics = [json.loads(p) if p else m["compilation_metrics"] for m, p in records if "compilation_metrics" in m]
    assert metrics, "the second compile's compilation_metrics record is missing"
    assert all(not m.get("fail_type") and not m.get("fail_reason") for m in metrics), metrics


def _tlparse() -> str | None:
    beside = Path(sys.executable).parent / "tlparse"
    return str(beside) if beside.exists() else shutil.which("tlparse")


def test_tlparse_index_lists_the_stages_in_order(traced, tmp_path):
    exe = _tlparse()
    if exe is None:
        pytest.skip("tlparse is not installed (it is in the test extra: pip install -e '.[test]')")
    _, path, _ = traced
    out = tmp_path / "tl"
    done = subprocess.run([exe, str(path), "-o", str(out), "--no-browser", "--overwrite"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    directory = json.loads((out / "compile_directory.json").read_text())
    listed = [a["name"] for a in directory["[-/-]"]["artifacts"] if a["name"].startswith(ARTIFACT_PREFIX + "_")]
    emitted = [n for n, _ in _ours(_parse_trace(path))]
    assert [re.sub(r"_\d+\.(txt|json)$", "", n) for n in listed] == emitted
    stages = [n.removesuffix("_stage") for n in emitted if n.endswith("_stage")]
    assert stages[:2] == ["autoparallel_00_plan", "autoparallel_01_joint"] and len(stages) == len(ORDER)
    index = (out / "index.html").read_text()
    assert re.search(r"class='status-ok'>\[0/0\]", index), "the second compile shows as a success"
    failures = (out / "failures_and_restarts.html").read_text()
    assert "<td>" not in failures, "tlparse lists a failure or restart"


def test_torch_logs_autoparallel_selects_our_loggers(traced, monkeypatch):
    _, _, logs = traced
    assert [r.getMessage().split(":")[0] for r in logs if r.name == "autoparallel.pipeline"] == [f"stage {s}" for s in ORDER]
    # TORCH_LOGS=autoparallel / +autoparallel (parsed on a copy of torch's log registry)
    monkeypatch.setattr(torch_logging, "log_registry", copy.deepcopy(torch_logging.log_registry))
    for setting, level in (("autoparallel", logging.INFO), ("+autoparallel", logging.DEBUG)):
        state = torch_logging._parse_log_settings(setting)
        assert dict(state.get_log_level_pairs())["autoparallel"] == level
    assert all(r.name.startswith("autoparallel.") for r in logs)


def test_positions_letters_and_names():
    tracer = StageTracer()
    results = [SimpleNamespace(alternative=a) for a in (False, False, True, True, False, True)]
    assert [tracer.position(r) for r in results] == ["00", "01", "01a", "01b", "02", "02a"]
    assert artifact_name("04a", "pre_overlap_bucketing (alone)", "forward_graph") == (
        "autoparallel_04a_pre_overlap_bucketing_alone_forward_graph")


def test_a_failing_payload_is_logged_and_named_and_the_run_goes_on(structured_trace, caplog):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))

    def broken(_):
        raise RuntimeError("no val on node addmm")

    result = P.StageResult("cleanup", gm, 0.5, "joint", report=None)
    with caplog.at_level(logging.WARNING, logger="autoparallel.trace"):
        StageTracer(graph_text=broken)(result)
    got = dict(structured_trace.artifacts(ARTIFACT_PREFIX))
    assert got["autoparallel_00_cleanup_graph"] == (
        "(artifact autoparallel_00_cleanup_graph failed: RuntimeError: no val on node addmm)")
    assert json.loads(got["autoparallel_00_cleanup_stage"])["nodes"] == {"graph": len(gm.graph.nodes)}
    assert "autoparallel_00_cleanup_graph failed: RuntimeError: no val on node addmm" in caplog.text


def test_jsonable_reports_of_any_shape():
    g = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    node = next(iter(g.graph.nodes))

    @dataclass
    class Report:
        nodes: list
        removed: Counter
        ratio: float
        seen: set
        _private: object = None

    data = jsonable(Report([node], Counter({"aten.view": 2}), float("inf"), {"b", "a"}, object()))
    assert data == {"nodes": [node.name], "removed": {"aten.view": 2}, "ratio": "inf", "seen": ["a", "b"]}
    assert jsonable({"g": g, "dtype": torch.bfloat16, 3: (1, None)}) == {
        "g": {"graph_nodes": len(g.graph.nodes)}, "dtype": "torch.bfloat16", "3": [1, None]}
    assert jsonable(object).startswith("<class")  # a type is not called for to_json/to_dict
    json.dumps(data)


def test_only_a_lazy_handler_without_a_directory_is_not_a_listener(monkeypatch, tmp_path):
    """PyTorch's lazy handler without a directory writes nothing outside Meta's cluster."""
    trace_log, LazyTraceHandler = torch_logging.trace_log, torch_logging.LazyTraceHandler
    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler(None)])
    assert not structured_trace_listens()
    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler(str(tmp_path))])
    assert structured_trace_listens()
    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler(None), logging.NullHandler()])
    assert structured_trace_listens()
