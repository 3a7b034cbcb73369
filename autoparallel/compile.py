"""``autoparallel_backend()``: the torch.compile backend for an already partitioned ParallelModule.

``torch.compile(parallel_mod, backend=autoparallel_backend())`` re-traces the module. The first
partition's graphs run as FX interpreters under ``preserve_node_meta``, so the fresh joint graph
carries the first partition's recompute tags and ``custom.ap_must_save`` records. The backend
then applies, each scoped to this compile and restored afterwards:

* optionally ``ac_joint_pass`` (``enable_ac``; ``autoparallel.passes.ac_joint``), through
  functorch's ``joint_custom_pass``;
* the ATen kernels of ops whose Python decomposition a trace would run (patch
  ``eager_kernels_retrace``, ``autoparallel.eager_kernels``): the first partition's graphs hold
  ``upsample_bilinear2d`` and its backward as eager runs them; re-tracing them through the
  decomposition again would round otherwise (mobilevit's second compile was NOT bitwise);
* the ``ReplaySavesPartitioner`` (patch ``replay_saves_partitioner``), which saves exactly what the
  first partition saved;
* optionally Inductor's overlap-scheduling settings (``overlap_scheduling``). They must still be in
  force when the backward is compiled, and AOT compiles the backward lazily, on the first
  ``.backward()``, long after this backend returned. So they are handed to the compilers
  themselves (``compile_fx(config_patches=...)``, which re-applies them around every inner
  compile; the aot_eager compilers do the same), not set in a context manager here (patch
  ``overlap_config_persists``; the context-manager version is the bug #483 fixed).

``compiler="aot_eager"`` runs the partitioned graphs as they are (bitwise equal to eager on
CPU); ``compiler="inductor"`` compiles them with Inductor (slow on CPU, not bitwise). Overlap
scheduling needs a runtime estimator on CPU (it imports triton otherwise), so on CPU use
``overlap_scheduling=True`` only with ``aot_eager`` (config plumbing) until an estimator exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from autoparallel import meta as M
from autoparallel import patches, roles
from autoparallel.eager_kernels import RETRACE_PATCH as EAGER_KERNELS_RETRACE
from autoparallel.eager_kernels import kernels_as_eager
from autoparallel.partition import label_partition
from autoparallel.passes.ac_joint import ac_joint_pass
from autoparallel.passes.collective import bucket_fw_bw, tag_joint
from autoparallel.passes.kept_random_draws import PATCH as KEPT_RANDOM_DRAWS
from autoparallel.replay_partition import REPLAY_PATCH, ReplaySavesPartitioner

OVERLAP_PATCH = "overlap_config_persists"
SECOND_COMPILE = "second_compile"
TANGENT_ROLES = "tangent_roles"

# Inductor settings for compute/communication overlap in the post-grad passes.
OVERLAP_SCHEDULING_PATCHES: dict[str, Any] = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,
    "aten_distributed_optimizations.insert_overlap_deps": True,
    "aten_distributed_optimizations.max_compute_pre_fetch": 10,
}

Compiler = Literal["aot_eager", "inductor"]
OnPartition = Callable[[fx.GraphModule, fx.GraphModule], None]
OnCompile = Callable[[str, fx.GraphModule], None]  # ("forward" | "backward", graph)
OnCollectivePasses = Callable[[fx.GraphModule, fx.GraphModule, Any], None]  # (fw, bw, PipelineMetrics)

# --- partitioner / compilers --------------------------------------------------------------------


def dynamo_input_roles(gm: fx.GraphModule, strip_prefix: str = "model.") -> list[str | None]:
    """Roles of a Dynamo graph's inputs, from their sources: ``param:<fqn>``, ``buffer:<fqn>``,
    ``input:<i>`` (None where the source says nothing). ``strip_prefix`` drops the
    ``ParallelModule`` container name so FQNs are the user's."""
    out: list[str | None] = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        grapharg = ph.meta.get(M.GRAPHARG)
        name = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
        name = name() if callable(name) else str(name)
        out.append(roles.of_source_name(name, strip_prefix))
    return out


def _grad_roles(input_roles: Sequence[str | None], out: fx.Node) -> list[str | None]:
    """Gradient labels of a second-compile graph's outputs (``grad:<fqn>`` where AOT's descriptor
    says "gradient of plain input i" and input i has a role), None elsewhere."""
    from torch._functorch._aot_autograd import descriptors as D

    labels: list[str | None] = []
    for desc in out.meta.get(M.DESC) or [None] * len(out.args[0]):
        is_grad = isinstance(desc, D.GradAOTOutput)
        labels.append(roles.of_descriptor(desc, plain_inputs=input_roles) if is_grad else None)
    return labels


