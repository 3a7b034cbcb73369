"""The HTML report page on the tiny fsdp and fsdp_tp pipelines: a section per stage with its
stats table, graphs and pictures (each well-formed SVG), diffs exactly where something differs,
parity and golden verdicts, and an embedded payload nothing in a graph can break out of."""

from __future__ import annotations

import functools
import json
import re
import xml.etree.ElementTree as ET

import pytest

from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES, PipelineMetrics
from autoparallel.pipeline import STAGE_NAMES
from verify.commands.html import (
    ALONE,
    build_report_page,
    records_from_pipeline_run,
    write_report,
)
from verify.commands.html.page import build_page
from verify.commands.html.page import page_sections as sections
from verify.commands.html.synthetic import synthetic_views
from verify.commands.html.views import golden_sections, golden_with_current
from verify.goldens.catalog import GOLDEN_SCENARIOS
from verify.goldens.text import render_golden
from verify.graphs.canon import canonicalize
from verify.stages.pipeline_run import run_scenario

SIDS = ["tiny-fsdp-dp8", "tiny-fsdp_tp-dp4tp2"]  # the issue asks for page structure on these two
BUCKETING_PASSES = {"pre_overlap_bucketing", "topo_span_bucketing"}
# The page: every stage in order, then each collective pass alone on the second compile's graphs.
SECTIONS = [*STAGE_NAMES, *(p + ALONE for p in COLLECTIVE_PASS_NAMES)]


def _grouped(sids):
    # the golden tests' xdist group: the pipeline run is built once per worker
    return [pytest.param(sid, marks=pytest.mark.xdist_group(sid)) for sid in sids]


def _run(sid):
    return run_scenario(GOLDEN_SCENARIOS[sid])


def _records(sid, **kw):
    return records_from_pipeline_run(_run(sid), scenario=GOLDEN_SCENARIOS[sid], **kw)


def _result(run, section: str):
    """The pipeline result a page section shows."""
    return run.alternative(section.removesuffix(ALONE)) if section.endswith(ALONE) else run.stage(section)


def _bucketed(result) -> bool:
    """Whether the stage merged any bucket (composed after pre-overlap bucketing, topo-span
    bucketing may find nothing left to merge at the default cap)."""
    m = result.report
    if not isinstance(m, PipelineMetrics):
        return False
    return any(
        any(b.buckets for b in g.overlap_bucketing)
        or (g.pre_overlap is not None and any(b.buckets for b in g.pre_overlap.metrics.values()))
        for g in m.graphs.values()
    )


def _graph_list(result) -> list:
    return list(result.graphs) if isinstance(result.graphs, tuple) else [result.graphs]


def _page(sid, records=None) -> str:
    if records is None:
        return _default_page(sid)
    return build_report_page(records, title=f"report {sid}", mesh=GOLDEN_SCENARIOS[sid].mesh_spec)


@functools.cache
def _default_page(sid) -> str:  # built once per worker: the tests only read it
    return _page(sid, _records(sid))


def figures(chunk: str) -> list[ET.Element]:
    """Every <svg> in ``chunk``, parsed (a malformed one fails here)."""
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", chunk, re.S)]


def payload(html: str) -> dict:
    text = re.search(r"<script type='application/json' id=ap-data>(.*?)</script>", html, re.S).group(1)
    return json.loads(text)


def stage_texts(result) -> str:
    if isinstance(result.graphs, tuple):
        return "".join(f"== {k} ==\n{canonicalize(g)}" for k, g in zip(("forward", "backward"), result.graphs, strict=True))
    return canonicalize(result.graphs)


@pytest.mark.parametrize("sid", _grouped(SIDS))
def test_every_stage_has_its_table_graphs_and_pictures(sid, shared_pipeline_runs):
    html = _page(sid)
    assert html.startswith("<!DOCTYPE html>") and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    secs = sections(html)
    assert list(secs) == SECTIONS
    run = _run(sid)
    for name, chunk in secs.items():
        n_graphs = len(_graph_list(_result(run, name)))
        kinds = [f.get("data-figure") for f in figures(chunk)]
        assert "<table class=stats>" in chunk, name
        assert kinds.count("memory") == 1, (name, kinds)
        assert kinds.count("overlap") == n_graphs, (name, kinds)  # every graph has collectives
        result = _result(run, name)
        assert kinds.count("buckets") == (1 if _bucketed(result) else 0), (name, kinds)
        if name.endswith(ALONE) and name.removesuffix(ALONE) in BUCKETING_PASSES:
            assert _bucketed(result), name  # alone on the second compile's graphs, each pass buckets
        assert kinds.count("measured-memory") == 0
        assert chunk.count("<details class='graph'") == n_graphs
        # a collective pass's graph golden is the pass alone; the composed pass has none
        golden = "none" if name in COLLECTIVE_PASS_NAMES else "matches"
        assert f"data-golden='{golden}'" in chunk and "diff-golden" not in chunk, name
    chart = figures(html.split("<section class=stage", 1)[0])
    assert [f.get("data-figure") for f in chart] == ["collective-bytes"]


