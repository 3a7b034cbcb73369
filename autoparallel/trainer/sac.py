"""Graph selective activation checkpointing: tag forward nodes, then rematerialize in backward.

``apply_sac_pass(gm, policy)`` writes ``meta["recompute"]`` (a ``CheckpointPolicy``) and
``meta["ac_graph_id"]`` (the int AC region, see :func:`annotate_ac_regions`) on the forward nodes
of a traced training step. ``remat_pass(gm)`` then runs PyTorch's
``remat_using_tags_for_fwd_loss_bwd_graph``: every recomputable forward value a backward node
needs is duplicated just before its first backward use, and forward copies nobody else uses are
dead-code eliminated, so those activations are not alive between forward and backward.

Rules of the tagging pass:

* Backward nodes are skipped at the source (patch ``sac_skips_backward``): a recompute tag on a
  backward node would make the remat pass duplicate backward ops.
* Nodes outside every AC region (embedding, final norm, output head, loss) are not tagged:
  they are saved, as in eager, where only the blocks are checkpointed.
* ``getitem`` and ``wait_tensor`` nodes inherit their parent's tag and region (a tuple element
  or an async collective's result is decided with the op that produced it).
* Ops tagged ``nondeterministic_seeded`` are always saved: the remat pass refuses to replay
  random ops. Note that this includes SDPA (it takes a dropout argument), so ``"full"`` saves
  the attention output where eager full AC would recompute it.
* Policies: ``"op"`` takes each decision from :class:`autoparallel.ac.OpSACState`
  (one state per region, nodes in forward order), the same function eager
  ``apply_ac(model, "op")`` uses, so the saved set is identical. ``"full"`` recomputes
  everything in a region (``MUST_RECOMPUTE``); only region inputs are saved.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel.ac import FULL, OP, SAC_POLICIES, OpSACState, is_random
from autoparallel.fx_utils import WAIT, copy_graph_module
from autoparallel.patches import enabled
from autoparallel.trainer.regions import region_of
from autoparallel.trainer.trace import TracedStep, is_backward_node

__all__ = [
    "SAC_POLICIES",
    "apply_sac_pass",
    "graph_sac",
    "live_recomputable_values",
    "recompute_summary",
    "remat_pass",
    "sac_stages",
]


def _op_policy() -> Callable[[int, fx.Node], CheckpointPolicy]:
    states: dict[int, OpSACState] = {}

    def decide(region: int, node: fx.Node) -> CheckpointPolicy:
        state = states.setdefault(region, OpSACState())
        return state.decide(node.target, node.args)

    return decide


def _full_policy() -> Callable[[int, fx.Node], CheckpointPolicy]:
    def decide(region: int, node: fx.Node) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_RECOMPUTE

    return decide


_POLICY_FACTORIES = {OP: _op_policy, FULL: _full_policy}


def _is_rng(node: fx.Node) -> bool:
    return is_random(node.target)


def apply_sac_pass(gm: fx.GraphModule, policy: str = OP) -> fx.GraphModule:
    """Tag the forward nodes of ``gm`` for selective AC with ``policy``; in place, returns ``gm``.

    Raises ValueError for an unknown policy (listing the valid ones) and when no node carries
    an AC region (call :func:`annotate_ac_regions` on the model before tracing).
    """
    if policy not in _POLICY_FACTORIES:
        raise ValueError(f"unknown SAC policy {policy!r}; valid policies: {list(SAC_POLICIES)}")
    decide = _POLICY_FACTORIES[policy]()
    skip_backward = enabled("sac_skips_backward")
    seen_region = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if skip_backward and is_backward_node(node):
            continue
        region = region_of(node)
        if region is None:
            continue
        seen_region = True
        if node.target is operator.getitem or node.target is WAIT:
            parent = node.args[0]
            if isinstance(parent, fx.Node) and M.RECOMPUTE in parent.meta:
                node.meta[M.RECOMPUTE] = parent.meta[M.RECOMPUTE]
                node.meta[M.AC_GRAPH_ID] = parent.meta[M.AC_GRAPH_ID]
                continue
        if _is_rng(node):
            tag = CheckpointPolicy.MUST_SAVE
        else:
            tag = decide(region, node)
        node.meta[M.RECOMPUTE] = tag
        node.meta[M.AC_GRAPH_ID] = region
    if not seen_region:
        raise ValueError(
            "apply_sac_pass: no node of the graph carries an AC region "
            f"(meta['{M.CUSTOM}']['{M.AC_REGION}']); call annotate_ac_regions(model) before "
            "trace_train_step"
        )
    gm.graph.lint()
    return gm


_RECOMPUTE_TAGS = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def live_recomputable_values(gm: fx.GraphModule) -> list[fx.Node]:
    """Forward nodes tagged for recompute that a backward node still reads directly.

    After a working remat pass there are none: each such use reads a copy placed after the
    first backward node. Nodes after that point (the copies) are not forward nodes here.
    """
    live = []
    for node in gm.graph.nodes:
        if is_backward_node(node):
            break
        if node.meta.get(M.RECOMPUTE) in _RECOMPUTE_TAGS and any(
            is_backward_node(user) for user in node.users
        ):
            live.append(node)
    return live


def remat_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """PyTorch's ``remat_using_tags_for_fwd_loss_bwd_graph`` on ``gm``; returns a new graph.

    A no-op (the same ``gm``) when nothing is tagged for recompute or when no node is marked
    as backward (``custom[PHASE] == PHASE_BACKWARD``). Raises RuntimeError when the pass ran
    but left recomputable activations alive into the backward (a torch whose remat pass reads
    another backward marker does that silently; the peak memory then equals no remat).
    """
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (
        remat_using_tags_for_fwd_loss_bwd_graph,
    )

    out = remat_using_tags_for_fwd_loss_bwd_graph(gm)
    out.meta.update({k: v for k, v in gm.meta.items() if k not in out.meta})
    out.graph.lint()
    live = live_recomputable_values(out)
    if live:
        names = ", ".join(n.name for n in live[:5]) + (", ..." if len(live) > 5 else "")
        raise RuntimeError(
            f"remat_pass: {len(live)} value(s) tagged for recompute are still read by the "
            f"backward ({names}); torch {torch.__version__}'s "
            "remat_using_tags_for_fwd_loss_bwd_graph did not rematerialize them (does it read "
            f"meta['custom']['{M.PHASE}'] or ['{M.REMAT_PASS_TAG}']?)"
        )
    return out


def sac_stages(step: TracedStep, policy: str = OP) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``(tagged, rematerialized)``: a copy of ``step.gm`` with SAC tags, and the remat graph.

    ``step.gm`` itself is not modified.
    """
    tagged = apply_sac_pass(copy_graph_module(step.gm), policy)
    tagged.meta[M.GM_STAGE] = f"trainer:sac-{policy}"
    # The remat pass normalizes tags in place (cleanup_recompute_tags); keep `tagged` as tagged.
    out = remat_pass(copy_graph_module(tagged))
    out.meta[M.GM_STAGE] = f"trainer:sac-{policy}+remat"
    return tagged, out


def graph_sac(step: TracedStep, policy: str = OP) -> TracedStep:
    """Graph SAC on a traced step: ``apply_sac_pass`` then ``remat_pass``, on a copy of its graph.

    Returns the new step; ``step`` is unchanged.
    """
    return step.with_graph(sac_stages(step, policy)[1])


def recompute_summary(gm: fx.GraphModule) -> dict[str, int]:
    """Counts for reports and tests: tagged nodes per ``CheckpointPolicy`` name (duplicates
    excluded) and ``"recomputed"``, the nodes the remat pass duplicated into the backward."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.meta.get(M.AUTOGRAD_BACKWARD):  # the remat pass marks its duplicates so
            counts["recomputed"] += 1
            continue
        tag = node.meta.get(M.RECOMPUTE)
        if tag is not None:
            counts[tag.name] += 1
    return dict(counts)
