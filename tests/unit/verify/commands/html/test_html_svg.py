"""verify.commands.html.svg: each renderer gives well-formed SVG with the elements it promises, names
what it draws in tooltips (escaped), and stays small on 8B-sized series."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from verify.commands.html import svg
from verify.commands.html.svg import BucketPanel, BucketView
from verify.commands.html.timeline import CollectiveSpan, ComputeSpan, OverlapTimeline

NS = "{http://www.w3.org/2000/svg}"


def parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{NS}svg"
    return root


def titles(root: ET.Element, cls: str) -> list[str]:
    return [e.find(f"{NS}title").text for e in root.iter() if cls in (e.get("class") or "").split()]


def count(root: ET.Element, cls: str) -> int:
    return sum(1 for e in root.iter() if cls in (e.get("class") or "").split())


def _memory(n: int, peak_at: int):
    live = [100 + (i % 7) for i in range(n)]
    live[peak_at] = 10_000
    phases = ["forward"] * (n // 2) + ["backward"] * (n - n // 2)
    names = [f"op_{i}" for i in range(n)]
    at_peak = [("mm<&>_3", "backward", 6000), ("param:w", "forward", 3000), ("x", "forward", 1000)]
    return names, phases, live, peak_at, at_peak


def test_memory_marks_the_peak_and_names_its_contributors():
    root = parse(svg.memory_svg(*_memory(40, 25), title="t <1>", top=2))
    assert root.get("data-figure") == "memory"
    assert titles(root, "peak") == ["peak 9.8 KiB at op_25 (backward)"]
    contributors = [e.text for e in root.iter(f"{NS}text") if e.get("class") == "contributor"]
    assert len(contributors) == 2 and "mm<&>_3 (backward)" in contributors[0] and "60.0%" in contributors[0]
    assert count(root, "phase-forward") == 1 and count(root, "phase-backward") == 1


def test_memory_of_a_long_series_keeps_the_peak_in_one_point_per_pixel():
    n = 16_000
    root = parse(svg.memory_svg(*_memory(n, 12_345), title="big"))
    poly = next(e for e in root.iter(f"{NS}polygon") if e.get("class") == "live")
    ys = [float(p.split(",")[1]) for p in poly.get("points").split()]
    assert len(ys) <= svg.PLOT_W + 2
    peak_y = float(next(e for e in root.iter(f"{NS}circle")).get("cy"))
    assert min(ys) == pytest.approx(peak_y, abs=0.1)  # the column maximum keeps the peak


def test_column_max_keeps_every_maximum():
    values = list(range(100)) + [5] * 900
    cols = svg.column_max(values, 10)
    assert len(cols) == 10 and cols[0] == (0, 99, 99.0)
    assert svg.column_max([3, 1], 10) == [(0, 0, 3.0), (1, 1, 1.0)]


def test_measured_memory_marks_the_measured_peak():
    root = parse(svg.measured_memory_svg([0.0, 1.0, 2.0, 3.0], [0, 4096, 1024, 0], title="m"))
    assert root.get("data-figure") == "measured-memory"
    assert titles(root, "peak") == ["measured peak 4.0 KiB at 1.00 ms"]


def _bucket_panels(bound):
    b0 = BucketView(("param:a", "param:b"), (10, 20), 40, 7, "bytes")
    b1 = BucketView(("param:c", "param:d", "param:e"), (5, 5, 5), 40, 3, "end")
    return [BucketPanel("forward", "all_gather", "dp", (b0, b1), bound)]


def test_buckets_draw_members_against_the_cap_and_span_against_the_bound():
    root = parse(svg.buckets_svg(_bucket_panels(5), title="b"))
    members = titles(root, "member")
    assert len(members) == 5
    assert members[0] == "bucket 0 (bytes): param:a, 10 B; bucket 30 B of cap 40 B (2 members)"
    assert count(root, "cap") == 1 and count(root, "span") == 2
    assert titles(root, "span-bound") == ["max_topo_span = 5"]
    spans = [e for e in root.iter(f"{NS}rect") if e.get("class") == "span"]
    assert float(spans[0].get("height")) > float(spans[1].get("height"))  # 7 vs 3
    unbounded = parse(svg.buckets_svg(_bucket_panels(None), title="b"))
    assert count(unbounded, "span-bound") == 0
    assert any("; no topo span bound" in (e.text or "") for e in unbounded.iter(f"{NS}text"))
    assert any("; max_topo_span 5" in (e.text or "") for e in root.iter(f"{NS}text"))
    empty = parse(svg.buckets_svg([], title="none"))
    assert any(e.text == "no merged buckets" for e in empty.iter(f"{NS}text"))


def test_merge_runs_bounds_the_rectangles():
    spans = [(i * 0.001, i * 0.001 + 0.001, f"n{i}") for i in range(10_000)]
    merged = svg.merge_runs(spans, scale=svg.PLOT_W / 10.0)
    assert len(merged) <= svg.PLOT_W
    assert sum(c for _, _, c, _ in merged) == 10_000
    wide = svg.merge_runs([(0.0, 1.0, "a"), (1.0, 2.0, "b")], scale=100.0)
    assert [r[3] for r in wide] == ["a", "b"]  # visible spans stay apart


def _timeline():
    compute = [ComputeSpan("mm_0", 0.0, 1.0), ComputeSpan("mm_1", 1.0, 2.0)]
    ag = CollectiveSpan("all_gather_0", "all_gather", "dp", 2048, 0.0, 0.0, 2.5, waited_at=2.0,
                        exposed=0.5, hidden=[("mm_0", 1.0), ("mm_1", 1.0)], hidden_count=2)
    ar = CollectiveSpan("all_reduce_0", "all_reduce", "tp", 64, 2.5, 2.5, 2.6)
    return OverlapTimeline(compute, [ag, ar], 2.6, 2.0)


def test_overlap_lanes_say_what_each_collective_hides_behind():
    root = parse(svg.overlap_svg(_timeline(), title="o"))
    assert root.get("data-figure") == "overlap"
    colls = titles(root, "collective")
    assert colls[0] == ("all_gather_0 (all_gather, 2.0 KiB): 2.500 ms; hides behind mm_0 1.000 ms, "
                        "mm_1 1.000 ms; exposed 0.500 ms")
    assert "hides behind nothing" in colls[1]
    assert titles(root, "stall") == ["blocked 0.500 ms waiting on all_gather_0"]
    lanes = [e.text for e in root.iter(f"{NS}text") if (e.text or "").startswith("comm [")]
    assert lanes == ["comm [dp]", "comm [tp]"]


def test_overlap_of_thousands_of_nodes_stays_small():
    compute = [ComputeSpan(f"op_{i}", i * 0.01, i * 0.01 + 0.01) for i in range(8000)]
    tl = OverlapTimeline(compute, [], 80.0, 80.0)
    root = parse(svg.overlap_svg(tl, title="big"))
    assert count(root, "compute") <= svg.PLOT_W


def test_collective_bytes_chart_has_a_bar_per_stage_and_series():
    rows = [("joint", {("all_gather", "dp"): (21, 4096), ("all_reduce", "tp"): (4, 512)}),
            ("bucketed", {("all_gather", "dp"): (2, 4096)})]
    root = parse(svg.collective_bytes_svg(rows, title="c"))
    bars = titles(root, "bar")
    assert len(bars) == 4
    assert "joint: all_gather [dp] 21 collectives, 4.0 KiB" in bars
    assert "bucketed: all_reduce [tp] 0 collectives, 0 B" in bars
    labels = [e.text for e in root.iter(f"{NS}text") if e.get("class") == "stage-label"]
    assert labels == ["joint", "bucketed"]


def label_boxes(root: ET.Element) -> list[tuple[float, float, float, float]]:
    """Each stage label's box (left, top, right, bottom) from its attributes, its width by
    ``svg.CHAR_W`` per character and the 11 px font's height; a rotated label turned upright."""
    out = []
    for e in root.iter(f"{NS}text"):
        if e.get("class") != "stage-label":
            continue
        x, y, w = float(e.get("x")), float(e.get("y")), len(e.text) * svg.CHAR_W
        if e.get("transform"):  # rotate(-90 x y), anchored at its end: hangs down from y, glyphs left of x
            assert e.get("transform") == f"rotate(-90 {e.get('x')} {e.get('y')})" and e.get("text-anchor") == "end"
            out.append((x - 11, y, x, y + w))
        else:
            out.append((x - w / 2, y - 11, x + w / 2, y))
    return out


