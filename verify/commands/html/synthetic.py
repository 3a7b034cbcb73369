"""Synthetic stage views of a given size, to measure the page at LLaMA-3 8B scale without
tracing it (the 8B run's graphs: joint 10260 nodes, forward 4107, backward 8006; ~300
collectives and ~100 buckets per graph). Deterministic in ``seed``.

    python -m verify.commands.html.synthetic OUT_DIR   # writes OUT_DIR/index.html, prints its size
"""

from __future__ import annotations

import random

from autoparallel import roles
from verify.commands.html.svg import BucketPanel, BucketView
from verify.commands.html.timeline import CollectiveSpan, ComputeSpan, OverlapTimeline
from verify.commands.html.views import StageView
from verify.graphs.liveness import Contributor, StaticLiveness

__all__ = ["synthetic_views"]

_OPS = ("mm", "view", "add", "mul", "t", "_to_copy", "sum", "rsqrt", "silu", "bmm")


def _text(rng: random.Random, n: int, tag: str) -> str:
    lines = [f"{roles.param(f'layers.{i // 9}.w{i % 9}.weight')}: bf16[4096, 512]" for i in range(min(n // 10, 300))]
    counts: dict[str, int] = {}
    while len(lines) < n:
        op = _OPS[rng.randrange(len(_OPS))]
        k = counts.get(op, 0)
        counts[op] = k + 1
        lines.append(f"{op}_{k}: f32[2, 8192, 4096] = aten.{op}.default({op}_{max(k - 1, 0)}, arg_{k % 7})  {{{tag}}}")
    return "\n".join(lines) + "\n"


def _liveness(rng: random.Random, n_fw: int, n_bw: int) -> StaticLiveness:
    live, cur = [], 2 << 30
    for i in range(n_fw + n_bw):
        cur = max(cur + rng.randint(-(40 << 20), (60 << 20) if i < n_fw else (30 << 20)), 1 << 30)
        live.append(cur)
    peak = max(live)
    step = live.index(peak)
    names = [f"node_{i}" for i in range(len(live))]
    phases = ["forward"] * n_fw + ["backward"] * n_bw
    at_peak = [Contributor(f"saved_{k}", "forward", peak // 20) for k in range(20)]
    return StaticLiveness(names, phases, live, peak, step, at_peak)


def _timeline(rng: random.Random, n_compute: int, n_coll: int) -> OverlapTimeline:
    t, compute = 0.0, []
    for i in range(n_compute):
        d = rng.random() * 0.05
        compute.append(ComputeSpan(f"op_{i}", t, t + d))
        t += d
    colls = []
    for i in range(n_coll):
        s = t * i / n_coll
        colls.append(CollectiveSpan(f"all_gather_{i}", "all_gather" if i % 3 else "reduce_scatter",
                                    "dp" if i % 4 else "tp", 50 << 20, s, s, s + t / n_coll * 0.9,
                                    waited_at=s + t / n_coll, hidden=[("op_1", 0.1)], hidden_count=12))
    return OverlapTimeline(compute, colls, t, t)


def _panels(rng: random.Random, n: int) -> list[BucketPanel]:
    out = []
    for graph, kind in (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")):
        buckets = tuple(
            BucketView(tuple(roles.param(f"layers.{i}.w{k}.weight") for k in range(3)),
                       tuple(rng.randint(4 << 20, 8 << 20) for _ in range(3)), 25 << 20,
                       rng.randint(10, 1500), "bytes")
            for i in range(n)
        )
        out.append(BucketPanel(graph, kind, "dp", buckets, 1500))
    return out


def synthetic_views(
    *, stages: int = 7, fw_nodes: int = 4107, bw_nodes: int = 8006, collectives: int = 300,
    buckets: int = 100, seed: int = 0,
) -> list[StageView]:
    """``stages`` forward/backward stages of the given sizes; every other stage changes a few
    lines, so the page carries diffs against the previous stage."""
    rng = random.Random(seed)
    base_fw, base_bw = _text(rng, fw_nodes, "a"), _text(rng, bw_nodes, "b")
    views = []
    for i in range(stages):
        fw = base_fw if i % 2 == 0 else base_fw.replace("mm_1", f"mm_1 stage{i}", 3)
        bw = base_bw if i % 2 == 0 else base_bw.replace("bmm_2", f"bmm_2 stage{i}", 3)
        views.append(StageView(
            name=f"stage_{i}",
            texts={"forward": fw, "backward": bw},
            stats={"fw": _stats(fw_nodes), "bw": _stats(bw_nodes), "saved_count": 943,
                   "saved_bytes": 29 << 30, "static_peak_bytes": 40 << 30},
            liveness=_liveness(rng, fw_nodes, bw_nodes),
            collectives={("all_gather", "dp"): (291, 30 << 30), ("reduce_scatter", "dp"): (291, 30 << 30),
                         ("all_reduce", "tp"): (128, 8 << 30)},
            timelines={"forward": _timeline(rng, fw_nodes, collectives),
                       "backward": _timeline(rng, bw_nodes, collectives)},
            buckets=_panels(rng, buckets) if i >= 3 else None,
        ))
    return views


def _stats(n: int) -> dict:
    return {"categories": {"compute": n // 2, "view": n // 4, "other": n // 8, "placeholder": 300,
                           "output": 1, "collective": 300, "wait": 300},
            "collectives": {"all_gather": {"dp": {"count": 291, "bytes": 30 << 30}}},
            "max_consec_compute_between_rs": 11, "must_save": 0, "num_nodes": n,
            "recompute": {}, "waits": 300}


if __name__ == "__main__":
    import sys
    import time
    from pathlib import Path

    from verify.commands.html.page import build_page

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "synthetic-report")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    html = build_page(synthetic_views(), title="synthetic 8B-sized report")
    (out / "index.html").write_text(html, encoding="utf-8")
    print(f"{out / 'index.html'}: {len(html) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
