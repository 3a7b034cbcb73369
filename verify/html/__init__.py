"""The HTML report: one self-contained static page per pipeline run (``index.html``).

Layers, each usable alone:

* ``records``: :class:`StageRecord` (a stage's graphs, pass metrics, golden text, parity,
  measured memory) and adapters from today's producers (:func:`records_from_pipeline_run`,
  :func:`trainer_records`, :func:`parity_from_report`);
* ``views``: a record -> :class:`StageView`, plain data (canonical texts, stats, static liveness,
  buckets, overlap timelines, golden comparison); the only layer that reads FX graphs;
* ``svg``: pure renderers (data in, ``<svg>`` string out); ``timeline``: the overlap replay;
* ``page``: views -> the page; ``browser``: open a page in headless Chromium (tests, timings).

Only the standard library and what ``verify`` already needs: ``python -m verify report`` keeps
working on a base install.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_FROM_RECORDS = ("ALONE", "Parity", "StageRecord", "parity_from_report", "records_from_pipeline_run", "trainer_records")


def __getattr__(name: str) -> Any:
    # Lazy, so ``verify.html.browser`` (imported by the pytest plugin's browser gate) stays light.
    if name in _FROM_RECORDS:
        from verify.html import records

        return getattr(records, name)
    raise AttributeError(f"module 'verify.html' has no attribute {name!r}")


__all__ = [
    "ALONE",
    "Parity",
    "StageRecord",
    "build_report_page",
    "parity_from_report",
    "records_from_pipeline_run",
    "trainer_records",
    "write_page",
    "write_report",
]

PAGE_NAME = "index.html"


def build_report_page(
    records: Sequence[Any], *, title: str, subtitle: str = "", mesh=None, roofline=None, planning=None
) -> str:
    """The page's HTML for ``records`` (``StageRecord``s, in pipeline order). ``mesh`` (a ``MeshSpec``) gives the
    group sizes of collectives whose schema has none (all-reduce) once the fake world is gone;
    ``roofline``: the estimator's ``RooflineConfig`` (default: one H100); ``planning``: the plan
    stage's ``PlanningReport`` (``plan="auto"``), shown in a section of its own."""
    from verify.html.page import build_page
    from verify.html.plan_section import plan_section
    from verify.html.views import stage_view

    if not records:
        raise ValueError("no stage records: nothing to report (pass the pipeline's stages in order)")
    views = [stage_view(r, mesh=mesh, roofline=roofline) for r in records]
    return build_page(views, title=title, subtitle=subtitle, plan=plan_section(planning) if planning is not None else "")


def write_report(
    records: Sequence[Any], out_dir: str | Path, *, title: str, subtitle: str = "",
    mesh=None, roofline=None, planning=None,
) -> Path:
    """Write ``out_dir/index.html`` (creating ``out_dir``) and return its path."""
    page = build_report_page(records, title=title, subtitle=subtitle, mesh=mesh, roofline=roofline, planning=planning)
    return write_page(page, out_dir)


def write_page(html: str, out_dir: str | Path) -> Path:
    """Write ``html`` as ``out_dir/index.html`` (creating ``out_dir``) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / PAGE_NAME
    path.write_text(html, encoding="utf-8")
    return path
