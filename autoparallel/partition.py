"""The apply_placement boundary and the first partition.

``apply_placement(jg)`` turns a traced joint graph into a runnable ``ParallelModule`` by running
:data:`PLACEMENT_STEPS` in order (recorded on the result as ``steps``; the order is part of the
contract, and ``autoparallel.pipeline`` makes one stage of each step):

1. ``cleanup``: structural rewrites (DCE, no-op removal, view -> reshape). They come first so
   no tag is written on a node a rewrite later replaces.
2. ``fsdp_tagging`` (``mark_fsdp_all_gather_recomputation``): recompute (or save) tags on FSDP
   all-gather chains, written on the final structure, right before the compiler consumes the
   graph.
3. ``first_partition``: ``aot_compile_joint_with_descriptors``. Its forward compiler records the
   partitioner's decision on the graph: every saved-for-backward output gets
   ``custom.ap_must_save`` (for a multi-output op the parent, with the getitem indices). Both
   compilers are FX interpreters under ``preserve_node_meta``, so a re-trace of the module
   carries those records into the second compile.

``autoparallel.replay_partition.ReplaySavesPartitioner`` is the second compile's partitioner: it
saves exactly what the first partition recorded here instead of deciding again.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.aot_graph_text import PATCH as AOT_GRAPH_TEXT
from autoparallel.aot_graph_text import aot_graph_text_only_when_logged
from autoparallel.mesh import attach_group_dims
from autoparallel.parallelize.program import clean_fqn
from autoparallel.passes.cleanup import CleanupReport, cleanup_graph
from autoparallel.passes.fsdp_recompute import FsdpTagReport, mark_fsdp_all_gather_recomputation
from autoparallel.passes.kept_random_draws import PATCH as KEPT_RANDOM_DRAWS
from autoparallel.passes.kept_random_draws import read_dead_draws, restore_dropped_random_ops
from autoparallel.runtime.parallel_module import ParallelModule, PartitionRecord

log = logging.getLogger(__name__)

STEP_CLEANUP = "cleanup"
STEP_FSDP_TAGS = "fsdp_tagging"
STEP_FIRST_PARTITION = "first_partition"



# --- first partition: record the saves --------------------------------------------------------


def _is_saved_desc(desc: Any) -> bool:
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    return isinstance(desc, SavedForBackwardsAOTOutput)


def saved_forward_outputs(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward graph's outputs that are saved for the backward (AOT layout: user outputs
    first, then saved values); uses the output descriptors where AOT wrote them."""
    out = fw_gm.graph.output_node()
    values = list(out.args[0])
    descs = out.meta.get(M.DESC)
    if descs is not None and len(descs) == len(values):
        return [v for v, d in zip(values, descs, strict=True) if isinstance(v, fx.Node) and _is_saved_desc(d)]
    return [v for v in values[num_fwd_outputs:] if isinstance(v, fx.Node)]


def _is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get(M.VAL), torch.Tensor)


