"""One self-contained static HTML page from ``StageView``s: no server, no network, inline
CSS, SVG and one small script.

Size: graph texts of an 8B run are ~12k lines per stage. They are not in the DOM at load: every
distinct text is stored once in an embedded JSON block and copied into its collapsed
``<details>`` when it is first opened; diffs are computed here (``difflib`` opcodes, a few
integers per hunk) and rendered side by side by the script on first open, with unchanged runs
folded and long diffs cut until "show all" is pressed. The pictures are drawn at pixel
resolution (``verify.commands.html.svg``), so the page's DOM stays small whatever the graph size.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from html import escape, unescape

from verify.commands.html import svg
from verify.commands.html.diff import PAGE_CSS, PAGE_JS, TextStore, diff_opcodes, payload_script
from verify.commands.html.plan_section import SECTION_ID as PLAN_SECTION_ID
from verify.commands.html.views import StageView, stage_text
from verify.graphs.classify import CATEGORIES
from verify.graphs.stats import human_bytes

__all__ = ["build_page", "page_sections", "stats_table"]


_SECTION_HEAD = re.compile(r"<section class=stage id='[^']+' data-stage='([^']+)'>")


def page_sections(html: str) -> dict[str, str]:
    """Stage name -> the HTML of its section, in page order (a page :func:`build_page` wrote)."""
    out = {}
    for part in re.split(r"(?=<section class=stage )", html)[1:]:
        m = _SECTION_HEAD.match(part)
        if m is None:
            raise ValueError(f"not a stage section of this page: {part[:80]!r}")
        out[unescape(m.group(1))] = part.split("</section>", 1)[0]
    return out


def _slug(i: int, name: str) -> str:
    return f"stage-{i}-" + "".join(c if c.isalnum() else "-" for c in name)


def _cell(cs: dict | None) -> str:
    if not cs or not cs.get("count"):
        return "<td class=num>-</td><td class=num></td>"
    return f"<td class=num>{cs['count']}</td><td class=num>{escape(human_bytes(cs['bytes']))}</td>"


def stats_table(stats: dict) -> str:
    """The stats table (what the golden's stats section says) as HTML."""
    graphs = [("forward", stats["fw"]), ("backward", stats["bw"])] if "fw" in stats else [("graph", stats)]
    keys = sorted(
        {(k, d) for _, g in graphs for k, per in g["collectives"].items() for d in per},
        key=lambda kd: (list(svg.KIND_COLORS).index(kd[0]) if kd[0] in svg.KIND_COLORS else 99, kd),
    )
    head = "".join(f"<th colspan=2>{name}</th>" for name, _ in graphs)
    rows = [f"<tr><th>stat</th><th>dim</th>{head}</tr>"]
    for kind, dim in keys:
        cells = "".join(_cell(g["collectives"].get(kind, {}).get(dim)) for _, g in graphs)
        rows.append(f"<tr><td>{kind}</td><td>{escape(dim)}</td>{cells}</tr>")

    def plain(label: str, detail: str, values: list) -> str:
        cells = "".join(f"<td class=num>{v}</td><td></td>" for v in values)
        return f"<tr><td>{label}</td><td>{escape(detail)}</td>{cells}</tr>"

    rows.append(plain("wait_tensor", "", [g["waits"] for _, g in graphs]))
    for p in sorted({p for _, g in graphs for p in g["recompute"]}):
        rows.append(plain("recompute", p, [g["recompute"].get(p, 0) for _, g in graphs]))
    if any(g["must_save"] for _, g in graphs):
        rows.append(plain("ap_must_save", "", [g["must_save"] for _, g in graphs]))
    rows.append(plain("max_consec_compute_between_rs", "", [g["max_consec_compute_between_rs"] for _, g in graphs]))
    rows.append(plain("nodes", "", [g["num_nodes"] for _, g in graphs]))
    for cat in CATEGORIES:
        rows.append(plain("nodes", cat, [g["categories"].get(cat, 0) for _, g in graphs]))
    if "fw" in stats:
        rows.append(f"<tr><td>saved for backward</td><td></td><td class=num>{stats['saved_count']}</td>"
                    f"<td class=num>{escape(human_bytes(stats['saved_bytes']))}</td><td></td><td></td></tr>")
        rows.append(f"<tr><td>static peak</td><td></td><td></td><td class=num>"
                    f"{escape(human_bytes(stats['static_peak_bytes']))}</td><td></td><td></td></tr>")
    return "<table class=stats>" + "".join(rows) + "</table>"


def _parity_html(view: StageView) -> str:
    p = view.parity
    if p is None:
        return "<span class='badge none'>parity: not run for this stage</span>"
    cls = {True: "ok", False: "bad", None: "none"}[p.ok]
    return f"<span class='badge {cls}' data-parity='{cls}'>parity: {escape(p.describe())}</span>"


def _golden_html(view: StageView) -> str:
    status = view.golden_status
    cls = {"matches": "ok", "differs": "bad", "none": "none"}[status]
    text = {"matches": "golden: matches", "differs": "golden: DIFFERS (diff below)",
            "none": "golden: none for this stage"}[status]
    return f"<span class='badge {cls}' data-golden='{status}'>{text}</span>"


def _details(kind: str, summary: str, attrs: str) -> str:
    return (f"<details class='{kind}' {attrs}><summary>{escape(summary)}</summary>"
            f"<div class=lazy></div></details>")


def _figure(title: str, svg_text: str, note: str = "") -> str:
    n = f"<p class=note>{escape(note)}</p>" if note else ""
    return f"<figure><figcaption>{escape(title)}</figcaption>{svg_text}{n}</figure>"


def _stage_section(i: int, view: StageView, prev: StageView | None, texts: TextStore, diffs: list) -> str:
    out = [f"<section class=stage id='{_slug(i, view.name)}' data-stage='{escape(view.name)}'>"]
    out.append(f"<h2>{i}. {escape(view.name)}</h2>")
    out.append(f"<p class=verdicts>{_parity_html(view)} {_golden_html(view)}</p>")
    out.append(stats_table(view.stats))
    liv = view.liveness
    out.append(_figure(
        "memory over the schedule (static, from FakeTensor sizes)",
        svg.memory_svg(liv.names, liv.phases, liv.live, liv.peak_step,
                       [(c.name, c.phase, c.bytes) for c in liv.at_peak],
                       title=f"{view.name}: static live bytes per node"),
    ))
    if view.measured is not None:
        out.append(_figure(
            "measured CPU memory of one step (profiler allocations, beside the static estimate)",
            svg.measured_memory_svg(view.measured.times_ms, view.measured.bytes,
                                    title=f"{view.name}: measured bytes over time"),
        ))
    if view.buckets is not None:
        out.append(_figure(
            "buckets: members, bytes against the cap, topo span against max_topo_span",
            svg.buckets_svg(view.buckets, title=f"{view.name}: merged buckets"),
            "; ".join(view.bucket_summaries),
        ))
        out.append(_bucket_table(view))
    for label, tl in view.timelines.items():
        out.append(_figure(
            f"overlap ({label}): CPU roofline estimate, what each collective hides behind",
            svg.overlap_svg(tl, title=f"{view.name} {label}: compute and collectives"),
        ))
    for label, text in view.texts.items():
        idx = texts.add(text)
        n = text.count("\n")
        out.append(_details("graph", f"{label} graph, canonical text ({n} lines)",
                            f"data-text='{idx}' data-graph='{escape(label)}'"))
    if view.golden_status == "differs":
        d = len(diffs)
        diffs.append({"a": texts.add(view.golden), "b": texts.add(view.golden_now),
                      "a_name": "golden file", "b_name": "this run",
                      "ops": diff_opcodes(view.golden, view.golden_now)})
        out.append(_details("diff diff-golden", "side-by-side diff against the golden",
                            f"data-diff='{d}'"))
    if prev is not None:
        a, b = stage_text(prev), stage_text(view)
        if a != b:
            d = len(diffs)
            ops = diff_opcodes(a, b)
            changed = sum(max(i2 - i1, j2 - j1) for t, i1, i2, j1, j2 in ops if t != "e")
            diffs.append({"a": texts.add(a), "b": texts.add(b), "a_name": prev.name,
                          "b_name": view.name, "ops": ops})
            out.append(_details("diff diff-prev",
                                f"side-by-side diff against the previous stage, {prev.name} "
                                f"({changed} lines differ)", f"data-diff='{d}'"))
        else:
            out.append(f"<p class=note data-same-as-previous>graphs identical to {escape(prev.name)}</p>")
    out.append("</section>")
    return "".join(out)


def _bucket_table(view: StageView) -> str:
    """Every merged bucket with its members, collapsed (the picture's tooltips, readable)."""
    rows = ["<tr><th>graph</th><th>kind</th><th>dim</th><th>#</th><th>bytes</th><th>cap</th>"
            "<th>span</th><th>closed by</th><th>members</th></tr>"]
    count = 0
    for p in view.buckets or []:
        bound = "-" if p.max_topo_span is None else str(p.max_topo_span)
        for i, b in enumerate(p.buckets):
            count += 1
            rows.append(
                f"<tr><td>{p.graph}</td><td>{p.kind}</td><td>{escape(p.dim)}</td><td>{i}</td>"
                f"<td class=num>{escape(human_bytes(sum(b.member_bytes)))}</td>"
                f"<td class=num>{escape(human_bytes(b.cap_bytes))}</td><td class=num>{b.span} / {bound}</td>"
                f"<td>{b.closed_by}</td><td class=members>{escape(', '.join(b.members))}</td></tr>"
            )
    return (f"<details class=buckets-table><summary>bucket members ({count} buckets)</summary>"
            f"<table class=buckets>{''.join(rows)}</table></details>")


def _summary_table(views: Sequence[StageView]) -> str:
    rows = ["<tr><th>stage</th><th>nodes</th><th>collectives</th><th>static peak</th>"
            "<th>parity</th><th>golden</th></tr>"]
    for i, v in enumerate(views):
        colls = ", ".join(f"{k}[{d}] {c}" for (k, d), (c, _) in sorted(v.collectives.items()) if c) or "-"
        parity = "-" if v.parity is None else {True: "ok", False: "FAILED", None: "-"}[v.parity.ok]
        rows.append(
            f"<tr><td><a href='#{_slug(i, v.name)}'>{escape(v.name)}</a></td>"
            f"<td class=num>{' / '.join(map(str, v.num_nodes))}</td><td>{escape(colls)}</td>"
            f"<td class=num>{escape(human_bytes(v.liveness.peak_bytes))}</td><td>{parity}</td>"
            f"<td>{v.golden_status}</td></tr>"
        )
    return "<table class=summary>" + "".join(rows) + "</table>"


def build_page(views: Sequence[StageView], *, title: str, subtitle: str = "", plan: str = "") -> str:
    """The whole page (a string starting with ``<!DOCTYPE html>``); ``plan``: the plan stage's
    section (``verify.commands.html.plan_section``), ahead of the stages, for ``plan="auto"``."""
    texts = TextStore()
    diffs: list[dict] = []
    by_name = {v.name: v for v in views}
    unknown = sorted({v.previous for v in views if v.previous is not None} - set(by_name))
    if unknown:
        raise ValueError(f"stage view(s) name previous stage(s) {unknown} that are not on the page: {list(by_name)}")
    sections = [
        _stage_section(i, v, by_name[v.previous] if v.previous else (views[i - 1] if i else None), texts, diffs)
        for i, v in enumerate(views)
    ]
    chart = svg.collective_bytes_svg([(v.name, v.collectives) for v in views],
                                     title="collective bytes per kind and mesh dim, per stage")
    return "".join([
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>{escape(title)}</title><style>{PAGE_CSS}</style></head><body>",
        f"<header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p></header>",
        "<nav>", (f"<p><a href='#{PLAN_SECTION_ID}'>plan</a> (the plan stage)</p>" if plan else ""),
        _summary_table(views), "</nav>",
        "<section class=pipeline id=pipeline>",
        _figure("collective bytes across the pipeline", chart), "</section>",
        plan,
        *sections,
        payload_script(texts, diffs),
        f"<script>{PAGE_JS}</script></body></html>",
    ])