def overlapping(boxes) -> list[tuple[int, int]]:
    return [(i, j) for i, a in enumerate(boxes) for j, b in enumerate(boxes[i + 1:], i + 1)
            if a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]]


PIPELINE_ROWS = [(f"{s} {half}", {("all_gather", "dp"): (21, 4096)}) for s in (
    "first_partition", "second_compile", "fuse_chained_allgathers", "pre_overlap_bucketing", "topo_span_bucketing")
    for half in ("fwd", "bwd")]


def test_stage_labels_never_overlap_and_fit_in_the_chart():
    """The report's stage names in groups too narrow for them are written upright; short names
    in wide groups stay across. Either way no two label boxes intersect and all fit the figure."""
    for rows, upright in ((PIPELINE_ROWS * 3, True), (PIPELINE_ROWS[:2], False)):
        root = parse(svg.collective_bytes_svg(rows, title="c"))
        boxes = label_boxes(root)
        assert len(boxes) == len(rows) and overlapping(boxes) == []
        assert all(bool(e.get("transform")) == upright for e in root.iter(f"{NS}text") if e.get("class") == "stage-label")
        assert max(b[3] for b in boxes) < float(root.get("height")) - 14  # the caption below them included
    crowded = [(x - 40, 0, x + 40, 11) for x in (0, 60)]  # the old layout: centred across, 60 px apart
    assert overlapping(crowded) == [(0, 1)]
