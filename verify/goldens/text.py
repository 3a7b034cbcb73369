"""Golden text: the file format, reading with corruption checks, and rendering graphs as goldens.

Goldens are one reviewed text file per golden under ``goldens/<tests subdir>/<module>/<test>.txt``,
written through syrupy (``verify.goldens.syrupy_ext``, the only module that imports it;
``pytest --snapshot-update`` regenerates, goldens no test uses fail the run). Three additions a
reviewer needs: the text is canonical (``verify.graphs.canon``) so a diff means the graph changed; every
file starts with a format line so a truncated or foreign file is reported as corrupt, not diffed;
and every failure names the file and the command that regenerates it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path

FORMAT_LINE = "# autoparallel golden v1"
UPDATE_COMMAND = "python -m verify goldens --update"
CHECK_COMMAND = "python -m verify goldens --check"
GOLDENS_DIR = "goldens"
TESTS_DIR = "tests"


class CorruptGoldenError(Exception):
    """A golden file that is not a golden this project wrote."""


def goldens_root_for(test_file: str | Path) -> tuple[Path, Path]:
    """(repo root, test file path relative to ``tests/``) for a test file under ``tests/``."""
    path = Path(test_file).resolve()
    for parent in path.parents:
        if parent.name == TESTS_DIR:
            return parent.parent, path.relative_to(parent)
    raise ValueError(f"{path}: golden tests must live under a '{TESTS_DIR}/' directory")


def golden_dir_for(test_file: str | Path) -> Path:
    root, rel = goldens_root_for(test_file)
    return root / GOLDENS_DIR / rel.parent / rel.stem


def read_golden(path: str | Path) -> str:
    """The text of a golden file; CorruptGoldenError (naming the file) if it is not one of ours."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode()  # UTF-8
    except UnicodeDecodeError as e:
        raise CorruptGoldenError(_corrupt(str(path), f"not UTF-8 text ({e.reason} at byte {e.start})")) from None
    if not text.startswith(FORMAT_LINE + "\n"):
        first = text.partition("\n")[0][:60]
        raise CorruptGoldenError(_corrupt(str(path), f"first line is {first!r}, expected {FORMAT_LINE!r}"))
    return text


def _corrupt(path: str, why: str) -> str:
    return (
        f"golden file {path} is corrupt: {why}. Restore it from version control "
        f"(git checkout -- {path}) or regenerate it with `{UPDATE_COMMAND}` and review the diff."
    )


