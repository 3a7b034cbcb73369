"""Inside a parity world: agree on every graph's collectives before any of them runs.

Each rank reads its own graphs' collectives (``verify.graphs.collective_agreement``), the ranks
exchange them with ``all_gather_object`` (pickled, its sizes exchanged first: it cannot itself
mismatch), and every rank compares all of them. A mismatch raises
:class:`~verify.graphs.collective_agreement.CollectiveMismatchError` naming the graph, the
collective's position, and each side's node and module path, on *every* rank, before the first
collective reaches the backend: the world ends with that error (``RankFailedError`` from the
launcher) instead of gloo aborting every rank with "Received data size doesn't match expected
size". One exchange per world and model, a few kB. Both parity worlds call it before training:
the planned one (``verify.parity.planned``: every stage's graphs and the rank's collective passes)
and the hand plans' (``verify.parity.runs``: every stage's graphs, the rank's own where it re-ran
the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import fx

from verify.graphs.collective_agreement import check_agreement, rank_calls


def agree_on_collectives(graphs: Sequence[tuple[str, fx.GraphModule]], group=None) -> int:
    """Check that every rank of ``group`` (default: the world) issues the same collectives in
    ``graphs`` ((label, graph), this rank's); the number of collectives compared per rank."""
    calls = rank_calls(graphs)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, calls, group=group)
    check_agreement(gathered)
    return sum(len(c) for c in calls.values())


__all__ = ["agree_on_collectives"]
