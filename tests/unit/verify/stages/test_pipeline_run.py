"""verify.stages.pipeline_run: the structured trace of verify's runs carries the goldens' canonical text and
the stats table's data (what ``TORCH_TRACE`` + tlparse show a reviewer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verify.commands.html.views import golden_sections
from verify.goldens import catalog, read_golden
from verify.graphs.canon import canonicalize
from verify.graphs.stats import graph_stats, partition_stats
from verify.stages.pipeline_run import run_scenario, stage_tracer

SID = "tiny-fsdp-dp8"
ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.xdist_group(SID)  # the golden tests' run of this scenario
def test_trace_of_a_run_is_the_goldens_text_and_the_stats(structured_trace, shared_pipeline_runs):
    run = run_scenario(catalog.GOLDEN_SCENARIOS[SID])
    tracer = stage_tracer()
    for result in run.results:  # as the run's own observer saw them
        tracer(result)
    got = dict(structured_trace.artifacts("autoparallel_"))
    joint = run.stage("joint").graphs
    assert got["autoparallel_00_joint_graph"] == canonicalize(joint)
    assert json.loads(got["autoparallel_00_joint_stats"]) == json.loads(json.dumps(graph_stats(joint).to_dict()))
    fw, bw = run.stage("second_compile").graphs
    stats = json.loads(got["autoparallel_04_second_compile_stats"])
    assert stats == json.loads(json.dumps(partition_stats(fw, bw).to_dict())) and stats["static_peak_bytes"] > 0
    _, sections = golden_sections(read_golden(catalog.golden_path(ROOT, catalog.STAGE_TEST, f"{SID}-second_compile")))
    sections = dict(sections)
    assert got["autoparallel_04_second_compile_forward_graph"].rstrip("\n") == sections["forward"].rstrip("\n")
    assert got["autoparallel_04_second_compile_backward_graph"].rstrip("\n") == sections["backward"].rstrip("\n")
    last = len(run.results) - 1
    report = json.loads(got[f"autoparallel_{last:02d}_topo_span_bucketing_report"])
    assert set(report["graphs"]) == {"fw", "bw"}  # the pass's metrics, per graph
