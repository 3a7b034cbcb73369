"""Do all ranks' graphs issue the same collectives? Compared before anything runs.

A collective whose size differs between ranks reaches gloo as "Received data size doesn't match
expected size" and gloo aborts every rank (SIGABRT: no Python exception, no node named). Graphs
can differ per rank (a lowered plan keeps the rank's piece, bucketing runs on each rank's graph),
so each rank's graphs are read here *before* any collective runs: per graph, the sequence of
collectives in issue order, each as a :class:`CollectiveCall` (its op, mesh dim, the shapes and
dtypes of its tensors, its other arguments; the group *name* differs between ranks of one mesh
dim, so the mesh dim stands for it). :func:`check_agreement` compares the ranks' sequences and
raises :class:`CollectiveMismatchError` naming the first collective that differs, with its node
and module path on each side. ``verify.parity.collective_check`` exchanges the sequences inside a
parity world (every rank raises the same error, the world ends cleanly); on a fake world, the
planner's per-rank lowerings can be compared directly (``tests/property``), and there
:func:`structure_disagreement` asks more: that the ranks' graphs are one program up to the piece
a local split keeps (a pad only some ranks have leaves the collectives' sizes equal, and then a
pass decides differently per rank: how the padded shards of ``plan="auto"`` broke).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel.fx_utils import GROUP_ARG, group_arg, group_arg_name, schema_group_index
from autoparallel.mesh import group_dims_of
from verify.graphs.bucket_members import SPLITS, bucket_members
from verify.graphs.classify import collective_kind




class CollectiveMismatchError(RuntimeError):
    """Ranks' graphs issue different collectives (named: graph, position, node, module path)."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the ranks must agree on it (``signature``) and where it is (``node``,
    ``module``: for the error only)."""

    signature: tuple
    node: str
    module: str | None
    members: tuple[str, ...] = ()  # the roles it carries, in order (verify.graphs.bucket_members)

    def describe(self) -> str:
        op, dim, tensors, args = self.signature
        shapes = ", ".join(f"{dt}{list(s)}" for s, dt in tensors)
        where = f" in {self.module}" if self.module else ""
        return f"{op} on {dim} of ({shapes}) args {list(args)} at node {self.node!r}{where}"


def _tensor_sig(v) -> list[tuple[tuple[int, ...], str]]:
    if isinstance(v, torch.Tensor):
        return [(tuple(int(s) for s in v.shape), str(v.dtype).removeprefix("torch."))]
    if isinstance(v, list | tuple):
        return [t for x in v for t in _tensor_sig(x)]
    return []


def _static(a):
    if isinstance(a, list | tuple):
        return tuple(_static(x) for x in a)
    if isinstance(a, fx.Node | torch.Tensor):
        return "T"
    return a if isinstance(a, int | float | str | bool | type(None)) else str(a)


def collective_calls(gm: fx.GraphModule) -> list[CollectiveCall]:
    """``gm``'s collectives in graph (issue) order, each with what the ranks must agree on."""
    dims = group_dims_of(gm)
    out = []
    for node in gm.graph.nodes:
        if collective_kind(node) is None:
            continue
        group = group_arg(node)
        name = group_arg_name(group) if group is not None else None
        dim = dims.get(name, f"group {name}") if name is not None else "?"
        at = schema_group_index(node.target)
        tensors = []
        for a in node.all_input_nodes:
            tensors += _tensor_sig(a.meta.get(M.VAL))
        tensors += _tensor_sig(node.meta.get(M.VAL))
        args = tuple(_static(a) for i, a in enumerate(node.args) if i != at and not isinstance(a, fx.Node))
        kwargs = tuple(sorted((k, _static(v)) for k, v in node.kwargs.items() if k != GROUP_ARG and not isinstance(v, fx.Node)))
        module = (node.meta.get(M.CUSTOM) or {}).get(M.MODULE_PATH)
        members = bucket_members(node, collective_kind(node))
        out.append(CollectiveCall((str(node.target), dim, tuple(tensors), args + kwargs), node.name, module, members))
    return out


def rank_calls(graphs: Sequence[tuple[str, fx.GraphModule]]) -> dict[str, list[CollectiveCall]]:
    """Per graph label, its collectives (``graphs``: (label, graph) as ``StageResult.graph_rows``)."""
    return {label: collective_calls(gm) for label, gm in graphs}