def second_compile_placeholder_roles(gm: fx.GraphModule, input_roles: Sequence[str | None]) -> dict[str, str]:
    """Roles of a second-compile joint graph's placeholders by AOT name: ``primals_<i+1>`` from the
    Dynamo input roles, ``tangents_<k>`` from AOT's descriptors (patch ``tangent_roles``).

    AOT orders the tangents as it orders the outputs that need one: a parameter's new value
    (``tangent:mutated:<fqn>``, gemma3n's clamp of ``weight.data``) comes before the loss, so
    ``tangents_1`` is the loss's only when nothing else has a tangent. A tangent without a
    descriptor stays unlabelled (the executors then refuse to guess what to feed it), unless it
    is the only one. Disabled: ``tangents_1`` is ``tangent:loss``, whatever AOT says."""
    labels: dict[str, str] = {}
    tangents = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        i = roles.aot_primal_index(ph.name)
        if i is not None and i < len(input_roles) and input_roles[i]:
            labels[ph.name] = input_roles[i]
        elif roles.is_aot_tangent_name(ph.name):
            tangents.append(ph)
    if not patches.enabled(TANGENT_ROLES):
        labels[roles.aot_tangent_name(0)] = roles.tangent(roles.LOSS)
        return labels
    for ph in tangents:
        role = roles.of_descriptor(ph.meta.get(M.DESC), plain_inputs=input_roles, name_unknown=False)
        if roles.is_tangent(role):
            labels[ph.name] = role
        elif len(tangents) == 1:
            labels[ph.name] = roles.tangent(roles.LOSS)
    return labels


def _label_joint(gm: fx.GraphModule, input_roles: Sequence[str | None]) -> None:
    """Roles on a second-compile joint graph: its placeholders' (:func:`second_compile_placeholder_roles`),
    outputs ``loss`` / ``grad:<fqn>`` (from AOT's descriptors) or None, one per output entry."""
    from torch._functorch._aot_autograd import descriptors as D

    placeholder_roles = second_compile_placeholder_roles(gm, input_roles)
    for ph in gm.graph.find_nodes(op="placeholder"):
        if ph.name in placeholder_roles:
            ph.meta[M.ROLE] = placeholder_roles[ph.name]
    out = gm.graph.output_node()
    leaves = list(out.args[0])
    grads = _grad_roles(input_roles, out)
    descs = out.meta.get(M.DESC) or [None] * len(leaves)
    labels: list[str | None] = []
    for leaf, desc, grad in zip(leaves, descs, grads, strict=True):
        if leaf is None:
            labels.append(None)
        elif isinstance(desc, D.PlainAOTOutput):
            labels.append(roles.user_output(desc.idx))
        else:
            labels.append(grad)
    out.meta[M.ROLE] = labels


class _Partitioner(CustomPartitionerFn):
    """The partitioner the backend installs: replay (or stock min-cut), then labels the pair
    (roles, stage) for goldens and stats, then shows it to ``on_partition``."""

    def __init__(
        self,
        inner: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
        on_partition: OnPartition | None,
        input_roles: Sequence[str | None],
        collective_passes=None,
        on_collective_passes: OnCollectivePasses | None = None,
        group_dims: dict[str, str] | None = None,
    ):
        self.group_dims = group_dims
        self.inner = inner
        self.on_partition = on_partition
        self.input_roles = list(input_roles)
        self.collective_passes = collective_passes
        self.on_collective_passes = on_collective_passes

    def __call__(self, gm, joint_inputs, **kwargs):
        if self.collective_passes is not None:
            # Bucketing tags are written on this compile's joint graph (roles first: the tagger
            # finds param-derived all-gathers and gradient-terminal reduce-scatters by role).
            _label_joint(gm, self.input_roles)
            tag_joint(gm)
        fw, bw = self.inner(gm, joint_inputs, **kwargs)
        placeholder_roles = second_compile_placeholder_roles(gm, self.input_roles)
        grad_roles = _grad_roles(self.input_roles, bw.graph.output_node())
        label_partition(
            fw,
            bw,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            placeholder_roles=placeholder_roles,
            grad_roles=grad_roles,
            group_dims=None,
            stage=SECOND_COMPILE,
            plain_inputs=self.input_roles,
        )
        if self.group_dims is not None:
            for g in (fw, bw):
                g.meta[M.GM_GROUP_DIMS] = dict(self.group_dims)
        if self.on_partition is not None:
            self.on_partition(fw, bw)
        if self.collective_passes is not None:
            fw, bw, metrics = bucket_fw_bw(fw, bw, self.collective_passes)
            if self.on_collective_passes is not None:
                self.on_collective_passes(fw, bw, metrics)
        return fw, bw

    def uuid(self) -> None:
        return None  # see ReplaySavesPartitioner.uuid


