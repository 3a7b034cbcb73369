"""verify.stages.pipeline_run: the structured trace of verify's runs carries the goldens' canonical text and
the stats table's data (what ``TORCH_TRACE`` + tlparse show a reviewer)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import verify.stages.pipeline_run as pr
from verify.check import check_model
from verify.commands.html.views import golden_sections
from verify.goldens import catalog, read_golden
from verify.graphs.canon import canonicalize
from verify.graphs.stats import graph_stats, partition_stats
from verify.stages.pipeline_run import reuse_pipeline_runs, run_scenario, stage_tracer
from verify.zoo import ln_mlp

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


def _counting_runs(monkeypatch) -> list:
    """``run_pipeline`` replaced by a recorder: each call appends its options and returns a stub
    run (with a compiled module when it kept one)."""
    calls = []

    def fake(*_args, until=None, trace=None):
        options = _args[-1]
        calls.append(options)
        return types.SimpleNamespace(compiled=object() if options.keep_compiled else None,
                                     alternatives=["alone"] if options.alternatives else [])

    monkeypatch.setattr(pr.P, "run_pipeline", fake)
    monkeypatch.setattr(pr, "_shared_runs", None)  # not the session's shared runs
    return calls


def test_a_run_without_alternatives_serves_only_requests_that_do_not_want_them(monkeypatch):
    calls = _counting_runs(monkeypatch)
    sc = catalog.GOLDEN_SCENARIOS[SID]
    with reuse_pipeline_runs():
        lean = run_scenario(sc, alternatives=False)
        assert [o.alternatives for o in calls] == [False]
        assert run_scenario(sc, alternatives=False) is lean and run_scenario(sc, until="joint") is lean
        whole = run_scenario(sc)  # the goldens want the alternatives: a second run
        assert whole is not lean and [o.alternatives for o in calls] == [False, True]
        assert run_scenario(sc, alternatives=False) is lean and run_scenario(sc) is whole
    assert len(calls) == 2


def test_a_shared_run_answers_only_requests_for_its_lowering(monkeypatch):
    """The lowering is part of a shared run's key (issue 44: a DTensor run served to a replay
    request reported replayed=0 in CI, where the session fixture shares runs)."""
    calls = _counting_runs(monkeypatch)
    sc = catalog.GOLDEN_SCENARIOS[SID]
    with reuse_pipeline_runs():
        dtensor = run_scenario(sc, until="joint", lowering="dtensor")
        replay = run_scenario(sc, until="joint", lowering="replay")
        assert replay is not dtensor and [o.lowering for o in calls] == ["dtensor", "replay"]
        assert run_scenario(sc, until="joint", lowering="replay") is replay and run_scenario(sc, until="joint", lowering="dtensor") is dtensor
        assert run_scenario(sc, until="joint") is replay  # the default lowering (autoparallel.defaults.DEFAULT_LOWERING)
    assert len(calls) == 2


def test_check_model_runs_no_alternatives(monkeypatch):
    """check_model runs the alternatives (each collective pass alone: about a fifth of a small
    model's pipeline run) only for the goldens that show them."""
    calls = _counting_runs(monkeypatch)
    result = check_model(ln_mlp, plan="fsdp", mesh="dp=2", parity=False)
    assert [o.alternatives for o in calls] == [False]
    with pytest.raises(ValueError, match=r"check_model\(\.\.\., goldens=True\)"):
        result.golden_texts()
    check_model(ln_mlp, plan="fsdp", mesh="dp=2", parity=False, goldens=True)
    assert [o.alternatives for o in calls] == [False, True]
