"""The report's pictures as hand-written SVG: pure functions, data in, one ``<svg>`` string out.

Why hand-written and not matplotlib: every picture here is rectangles, one polyline and text;
each element carries a ``<title>`` tooltip naming the node, bucket or collective it stands for
(matplotlib's SVG has no per-element tooltips without post-processing); the output is
deterministic (no dates or random clip ids) so tests compare it and parse it with
``xml.etree``; and the base install stays ``torch`` + ``numpy``.

Size: an 8B graph has ~8000 nodes, so series are reduced to one point per pixel column (the
column's maximum, so a peak is never smoothed away) and runs of compute narrower than a pixel
are merged into one rectangle whose tooltip counts them. A picture stays a few thousand
elements whatever the graph size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from verify.graphs.stats import human_bytes

__all__ = [
    "BucketPanel",
    "BucketView",
    "KIND_COLORS",
    "buckets_svg",
    "collective_bytes_svg",
    "measured_memory_svg",
    "memory_svg",
    "overlap_svg",
]

WIDTH = 960
LEFT = 80  # room for y-axis labels
RIGHT = 16
PLOT_W = WIDTH - LEFT - RIGHT

KIND_COLORS = {
    "all_gather": "#3b7dd8",
    "reduce_scatter": "#d8503b",
    "all_reduce": "#3ba55c",
    "all_to_all": "#9b59b6",
    "broadcast": "#c9a227",
}
_OTHER_COLOR = "#8e8e8e"
COMPUTE_COLOR = "#9aa5b1"
STALL_COLOR = "#f0a030"
FORWARD_FILL = "#cfe0f7"
BACKWARD_FILL = "#f7dccf"


def kind_color(kind: str) -> str:
    return KIND_COLORS.get(kind, _OTHER_COLOR)


# --- primitives ---------------------------------------------------------------------------------


def _f(x: float) -> str:
    """Coordinates with at most one decimal (small files, stable text)."""
    return f"{x:.1f}".rstrip("0").rstrip(".") if math.isfinite(x) else "0"


def _attrs(kw: dict) -> str:
    out = []
    for k, v in kw.items():
        if v is None:
            continue
        name = k.rstrip("_").replace("_", "-")
        val = _f(v) if isinstance(v, float) else str(v)
        out.append(f"{name}={quoteattr(val)}")
    return " ".join(out)


def _el(tag: str, title: str | None = None, text: str | None = None, **kw) -> str:
    inner = ""
    if title is not None:
        inner += f"<title>{escape(title)}</title>"
    if text is not None:
        inner += escape(text)
    attrs = _attrs(kw)
    head = f"<{tag} {attrs}" if attrs else f"<{tag}"
    return f"{head}>{inner}</{tag}>" if inner else f"{head}/>"


def _svg(kind: str, height: float, body: Iterable[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="fig fig-{kind}" data-figure="{kind}" '
        f'role="img" width="{WIDTH}" height="{_f(height)}" viewBox="0 0 {WIDTH} {_f(height)}" '
        f'font-family="sans-serif" font-size="11"><title>{escape(title)}</title>'
        + "".join(body)
        + "</svg>"
    )


def _nice_step(span: float, ticks: int = 5) -> float:
    if span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _byte_step(top: float) -> float:
    """A tick step for a byte axis: a power of 1024 times 1, 2 or 5 (so labels read 2.0 MiB)."""
    if top <= 0:
        return 1.0
    unit = 1024 ** max(0, math.floor(math.log(top, 1024)))
    return _nice_step(top / unit) * unit


def _y_axis(y0: float, h: float, top: float, label, step: float) -> list[str]:
    out = [_el("line", x1=float(LEFT), y1=y0, x2=float(LEFT), y2=y0 + h, stroke="#444")]
    v = 0.0
    while v <= top * 1.0001 and top > 0:
        y = y0 + h - h * v / top
        out.append(_el("line", x1=float(LEFT - 4), y1=y, x2=float(LEFT + PLOT_W), y2=y, stroke="#e4e4e4"))
        out.append(_el("text", text=label(v), x=float(LEFT - 6), y=y + 4, text_anchor="end"))
        v += step
    return out


def _x_axis_ms(y: float, total: float) -> list[str]:
    out = [_el("line", x1=float(LEFT), y1=y, x2=float(LEFT + PLOT_W), y2=y, stroke="#444")]
    step = _nice_step(total, 8)
    v = 0.0
    while total > 0 and v <= total * 1.0001:
        x = LEFT + PLOT_W * v / total
        out.append(_el("line", x1=x, y1=y, x2=x, y2=y + 4, stroke="#444"))
        out.append(_el("text", text=f"{v:g} ms", x=x, y=y + 15, text_anchor="middle"))
        v += step
    return out


def column_max(values: Sequence[float], columns: int) -> list[tuple[int, int, float]]:
    """``(first index, last index, max)`` per pixel column: at most ``columns`` points, and the
    maximum of the series always among them."""
    n = len(values)
    if n <= columns:
        return [(i, i, float(v)) for i, v in enumerate(values)]
    out = []
    for c in range(columns):
        lo, hi = c * n // columns, max((c + 1) * n // columns, c * n // columns + 1)
        chunk = values[lo:hi]
        out.append((lo, hi - 1, float(max(chunk))))
    return out


# --- memory -------------------------------------------------------------------------------------


def memory_svg(
    names: Sequence[str],
    phases: Sequence[str],
    live: Sequence[int],
    peak_step: int,
    at_peak: Sequence[tuple[str, str, int]],
    *,
    title: str,
    top: int = 5,
) -> str:
    """Static live bytes per node in run order; the forward and backward shaded, the peak marked
    and its ``top`` largest live storages named (``at_peak``: (node, phase, bytes))."""
    plot_h = 180.0
    y0 = 24.0
    n = len(live)
    peak = max(live, default=0)
    ytop = peak * 1.1 or 1.0
    body = [_el("text", text=title, x=float(LEFT), y=14.0, font_weight="bold")]
    # phase bands
    if n:
        start = 0
        for i in range(1, n + 1):
            if i == n or phases[i] != phases[start]:
                x0 = LEFT + PLOT_W * start / n
                x1 = LEFT + PLOT_W * i / n
                fill = BACKWARD_FILL if phases[start] == "backward" else FORWARD_FILL
                body.append(
                    _el(
                        "rect",
                        f"{phases[start]}: nodes {start}..{i - 1}",
                        x=x0, y=y0, width=max(x1 - x0, 0.5), height=plot_h, fill=fill,
                        class_=f"phase phase-{phases[start]}",
                    )
                )
                body.append(_el("text", text=phases[start], x=x0 + 4, y=y0 + 12, fill="#555"))
                start = i
    body += _y_axis(y0, plot_h, ytop, lambda v: human_bytes(int(v)), _byte_step(ytop))
    cols = column_max(live, PLOT_W)
    if cols:
        pts = [f"{_f(float(LEFT))},{_f(y0 + plot_h)}"]
        for lo, hi, v in cols:
            x = LEFT + PLOT_W * (lo + hi + 1) / 2 / n
            pts.append(f"{_f(x)},{_f(y0 + plot_h - plot_h * v / ytop)}")
        pts.append(f"{_f(float(LEFT + PLOT_W))},{_f(y0 + plot_h)}")
        body.append(
            _el("polygon", points=" ".join(pts), fill="#3b7dd8", fill_opacity="0.35",
                stroke="#1d4f91", stroke_width="1", class_="live")
        )
    if n:
        px = LEFT + PLOT_W * (peak_step + 0.5) / n
        py = y0 + plot_h - plot_h * peak / ytop
        label = f"peak {human_bytes(peak)} at {names[peak_step]} ({phases[peak_step]})"
        body.append(_el("line", x1=px, y1=y0, x2=px, y2=y0 + plot_h, stroke="#c0392b",
                        stroke_dasharray="4 3"))
        body.append(_el("circle", label, cx=px, cy=py, r=4.0, fill="#c0392b", class_="peak"))
        anchor = "end" if px > LEFT + PLOT_W * 0.6 else "start"
        body.append(_el("text", text=label, x=px + (-6 if anchor == "end" else 6), y=max(py - 6, y0 + 24),
                        text_anchor=anchor, fill="#c0392b", font_weight="bold"))
    ly = y0 + plot_h + 18
    body.append(_el("text", text=f"live at the peak, largest first ({len(at_peak)} storages):",
                    x=float(LEFT), y=ly, fill="#333"))
    for k, (name, phase, nbytes) in enumerate(at_peak[:top]):
        share = nbytes / peak if peak else 0.0
        body.append(_el("text", text=f"{human_bytes(nbytes):>10}  {share:5.1%}  {name} ({phase})",
                        x=float(LEFT + 12), y=ly + 15 * (k + 1), class_="contributor",
                        font_family="monospace"))
    height = ly + 15 * (min(top, len(at_peak)) + 1)
    return _svg("memory", height, body, title)


def measured_memory_svg(times_ms: Sequence[float], nbytes: Sequence[int], *, title: str) -> str:
    """Measured CPU bytes over time (allocation events replayed), peak marked."""
    plot_h = 140.0
    y0 = 24.0
    peak = max(nbytes, default=0)
    ytop = peak * 1.1 or 1.0
    total = max(times_ms[-1] if times_ms else 0.0, 1e-9)
    body = [_el("text", text=title, x=float(LEFT), y=14.0, font_weight="bold")]
    body += _y_axis(y0, plot_h, ytop, lambda v: human_bytes(int(v)), _byte_step(ytop))
    body += _x_axis_ms(y0 + plot_h, total)
    # one point per pixel column of time: the column's maximum
    colmax: dict[int, float] = {}
    for t, b in zip(times_ms, nbytes, strict=True):
        c = min(int(PLOT_W * t / total), PLOT_W - 1)
        colmax[c] = max(colmax.get(c, 0.0), float(b))
    pts = [f"{_f(float(LEFT))},{_f(y0 + plot_h)}"]
    for c in sorted(colmax):
        pts.append(f"{_f(LEFT + c + 0.5)},{_f(y0 + plot_h - plot_h * colmax[c] / ytop)}")
    pts.append(f"{_f(float(LEFT + PLOT_W))},{_f(y0 + plot_h)}")
    body.append(_el("polygon", points=" ".join(pts), fill="#3ba55c", fill_opacity="0.35",
                    stroke="#22733d", stroke_width="1", class_="measured"))
    if nbytes:
        i = list(nbytes).index(peak)
        px = LEFT + PLOT_W * times_ms[i] / total
        py = y0 + plot_h - plot_h * peak / ytop
        label = f"measured peak {human_bytes(peak)} at {times_ms[i]:.2f} ms"
        body.append(_el("circle", label, cx=px, cy=py, r=4.0, fill="#c0392b", class_="peak"))
        anchor = "end" if px > LEFT + PLOT_W * 0.6 else "start"
        body.append(_el("text", text=label, x=px + (-6 if anchor == "end" else 6), y=max(py - 6, y0 + 12),
                        text_anchor=anchor, fill="#c0392b"))
    return _svg("measured-memory", y0 + plot_h + 24, body, title)


# --- buckets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketView:
    members: tuple[str, ...]  # labels (parameter or gradient names where known)
    member_bytes: tuple[int, ...]
    cap_bytes: int
    span: int
    closed_by: str


@dataclass(frozen=True)
class BucketPanel:
    """The buckets of one graph, collective kind and mesh dim."""

    graph: str
    kind: str
    dim: str
    buckets: tuple[BucketView, ...]
    max_topo_span: int | None


def buckets_svg(panels: Sequence[BucketPanel], *, title: str) -> str:
    """Per panel, one column per bucket: bytes against its cap (members stacked, each with a
    tooltip) above, topo span against ``max_topo_span`` below."""
    bar_h, span_h, gap = 90.0, 50.0, 34.0
    y = 24.0
    body = [_el("text", text=title, x=float(LEFT), y=14.0, font_weight="bold")]
    for p in panels:
        n = len(p.buckets)
        fill = max((sum(b.member_bytes) / b.cap_bytes for b in p.buckets if b.cap_bytes), default=0.0)
        members = sum(len(b.members) for b in p.buckets)
        bound_text = "no topo span bound" if p.max_topo_span is None else f"max_topo_span {p.max_topo_span}"
        body.append(_el("text", text=f"{p.graph} {p.kind} [{p.dim}]: {n} bucket(s) of {members} "
                        f"collectives; fullest at {fill:.1%} of its cap; {bound_text}", x=float(LEFT),
                        y=y + 10, font_weight="bold", class_="panel-title"))
        y += 16
        col = PLOT_W / max(n, 1)
        w = max(min(col * 0.8, 28.0), 0.6)
        # bytes against the cap: 100% of the cap at the dashed line
        top = max([1.0] + [sum(b.member_bytes) / b.cap_bytes for b in p.buckets if b.cap_bytes])
        top = max(top, 1.0) * 1.15  # headroom for the percentages
        cap_y = y + bar_h - bar_h / top
        body.append(_el("text", text="bytes / cap", x=float(LEFT - 6), y=y + bar_h / 2, text_anchor="end"))
        body.append(_el("line", x1=float(LEFT), y1=y + bar_h, x2=float(LEFT + PLOT_W), y2=y + bar_h, stroke="#444"))
        body.append(_el("line", "the bucket cap", x1=float(LEFT), y1=cap_y, x2=float(LEFT + PLOT_W), y2=cap_y,
                        stroke="#c0392b", stroke_dasharray="5 3", class_="cap"))
        for i, b in enumerate(p.buckets):
            x = LEFT + col * i + (col - w) / 2
            total = sum(b.member_bytes)
            by = y + bar_h
            for k, (m, mb) in enumerate(zip(b.members, b.member_bytes, strict=True)):
                h = bar_h * mb / b.cap_bytes / top if b.cap_bytes else 0.0
                by -= h
                tip = (f"bucket {i} ({b.closed_by}): {m}, {human_bytes(mb)}; bucket {human_bytes(total)} "
                       f"of cap {human_bytes(b.cap_bytes)} ({len(b.members)} members)")
                shade = "#3b7dd8" if k % 2 == 0 else "#7fa8e6"
                if p.kind != "all_gather":
                    shade = "#d8503b" if k % 2 == 0 else "#e89382"
                body.append(_el("rect", tip, x=x, y=by, width=w, height=max(h, 0.3), fill=shade,
                                class_="member"))
            if col >= 40:
                share = total / b.cap_bytes if b.cap_bytes else 0.0
                body.append(_el("text", text=f"{share:.0%}", x=x + w / 2, y=min(by, y + bar_h) - 3,
                                text_anchor="middle", font_size="9"))
        y += bar_h + 8
        # topo span against the bound
        bound = p.max_topo_span
        smax = max([b.span for b in p.buckets] + [bound or 0, 1]) * 1.3  # headroom for the labels
        body.append(_el("text", text="topo span", x=float(LEFT - 6), y=y + span_h / 2, text_anchor="end"))
        body.append(_el("line", x1=float(LEFT), y1=y + span_h, x2=float(LEFT + PLOT_W), y2=y + span_h, stroke="#444"))
        if bound is not None:
            by = y + span_h - span_h * bound / smax
            body.append(_el("line", f"max_topo_span = {bound}", x1=float(LEFT), y1=by, x2=float(LEFT + PLOT_W),
                            y2=by, stroke="#c0392b", stroke_dasharray="5 3", class_="span-bound"))
        for i, b in enumerate(p.buckets):
            x = LEFT + col * i + (col - w) / 2
            h = span_h * b.span / smax
            body.append(_el("rect", f"bucket {i}: topo span {b.span}", x=x, y=y + span_h - h, width=w,
                            height=max(h, 0.3), fill="#8e7cc3", class_="span"))
            if col >= 40:
                body.append(_el("text", text=str(b.span), x=x + w / 2, y=y + span_h - h - 3,
                                text_anchor="middle", font_size="9"))
        y += span_h + gap
    if not panels:
        body.append(_el("text", text="no merged buckets", x=float(LEFT), y=y + 12, fill="#777"))
        y += 20
    return _svg("buckets", y, body, title)


# --- overlap ------------------------------------------------------------------------------------


def merge_runs(
    spans: Sequence[tuple[float, float, str]], scale: float, min_px: float = 1.0
) -> list[tuple[float, float, int, str]]:
    """Merge consecutive ``(start, end, name)`` spans (sorted) whose gap is under ``min_px``
    pixels into ``(start, end, count, first name)``: at most about one rectangle per pixel."""
    out: list[list] = []
    for s, e, name in spans:
        if out and (s - out[-1][1]) * scale < min_px and (out[-1][1] - out[-1][0]) * scale < 4 * min_px:
            out[-1][1] = max(out[-1][1], e)
            out[-1][2] += 1
        else:
            out.append([s, e, 1, name])
    return [tuple(r) for r in out]


def overlap_svg(timeline, *, title: str) -> str:
    """Lanes: compute (with the time it is blocked on a wait), then one lane per mesh dim with
    its collectives; each collective's tooltip says what it hides behind and what is exposed."""
    lane_h, y0 = 22.0, 24.0
    total = max(timeline.total, 1e-9)
    scale = PLOT_W / total
    dims = timeline.dims
    body = [_el("text", text=title, x=float(LEFT), y=14.0, font_weight="bold")]
    y = y0
    body.append(_el("text", text="compute", x=float(LEFT - 6), y=y + 15, text_anchor="end"))
    for s, e, count, name in merge_runs([(c.start, c.end, c.name) for c in timeline.compute], scale):
        tip = f"{name} ({(e - s):.3f} ms)" if count == 1 else f"{count} ops from {name} ({(e - s):.3f} ms)"
        body.append(_el("rect", tip, x=LEFT + s * scale, y=y + 3, width=max((e - s) * scale, 0.5),
                        height=lane_h - 6, fill=COMPUTE_COLOR, class_="compute"))
    for c in timeline.collectives:
        if c.exposed > 0 and c.waited_at is not None:
            body.append(_el("rect", f"blocked {c.exposed:.3f} ms waiting on {c.name}",
                            x=LEFT + c.waited_at * scale, y=y + 3, width=max(c.exposed * scale, 0.5),
                            height=lane_h - 6, fill=STALL_COLOR, class_="stall"))
    for d in dims:
        y += lane_h + 4
        body.append(_el("text", text=f"comm [{d}]", x=float(LEFT - 6), y=y + 15, text_anchor="end"))
        for c in (c for c in timeline.collectives if c.dim == d):
            hidden = ", ".join(f"{n} {ms:.3f} ms" for n, ms in c.hidden) or "nothing"
            more = f" (+{c.hidden_count - len(c.hidden)} more)" if c.hidden_count > len(c.hidden) else ""
            tip = (f"{c.name} ({c.kind}, {human_bytes(c.nbytes)}): {c.duration:.3f} ms; hides behind "
                   f"{hidden}{more}; exposed {c.exposed:.3f} ms")
            width = max(c.duration * scale, 0.5)
            body.append(_el("rect", tip, x=LEFT + c.start * scale, y=y + 3, width=width, height=lane_h - 6,
                            fill=kind_color(c.kind), class_=f"collective kind-{c.kind}",
                            stroke="#c0392b" if c.exposed > 0 and width >= 4 else None))
    y += lane_h + 6
    body += _x_axis_ms(y, total)
    y += 30
    exposed = timeline.exposed
    summary = (f"{total:.3f} ms end to end; compute {timeline.compute_total:.3f} ms; "
               f"{len(timeline.collectives)} collectives; exposed {exposed:.3f} ms"
               " (orange: compute blocked on a wait)")
    body.append(_el("text", text=summary, x=float(LEFT), y=y, fill="#333", class_="summary"))
    legend_x = LEFT
    y += 16
    for kind in sorted({c.kind for c in timeline.collectives}):
        body.append(_el("rect", x=float(legend_x), y=y - 9, width=10.0, height=10.0, fill=kind_color(kind)))
        body.append(_el("text", text=kind, x=float(legend_x + 14), y=y))
        legend_x += 14 + 7 * len(kind) + 16
    return _svg("overlap", y + 10, body, title)


