"""The second compile's partitioner: ``ReplaySavesPartitioner`` saves exactly what the first
partition (``autoparallel.partition``) recorded as ``custom.ap_must_save`` instead of deciding
again (see its docstring for why). Patch ``replay_saves_partitioner`` (:data:`REPLAY_PATCH`)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.passes.kept_random_draws import restore_dropped_random_ops

REPLAY_PATCH = "replay_saves_partitioner"
UNREAD_SAVES_PATCH = "unread_saves_dropped"


def _custom(node: fx.Node) -> dict:
    return node.meta.get(M.CUSTOM) or {}


def _is_multi_output(node: fx.Node) -> bool:
    if isinstance(node.meta.get(M.VAL), (list, tuple)):
        return True
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


def _getitem_children(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]


def _only_asserted(node: fx.Node) -> bool:
    """A SymBool read only by ``_assert_scalar``: checked in the forward, nothing the backward needs
    (the stock partitioner's rule; torch 2.11, on the GPU machines, has no helper for it)."""
    try:
        from torch._functorch.partitioners import _is_assert_only_symbool
    except ImportError:
        return (isinstance(node.meta.get(M.VAL), torch.SymBool) and len(node.users) > 0
                and all(u.target is torch.ops.aten._assert_scalar.default for u in node.users))
    return _is_assert_only_symbool(node)


def _is_opaque(node: fx.Node) -> bool:
    """An opaque (script-object) value, saved apart; a torch without opaque values (2.11) has none."""
    try:
        from torch._functorch.partitioners import is_opaque_node
    except ImportError:
        return False
    return is_opaque_node(node)


def choose_replay_saves(gm: fx.GraphModule, node_info) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """(saved tensors, saved sym nodes, saved opaque nodes) for the replay partitioner.

    For every forward (and unclaimed) node, in graph order, the first rule that applies:

    1. ``recompute == MUST_RECOMPUTE``: never saved, whatever else it carries (FSDP chains).
    2. A SymInt/SymBool: saved as a sym node (unless only asserts read it).
    3. A multi-output op: MUST_SAVE saves every getitem child; ``custom.ap_must_save`` saves the
       children listed in ``custom.ap_must_save_getitem_indices`` (all if there is no list). A
       multi-output node tagged ``ap_must_save`` without getitem users is an error.
    4. An opaque value (process group, script object): saved.
    5. A placeholder: saved (``_extract_fwd_bwd_modules`` drops the ones the backward never reads).
    6. ``custom.ap_must_save`` or ``recompute == MUST_SAVE``: saved.

    Anything else is recomputed in the backward if the backward needs it. PREFER_RECOMPUTE
    appears in no rule: an AC pass can make the replay recompute, never save more.

    ``custom.ap_must_save`` counts only on nodes traced in the forward: AOT gives every node it
    traces in the backward the ``custom`` meta of the forward op being differentiated, and from
    the re-trace's point of view that op is the whole first-partition forward, so backward nodes
    can inherit the tag of whichever forward node ran last. A backward node that only reads
    forward values (the transpose of a gathered weight, ``t(t(w))``, in a Linear's input
    gradient) is then claimable by the forward, and with the leaked tag it was saved: an
    all-gathered weight kept alive across the step. Where nothing is gathered (DDP) such
    backward ops were saved too (5 extra values on tiny LLaMA-3 under DDP).
    """
    from torch._functorch.partitioners import is_sym_node

    saved: list[fx.Node] = []
    saved_sym: list[fx.Node] = []
    saved_opaque: list[fx.Node] = []
    multi_output_parents: set[fx.Node] = set()
    # is_required_fw, not `in required_fw_nodes`: that is a sorted list (quadratic at 8B size).
    candidates = [n for n in gm.graph.nodes if node_info.is_required_fw(n) or node_info.is_unclaimed(n)]
    for node in candidates:
        if node.op == "output":
            continue
        recompute = node.meta.get(M.RECOMPUTE)
        if recompute == CheckpointPolicy.MUST_RECOMPUTE:
            continue
        if is_sym_node(node):
            if not _only_asserted(node):
                saved_sym.append(node)
            continue
        custom = _custom(node)
        recorded = bool(custom.get(M.AP_MUST_SAVE)) and node.meta.get(M.PARTITIONER_TAG) != M.PARTITIONER_TAG_BACKWARD
        if node.op == "call_function" and _is_multi_output(node):
            multi_output_parents.add(node)
            children = _getitem_children(node)
            if recompute == CheckpointPolicy.MUST_SAVE:
                saved.extend(children)
            elif recorded:
                if not children:
                    raise ValueError(
                        f"node {node.name!r} ({node.target}) is tagged custom.{M.AP_MUST_SAVE} as a "
                        "multi-output op but has no getitem users to save; tag the value it returns, "
                        "or re-trace so its outputs are read through getitem"
                    )
                indices = custom.get(M.AP_MUST_SAVE_GETITEM_INDICES)
                saved.extend(c for c in children if indices is None or c.args[1] in indices)
            continue
        if _is_opaque(node):
            saved_opaque.append(node)
            continue
        if node.op == "placeholder":
            saved.append(node)
            continue
        if node.target is operator.getitem and node.args[0] in multi_output_parents:
            # Decided by the parent (rule 3); an explicit MUST_SAVE on the child still counts.
            if recompute == CheckpointPolicy.MUST_SAVE:
                saved.append(node)
            continue
        if recorded or recompute == CheckpointPolicy.MUST_SAVE:
            saved.append(node)
    dedup = lambda xs: list(dict.fromkeys(xs))  # noqa: E731
    return dedup(saved), dedup(saved_sym), dedup(saved_opaque)


def unread_saves(bw: fx.GraphModule) -> set[str]:
    """Names of ``bw``'s placeholders that only dead code reads.

    With ``fallback_random`` set, dead-code elimination keeps random ops, so the backward's
    extraction copies a forward draw it can compute (a dropout's ``bernoulli`` on
    ``empty_like(batch_norm(...))``) with the whole chain it needs, and the chain's placeholders
    stay saved for the backward though nothing live reads them. A saved input that the forward
    also updates in place (a BatchNorm running stat, ``copy_`` after the forward) then fails
    autograd's version check in the backward (efficientnet: "[torch.FloatTensor [24]] is at
    version 8; expected version 7"); any other holds memory for nothing. Live: what the output
    or an impure op other than a draw reads."""
    live: set[fx.Node] = set()
    stack = [n for n in bw.graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure(impure_random=False))]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return {n.name for n in bw.graph.find_nodes(op="placeholder") if n not in live}


