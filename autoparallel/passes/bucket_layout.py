"""A bucket's layout is a contract between ranks: its members listed in an order every rank shares.

A merged collective concatenates its members in the order its bucket lists them, and every rank
splits the result with its own list. Graphs traced per rank (an MoE whose routing differs between
the ranks' slices: ``verify.parity.retrace``) compute the same gradients in other orders: a rank
whose slice skips an expert gets that expert's zero gradient at the loss's backward
(``autoparallel.parallelize.gathered_first.ZeroGrads``), a rank that ran it gets its gradient in
the expert's backward. Listed in graph order, the same members then sit at other offsets on each
rank, and the reduction adds one rank's rows of one gradient to another rank's rows of another:
the sizes agree, nothing aborts, the gradients are wrong (docs/failure-classes.md 11m).

Listed by what each member carries, the layout no longer depends on the graph's order: an
all-gather by the role of the one placeholder its input is read from when that is a parameter
(``param:<fqn>``), a reduction by the role of the one graph output its result reaches when that
is a gradient (``grad:<fqn>``). A bucket with a member without such a role (a collective of
activations) stays in graph order, as before. Patch
``canonical_bucket_layout``; :func:`autoparallel.passes.bucket_plan.plan_buckets` applies it, so
both bucketing passes do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.fx_utils import ALL_GATHER, ALL_GATHER_OUT, wait_of

PATCH = "canonical_bucket_layout"

_MAX_HOPS = 64  # a result reaches its output through a few views, casts and splits


def _placeholder_role(collective: fx.Node) -> str | None:
    """The role of the one placeholder an all-gather's input is computed from (None: not one)."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = list(collective.args[:1])
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(node)
        stack.extend(node.all_input_nodes)
    role = next(iter(found)).meta.get(M.ROLE) if len(found) == 1 else None
    return role if roles.is_param(role) else None


def _output_roles(graph: fx.Graph) -> dict[fx.Node, str]:
    out = graph.output_node()
    labels = out.meta.get(M.ROLE)
    leaves = pytree.tree_leaves(out.args[0])
    if labels is None or len(labels) != len(leaves):
        return {}
    found: dict[fx.Node, str] = {}
    for leaf, role in zip(leaves, labels, strict=True):
        if isinstance(leaf, fx.Node):
            found.setdefault(leaf, role)
    return found


def _output_role(collective: fx.Node, outputs: dict[fx.Node, str]) -> str | None:
    """The role of the one gradient output a reduction's result reaches (None: it reaches another
    output too, or none)."""
    start = wait_of(collective) or collective
    reached: set[str] = set()
    seen, todo = {start}, deque([(start, 0)])
    while todo:
        node, hops = todo.popleft()
        if node in outputs:
            reached.add(outputs[node])
        if hops >= _MAX_HOPS:
            continue
        for user in node.users:
            if user.op != "output" and user not in seen:
                seen.add(user)
                todo.append((user, hops + 1))
    role = next(iter(reached)) if len(reached) == 1 else None
    return role if roles.is_grad(role) else None


def layout_keys(graph: fx.Graph, candidates: Sequence[fx.Node]) -> dict[fx.Node, str | None]:
    """Per candidate collective, the role that places it in a bucket (module docstring)."""
    outputs = _output_roles(graph)
    keys: dict[fx.Node, str | None] = {}
    for c in candidates:
        if c.target in (ALL_GATHER, ALL_GATHER_OUT):
            keys[c] = _placeholder_role(c)
        else:
            keys[c] = _output_role(c, outputs)
    return keys


def ordered_members(bucket: list[fx.Node], keys: dict[fx.Node, str | None]) -> list[fx.Node]:
    """``bucket`` listed by its members' roles when every member has a distinct one and the patch
    is on; else as given (graph order)."""
    roles_ = [keys.get(n) for n in bucket]
    if not patches.enabled(PATCH) or any(r is None for r in roles_) or len(set(roles_)) != len(roles_):
        return bucket
    return [n for _, n in sorted(zip(roles_, bucket, strict=True), key=lambda rn: rn[0])]


__all__ = ["PATCH", "layout_keys", "ordered_members"]
