"""The report page in a real browser (the system's headless Chromium through Playwright): it loads
with no console errors, graph and diff sections expand into their lazy content, and a screenshot
is written. Skips with the reason where Chromium or playwright is missing (``--ap-require-browser``
makes that a failure). Render times are printed (``-s``), never asserted: they are benchmarks.
"""

from __future__ import annotations

import pytest

from verify.commands.html import build_report_page, records_from_pipeline_run
from verify.commands.html.browser import open_page
from verify.commands.html.diff import build_diff_page
from verify.commands.html.page import build_page
from verify.commands.html.synthetic import synthetic_views
from verify.goldens.catalog import GOLDEN_SCENARIOS
from verify.stages.pipeline_run import run_scenario

pytestmark = pytest.mark.browser

PNG = b"\x89PNG\r\n\x1a\n"
# Per collective chart: [stage labels, pairs of them whose drawn boxes intersect] (the browser's own
# layout of the text, rotation included).
LABEL_OVERLAPS = """[...document.querySelectorAll('svg.fig-collective-bytes')].map(svg => {
  const r = [...svg.querySelectorAll('text.stage-label')].map(t => t.getBoundingClientRect());
  let n = 0;
  for (let i = 0; i < r.length; i++) for (let j = i + 1; j < r.length; j++)
    if (r[i].left < r[j].right && r[j].left < r[i].right && r[i].top < r[j].bottom && r[j].top < r[i].bottom) n++;
  return [r.length, n];
})"""


@pytest.mark.xdist_group("tiny-fsdp-dp8")
def test_pipeline_page_loads_cleanly_and_sections_expand(tmp_path, shared_pipeline_runs):
    sc = GOLDEN_SCENARIOS["tiny-fsdp-dp8"]
    records = records_from_pipeline_run(run_scenario(sc), scenario=sc)
    joint = records[0]
    assert joint.name == "joint" and joint.golden is not None
    joint.golden = joint.golden.replace("/mm_0:", "/mm_0 (edited):", 1)  # a golden diff too
    page = tmp_path / "index.html"
    page.write_text(build_report_page(records, title="tiny fsdp", mesh=sc.mesh_spec), encoding="utf-8")
    shot = tmp_path / "page.png"
    check = open_page(page, screenshot=shot, expand=("graph", "diff-prev", "diff-golden", "buckets-table"),
                      element_shots={"svg.fig-overlap": tmp_path / "overlap.png"}, probe=LABEL_OVERLAPS)
    assert check.errors == []
    assert check.probed == [[len(records), 0]], "the collective chart's stage labels overlap"
    joint_lines = len(records[0].graphs.graph.nodes)
    assert check.expanded["graph"] >= joint_lines  # the joint graph's text, one line per node at least
    assert check.expanded["diff-prev"] > 10 and check.expanded["diff-golden"] > 1
    assert check.expanded["buckets-table"] == 0  # not lazy: nothing to fill, but it opens
    for png in (shot, tmp_path / "overlap.png"):
        assert png.read_bytes()[:8] == PNG
    print(f"\ntiny fsdp page ({page.stat().st_size / 2**20:.1f} MiB): rendered in {check.render_ms:.0f} ms; "
          f"screenshot {shot}")


def test_large_page_renders(tmp_path):
    """An 8B-sized page (synthetic views: forward 4107 / backward 8006 nodes, seven stages)."""

    page = tmp_path / "index.html"
    page.write_text(build_page(synthetic_views(), title="synthetic 8B"), encoding="utf-8")
    check = open_page(page, expand=("graph", "diff-prev"))
    assert check.errors == []
    assert check.expanded["graph"] == 4108 and check.expanded["diff-prev"] > 0
    print(f"\nsynthetic 8B page ({page.stat().st_size / 2**20:.1f} MiB): rendered in "
          f"{check.render_ms:.0f} ms (wall {check.wall_ms:.0f} ms)")


def test_golden_diff_page_opens_with_its_diff_drawn(tmp_path):
    """The page a failing golden test writes: its one diff is open and drawn on load."""
    old = "".join(f"n{i}: f32[4] = aten.mm(a, b)\n" for i in range(200))
    new = old.replace("n100: f32[4]", "n100: f32[8]")
    page = tmp_path / "golden-diff.html"
    page.write_text(build_diff_page(old, new, title="golden t.txt"), encoding="utf-8")
    check = open_page(page, probe="[...document.querySelectorAll('table.diff tr')].map(r => r.className)")
    assert check.errors == []
    rows = check.probed
    assert rows.count("r") == 1 and rows.count("fold") == 2  # one changed line, the rest folded