class ReplaySavesPartitioner(CustomPartitionerFn):
    """Second-compile partitioner that saves exactly what the first partition saved.

    Why: ``torch.compile`` of a ParallelModule re-traces an already partitioned program, and a
    second ``min_cut_rematerialization_partition`` decides again, differently. With the AC pass's
    PREFER_RECOMPUTE tags it recomputes matmuls in the backward; those need the gathered weights;
    upstream ``force_save_collectives`` pins non-recompute collectives MUST_SAVE, so min-cut saves
    the gathered weights (about 1.2 GB per 4 layers on LLaMA-3 8B in the reference). Replaying
    the first decision keeps the ``reshard_after_forward`` contract and the memory the first
    partition planned.

    Steps: DCE; ``fx_graph_cse`` (the first backward's recomputed all-gather chains were baked
    into the re-trace and duplicate the forward's; CSE merges them, keeping the first
    occurrence's meta); upstream's recompute-tag clean-up and force-save rules; ``classify_nodes``
    for the forward/backward boundary (topology, so backward ops interleaved into the forward
    region are handled); ``choose_replay_saves``; ``_extract_fwd_bwd_modules``; upstream's
    post-processing (RNG functionalisation, backward reordering, getitem raising). Saved values
    only dead code of the backward reads (:func:`unread_saves`) are left out and the graphs
    extracted again (patch ``unread_saves_dropped``).
    """

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch import config as functorch_config
        from torch._functorch.compile_utils import fx_graph_cse
        from torch._functorch.partitioners import (
            _extract_fwd_bwd_modules,
            classify_nodes,
            cleanup_recompute_tags,
            default_partition,
            force_save_bw_mutation_src,
            force_save_collectives,
            force_save_effectful_ops,
            functionalize_rng_ops,
            has_recomputable_ops,
            has_recomputable_rng_ops,
            raise_getitems,
            reordering_to_mimic_autograd_engine,
            thread_graphsafe_rng_from_hops,
        )

        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static_indices = kwargs.get("static_lifetime_input_indices") or []
        gm.graph.eliminate_dead_code()
        gm.recompile()
        if functorch_config.cse:
            gm.graph = fx_graph_cse(gm.graph)
            gm.recompile()
        recomputable = has_recomputable_ops(gm)
        if recomputable:
            gm = cleanup_recompute_tags(gm, is_default_partition=False)
        if not functorch_config.unsafe_allow_optimization_of_collectives:
            force_save_collectives(gm)
        force_save_effectful_ops(gm)
        force_save_bw_mutation_src(gm)
        node_info = classify_nodes(gm, static_indices, num_fwd_outputs)
        if not node_info.required_bw_nodes:  # inference graph: nothing to save
            return default_partition(
                gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_indices
            )
        saved, saved_sym, saved_opaque = choose_replay_saves(gm, node_info)
        # torch 2.11 (the GPU machines' CUDA build) has no opaque values, nor the argument for them.
        opaque = {"saved_opaque_nodes": saved_opaque} if saved_opaque else {}

        def extract(unread=frozenset()):
            # Copies: the extraction edits the lists it is given.
            keep = lambda xs: [n for n in xs if n.name not in unread]  # noqa: E731
            return _extract_fwd_bwd_modules(
                gm,
                keep(saved),
                saved_sym_nodes=keep(saved_sym),
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_nodes=node_info.static_lifetime_input_nodes,
                **opaque,
            )

        fw, bw = extract()
        unread = unread_saves(bw) if patches.enabled(UNREAD_SAVES_PATCH) else set()
        if unread:
            fw, bw = extract(frozenset(unread))
        restore_dropped_random_ops(gm, fw, bw)
        if recomputable and has_recomputable_rng_ops(gm):
            fw, bw = functionalize_rng_ops(gm, fw, bw, len(saved_sym))
        bw = reordering_to_mimic_autograd_engine(bw)
        fw = thread_graphsafe_rng_from_hops(raise_getitems(fw), is_backward=False)
        bw = thread_graphsafe_rng_from_hops(raise_getitems(bw), is_backward=True)
        return fw, bw

    def uuid(self) -> None:
        # None disables Inductor's FX graph cache for graphs partitioned by this class. The
        # partition depends on node.meta (custom.ap_must_save, recompute tags) that the cache key
        # does not cover, so a cached artifact from a run with other tags would be replayed
        # silently; and a cache hit skips the partitioner entirely.
        return None