def render_golden(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """The golden text: format line, title, then ``== name ==`` sections."""
    lines = [FORMAT_LINE, f"# {title}"]
    for name, body in sections:
        lines += ["", f"== {name} ==", body.rstrip("\n")]
    return "\n".join(lines) + "\n"


def header_text(fields: Mapping[str, object]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def graph_golden_text(title: str, header: Mapping[str, object], graphs) -> str:
    """Header, stats table, then canonical graph(s).

    ``graphs`` is one GraphModule or a ``(forward, backward)`` pair.
    """
    # canon and stats import torch; importing them here keeps this module (the golden file
    # format, which the goldens CLI and the pytest plugin read) free of torch.
    from verify.graphs.canon import canonicalize
    from verify.graphs.stats import format_stats_table, graph_stats, partition_stats

    sections = [("header", header_text(header))]
    if isinstance(graphs, tuple):
        fw, bw = graphs
        sections.append(("stats", format_stats_table(partition_stats(fw, bw))))
        sections.append(("forward", canonicalize(fw)))
        sections.append(("backward", canonicalize(bw)))
    else:
        sections.append(("stats", format_stats_table(graph_stats(graphs))))
        sections.append(("graph", canonicalize(graphs)))
    return render_golden(title, sections)


def collective_counts_text(rows: Sequence[tuple[str, object]]) -> str:
    """A small table: one line per (stage, graph), all-gather / reduce-scatter / all-reduce count and bytes.

    ``rows`` are ``(stage name, GraphModule)``; a reviewer sees e.g. ``AG fwd 290 -> 98`` as a
    one-line change.
    """
    from verify.graphs.stats import graph_stats

    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    table = [("stage", *kinds)]
    for name, gm in rows:
        st = graph_stats(gm)
        cells = []
        for kind in kinds:
            per = st.collectives.get(kind)
            if not per:
                cells.append("-")
                continue
            cells.append(" ".join(f"{dim}:{per[dim].count}/{per[dim].bytes}B" for dim in sorted(per)))
        table.append((name, *cells))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in table)


# --- diffs a reviewer reads ---------------------------------------------------------------------

_STATS_SECTION = "stats"


def golden_sections(text: str) -> list[tuple[str, int, list[str]]]:
    """``(section name, first line index, lines)`` in file order; lines before the first
    ``== name ==`` line form the section ``""`` (format line and title). The blank line that
    ``render_golden`` puts before a section header belongs to that section."""
    sections: list[tuple[str, int, list[str]]] = [("", 0, [])]
    for i, line in enumerate(text.splitlines()):
        if line.startswith("== ") and line.endswith(" ==") and len(line) > 6:
            prev = sections[-1][2]
            blank = bool(prev) and prev[-1] == ""
            if blank:
                prev.pop()
            sections.append((line[3:-3], i - blank, [""] * blank + [line]))
        else:
            sections[-1][2].append(line)
    return sections


def _hunks(old: list[str], new: list[str], old_at: int, new_at: int, context: int) -> list[list[str]]:
    """Unified-diff hunks of one section, with line numbers of the whole file."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    out = []
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        hunk = [f"@@ -{old_at + i1 + 1},{i2 - i1} +{new_at + j1 + 1},{j2 - j1} @@"]
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                hunk += [" " + ln for ln in old[a1:a2]]
            else:
                hunk += ["-" + ln for ln in old[a1:a2]] + ["+" + ln for ln in new[b1:b2]]
        out.append(hunk)
    return out


def golden_diff(old: str, new: str, *, name: str = "golden", context: int = 2) -> str:
    """The diff a failing golden prints: a summary of hunks per section first, then the stats
    table's diff (what changed in counts, bytes, saved tensors, peak memory), then every other
    changed section in file order. Nothing is cut: the summary says how long the rest is."""
    old_secs = {n: (at, lines) for n, at, lines in golden_sections(old)}
    new_secs = {n: (at, lines) for n, at, lines in golden_sections(new)}
    order = [n for n, _, _ in golden_sections(new)] + [n for n in old_secs if n not in new_secs]
    diffs: dict[str, list[list[str]]] = {}
    for sec in order:
        o_at, o_lines = old_secs.get(sec, (len(old.splitlines()), []))
        n_at, n_lines = new_secs.get(sec, (len(new.splitlines()), []))
        hunks = _hunks(o_lines, n_lines, o_at, n_at, context)
        if hunks:
            diffs[sec] = hunks
    if not diffs:
        return f"{name}: no difference"
    summary = []
    for sec, hunks in diffs.items():
        plus = sum(ln.startswith("+") for h in hunks for ln in h[1:])
        minus = sum(ln.startswith("-") for h in hunks for ln in h[1:])
        summary.append(f"{sec or 'title'}: {len(hunks)} hunk(s), +{plus} -{minus}")
    unchanged = [n or "title" for n in order if n not in diffs]
    total = sum(len(h) for hunks in diffs.values() for h in hunks)
    lines = [f"{name}: changed sections: " + "; ".join(summary) + (f" (unchanged: {', '.join(unchanged)})" if unchanged else "")]
    lines.append(f"full diff below ({total} lines), the stats table first")
    lines += [f"--- golden {name}", "+++ produced now"]
    first = [_STATS_SECTION] if _STATS_SECTION in diffs else []
    for sec in first + [s for s in diffs if s != _STATS_SECTION]:
        lines.append(f"== {sec or 'title'} ==")
        for hunk in diffs[sec]:
            lines += hunk
    return "\n".join(lines)
