"""The AC joint pass of the second compile: selective-AC tags on the joint graph (``enable_ac``).

``autoparallel_backend(enable_ac=True)`` installs it as functorch's ``joint_custom_pass``, so it
runs on the re-traced joint graph before the partitioner. It exists so the second compile sees AC
tags, and the replay partitioner can be checked not to save more because of them; the decisions
come from the one AC policy (``autoparallel.ac``), applied graph-wide because the second compile's
joint graph carries no block regions: SDPA outputs and every other matmul are saved, the rest of
what the backward reads is PREFER_RECOMPUTE. There is no memory-budget staging.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import ac, roles
from autoparallel import meta as M


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a tangent: the backward proper (recomputed chains that only read
    primals count as forward here)."""
    bw: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and roles.is_aot_tangent_name(node.target):
            bw.add(node)
        elif node.op != "output" and any(a in bw for a in node.all_input_nodes):
            bw.add(node)
    return bw


def recomputable_forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Forward ops whose value the backward reads, directly or through other forward ops."""
    bw = _backward_nodes(graph)
    needed: set[fx.Node] = set()
    stack = [a for n in bw for a in n.all_input_nodes if a not in bw]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes if a not in bw)
    return [n for n in graph.nodes if n in needed and n.op == "call_function"]


def ac_joint_pass(gm: fx.GraphModule, joint_inputs: Sequence[object] | None = None) -> fx.GraphModule:
    """Tag the forward ops the backward needs (in place; returns ``gm``).

    Every such op that carries no recompute tag yet gets PREFER_RECOMPUTE, except what the
    policy keeps: SDPA outputs (``ac.is_sdpa_forward``) and every other ``mm`` (``ac.saves_mm``:
    1st, 3rd, ... in graph order) get MUST_SAVE. Getitems are skipped (they follow their
    multi-output parent) and so are collectives (communication is never an AC candidate here;
    FSDP all-gathers already carry their own tags). All tags use ``AP_AC_GRAPH_ID``.
    """
    mm_seen = 0
    for node in recomputable_forward_nodes(gm.graph):
        if M.RECOMPUTE in node.meta or node.target is operator.getitem:
            continue
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional":
            continue
        if not isinstance(node.meta.get(M.VAL), (torch.Tensor, tuple, list)):
            continue
        policy = CheckpointPolicy.PREFER_RECOMPUTE
        if ac.is_sdpa_forward(t):
            policy = CheckpointPolicy.MUST_SAVE
        elif t is ac.MM:
            mm_seen += 1
            if ac.saves_mm(mm_seen):
                policy = CheckpointPolicy.MUST_SAVE
        node.meta[M.RECOMPUTE] = policy
        node.meta[M.AC_GRAPH_ID] = M.AP_AC_GRAPH_ID
    return gm


__all__ = ["ac_joint_pass", "recomputable_forward_nodes"]