def _stock_partition(gm, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def _nop_compiler(stage: str, config_patches: dict[str, Any], on_compile: OnCompile | None):
    """aot_eager-style compiler: runs the graph as is, with ``config_patches`` in force while it
    'compiles' (what compile_fx does for Inductor's inner compiles)."""
    from functorch.compile import make_boxed_func

    def compile_(gm: fx.GraphModule, example_inputs):
        with torch._inductor.config.patch(config_patches):
            if on_compile is not None:
                on_compile(stage, gm)
            return make_boxed_func(gm.forward)

    return compile_


def _observed_inner_compile(on_compile: OnCompile | None):
    from torch._inductor.compile_fx import compile_fx_inner

    if on_compile is None:
        return compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        on_compile("backward" if kwargs.get("is_backward") else "forward", gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    return inner


def autoparallel_backend(
    enable_ac: bool = False,
    overlap_scheduling: bool = False,
    compiler: Compiler = "aot_eager",
    *,
    on_partition: OnPartition | None = None,
    on_compile: OnCompile | None = None,
    collective_passes=None,
    on_collective_passes: OnCollectivePasses | None = None,
    group_dims: dict[str, str] | None = None,
):
    """A ``torch.compile`` backend for a ParallelModule (see the module docstring).

    ``on_partition(fw, bw)`` sees the second compile's partition; ``on_compile(stage, gm)`` is
    called when a graph is compiled (``stage`` "forward" or "backward", the backward lazily on
    the first ``.backward()``) with the compile-time configuration in force.
    ``collective_passes`` (an ``autoparallel.passes.collective.CollectivePassesConfig``): tag this
    compile's joint graph for pre-overlap bucketing and run the collective passes (chained
    all-gather fusion, bucketing, optional CPU overlap scheduling) on the split graphs before they
    are compiled; ``on_collective_passes(fw, bw, metrics)`` sees the result. Bucketed graphs are
    rank-specific: compile on each rank. ``group_dims`` (the module's ``group_dims``) is attached
    to the split graphs so passes and stats can name process groups by mesh dim. Patches are read
    when the backend runs, so ``patches.disabled(...)`` around ``torch.compile``'s first call
    takes effect.
    """
    if compiler not in ("aot_eager", "inductor"):
        raise ValueError(f"unknown compiler {compiler!r}; use 'aot_eager' or 'inductor'")

    def backend(gm: fx.GraphModule, example_inputs):
        inner = ReplaySavesPartitioner() if patches.enabled(REPLAY_PATCH) else _stock_partition
        partitioner = _Partitioner(
            inner, on_partition, dynamo_input_roles(gm), collective_passes, on_collective_passes, group_dims
        )
        overlap = dict(OVERLAP_SCHEDULING_PATCHES) if overlap_scheduling else {}
        persist = patches.enabled(OVERLAP_PATCH)
        compiler_patches = overlap if persist else {}
        with contextlib.ExitStack() as stack:
            if patches.enabled(KEPT_RANDOM_DRAWS):
                # Inside torch.compile, FX's dead-code elimination drops a random op nobody reads
                # unless fallback_random is set; eager draws it (autoparallel.passes.kept_random_draws).
                stack.enter_context(torch._inductor.config.patch(fallback_random=True))
            # AOT traces synchronously inside this call (both compilers): the lift is scoped to it.
            stack.enter_context(kernels_as_eager(EAGER_KERNELS_RETRACE))
            if enable_ac:
                stack.enter_context(torch._functorch.config.patch(joint_custom_pass=ac_joint_pass))
            if overlap and not persist:
                # Pre-fix behaviour: gone by the time the backward compiles.
                stack.enter_context(torch._inductor.config.patch(overlap))
            if compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx

                # The partition runs synchronously inside compile_fx: a scoped patch is enough.
                stack.enter_context(torch._inductor.config.patch(custom_partitioner_fn=partitioner))
                return compile_fx(
                    gm,
                    example_inputs,
                    inner_compile=_observed_inner_compile(on_compile),
                    config_patches=compiler_patches or None,
                )
            from torch._dynamo.backends.common import aot_autograd

            aot = aot_autograd(
                fw_compiler=_nop_compiler("forward", compiler_patches, on_compile),
                bw_compiler=_nop_compiler("backward", compiler_patches, on_compile),
                partition_fn=partitioner,
            )
            return aot(gm, example_inputs)

    return backend