# --- collective bytes across stages -------------------------------------------------------------


def collective_bytes_svg(
    rows: Sequence[tuple[str, dict[tuple[str, str], tuple[int, int]]]], *, title: str
) -> str:
    """Grouped bars: per stage, one bar per (kind, mesh dim), height = bytes, count on top.
    ``rows``: (stage, {(kind, dim): (count, bytes)})."""
    series = sorted({k for _, per in rows for k in per},
                    key=lambda kd: (list(KIND_COLORS).index(kd[0]) if kd[0] in KIND_COLORS else 99, kd))
    plot_h, y0 = 180.0, 40.0
    top = max([b for _, per in rows for _, b in per.values()] + [1]) * 1.15
    body = [_el("text", text=title, x=float(LEFT), y=14.0, font_weight="bold")]
    lx = LEFT
    dim_shades = {}
    for kind, dim in series:
        dims_of_kind = [d for k, d in series if k == kind]
        shade = dims_of_kind.index(dim)
        dim_shades[(kind, dim)] = 1.0 - 0.35 * shade
        body.append(_el("rect", x=float(lx), y=22.0, width=10.0, height=10.0, fill=kind_color(kind),
                        fill_opacity=_f(dim_shades[(kind, dim)])))
        label = f"{kind} [{dim}]"
        body.append(_el("text", text=label, x=float(lx + 14), y=31.0))
        lx += 14 + 6.5 * len(label) + 14
    body += _y_axis(y0, plot_h, top, lambda v: human_bytes(int(v)), _byte_step(top))
    group_w = PLOT_W / max(len(rows), 1)
    bar_w = min(group_w * 0.8 / max(len(series), 1), 40.0)
    vertical = not labels_fit_across([stage for stage, _ in rows], group_w)
    for g, (stage, per) in enumerate(rows):
        gx = LEFT + group_w * g + (group_w - bar_w * len(series)) / 2
        for s, key in enumerate(series):
            count, nbytes = per.get(key, (0, 0))
            h = plot_h * nbytes / top
            x = gx + bar_w * s
            tip = f"{stage}: {key[0]} [{key[1]}] {count} collectives, {human_bytes(nbytes)}"
            body.append(_el("rect", tip, x=x, y=y0 + plot_h - h, width=bar_w * 0.9, height=max(h, 0.0),
                            fill=kind_color(key[0]), fill_opacity=_f(dim_shades[key]), class_="bar"))
            if count:
                body.append(_el("text", text=str(count), x=x + bar_w * 0.45, y=y0 + plot_h - h - 3,
                                text_anchor="middle", font_size="9"))
        body.append(stage_label(stage, LEFT + group_w * (g + 0.5), y0 + plot_h, vertical))
    body.append(_el("line", x1=float(LEFT), y1=y0 + plot_h, x2=float(LEFT + PLOT_W), y2=y0 + plot_h, stroke="#444"))
    room = label_room([stage for stage, _ in rows], vertical)
    body.append(_el("text", text="bar height: bytes; number on top: collective launches",
                    x=float(LEFT), y=y0 + plot_h + room + 14, fill="#555"))
    return _svg("collective-bytes", y0 + plot_h + room + 24, body, title)


CHAR_W = 6.5  # a generous width of one character of the charts' 11 px sans-serif text


def labels_fit_across(labels: Sequence[str], slot: float) -> bool:
    """Whether every label fits in its slot written across; if not, they are written upright."""
    return max((len(s) for s in labels), default=0) * CHAR_W <= slot - 6


def label_room(labels: Sequence[str], vertical: bool) -> float:
    """The height under the axis the labels take."""
    return max((len(s) for s in labels), default=0) * CHAR_W + 10 if vertical else 18.0


def stage_label(text: str, x: float, axis_y: float, vertical: bool) -> str:
    """A stage's name under its group: centred across, or (long names, narrow groups) turned a
    quarter upright and hanging down from the axis, so neighbours never overlap."""
    if not vertical:
        return _el("text", text=text, x=x, y=axis_y + 14, text_anchor="middle", class_="stage-label")
    x, y = x + 4, axis_y + 6  # the glyphs sit left of the rotated baseline: centre them on the group
    return _el("text", text=text, x=x, y=y, text_anchor="end", transform=f"rotate(-90 {_f(x)} {_f(y)})", class_="stage-label")
