"""verify.goldens.text on bad files and changed goldens: what a reviewer is told."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autoparallel import meta as M
from verify.goldens import (
    FORMAT_LINE,
    UPDATE_COMMAND,
    CorruptGoldenError,
    collective_counts_text,
    golden_diff,
    golden_sections,
    read_golden,
    render_golden,
)
from verify.goldens.catalog import compare_with_golden, golden_path
from verify.goldens.syrupy_ext import GoldenTextExtension

GOOD = render_golden("t", [("header", "stage: joint"), ("stats", "nodes 3"), ("graph", "a\nb\nc")])


def test_render_format():
    assert GOOD == f"{FORMAT_LINE}\n# t\n\n== header ==\nstage: joint\n\n== stats ==\nnodes 3\n\n== graph ==\na\nb\nc\n"


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\xff\xfe" + GOOD.encode(), "not UTF-8 text (invalid start byte at byte 0)"),
        (b"", "first line is '', expected"),
        (GOOD.replace("v1", "v2").encode(), "first line is '# autoparallel golden v2'"),
        (FORMAT_LINE.encode(), "first line is '# autoparallel golden v1', expected"),  # truncated: no newline
        ("\ufeff".encode() + GOOD.encode(), "first line is '\\ufeff# autoparallel golden v1'"),  # a BOM
        (GOOD.replace("\n", "\r\n").encode(), "first line is '# autoparallel golden v1\\r'"),  # CRLF checkout
        (GOOD.split("\n", 1)[1].encode(), "first line is '# t'"),  # format line lost
        (b"y" * 80 + b"\n" + GOOD.encode(), f"first line is '{'y' * 60}', expected"),  # cut at 60 characters
    ],
)
def test_corrupt_golden_names_the_file_why_and_what_to_do(tmp_path, raw, why):
    path = tmp_path / "g.txt"
    path.write_bytes(raw)
    with pytest.raises(CorruptGoldenError) as e:
        read_golden(path)
    msg = str(e.value)
    assert f"golden file {path} is corrupt: " in msg and why in msg
    assert f"git checkout -- {path}" in msg and UPDATE_COMMAND in msg


def test_missing_golden_is_file_not_found_and_syrupy_sees_none(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_golden(tmp_path / "nope.txt")
    ext = GoldenTextExtension()
    assert ext.read_snapshot_data_from_location(snapshot_location=str(tmp_path / "nope.txt"), snapshot_name="x", session_id="s") is None
    (tmp_path / "bad.txt").write_text("not a golden\n")
    with pytest.raises(CorruptGoldenError):  # corrupt is never mistaken for missing
        ext.read_snapshot_data_from_location(snapshot_location=str(tmp_path / "bad.txt"), snapshot_name="x", session_id="s")


def test_catalog_compare_with_golden(tmp_path):
    path = golden_path(tmp_path, "test_x", "sid")
    assert compare_with_golden(tmp_path, "test_x", "sid", GOOD) == "missing"
    path.parent.mkdir(parents=True)
    path.write_text(GOOD)
    assert compare_with_golden(tmp_path, "test_x", "sid", GOOD) == "matches"
    assert compare_with_golden(tmp_path, "test_x", "sid", GOOD + "x\n") == "differs"
    path.write_bytes(GOOD.replace("\n", "\r\n").encode())  # a CRLF checkout: its golden test fails (corrupt)
    assert compare_with_golden(tmp_path, "test_x", "sid", GOOD) == "differs"
    path.write_bytes(GOOD.replace("graph", "graph \u2192 \u00e9").encode())  # UTF-8, whatever the locale
    assert compare_with_golden(tmp_path, "test_x", "sid", GOOD.replace("graph", "graph \u2192 \u00e9")) == "matches"


@pytest.mark.parametrize("body", ["  x = 1  \n\n", "\nafter a blank line", "ends in X\n", "tab\t"])
def test_render_keeps_a_section_body_as_given_less_its_trailing_newlines(body):
    assert render_golden("t", [("s", body)]) == f"{FORMAT_LINE}\n# t\n\n== s ==\n{body.rstrip(chr(10))}\n"


def test_sections():
    names = [(n, at) for n, at, _ in golden_sections(GOOD)]
    assert names == [("", 0), ("header", 2), ("stats", 5), ("graph", 8)]  # from the blank line before
    assert golden_sections(GOOD)[1][2] == ["", "== header ==", "stage: joint"]


def test_sections_only_at_whole_header_lines():
    text = "# t\n== x ==\n== not a header\nnot one either ==\n==  ==\n== ==\nbody\n\n== y ==\nlast"
    assert golden_sections(text) == [
        ("", 0, ["# t"]),
        # no blank line before it: nothing of the title is taken into the section
        ("x", 1, ["== x ==", "== not a header", "not one either ==", "==  ==", "== ==", "body"]),
        ("y", 7, ["", "== y ==", "last"]),
    ]


def _golden(stats: str, graph: list[str]) -> str:
    return render_golden("t", [("header", "stage: joint"), ("stats", stats), ("graph", "\n".join(graph))])


def test_diff_puts_a_summary_first_then_stats_then_graph_hunks_uncut():
    graph = [f"n{i}: f32[2] = aten.relu.default(n{i - 1})" for i in range(600)]
    changed = list(graph)
    for i in (5, 300, 590):  # three separate hunks, the first near the top
        changed[i] = changed[i].replace("relu", "gelu")
    old, new = _golden("nodes 600", graph), _golden("nodes 601", changed + ["extra"])
    diff = golden_diff(old, new, name="g.txt").splitlines()
    assert diff[0] == "g.txt: changed sections: stats: 1 hunk(s), +1 -1; graph: 4 hunk(s), +4 -3 (unchanged: title, header)"
    assert diff[1].startswith("full diff below (") and "the stats table first" in diff[1]
    assert diff.index("== stats ==") < diff.index("== graph ==")
    assert "-nodes 600" in diff and "+nodes 601" in diff
    for i in (5, 300, 590):  # nothing cut: the top and the bottom of the graph are both shown
        assert f"+n{i}: f32[2] = aten.gelu.default(n{i - 1})" in diff
    assert "+extra" in diff
    hunk = next(ln for ln in diff if ln.startswith("@@") and diff[diff.index(ln) + 1].startswith(" n3:"))
    assert hunk == f"@@ -{10 + 3 + 1},5 +{10 + 3 + 1},5 @@"  # file line numbers: graph starts at line 11


def test_diff_of_a_changed_title_and_of_every_section_changed():
    old, new = _golden("nodes 3", ["a"]), render_golden("u", [("header", "stage: cleanup"), ("stats", "nodes 4"), ("graph", "b")])
    diff = golden_diff(old, new, name="g.txt").splitlines()
    assert diff[:5] == [
        "g.txt: changed sections: title: 1 hunk(s), +1 -1; header: 1 hunk(s), +1 -1; stats: 1 hunk(s), +1 -1; "
        "graph: 1 hunk(s), +1 -1",  # nothing unchanged: no "(unchanged: ...)"
        "full diff below (19 lines), the stats table first",
        "--- golden g.txt",
        "+++ produced now",
        "== stats ==",
    ]
    assert diff[diff.index("== title ==") + 1:diff.index("== header ==")] == ["@@ -1,2 +1,2 @@", " " + FORMAT_LINE, "-# t", "+# u"]
    assert len(diff) == 4 + 4 + 19  # the lines above the first section, a line per section, the hunks


def test_diff_of_a_long_run_of_equal_lines_shows_the_one_line_changed():
    # A backward graph returns None for every input without a gradient: a long run of equal
    # lines. difflib's "popular line" heuristic (autojunk) would show the whole run replaced.
    graph = [f"n{i}: f32[2] = aten.relu.default(n{i - 1})" for i in range(150)] + ["return:"] + ["  None"] * 100
    changed = list(graph)
    changed[200] = "  grad_5"
    diff = golden_diff(_golden("s", graph), _golden("s", changed))
    assert diff.splitlines()[0] == "golden: changed sections: graph: 2 hunk(s), +1 -1 (unchanged: title, header, stats)"


def test_diff_of_a_stats_only_change_and_of_sections_added_or_removed():
    old = _golden("nodes 3", ["a"])
    assert golden_diff(old, old) == "golden: no difference"
    only_stats = golden_diff(old, _golden("nodes 4", ["a"]))
    assert only_stats.splitlines()[0].startswith("golden: changed sections: stats: 1 hunk(s), +1 -1 (unchanged: title, header, graph)")
    extra = render_golden("t", [("header", "stage: joint"), ("stats", "nodes 3"), ("graph", "a"), ("backward", "b")])
    assert "backward: 1 hunk(s), +3 -0" in golden_diff(old, extra)
    assert "backward: 1 hunk(s), +0 -3" in golden_diff(extra, old)


def test_collective_counts_text_has_known_counts_and_bytes():
    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = torch.empty(4, 16, device="meta")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "1"))
    ag.meta[M.VAL] = torch.empty(32, 16, device="meta")
    rs = g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "3"))
    rs.meta[M.VAL] = torch.empty(2, 16, device="meta")
    ag_tp = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "3"))
    ag_tp.meta[M.VAL] = torch.empty(8, 16, device="meta")
    g.output((ag, rs, ag_tp))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {"1": "dp", "3": "tp"}
    text = collective_counts_text([("joint", gm)])
    # all-gather: output bytes, one cell per kind with its mesh dims in name order; reduce-scatter:
    # input bytes; columns left-aligned to the widest cell, no trailing blanks
    assert text.splitlines() == [
        "stage  all_gather            reduce_scatter  all_reduce",
        "joint  dp:1/2048B tp:1/512B  tp:1/256B       -",
    ]
