"""autoparallel.passes.collective.METRIC_FIELDS: a collective pass's per-graph metric, declared
once, shows in every view that renders pass reports: the golden text (``verify.goldens.catalog``),
``python -m verify scale``'s JSON and the HTML page's bucket panels. A view that listed the fields
itself would miss a new one: this test adds a toy field and looks for it in each."""

from __future__ import annotations

from dataclasses import dataclass

from autoparallel.passes import collective
from autoparallel.passes.bucket_plan import BucketingMetrics
from autoparallel.passes.collective import GraphPassMetrics, MetricField, PipelineMetrics
from verify.commands import scale
from verify.commands.html import views
from verify.commands.html.records import StageRecord
from verify.goldens import catalog


@dataclass
class ToyMetrics(GraphPassMetrics):
    """A pass that reports one more thing: a count and the bucketing call it made."""

    toy_merges: int = 0


TOY = MetricField(
    "toy_merges",
    text=lambda m: [f"toy merges {m.toy_merges}"],
    json=lambda m: {"toy_merges": m.toy_merges},
    buckets=lambda m: [("toy_kind", BucketingMetrics(num_candidates=m.toy_merges))],
)


def _metrics() -> PipelineMetrics:
    return PipelineMetrics({"fw": ToyMetrics({"all_gather": 2}, {"all_gather": 1}, fused_chains=1, toy_merges=7)})


def _views(metrics: PipelineMetrics) -> dict[str, str]:
    _, summaries = views._bucket_panels(StageRecord("toy_pass", None, metrics=metrics))
    return {
        "golden text": "\n".join(catalog._metrics_lines("toy_pass", metrics)),
        "scale json": repr(scale._bucketing_fields(metrics)),
        "html buckets": "\n".join(summaries),
    }


def test_a_metric_field_declared_once_shows_in_every_view(monkeypatch):
    monkeypatch.setattr(collective, "METRIC_FIELDS", (*collective.METRIC_FIELDS, TOY))
    shown = _views(_metrics())
    assert shown["golden text"] == "toy_pass fw: fused chains 1; toy merges 7"
    assert "'fused_chains': 1, 'toy_merges': 7" in shown["scale json"]
    assert "forward toy_kind: 0 buckets (0 of 7 collectives)" in shown["html buckets"]


def test_an_undeclared_field_shows_nowhere():
    """The negative side: the same metrics without the declaration show no toy in any view."""
    shown = _views(_metrics())
    assert shown["golden text"] == "toy_pass fw: fused chains 1"
    assert all("toy" not in text for name, text in shown.items() if name != "golden text"), shown
