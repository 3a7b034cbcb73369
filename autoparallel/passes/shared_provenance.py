"""Provenance shared, not deep-copied, while Inductor's bucketing merges collectives.

Upstream bucketing (``torch/_inductor/fx_passes/bucketing.py``, ``_populate_node_meta``) gives
every node it creates one ``NodeSource`` per collective of the bucket, and each ``NodeSource``
deep-copies its original node's ``meta["from_node"]`` history: new nodes x bucket members deep
copies, which was half the time of the collective passes on tiny LLaMA (bucket_fw_bw 1.54-1.85 s
-> 0.80-0.85 s on the second compile's graphs of tiny-fsdp-dp8, measured with the patch on and
off on the 2-core box).

:func:`run_with_shared_provenance` takes the histories off the graph's nodes before a pass (so
the copies are of empty lists) and gives them back after it: to every node that still exists, its
own list; to every ``NodeSource`` the pass created for one of those nodes, the same list (shared).
The provenance that results is the one upstream would have built, equal node by node
(``NodeSource.to_dict``); only its lists are shared instead of copied. Histories are records that
nothing mutates in place (passes build new ``from_node`` lists), so sharing them is safe.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from autoparallel import meta as M
from autoparallel import patches

PATCH = "shared_provenance"


def _take_histories(gm: fx.GraphModule) -> dict[str, list]:
    return {n.name: n.meta.pop(M.FROM_NODE) for n in gm.graph.nodes if M.FROM_NODE in n.meta}


def _give_back_histories(gm: fx.GraphModule, histories: dict[str, list]) -> None:
    for n in gm.graph.nodes:
        sources = n.meta.get(M.FROM_NODE)
        if sources is None:
            if n.name in histories:  # a node that was there before the pass
                n.meta[M.FROM_NODE] = histories[n.name]
            continue
        for src in sources:  # made by the pass, from nodes that were there before it
            info = getattr(src, "node_info", None)
            if info is not None and not src.from_node and info.name in histories:
                src.from_node = histories[info.name]
                src._dict = None  # NodeSource caches its dict form; drop one built without history


def run_with_shared_provenance(
    gm: fx.GraphModule, run: Callable[[fx.GraphModule], fx.GraphModule]
) -> fx.GraphModule:
    """``run(gm)`` (a graph pass that returns the graph module it leaves), with the nodes'
    provenance histories shared instead of deep-copied by upstream bucketing."""
    if not patches.enabled(PATCH):
        return run(gm)
    histories = _take_histories(gm)
    out = None
    try:
        out = run(gm)
    finally:
        _give_back_histories(out if out is not None else gm, histories)
    return out


__all__ = ["PATCH", "run_with_shared_provenance"]
