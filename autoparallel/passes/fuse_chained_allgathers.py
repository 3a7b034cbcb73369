"""Fuse chained all-gathers over two mesh dims into one all-gather on the flattened group.

Unsharding a parameter sharded on dim 0 over both dims of a 2-D mesh produces a chain

    x -> all_gather(group A) -> wait -> [views composing to the identity] -> all_gather(group B)
      -> wait

which launches two collectives where one on the flattened mesh group suffices. The chain is
fused when the two groups are the two dims of a mesh whose flattened group exists in
``group_dims`` (e.g. ``"dp"``, ``"tp"`` and ``"dp*tp"``: the group sizes multiply to the full
mesh), the values between the two all-gathers are pure views that compose to the identity
(same FakeTensor storage, shape, strides and offset at both ends; a direct chain with no views
counts too, the direction being known from the mesh), and no intermediate has another user.

Data layout. ``all_gather_into_tensor`` concatenates on dim 0 in group-rank order, and mesh groups
rank their members by mesh coordinate. With mesh dims ``(d0, d1)`` (row-major: flat rank
``i0 * n1 + i1``) and a shard ``x[i0, i1]`` on each rank, the chain's result is

* ag1 over d1, then ag2 over d0: ``cat_i0 cat_i1 x[i0, i1]``, block ``i0 * n1 + i1``: exactly
  one all-gather on the row-major flat group;
* ag1 over d0, then ag2 over d1: ``cat_i1 cat_i0 x[i0, i1]``, block ``i1 * n0 + i0``: the flat
  all-gather's blocks in column-major order, so the flat result ``[n0 * n1 * r, ...]`` is viewed
  as ``[n0, n1, r, ...]``, permuted to ``[n1, n0, r, ...]`` and made contiguous.

Every chain the pass finds (an all-gather whose input is, through pure views, the wait of another
all-gather) is either fused or listed in the pass's :class:`ChainReport` with the reason it was
left alone (no flattened group for the two dims, intermediate values with other users, views
that do not compose to the identity, a dtype change, a node already in a fused chain, or the
patch disabled).

Patch ``fuse_chained_allgathers``; disabled, the pass fuses nothing, returns 0 and reports every
chain it found as unfused for that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER, WAIT, group_of, new_node_like, node_val, wait_of
from autoparallel.mesh import FLAT_SEP, dim_label
from autoparallel.passes.permuted_split_cat import permute_plan

log = logging.getLogger(__name__)

PATCH = "fuse_chained_allgathers"

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# Ops that only re-view their input; reshape is included, and the storage check below rejects
# a reshape that copied.
_VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.alias.default,
    }
)


@dataclass
class ChainReport:
    """Every chain found: ``fused`` ones (``"ag1 -> ag2 on <flat group label>"``, ``[column-major]``
    when reshuffled) and ``unfused`` ones with the reason, ``(chain, reason)``."""

    fused: list[str] = field(default_factory=list)
    unfused: list[tuple[str, str]] = field(default_factory=list)

    @property
    def found(self) -> int:
        return len(self.fused) + len(self.unfused)

    def summary(self) -> str:
        out = f"{self.found} chained all-gathers found, {len(self.fused)} fused"
        if self.unfused:
            reasons: dict[str, int] = {}
            for _, why in self.unfused:
                reasons[why] = reasons.get(why, 0) + 1
            out += "; left: " + ", ".join(f"{n} x {why}" for why, n in sorted(reasons.items()))
        return out


# Why a chain is left alone (ChainReport.unfused).
NO_FLAT_GROUP = "no flattened group of the two mesh dims"
SAME_DIM = "both all-gathers on one mesh dim"
SHARED = "an intermediate value has other users"
NOT_IDENTITY = "the views between do not compose to the identity"
DTYPE_CHANGE = "the two all-gathers move different dtypes"
OVERLAP = "shares a node with a chain fused before it"
DISABLED = "patch fuse_chained_allgathers disabled"


@dataclass(frozen=True)
class _Chain:
    ag1: fx.Node
    wait1: fx.Node
    views: tuple[fx.Node, ...]
    ag2: fx.Node
    wait2: fx.Node
    flat_name: str
    column_major: bool  # ag1 gathers over the outer mesh dim: reshuffle needed
    sizes: tuple[int, int]  # (size of the outer flat dim, size of the inner flat dim)
    moved_dim: int = 0  # the dim ag1's blocks are moved to by a permuted copy (0: none)


def _storage(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _identity_views(wait1: fx.Node, views: list[fx.Node], end: fx.Node) -> bool:
    """Whether ``end`` is ``wait1`` re-viewed: all views of its storage, same geometry."""
    start = node_val(wait1, "the identity check of a chained all-gather")
    last = node_val(end, "the identity check of a chained all-gather")
    if not views:
        return True
    if not all(isinstance(v, torch.Tensor) for v in (start, last)):
        return False
    base = _storage(start)
    for v in views:
        val = node_val(v, "the identity check of a chained all-gather")
        if not isinstance(val, torch.Tensor) or _storage(val) != base:
            return False
    return (
        tuple(start.shape) == tuple(last.shape)
        and tuple(start.stride()) == tuple(last.stride())
        and start.storage_offset() == last.storage_offset()
        and start.dtype == last.dtype
    )


def _flat_group(
    label1: str, label2: str, group_dims: Mapping[str, str]
) -> tuple[str, list[str]] | None:
    """The flattened group made of exactly mesh dims {label1, label2}, and its dim order."""
    for name, label in group_dims.items():
        parts = label.split(FLAT_SEP)
        if len(parts) == 2 and set(parts) == {label1, label2} and label1 != label2:
            return name, parts
    return None


def _size_of(label: str, name: str, group_sizes: Mapping[str, int] | None, where: fx.Node) -> int:
    if group_sizes is not None:
        if label not in group_sizes:
            raise ValueError(f"node {where.name!r}: group_sizes has no size for mesh dim {label!r}")
        return int(group_sizes[label])
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(
            f"node {where.name!r}: fusing needs the size of mesh dim {label!r}; pass "
            "group_sizes={label: size} or run inside the (fake) world the graph was traced on"
        )
    try:
        return dist.distributed_c10d._resolve_process_group(name).size()
    except (RuntimeError, ValueError, KeyError):
        raise ValueError(
            f"node {where.name!r}: process group {name!r} (mesh dim {label!r}) is unknown to the "
            "running world; rebind the graph to this world or pass group_sizes"
        ) from None


def _describe(ag1: fx.Node, ag2: fx.Node, group_dims: Mapping[str, str]) -> str:
    return f"{ag1.name}({group_dims.get(str(group_of(ag1)), '?')}) -> {ag2.name}({group_dims.get(str(group_of(ag2)), '?')})"


def _moved_blocks(end: fx.Node) -> tuple[fx.Node, int, tuple[fx.Node, ...], int] | None:
    """``(wait, d, copy nodes, pieces)`` if ``end`` is the permuted copy that moves the
    ``pieces`` dim-0 blocks of ``wait`` to dim ``d > 0`` (``passes/permuted_split_cat.py``:
    reshape -> permute -> contiguous clone -> view, each read once; the lowering's own moves,
    ``planner/moves.py``, trace the reshape of the contiguous gathered tensor as a view), else None."""
    nodes = [end]
    for targets in ({aten.clone.default}, {aten.permute.default}, {aten.reshape.default, aten.view.default}):
        prev = nodes[-1].args[0] if nodes[-1].args else None
        if not (isinstance(prev, fx.Node) and prev.target in targets and len(prev.users) == 1):
            return None
        nodes.append(prev)
    view, clone, permute, reshape = nodes
    wait = reshape.args[0]
    if view.target is not aten.view.default or clone.kwargs.get("memory_format") is not torch.contiguous_format:
        return None
    if not (isinstance(wait, fx.Node) and wait.target is WAIT and len(wait.users) == 1):
        return None
    shape = [int(s) for s in node_val(wait, "a permuted copy after an all-gather").shape]
    pieces = int(reshape.args[1][0]) if reshape.args[1] else 0
    if pieces < 1 or shape[0] % pieces:
        return None
    for d in range(1, len(shape)):
        viewed, perm = permute_plan(shape, pieces, 0, d)
        moved = list(shape)
        moved[0], moved[d] = shape[0] // pieces, shape[d] * pieces
        if list(reshape.args[1]) == viewed and list(permute.args[1]) == perm and list(view.args[1]) == moved:
            return wait, d, (reshape, permute, clone, view), pieces
    return None


def _match(
    ag2: fx.Node, group_dims: Mapping[str, str], group_sizes: Mapping[str, int] | None
) -> _Chain | tuple[fx.Node, str] | None:
    """The fusible chain ending at ``ag2``; ``(ag1, reason)`` for a chain that cannot be fused;
    None when ``ag2`` ends no chain (its input is not, through views or one permuted copy of its
    blocks to another dim, another all-gather's wait)."""
    wait2 = wait_of(ag2)
    if wait2 is None:
        return None
    views: list[fx.Node] = []
    shared = False
    moved_dim = 0
    cur = ag2.args[0]
    moved = _moved_blocks(cur) if isinstance(cur, fx.Node) else None
    if moved is not None:
        cur, moved_dim, copy, _ = moved
        views = list(reversed(copy))
    while moved is None and isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target in _VIEW_OPS:
        shared = shared or len(cur.users) != 1
        views.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node) or cur.op != "call_function" or cur.target is not WAIT:
        return None
    wait1 = cur
    ag1 = wait1.args[0]
    if not isinstance(ag1, fx.Node) or ag1.target is not ALL_GATHER or wait_of(ag1) is not wait1:
        return None
    if moved is not None and int(ag1.args[1]) != moved[3]:
        return None  # the copy moves another number of blocks than ag1 gathered
    views.reverse()
    label1 = dim_label(group_of(ag1), group_dims, where=ag1.name)
    label2 = dim_label(group_of(ag2), group_dims, where=ag2.name)
    if label1 == label2:
        return ag1, SAME_DIM
    if shared or len(wait1.users) != 1:
        return ag1, SHARED
    flat = _flat_group(label1, label2, group_dims)
    if flat is None:
        return ag1, NO_FLAT_GROUP
    flat_name, order = flat
    n1, n2 = int(ag1.args[1]), int(ag2.args[1])
    s1 = _size_of(label1, group_of(ag1), group_sizes, ag1)
    s2 = _size_of(label2, group_of(ag2), group_sizes, ag2)
    s_flat = _size_of(group_dims[flat_name], flat_name, group_sizes, ag2)
    if (n1, n2) != (s1, s2) or s1 * s2 != s_flat:
        raise ValueError(
            f"chained all-gathers {ag1.name!r} -> {ag2.name!r} have the wrong shape: group sizes "
            f"{n1} ({label1!r} has {s1}) and {n2} ({label2!r} has {s2}) must multiply to the "
            f"{group_dims[flat_name]!r} group's {s_flat}; the graph does not match its mesh"
        )
    if node_val(ag1, "dtype").dtype != node_val(ag2, "dtype").dtype:
        return ag1, DTYPE_CHANGE
    if not moved_dim and not _identity_views(wait1, views, ag2.args[0]):
        return ag1, NOT_IDENTITY
    column_major = order.index(label1) < order.index(label2)
    # Flat rank = i_outer * n_inner + i_inner, outer = the first dim of the flat label.
    sizes = (n1, n2) if column_major else (n2, n1)
    return _Chain(ag1, wait1, tuple(views), ag2, wait2, flat_name, column_major, sizes, moved_dim)