def tag_saved_outputs(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """Write ``custom.ap_must_save`` on every saved tensor the forward computes (in place).

    A saved ``getitem`` tags its multi-output parent instead and records the index under
    ``custom.ap_must_save_getitem_indices``: a re-trace gives getitem nodes no metadata (getitem
    is a Python builtin, never dispatched), while the parent op keeps its node's meta. Saved
    placeholders need no tag (a partitioner saves inputs the backward uses anyway). Each tagged
    node gets its own ``custom`` dict: partitioners copy meta shallowly, so the dict may be
    shared with the joint graph's node. Returns the saved output nodes.
    """
    saved = saved_forward_outputs(fw_gm, num_fwd_outputs)
    for node in saved:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            parent, index = node.args[0], node.args[1]
            custom = dict(parent.meta.get(M.CUSTOM) or {})
            custom[M.AP_MUST_SAVE] = True
            custom[M.AP_MUST_SAVE_GETITEM_INDICES] = sorted({*custom.get(M.AP_MUST_SAVE_GETITEM_INDICES, []), index})
            parent.meta[M.CUSTOM] = custom
        elif _is_tensor_node(node):
            node.meta[M.CUSTOM] = {**(node.meta.get(M.CUSTOM) or {}), M.AP_MUST_SAVE: True}
    return saved


def label_partition(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    placeholder_roles: Mapping[str, str],
    grad_roles: Sequence[str | None] | None,
    group_dims: Mapping[str, str] | None,
    stage: str,
    plain_inputs: Sequence[str | None] | None = None,
) -> None:
    """Give a fw/bw pair what goldens and stats read: placeholder roles, output roles, the
    group-name registry (where known) and the stage name.

    ``placeholder_roles`` maps joint placeholder names to roles (partitioners keep primal and
    tangent names), so a saved parameter shard keeps its ``param:<fqn>`` role in the backward.
    Forward outputs are ``mutated:<fqn>`` (a buffer's new value), ``loss`` / ``output:<i>``, then
    ``saved:<k>`` in order; a backward input holding a computed saved value is named by the same
    ``saved:<k>``. ``plain_inputs``: the roles of a Dynamo graph's inputs, which its descriptors
    only number (see ``roles.of_descriptor``).
    """
    saved_names = {}
    out = fw.graph.output_node()
    values = list(out.args[0])
    descs = out.meta.get(M.DESC) or [None] * len(values)
    labels = []
    k = 0
    for i, (v, d) in enumerate(zip(values, descs, strict=True)):
        saved = _is_saved_desc(d) if d is not None else i >= num_fwd_outputs
        if saved:
            role = roles.saved(k)
            k += 1
            if isinstance(v, fx.Node):
                saved_names.setdefault(v.name, role)
        else:
            # A user output: its descriptor says which one; without one, its position does.
            role = roles.of_descriptor(d, fqn=clean_fqn, plain_inputs=plain_inputs, name_unknown=False) or roles.user_output(i)
        labels.append(role)
    out.meta[M.ROLE] = labels
    for gm in (fw, bw):
        for ph in gm.graph.find_nodes(op="placeholder"):
            if ph.name in placeholder_roles:
                ph.meta[M.ROLE] = placeholder_roles[ph.name]
            elif gm is bw and ph.name in saved_names:
                ph.meta[M.ROLE] = saved_names[ph.name]
        if group_dims is not None:
            attach_group_dims(gm, group_dims)
    fw.meta[M.GM_STAGE] = f"{stage}/forward"
    bw.meta[M.GM_STAGE] = f"{stage}/backward"
    if grad_roles is not None:
        bw_out = bw.graph.output_node()
        n = len(bw_out.args[0])
        bw_out.meta[M.ROLE] = list(grad_roles[:n]) + [None] * max(0, n - len(grad_roles))


def _default_first_partition():
    from torch._functorch.partitioners import default_partition

    return default_partition


@dataclass
class PlacementState:
    """What the placement steps work on: the joint graph (cleaned and tagged in place), the
    rank's local tensors, and the module the first partition makes (``module``)."""

    jg: Any  # autoparallel.parallelize.JointGraph
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    reshard_after_forward: bool
    partition_fn: Callable[..., Any]
    done: list[str] = field(default_factory=list)
    module: ParallelModule | None = None

    def run(self, step: PlacementStep) -> Any:
        """Run one step; its report (what the step says it did)."""
        report = step.run(self)
        self.done.append(step.name)
        return report


@dataclass(frozen=True)
class PlacementStep:
    """One step: ``run(placement) -> report``; ``patches``: the registered patches it applies."""

    name: str
    run: Callable[[PlacementState], Any]
    summary: str
    patches: tuple[str, ...] = ()


def _cleanup(p: PlacementState) -> CleanupReport:
    report = cleanup_graph(p.jg.gm)
    log.info("apply_placement cleanup: %s", report.summary())
    return report


def _fsdp_tagging(p: PlacementState) -> FsdpTagReport:
    tags = mark_fsdp_all_gather_recomputation(p.jg.gm.graph, p.reshard_after_forward, p.jg.gather_first)
    p.jg.gm.recompile()
    return tags


def _first_partition(p: PlacementState) -> PartitionRecord:
    """``aot_compile_joint_with_descriptors`` with the save-recording forward compiler; closes the
    joint graph's export context (the compiled callable must run outside its fake mode)."""
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        boxed_nop_preserve_node_meta,
    )

    jg, gm = p.jg, p.jg.gm
    t0 = time.perf_counter()
    placeholder_roles = {ph.name: ph.meta[M.ROLE] for ph in gm.graph.find_nodes(op="placeholder") if M.ROLE in ph.meta}
    grad_roles = jg.output_roles[jg.num_fwd_outputs :]
    captured: dict[str, Any] = {}

    def partition(joint, joint_inputs, **kwargs):
        read_dead_draws(joint)
        fw, bw = p.partition_fn(joint, joint_inputs, **kwargs)
        restore_dropped_random_ops(joint, fw, bw)
        captured["fw"], captured["bw"] = fw, bw
        captured["num_fwd_outputs"] = kwargs.get("num_fwd_outputs", jg.num_fwd_outputs)
        return fw, bw

    def fw_compiler(fw_gm, example_inputs):
        captured["fw_compiled"] = fw_gm
        captured["saved"] = tag_saved_outputs(fw_gm, captured.get("num_fwd_outputs", jg.num_fwd_outputs))
        return boxed_nop_preserve_node_meta(fw_gm, example_inputs)

    jg.resume_fake_mode()
    try:
        with aot_graph_text_only_when_logged():
            compiled = aot_compile_joint_with_descriptors(
                jg.jd, partition_fn=partition, fw_compiler=fw_compiler, bw_compiler=boxed_nop_preserve_node_meta
            )
    finally:
        jg.close()

    fw = captured.get("fw_compiled", captured["fw"])
    bw = captured["bw"]
    label_partition(
        fw,
        bw,
        num_fwd_outputs=captured["num_fwd_outputs"],
        placeholder_roles=placeholder_roles,
        grad_roles=grad_roles,
        group_dims=jg.group_dims,
        stage=STEP_FIRST_PARTITION,
    )
    record = PartitionRecord(fw, bw, [n.name for n in captured["saved"]], captured["num_fwd_outputs"])
    uninitialised = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        kind = roles.kind(ph.meta.get(M.ROLE))
        store = p.params if kind == roles.PARAM else p.buffers if kind == roles.BUFFER else None
        name = roles.name(ph.meta[M.ROLE]) if store is not None else None
        if store is None:
            continue
        v = ph.meta[M.VAL]
        if name not in store:
            store[name] = torch.empty(v.shape, dtype=v.dtype)
            uninitialised.append(name)
        else:
            _check_local_tensor(kind, name, store[name], v)
    p.module = ParallelModule(
        compiled,
        jg.input_roles,
        p.params,
        p.buffers,
        first_partition=record,
        steps=[*p.done, STEP_FIRST_PARTITION],
        group_dims=jg.group_dims,
        uninitialised=uninitialised,
        frozen=jg.frozen_params,
    )
    log.info("first partition saves %d values (%.2fs)", len(record.saved), time.perf_counter() - t0)
    return record