def first_disagreement(per_rank: Sequence[Mapping[str, Sequence[CollectiveCall]]]) -> str | None:
    """The first collective the ranks disagree on, described (None: they agree). Ranks are
    compared with rank 0, graph by graph, collective by collective in issue order."""
    ref = per_rank[0]
    for rank, calls in enumerate(per_rank[1:], start=1):
        if set(calls) != set(ref):
            return f"rank 0 has graphs {sorted(ref)}, rank {rank} has {sorted(calls)}"
        for label in ref:
            a, b = ref[label], calls[label]
            for i in range(max(len(a), len(b))):
                ca = a[i] if i < len(a) else None
                cb = b[i] if i < len(b) else None
                if ca is not None and cb is not None and ca.signature == cb.signature:
                    if ca.members == cb.members:
                        continue
                    at = next(j for j, (x, y) in enumerate(zip(ca.members + ("",), cb.members + ("",))) if x != y)
                    return (f"graph {label!r}, collective #{i}: the same sizes, other members: {ca.describe()} "
                            f"carries {_members(ca.members, at)} on rank 0, and rank {rank}'s {cb.node!r} carries "
                            f"{_members(cb.members, at)} (one rank's rows of one tensor would be reduced with another's)")
                left = ca.describe() if ca else "no collective (its graph ends)"
                right = cb.describe() if cb else "no collective (its graph ends)"
                return (f"graph {label!r}, collective #{i}: rank 0 issues {left}; rank {rank} issues {right}")
    return None


def _members(members: tuple[str, ...], at: int) -> str:
    shown = members[at:at + 3]
    return f"{list(shown)} from piece #{at} of {len(members)}" if shown else f"nothing at piece #{at} (it has {len(members)})"


_SLICE = torch.ops.aten.slice.Tensor


def program_structure(gm: fx.GraphModule) -> list[tuple]:
    """``gm``'s nodes as the ranks must share them for every later pass to decide alike: per
    node its op, target, output shapes and dtypes, and arguments (nodes by position), with the
    two things that legitimately differ per rank left out: group names (the mesh dim stands for
    them) and which piece a local split keeps (a ``getitem`` of a ``split``: its index, and
    users reading "a piece of that split"; a ``slice``: its start, its length kept, as the
    lowering's direct ``Replicate -> Shard`` move writes it). A pad or narrow only some ranks have (DTensor's
    uneven shards) shows up here even where the collectives' sizes still agree."""
    dims = group_dims_of(gm)
    pos: dict[fx.Node, object] = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        piece = node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            getattr(node.args[0].target, "overloadpacket", None) in SPLITS
        pos[node] = ("piece of", pos[node.args[0]]) if piece else i
        if piece:
            continue  # its own line would carry the rank's index
        at = schema_group_index(node.target) if node.op == "call_function" else None
        args = tuple(_structure_arg(a, pos, dims) if j != at else _group(a, dims) for j, a in enumerate(node.args))
        if node.target is _SLICE and len(args) >= 4 and all(isinstance(a, int) for a in node.args[2:4]):
            args = (args[0], args[1], ("piece of length", node.args[3] - node.args[2]), *args[4:])  # its start is the rank's
        kwargs = tuple(sorted((k, _group(v, dims) if k == GROUP_ARG else _structure_arg(v, pos, dims))
                              for k, v in node.kwargs.items()))
        out.append((node.op, str(node.target), tuple(_tensor_sig(node.meta.get(M.VAL))), args, kwargs, node.name))
    return out


def _group(a, dims: Mapping[str, str]) -> tuple:
    return ("group", dims.get(group_arg_name(a), "?"))


def _structure_arg(a, pos: Mapping[fx.Node, object], dims: Mapping[str, str]):
    if isinstance(a, fx.Node):
        return pos[a]
    if isinstance(a, list | tuple):
        return tuple(_structure_arg(x, pos, dims) for x in a)
    return _static(a)


def structure_disagreement(per_rank: Sequence[fx.GraphModule]) -> str | None:
    """The first node where a rank's graph differs from rank 0's (:func:`program_structure`,
    node names aside), described; None if they are the same program."""
    ref = program_structure(per_rank[0])
    for rank, gm in enumerate(per_rank[1:], start=1):
        got = program_structure(gm)
        for i in range(max(len(ref), len(got))):
            a = ref[i] if i < len(ref) else None
            b = got[i] if i < len(got) else None
            if a is not None and b is not None and a[:5] == b[:5]:
                continue
            return f"node #{i}: rank 0 has {a[5] if a else 'nothing'} {a[:5] if a else ''}; rank {rank} has {b[5] if b else 'nothing'} {b[:5] if b else ''}"
    return None


def check_agreement(per_rank: Sequence[Mapping[str, Sequence[CollectiveCall]]]) -> None:
    """CollectiveMismatchError naming the first collective the ranks disagree on."""
    diff = first_disagreement(per_rank)
    if diff is not None:
        raise CollectiveMismatchError(
            f"the ranks' graphs issue different collectives, which the backend would abort on: {diff}. "
            "Every rank must issue the same collectives with the same sizes (a shard that does not divide "
            "evenly, a pass that decides differently per rank, or a parameter the model reads on some ranks' "
            "data only, an MoE expert no token of a rank's slice reaches, breaks that)"
        )


__all__ = [
    "CollectiveCall",
    "CollectiveMismatchError",
    "check_agreement",
    "collective_calls",
    "first_disagreement",
    "program_structure",
    "rank_calls",
    "structure_disagreement",
]