def _block_order(ch: _Chain, rank: int) -> list[int]:
    """The permutation of the flat result viewed as ``[n_outer, n_inner, *shard dims]`` that puts
    ag2's blocks first and ag1's just before dim ``moved_dim`` (the identity: no reshuffle)."""
    a, b = ("o", "i") if ch.column_major else ("i", "o")  # ag1's and ag2's mesh dim in the flat group
    src = ["o", "i", *range(rank)]
    dst: list = [b]
    for d in range(rank):
        dst += [a, d] if d == ch.moved_dim else [d]
    return [src.index(label) for label in dst]


def _rewrite(graph: fx.Graph, ch: _Chain) -> None:
    x = ch.ag1.args[0]
    n_outer, n_inner = ch.sizes
    with graph.inserting_before(ch.ag2):
        ag = new_node_like(graph, ALL_GATHER, (x, n_outer * n_inner, ch.flat_name), ch.ag2)
        out = new_node_like(graph, WAIT, (ag,), ch.wait2)
        shard = [int(s) for s in node_val(x, "the fused result's shape").shape]
        perm = _block_order(ch, len(shard))
        if perm != sorted(perm):
            shape = list(node_val(ch.wait2, "the fused result's shape").shape)
            out = new_node_like(graph, aten.view.default, (out, [n_outer, n_inner, *shard]), ch.wait2)
            out = new_node_like(graph, aten.permute.default, (out, perm), ch.wait2)
            out = new_node_like(graph, aten.clone.default, (out,), ch.wait2, {"memory_format": torch.contiguous_format})
            out = new_node_like(graph, aten.view.default, (out, shape), ch.wait2)
    ch.wait2.replace_all_uses_with(out)
    for node in (ch.wait2, ch.ag2, *reversed(ch.views), ch.wait1, ch.ag1):
        graph.erase_node(node)