def _check_local_tensor(kind: str, name: str, t: torch.Tensor, traced: torch.Tensor) -> None:
    """A given local parameter/buffer must be real and have the traced local shape and dtype."""
    kind = "parameter" if kind == roles.PARAM else "buffer"
    if is_fake(t):
        raise ValueError(
            f"the local {kind} {name!r} given to apply_placement is a FakeTensor: it was created under a fake "
            "mode (a trace's context); pass this rank's real local shards (e.g. ParallelProgram.local_parameters())"
        )
    if tuple(t.shape) != tuple(traced.shape) or t.dtype != traced.dtype:
        raise ValueError(
            f"the local {kind} {name!r} has shape {tuple(t.shape)} {t.dtype}, but the graph was traced with "
            f"{tuple(traced.shape)} {traced.dtype} (this rank's shard under the plan)"
        )


#: The apply_placement boundary, in order.
PLACEMENT_STEPS: tuple[PlacementStep, ...] = (
    PlacementStep(STEP_CLEANUP, _cleanup, "structural clean-up: CSE, no-op removal, DCE, view -> reshape"),
    PlacementStep(
        STEP_FSDP_TAGS,
        _fsdp_tagging,
        "recompute (or save) tags on the FSDP all-gather chains",
        patches=("fsdp_chain_recompute",),
    ),
    PlacementStep(
        STEP_FIRST_PARTITION,
        _first_partition,
        "AOT partition; the saved values are recorded (ap_must_save)",
        patches=(AOT_GRAPH_TEXT, KEPT_RANDOM_DRAWS),
    ),
)
PLACEMENT_STEP_NAMES: tuple[str, ...] = tuple(s.name for s in PLACEMENT_STEPS)


def placement(
    jg,
    params: Mapping[str, torch.Tensor] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    *,
    reshard_after_forward: bool | None = None,
    partition_fn: Callable[..., Any] | None = None,
) -> PlacementState:
    """The state :data:`PLACEMENT_STEPS` run on (see :func:`apply_placement` for the arguments)."""
    if reshard_after_forward is None:
        reshard_after_forward = jg.plan.reshard_after_forward
    params = {**jg.local_params, **(params or {})}
    buffers = {**jg.local_buffers, **(buffers or {})}
    return PlacementState(jg, params, buffers, reshard_after_forward, partition_fn or _default_first_partition())


def apply_placement(
    jg,
    params: Mapping[str, torch.Tensor] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    *,
    reshard_after_forward: bool | None = None,
    partition_fn: Callable[..., Any] | None = None,
) -> ParallelModule:
    """Clean up, tag and partition ``jg`` (a ``JointGraph``) into a ``ParallelModule``.

    ``params`` / ``buffers``: this rank's local shards by FQN (e.g. a ``ParallelProgram``'s
    ``local_parameters()``); by default the values of the model ``jg`` was traced from (its
    ``local_params`` / ``local_buffers``). Missing ones (a model on meta) are allocated
    uninitialised with the traced local shapes and the module says so (``uninitialised``): the
    second compile refuses to run it. ``reshard_after_forward`` defaults to the plan's. ``partition_fn`` is the first
    partitioner (default: AOT's ``default_partition``, which saves every forward value the
    backward reads unless it is tagged for recompute).

    Consumes ``jg``: its export context (fake mode) is closed after compiling, because the
    compiled callable must run outside it.
    """
    p = placement(jg, params, buffers, reshard_after_forward=reshard_after_forward, partition_fn=partition_fn)
    for step in PLACEMENT_STEPS:
        p.run(step)
    return p.module
