"""``cat(split(x, c, dim=a), dim=b)`` with ``a != b``: one permuted copy, not W getitems and a cat.

DTensor gathers or scatters a dim other than 0 around a dim-0 collective: an all-gather's
result is chunked on dim 0 and the chunks concatenated on the gathered dim
(``all_gather -> wait -> split -> W getitems -> cat``), and a reduce-scatter's input is chunked
on the scattered dim and concatenated on dim 0 (``split -> W getitems -> cat ->
reduce_scatter``). Traced, each move is ``W + 2`` nodes (W the group size: 17 on a dp16 mesh),
about 1,900 nodes of an 8B planned graph, which every later stage pays for.

The same values, moved once: with ``x`` of shape ``S`` (``S[a] = W * c``), chunk ``i`` lands at
block ``i`` of dim ``b``, so

    reshape(x, S with dim a split into [W, c])      # W before the chunk's own dim
    -> permute (the W dim moved just before dim b)
    -> clone(memory_format=contiguous)               # the one copy, like cat's
    -> view(the cat's shape)

Four nodes whatever W is; a pure data movement, so the values are bitwise the cat's, and the
result is contiguous like the cat's. The rewrite applies when the cat reads, in order, every
piece of one equal-sized ``split`` of ``x`` (``split.Tensor`` or ``split_with_sizes`` with equal
sizes) along another dim; the split and its getitems go when nothing else reads them. Every new
node takes the cat's meta (phase, module path, the planned node it serves), so the collectives
checks that read ``custom[PLANNED_NODE]`` see the same graph.

Patch ``permuted_split_cat``; disabled, the pass rewrites nothing and reports every match as left.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autoparallel import patches
from autoparallel.fx_utils import new_node_like, node_val

log = logging.getLogger(__name__)

PATCH = "permuted_split_cat"

aten = torch.ops.aten
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})


@dataclass
class SplitCatReport:
    """Cats rewritten (``"<cat>: W=<n> dim <a> -> <b>"``), matches left (patch disabled), and the
    node count before and after."""

    rewritten: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    @property
    def acted(self) -> int:
        return len(self.rewritten)

    def summary(self) -> str:
        left = f", {len(self.left)} left (patch {PATCH} disabled)" if self.left else ""
        return f"{len(self.rewritten)} split -> cat chains as permuted copies ({self.nodes_before} -> {self.nodes_after} nodes){left}"


@dataclass(frozen=True)
class _Match:
    cat: fx.Node
    split: fx.Node
    pieces: int
    split_dim: int
    cat_dim: int


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _equal_split(split: fx.Node, size: int) -> int | None:
    """The chunk size of ``split`` if all its pieces are equal (and divide ``size``), else None."""
    arg = split.args[1]
    if split.target is aten.split.Tensor:
        c = int(arg)
        return c if c > 0 and size % c == 0 else None
    sizes = [int(s) for s in arg]
    return sizes[0] if sizes and len(set(sizes)) == 1 and sizes[0] * len(sizes) == size else None


def _match(cat: fx.Node) -> _Match | None:
    """``cat`` as a permuted copy of one split's pieces, or None."""
    pieces = cat.args[0]
    if not isinstance(pieces, list | tuple) or len(pieces) < 2:
        return None
    first = pieces[0]
    if not (isinstance(first, fx.Node) and first.target is operator.getitem):
        return None
    split = first.args[0]
    if not (isinstance(split, fx.Node) and split.op == "call_function" and split.target in _SPLITS):
        return None
    x = split.args[0]
    xval = node_val(x, "the permuted split -> cat rewrite")
    rank = xval.dim()
    a = _dim(int(split.args[2]) if len(split.args) > 2 else int(split.kwargs.get("dim", 0)), rank)
    b = _dim(int(cat.args[1]) if len(cat.args) > 1 else int(cat.kwargs.get("dim", 0)), rank)
    if a == b:
        return None
    c = _equal_split(split, int(xval.shape[a]))
    if c is None or int(xval.shape[a]) // c != len(pieces):
        return None
    for i, p in enumerate(pieces):
        if not (isinstance(p, fx.Node) and p.target is operator.getitem and p.args == (split, i)):
            return None
    return _Match(cat, split, len(pieces), a, b)


def permute_plan(shape: list[int], pieces: int, a: int, b: int) -> tuple[list[int], list[int]]:
    """(the shape ``x`` is viewed as, the permutation) for moving ``pieces`` chunks of dim ``a``
    of a tensor of ``shape`` to blocks of dim ``b``."""
    src: list = []
    for d, s in enumerate(shape):
        src += ["W", d] if d == a else [d]
    dst: list = []
    for d in range(len(shape)):
        dst += ["W", d] if d == b else [d]
    viewed: list[int] = []
    for d, s in enumerate(shape):
        viewed += [pieces, s // pieces] if d == a else [s]
    return viewed, [src.index(label) for label in dst]


def _rewrite(graph: fx.Graph, m: _Match) -> None:
    x = m.split.args[0]
    shape = [int(s) for s in node_val(x, "the permuted split -> cat rewrite").shape]
    out_shape = [int(s) for s in node_val(m.cat, "the permuted split -> cat rewrite").shape]
    split_shape, perm = permute_plan(shape, m.pieces, m.split_dim, m.cat_dim)
    with graph.inserting_before(m.cat):
        v = new_node_like(graph, aten.reshape.default, (x, split_shape), m.cat)
        v = new_node_like(graph, aten.permute.default, (v, perm), m.cat)
        v = new_node_like(graph, aten.clone.default, (v,), m.cat, {"memory_format": torch.contiguous_format})
        v = new_node_like(graph, aten.view.default, (v, out_shape), m.cat)
    m.cat.replace_all_uses_with(v)
    graph.erase_node(m.cat)
    getitems = [u for u in m.split.users if u.target is operator.getitem]
    for g in getitems:
        if not g.users:
            graph.erase_node(g)
    if not m.split.users:
        graph.erase_node(m.split)


def permuted_split_cat(gm: fx.GraphModule, report: SplitCatReport | None = None) -> SplitCatReport:
    """Rewrite every matching ``split -> getitems -> cat`` of ``gm`` in place (module docstring);
    returns the report. Needs ``meta["val"]`` on the split's input and the cat (ValueError naming
    the node otherwise)."""
    report = report if report is not None else SplitCatReport()
    graph = gm.graph
    report.nodes_before = len(graph.nodes)
    enabled = patches.enabled(PATCH)
    for cat in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
        m = _match(cat)
        if m is None:
            continue
        what = f"{cat.name}: W={m.pieces} dim {m.split_dim} -> {m.cat_dim}"
        if not enabled:
            report.left.append(what)
            continue
        _rewrite(graph, m)
        report.rewritten.append(what)
    if report.rewritten:
        graph.lint()
        gm.recompile()
    report.nodes_after = len(graph.nodes)
    log.info("permuted_split_cat: %s", report.summary())
    return report


__all__ = ["PATCH", "SplitCatReport", "permute_plan", "permuted_split_cat"]