def fuse_chained_allgathers(
    graph: fx.Graph | fx.GraphModule,
    group_dims: Mapping[str, str] | None = None,
    group_sizes: Mapping[str, int] | None = None,
    *,
    report: ChainReport | None = None,
) -> int:
    """Fuse every eligible all-gather chain of ``graph`` in place; return how many were fused.

    ``group_dims`` (process-group name -> mesh-dim label, as ``ParallelMesh.group_dims``)
    defaults to the graph module's ``meta[GM_GROUP_DIMS]``. ``group_sizes`` (mesh-dim label ->
    size, e.g. ``{"dp": 4, "tp": 2, "dp*tp": 8}``) defaults to the sizes of the running world's
    groups. ``report``: filled with every chain found, fused or not and why (module docstring).
    Raises ValueError naming the node for an all-gather whose group is not in ``group_dims``, and
    for a chain whose group sizes do not match the mesh.
    """
    gm = graph if isinstance(graph, fx.GraphModule) else None
    g = gm.graph if gm is not None else graph
    report = report if report is not None else ChainReport()
    if group_dims is None:
        group_dims = (
            dict(getattr(gm, "meta", {}).get(M.GM_GROUP_DIMS, {})) if gm is not None else {}
        )
        if not group_dims:
            raise ValueError(
                "fuse_chained_allgathers needs the graph's group-name -> mesh-dim map: pass "
                "group_dims=mesh.group_dims or attach it with autoparallel.mesh.attach_group_dims"
            )
    enabled = patches.enabled(PATCH)
    all_gathers = list(g.find_nodes(op="call_function", target=ALL_GATHER))
    for node in all_gathers:
        dim_label(group_of(node), group_dims, where=node.name)
    chains = []
    used: set[fx.Node] = set()  # a node belongs to at most one fused chain
    for node in all_gathers:
        ch = _match(node, group_dims, group_sizes) if enabled else _match_unfused(node, group_dims, group_sizes)
        if ch is None:
            continue
        if isinstance(ch, tuple):
            report.unfused.append((_describe(ch[0], node, group_dims), ch[1]))
            continue
        if {ch.ag1, ch.wait1, ch.ag2, ch.wait2} & used:
            report.unfused.append((_describe(ch.ag1, ch.ag2, group_dims), OVERLAP))
            continue
        chains.append(ch)
        used |= {ch.ag1, ch.wait1, ch.ag2, ch.wait2}
        report.fused.append(
            f"{_describe(ch.ag1, ch.ag2, group_dims)} on {group_dims[ch.flat_name]}" + (" [column-major]" if ch.column_major else "")
            + (f" [blocks to dim {ch.moved_dim}]" if ch.moved_dim else "")
        )
    for ch in chains:
        _rewrite(g, ch)
    if chains:
        g.lint()
        if gm is not None:
            gm.recompile()
    if not enabled:
        log.info("fuse_chained_allgathers: disabled (AUTOPARALLEL_DISABLE); %d chains left", report.found)
    log.info("fuse_chained_allgathers: %s", report.summary())
    return len(chains)


def _match_unfused(ag2: fx.Node, group_dims, group_sizes) -> tuple[fx.Node, str] | None:
    """With the patch disabled: every chain found, reported as left alone for that reason."""
    got = _match(ag2, group_dims, group_sizes)
    if got is None:
        return None
    return (got.ag1 if isinstance(got, _Chain) else got[0]), DISABLED


__all__ = ["PATCH", "ChainReport", "fuse_chained_allgathers"]
