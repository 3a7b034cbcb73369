"""Keep uneven shards out of plans that run: every rank must issue the same collectives.

The candidates list padded ``Shard(0)`` for parameters whose dim 0 does not divide (how FSDP2
pads, priced at its padded bytes; :mod:`autoparallel.planner.strategies`), and their casts,
aliases, gradients and ``getitem`` s follow. A plan that runs is lowered through DTensor's own
redistributions (:mod:`autoparallel.planner.lower`), and DTensor pads *only the short pieces*:
the rank holding a full chunk gathers directly, the one holding a short chunk pads, gathers and
narrows. Lowered graphs then differ between ranks in structure, not only in values (on a 2-D
mesh the per-step chunk sizes differ between groups as well), and the collective passes decide
per rank: ``fuse_chained_allgathers`` fuses a tp -> dp chain where it is direct and not where a
pad sits in between, bucketing merges other gathers, and one rank issues a bucket of 25 floats
where its peer issues 24 (gloo aborts every rank: "Received data size doesn't match expected
size"; a 3-label BERT token classifier on dp=2,tp=2).

So a plan made to run keeps only candidates whose every output divides evenly over the mesh dims
that shard it (:func:`even_masks`, applied like pins): every rank's lowered graph then has the
same nodes and the same local shapes, whatever pass runs on it later. What it costs: a parameter
with no evenly divisible dim stays replicated (a 3-label head's bias; a weight still shards on
its other dim), a few elements per rank. Pricing a hand plan (``evaluate_hand_plan``) keeps the
padded candidates: the hand FSDP plan pads every rank's shard to the same size itself, and that
plan is priced, never lowered. ``lower.node_placements`` refuses an uneven placement in a plan
loaded from elsewhere, naming the node.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autoparallel.planner.problem import param_local_bytes
from autoparallel.planner.strategies import Candidate, divides


def even_candidate(cand: Candidate, metas, sizes, cache: dict | None = None) -> bool:
    """Whether every tensor output of ``cand`` divides evenly over the mesh (no padding).

    Outputs suffice: an op's own candidates already require even inputs (``divides`` without
    padding), and every other input is some producer's output. ``cache``: verdicts by (shape,
    placements), which repeat across a model's blocks."""
    cache = {} if cache is None else cache
    for pl, meta in zip(cand.outs, metas, strict=False):
        if pl is None or meta is None:
            continue
        key = (tuple(meta.shape), pl)
        ok = cache.get(key)
        if ok is None:
            ok = cache[key] = divides(pl, meta.shape, sizes)
        if not ok:
            return False
    return True


def even_masks(graph) -> dict[int, np.ndarray]:
    """Per node (index) with an uneven candidate: the mask of its even candidates.

    Uneven candidates all descend from a parameter's padded ``Shard(0)`` (ops, inputs and free
    outputs are listed only where they divide; casts, aliases, getitems and gradients follow their
    producer or parameter), so a model whose parameters all divide is not scanned further (the
    8B preset's 9,805 nodes: 8 ms, against 0.5 s for the whole scan). Should a strategy ever
    list an uneven candidate of its own, the lowering still refuses it, naming the node."""
    out: dict[int, np.ndarray] = {}
    cache: dict = {}
    params = graph.params()
    if all(even_candidate(c, pn.metas, graph.mesh_sizes, cache) for pn in params for c in pn.candidates):
        return out
    for pn in graph.nodes:
        mask = np.array([even_candidate(c, pn.metas, graph.mesh_sizes, cache) for c in pn.candidates], dtype=bool)
        if not mask.all():
            out[pn.index] = mask
    return out


def with_even_shards(graph, pins: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """``pins`` (allowed-candidate masks) with every uneven candidate masked out; ValueError
    naming the node where a pin allows only uneven ones."""
    out = dict(pins)
    for i, mask in even_masks(graph).items():
        both = mask & out[i] if i in out else mask
        if not both.any():
            pn = graph.nodes[i]
            raise ValueError(
                f"pin of {pn.key}: its placement does not divide {tuple(pn.meta.shape)} evenly on mesh "
                f"{dict(zip(graph.mesh_names, graph.mesh_sizes, strict=True))}; a plan that runs keeps every "
                "rank's shard the same size (uneven shards lower to different collectives per rank): "
                "pin an even placement, or price it with PlannerConfig(even_shards=False)"
            )
        out[i] = both
    return out


def param_bytes_floor(graph, masks: Mapping[int, np.ndarray]) -> int:
    """Per-rank parameter bytes with each parameter at its smallest allowed candidate (the
    default budget, "fully sharded", among the candidates the plan may use)."""
    total = 0
    for pn in graph.params():
        mask = masks.get(pn.index)
        total += min(param_local_bytes(pn.meta, c.outs[0], graph.mesh_sizes)
                     for j, c in enumerate(pn.candidates) if mask is None or mask[j])
    return total


__all__ = ["even_candidate", "even_masks", "param_bytes_floor", "with_even_shards"]