@pytest.mark.parametrize("sid", _grouped(SIDS))
def test_diffs_against_the_previous_stage_exactly_where_graphs_differ(sid, shared_pipeline_runs):
    html = _page(sid)
    secs = sections(html)
    data = payload(html)
    run = _run(sid)
    assert "diff-prev" not in secs[SECTIONS[0]]
    for i, name in enumerate(SECTIONS[1:], start=1):
        # an alternative is compared with the graphs it ran on, a stage with the one before it
        prev = "second_compile" if name.endswith(ALONE) else SECTIONS[i - 1]
        before, now = stage_texts(_result(run, prev)), stage_texts(_result(run, name))
        m = re.search(r"<details class='diff diff-prev' data-diff='(\d+)'>", secs[name])
        assert (m is not None) == (before != now), name
        if m is None:
            assert "data-same-as-previous" in secs[name]
            continue
        d = data["diffs"][int(m.group(1))]
        assert (d["a_name"], d["b_name"]) == (prev, name)
        assert data["texts"][d["a"]] == before and data["texts"][d["b"]] == now
        assert any(op[0] != "e" for op in d["ops"])
    # every text a graph <details> points at is that graph's canonical text
    for name, chunk in secs.items():
        idx = [int(i) for i in re.findall(r"data-text='(\d+)'", chunk)]
        assert [data["texts"][i] for i in idx] == [canonicalize(g) for g in _graph_list(_result(run, name))]


@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_a_changed_golden_gets_a_side_by_side_diff(shared_pipeline_runs):
    sid = "tiny-fsdp-dp8"
    records = _records(sid)
    target = next(r for r in records if r.name == "second_compile")
    assert target.golden is not None
    lines = target.golden.split("\n")
    k = next(i for i, ln in enumerate(lines) if ln.split(":", 1)[0].endswith("/mm_0"))
    lines[k] = lines[k] + "  {edited}"
    target.golden = "\n".join(lines)
    html = _page(sid, records)
    secs = sections(html)
    assert [n for n, c in secs.items() if "diff-golden" in c] == [target.name]
    assert "data-golden='differs'" in secs[target.name]
    m = re.search(r"<details class='diff diff-golden' data-diff='(\d+)'>", secs[target.name])
    d = payload(html)["diffs"][int(m.group(1))]
    changed = [op for op in d["ops"] if op[0] != "e"]
    assert changed == [["r", k, k + 1, k, k + 1]]


@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_parity_verdicts_and_bucket_members(shared_pipeline_runs):
    sid = "tiny-fsdp-dp8"
    parity = {
        "mesh": "dp=2", "steps": 2, "single_device_max_abs_diff": 3e-7,
        "vs_eager": {
            "joint": {"bitwise": True, "tensors": 44, "mismatches": 0, "max_abs_diff": 0.0},
            "first_partition": {"bitwise": False, "tensors": 44, "mismatches": 3, "max_abs_diff": 1e-3},
            "second_compile": {"bitwise": True, "tensors": 44, "mismatches": 0, "max_abs_diff": 0.0},
        },
    }
    secs = sections(_page(sid, _records(sid, parity=parity)))
    assert "data-parity='ok'" in secs["joint"] and "single-device eager max |diff| 3.00e-07" in secs["joint"]
    assert "data-parity='bad'" in secs["first_partition"] and "3 of 44 tensors differ" in secs["first_partition"]
    assert "parity: not run for this stage" in secs["pre_overlap_bucketing"]
    table = secs["pre_overlap_bucketing" + ALONE].split("<table class=buckets>", 1)[1]
    assert "param:layers.0.attention.wq.weight (layers.0.attention.wq.weight/all_gather_into_tensor_0)" in table
    assert "grad:layers.0.attention.wq.weight" in table  # reduce-scatter members name their gradient


def test_payload_cannot_close_the_script_element():
    (view,) = synthetic_views(stages=1, fw_nodes=20, bw_nodes=20, collectives=3, buckets=2)
    evil = "x: f32[] = aten.mm.default('</script><script>alert(1)</script>')\n"
    view.texts = {"forward": evil, "backward": "<!-- & -->\n"}
    html = build_page([view], title="t")
    assert html.count("</script>") == 2  # the payload's and the code's own closing tags
    assert payload(html)["texts"][:2] == [evil, "<!-- & -->\n"]


def test_golden_sections_round_trip_and_replace_only_what_changed():
    text = render_golden("t", [("header", "preset: tiny"), ("stats", "a  1\n"), ("forward", "x: f32[2]\n"),
                               ("backward", "y: f32[2]\n")])
    head, secs = golden_sections(text)
    assert head == ["# autoparallel golden v1", "# t"]
    assert [n for n, _ in secs] == ["header", "stats", "forward", "backward"]
    assert golden_with_current(text, {"stats": "a  1\n", "forward": "x: f32[2]\n"}) == text
    changed = golden_with_current(text, {"forward": "x: f32[3]\n"})
    assert changed == text.replace("x: f32[2]", "x: f32[3]")
    assert golden_with_current(text, {"graph": "z\n"}).endswith("\n== graph ==\nz\n")


def test_bad_input_is_named():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="no stage records"):
        write_report([], "unused", title="t")
    run = SimpleNamespace(names=["joint"], results=[], alternatives=[])
    parity = {"vs_eager": {"second_compile": {"bitwise": True, "tensors": 1, "mismatches": 0, "max_abs_diff": 0.0}}}
    with pytest.raises(ValueError, match=r"parity names stage\(s\) \['second_compile'\]"):
        records_from_pipeline_run(run, parity=parity, goldens=False)


def test_the_golden_diff_page_needs_no_torch():
    """A failing golden test writes its HTML diff through verify.commands.html.diff: cheap to import."""
    import subprocess
    import sys

    code = ("import sys; from verify.commands.html.diff import build_diff_page; build_diff_page('a\\n', 'b\\n', title='t'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'autoparallel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
