"""Recompute (or save) FSDP all-gathered parameters: the ``reshard_after_forward`` contract.

An FSDP all-gather materialises a full parameter from its shard. With
``reshard_after_forward=True`` the full parameter must not live from forward to backward: the
backward gathers it again. Upstream PyTorch has no such rule (pytorch/pytorch#136433): a
partitioner that sees the gathered weight used in the backward simply saves it. This pass writes
the rule into the graph as checkpoint tags that every partitioner honours:

* MUST_RECOMPUTE on the all-gather, its ``wait_tensor``, the dtype cast feeding the all-gather
  (mixed precision) and every forward node after the wait that reads nothing but the gathered
  weight: the single-input nodes reachable from the wait (``t``, ``permute``, ``slice``,
  ``view``/``reshape``, ``select``, dtype casts, ...), a chain or a tree. Tagging only the
  all-gather and its wait is not enough: the partitioner then saves the first untagged node
  after the wait, e.g. the transposed gathered weight (2.62 GiB on LLaMA-3 8B in the seed
  document). A tree, not just a chain: a parameter read in several places (``scale[0]``,
  ``scale[1]``; a tied embedding/head weight, read by the lookup and, transposed, by the
  head) fans out after the wait, and each branch is a view that would keep the whole
  gathered storage alive if saved. The narrow that drops the padding of an uneven shard
  (``autoparallel.parallelize.plan``) is such a node: the gathered padded weight is never saved.
* With ``reshard_after_forward=False`` the gathered parameter is meant to stay: the last
  non-view node of the chain is MUST_SAVE so no partitioner re-gathers it.

All tags carry ``ac_graph_id = AP_AC_GRAPH_ID`` so they form their own checkpoint region and
never merge with a user's (small) region ids.

Patch ``fsdp_chain_recompute``: when disabled, only the all-gather and its wait are tagged
(the behaviour before the chain fix).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.fx_utils import ALL_GATHER, WAIT, is_dtype_cast, node_val, tensor_bytes

log = logging.getLogger(__name__)

PATCH = "fsdp_chain_recompute"


@dataclass
class FsdpTagReport:
    """What the pass tagged: one entry per FSDP all-gather, and the bytes involved."""

    all_gathers: list[fx.Node] = field(default_factory=list)
    recomputed: list[fx.Node] = field(default_factory=list)  # nodes tagged MUST_RECOMPUTE
    saved: list[fx.Node] = field(default_factory=list)  # nodes tagged MUST_SAVE
    gathered_bytes: int = 0  # total size of the FSDP all-gather outputs

    @property
    def acted(self) -> int:
        """Tags written (MUST_RECOMPUTE and MUST_SAVE nodes): 0 means the pass did nothing."""
        return len(self.recomputed) + len(self.saved)

    def summary(self) -> str:
        return (
            f"{len(self.all_gathers)} FSDP all-gathers ({self.gathered_bytes} B): "
            f"{len(self.recomputed)} nodes MUST_RECOMPUTE, {len(self.saved)} MUST_SAVE"
        )


def _is_c10d(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional"


def _is_param_placeholder(node: fx.Node) -> bool:
    """Whether a placeholder holds a parameter. Graphs without roles (hand-built) count every
    placeholder as one; graphs traced by autoparallel.parallelize say so in ``meta[ROLE]``."""
    role = node.meta.get(M.ROLE)
    return role is None or roles.is_param(role)


def fsdp_source(node: fx.Node) -> fx.Node | None:
    """The parameter placeholder an all-gather's input leads back to through nodes that each have
    exactly one input (e.g. the mixed-precision dtype cast); None for any other node."""
    if node.op != "call_function" or node.target is not ALL_GATHER:
        return None
    cur = node.args[0]
    while isinstance(cur, fx.Node):
        if cur.op == "placeholder":
            return cur if _is_param_placeholder(cur) else None
        if cur.op != "call_function" or len(cur.all_input_nodes) != 1:
            return None
        cur = cur.all_input_nodes[0]
    return None


def is_fsdp_all_gather(node: fx.Node) -> bool:
    """An all-gather of a parameter (:func:`fsdp_source`)."""
    return fsdp_source(node) is not None


def _mutated_params(graph: fx.Graph) -> set[str]:
    """FQNs of the parameters the graph updates in place (a ``mutated:<fqn>`` output: gemma3n clamps
    ``weight.data`` in forward). AOTAutograd copies the new value into the parameter after the
    forward, so a backward that gathered it again would read the updated parameter, which autograd
    refuses ("modified by an inplace operation"): such a gather is saved, not recomputed."""
    out = graph.output_node().meta.get(M.ROLE) or []
    return {roles.name(r) for r in out if roles.is_mutated(r)}


def _check_waits(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not WAIT:
            continue
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem:
            src = src.args[0]  # wait on one output of a coalesced collective
        if not (isinstance(src, fx.Node) and _is_c10d(src)):
            what = src.format_node() if isinstance(src, fx.Node) else repr(src)
            raise ValueError(
                f"wait_tensor node {node.name!r} waits on {what}, which is not a _c10d_functional "
                "collective; a wait must consume the collective it completes (fix the pass that "
                "rewired it)"
            )


def _wait_of(ag: fx.Node) -> fx.Node:
    waits = [u for u in ag.users if u.op == "call_function" and u.target is WAIT]
    if len(waits) != 1 or len(ag.users) != 1:
        raise ValueError(
            f"FSDP all-gather {ag.name!r} must have exactly one user, its wait_tensor; it has "
            f"{[u.name for u in ag.users]}"
        )
    return waits[0]


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get(M.PARTITIONER_TAG) == "is_backward" or bool(node.meta.get(M.AUTOGRAD_BACKWARD))


def _reads_only_the_gathered_weight(wait: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node]:
    """Forward nodes after ``wait`` whose only input is the gathered weight or another such node
    (in graph order). Backward users (gradient math on the joint graph) are not followed."""
    found: set[fx.Node] = set()
    frontier = [wait]
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user in found or user.op != "call_function" or len(user.all_input_nodes) != 1 or _is_backward(user):
                continue
            found.add(user)
            frontier.append(user)
    return sorted(found, key=position.__getitem__)


def _chain_after(wait: fx.Node) -> list[fx.Node]:
    """Single-input nodes after ``wait``, each the only user of the previous one."""
    chain = []
    cur = wait
    while len(cur.users) == 1:
        (user,) = cur.users
        if user.op != "call_function" or len(user.all_input_nodes) != 1:
            break
        chain.append(user)
        cur = user
    return chain


def _is_view(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.is_view


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta[M.RECOMPUTE] = policy
    node.meta[M.AC_GRAPH_ID] = M.AP_AC_GRAPH_ID


def mark_fsdp_all_gather_recomputation(graph: fx.Graph | fx.GraphModule, reshard_after_forward: bool = True,
                                       kept: Collection[str] = ()) -> FsdpTagReport:
    """Tag every FSDP all-gather chain of ``graph`` (in place) and report what was tagged.

    ``kept``: parameters gathered first because only some ranks read them
    (``parallelize/gathered_first.py``): saved, as under ``reshard_after_forward=False``. A
    recomputed gather is placed before its first backward use, which differs between a rank that
    ran the expert and one that did not, and a rank whose forward does not read it would drop its
    forward gather: either way the ranks' collectives would differ.

    Non-FSDP all-gathers (activations, TP) are left alone. Raises ValueError naming the node for
    a wait that does not consume a collective, an FSDP all-gather without exactly one wait user,
    or an all-gather without ``meta["val"]``.
    """
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    _check_waits(graph)
    chain_fix = patches.enabled(PATCH)
    report = FsdpTagReport()
    position = {n: i for i, n in enumerate(graph.nodes)}
    mutated = _mutated_params(graph)
    for ag in list(graph.nodes):
        if not is_fsdp_all_gather(ag):
            continue
        val = node_val(ag, "sizing the FSDP all-gather (mark_fsdp_all_gather_recomputation)")
        wait = _wait_of(ag)
        report.all_gathers.append(ag)
        report.gathered_bytes += tensor_bytes(val)
        role = fsdp_source(ag).meta.get(M.ROLE)
        if reshard_after_forward and not (role is not None and roles.is_param(role) and roles.name(role) in mutated | set(kept)):
            tagged = [ag, wait]
            if chain_fix:
                if is_dtype_cast(ag.args[0]):
                    tagged.insert(0, ag.args[0])
                tagged.extend(_reads_only_the_gathered_weight(wait, position))
            for n in tagged:
                _tag(n, CheckpointPolicy.MUST_RECOMPUTE)
            report.recomputed.extend(tagged)
        else:
            chain = _chain_after(wait)
            end = chain[-1] if chain else wait
            while end is not wait and _is_view(end):
                end = end.all_input_nodes[0]
            _tag(end, CheckpointPolicy.MUST_SAVE)
            report.saved.append(end)
    log.info("mark_fsdp_all_gather_recomputation: %s", report.summary())
    return report
