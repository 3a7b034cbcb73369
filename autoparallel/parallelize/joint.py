"""model + plan + mesh -> the per-rank joint forward/backward graph.

The parallel program is traced with ``aot_export_joint_with_descriptors`` on fake tensors with
device "cpu" (autograd on fake cuda tensors aborts CPU builds of torch). Descriptors are turned
into role labels on placeholders and outputs, and the mesh's group-name registry is attached to
the graph, so everything downstream can say what a node is without knowing creation order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily

from autoparallel import meta as M
from autoparallel import patches
from autoparallel import roles
from autoparallel.compiling_flag import compiling_queries, tracing_as_compiling
from autoparallel.eager_dropout import dropout_as_eager, in_place_dropout_as_one_op
from autoparallel.eager_kernels import kernels_as_eager
from autoparallel.kernel_strides import strides_as_kernels
from autoparallel.mesh import ParallelMesh, attach_group_dims
from autoparallel.parallelize.module_paths import annotate_module_paths
from autoparallel.parallelize.plan import ParallelPlan, ParamSharding
from autoparallel.parallelize.program import LossFn, ParallelProgram, clean_fqn, data_slices, split_batch
from autoparallel.passes.pinned_layouts import PATCH as PINNED_LAYOUTS
from autoparallel.passes.pinned_layouts import pin_mixed_layouts
from autoparallel.passes.value_guards import PATCH as VALUE_GUARDS
from autoparallel.passes.value_guards import guard_reads
from autoparallel.patches import disabled_from_env
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.parallelize.reseeds import reseeds_refused
from autoparallel.parallelize.traced_values import Read, reads_agree, record_reads, replaying
from autoparallel.validate import DataDependentError, check_input_dtypes, data_dependent_ops_named

log = logging.getLogger(__name__)


@dataclass
class JointGraph:
    """A traced per-rank joint graph and what its inputs and outputs are.

    Call ``gm(primals, tangents)``; ``primals`` follow ``input_roles`` (params, buffers, inputs),
    the outputs follow ``output_roles`` (``loss`` first, then ``grad:<fqn>``; None for a parameter
    without a gradient: ``params_without_grad``). Keeps the export's context stack open until
    ``close()`` because a later compile of ``jd`` needs it.
    """

    gm: fx.GraphModule
    jd: object  # torch._functorch JointWithDescriptors
    plan: ParallelPlan
    mesh: ParallelMesh
    shardings: dict[str, ParamSharding]
    input_roles: list[str]
    output_roles: list[str | None]
    num_fwd_outputs: int
    trace_seconds: float
    fake_mode: FakeTensorMode
    # This rank's local parameter shards and buffers as real tensors, by FQN (the values the
    # traced model held, sharded by the plan); empty for a model on meta or fake tensors.
    local_params: dict[str, torch.Tensor] = field(default_factory=dict)
    local_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # Parameters the model holds with requires_grad=False (frozen), and every parameter whose
    # gradient output is None: the frozen ones and those the loss does not reach. Eager PyTorch
    # leaves their .grad None and AdamW skips them; the graph has no gradient collective for them.
    frozen_params: tuple[str, ...] = ()
    params_without_grad: tuple[str, ...] = ()
    # Where the model's code asked torch.compiler.is_compiling() during the trace (file:line
    # (function)); the trace answered True (patch trace_as_compiling), an eager run answers False.
    compiling_queries: tuple[str, ...] = ()
    # Values the model read into Python that the graph holds as traced, each guarded at run time
    # (patch value_guards): "module file:line (source): traced with value".
    specialised_reads: tuple[str, ...] = ()
    # The reads the trace answered (empty where the model reads nothing): a rank's graph for
    # another batch is keyed by them (``verify.parity.retrace``).
    traced_reads: tuple[Read, ...] = ()
    # Parameters some ranks read and others do not, gathered first (parallelize/gathered_first.py):
    # the FSDP tagging saves their gathered values instead of recomputing them.
    gather_first: tuple[str, ...] = ()
    _stack: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)
    # Holds the export's fake mode off the dispatch stack between the trace and the compile.
    _suspended: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)

    @property
    def group_dims(self) -> dict[str, str]:
        return dict(self.gm.meta[M.GM_GROUP_DIMS])

    @property
    def param_fqns(self) -> list[str]:
        return roles.names_of(self.input_roles, roles.PARAM)

    @property
    def num_params(self) -> int:
        return len(self.param_fqns)

    def resume_fake_mode(self) -> None:
        """Put the export's fake mode back (the first partition compiles under it)."""
        self._suspended.close()

    def close(self) -> None:
        self._suspended.close()
        self._stack.close()

    def __enter__(self) -> JointGraph:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_joint_graph(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: ParallelMesh,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    *,
    eager_dropout: bool = True,
    reads_per_rank: bool = False,
    gather_first: Sequence[str] = (),
) -> JointGraph:
    """Trace ``loss_fn(model(*inputs[:-1]), inputs[-1])`` as run by one rank under ``plan``.

    ``eager_dropout=False`` keeps upstream's one-op ``native_dropout`` (the planner's trace: it
    places a dropout's mask with its input and switches it off for the oracle, and its parity
    reference runs that same graph, so eager's CPU arithmetic is not what it must match); an
    in-place dropout (``nn.Dropout(inplace=True)``) traces as that op too, copied back.

    ``model`` may live on ``meta``, on cpu, or on fake tensors; ``example_inputs`` are the
    global batch (only shapes and dtypes are used); each rank sees its data-parallel slice.

    A model that reads values into Python is traced with the values of the first data-parallel
    slice, and refused when another slice reads other values (one graph serves every rank).
    ``reads_per_rank=True``: the caller traces a graph per rank instead (each with its own slice's
    values, on a world whose rank is that rank: ``fake_world(spec, rank=r)`` or a real one) and
    compares their collectives before any runs (``verify.parity.retrace``); the slices' reads are
    then not compared here. ``gather_first``: parameters some ranks read and others do not,
    gathered first on every rank and given a zero gradient (``parallelize/gathered_first.py``).
    """
    if not example_inputs:
        raise ValueError("example_inputs must hold the model inputs followed by the loss target")
    disabled_from_env()  # a misspelt $AUTOPARALLEL_DISABLE name is an error here, not a patch left on
    shardings = plan.resolve(model, mesh.spec)
    check_input_dtypes(model, example_inputs[:-1], plan.param_dtype)
    fake_mode = detect_fake_mode(list(model.parameters()) + list(example_inputs)) or FakeTensorMode()
    coordinate = mesh.coordinate() if reads_per_rank else {d: 0 for d in mesh.spec.names}
    local = split_batch(tuple(example_inputs), plan, mesh.spec, coordinate)
    program = ParallelProgram(model, plan, mesh, loss_fn, shardings=shardings, gather_first=gather_first)
    local_params, local_buffers = _real_local_values(program)
    frozen = tuple(fqn for fqn, p in program.local_parameters().items() if not p.requires_grad)
    _to_fake(program, fake_mode)
    fake_inputs = tuple(_fake_like(t, fake_mode) for t in local)

    def trace(reads: list[Read] | None):
        stack = contextlib.ExitStack()
        try:
            from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

            with (annotate_module_paths(program.model), tracing_as_compiling(), compiling_queries() as queried,
                  data_dependent_ops_named(), reseeds_refused(),
                  replaying(reads, fake_mode) if reads is not None else contextlib.nullcontext(),
                  dropout_as_eager() if eager_dropout else in_place_dropout_as_one_op(),
                  kernels_as_eager() if eager_dropout else contextlib.nullcontext(),
                  strides_as_kernels() if eager_dropout else contextlib.nullcontext()):
                return aot_export_joint_with_descriptors(stack, program, fake_inputs), stack, queried
        except BaseException:
            stack.close()
            raise

    t0 = time.perf_counter()
    reads = None
    try:
        jd, stack, queried = trace(None)
    except DataDependentError:
        # The model reads a tensor's value: trace again with the values a real run of this
        # rank's slice gives, each guarded in the graph (a random one stays refused).
        if not (patches.enabled(VALUE_GUARDS) and local_params and all(_is_real(t) for t in local)):
            raise
        replicated = patches.enabled(REPLICATED_DRAWS)
        # With reads_per_rank the caller re-traces per rank and per step (verify.parity.retrace), so
        # a read that differs between slices, or changes with state the forward updates, gets its
        # own graph; one graph for every rank must refuse both here.
        reads = record_reads(model, program.loss_fn, local, plan.param_dtype, replicated, again=not reads_per_rank)
        if not reads_per_rank and all(_is_real(t) for t in example_inputs):
            others = data_slices(tuple(example_inputs), plan, mesh.spec)[1:]
            reads_agree(reads, [record_reads(model, program.loss_fn, s, plan.param_dtype, replicated) for s in others])
        jd, stack, queried = trace(reads)
    seconds = time.perf_counter() - t0
    gm = jd.graph_module
    specialised: list[str] = []
    if reads is not None:
        specialised = guard_reads(gm).guarded
        log.info("specialised %d values the model reads into Python, each guarded: %s", len(specialised), specialised)
    if patches.enabled(PINNED_LAYOUTS):
        pinned = pin_mixed_layouts(gm).pinned
        if pinned:
            log.info("pinned the traced layout of %d pointwise ops with mixed-layout operands: %s", len(pinned), pinned)
    input_roles, output_roles, num_fwd = label_roles(gm)
    without_grad = tuple(params_without_grad(gm, input_roles, output_roles))
    if without_grad:
        log.info("parameters without a gradient (frozen: %s): %s", list(frozen), list(without_grad))
    suspended = contextlib.ExitStack()
    suspended.enter_context(unset_fake_temporarily())
    attach_group_dims(gm, mesh.group_dims)
    gm.meta[M.GM_STAGE] = "joint"
    log.info("traced joint graph: %d nodes in %.2fs", len(gm.graph.nodes), seconds)
    return JointGraph(
        gm=gm,
        jd=jd,
        plan=plan,
        mesh=mesh,
        shardings=shardings,
        input_roles=input_roles,
        output_roles=output_roles,
        num_fwd_outputs=num_fwd,
        trace_seconds=seconds,
        fake_mode=fake_mode,
        local_params=local_params,
        local_buffers=local_buffers,
        frozen_params=frozen,
        params_without_grad=without_grad,
        compiling_queries=tuple(queried),
        specialised_reads=tuple(specialised),
        traced_reads=tuple(reads or ()),
        gather_first=tuple(gather_first),
        _stack=stack,
        _suspended=suspended,
    )


def _fake_like(t: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    if detect_fake_mode([t]) is fake_mode:
        return t
    with fake_mode:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _real_local_values(program: ParallelProgram) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(params, buffers) of this rank's program by FQN, where every one is a real tensor:
    what the placement must run with. A model built in ``__init__`` computes buffers there (BERT's
    ``position_ids``): allocating them anew would compute on memory nobody wrote. Nothing for a
    model on meta or fake tensors (graph work only)."""
    params = {clean_fqn(n): p.detach() for n, p in program.named_parameters()}
    buffers = {clean_fqn(n): b.detach() for n, b in program.named_buffers()}
    if not all(_is_real(t) for t in (*params.values(), *buffers.values())):
        return {}, {}
    return params, buffers  # the trace swaps fakes into the program: these stay the rank's own


def _is_real(t: torch.Tensor) -> bool:
    return not t.is_meta and not is_fake(t)


def _to_fake(root: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replace every parameter and buffer by a fake cpu tensor (ties preserved)."""
    memo: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    fake = _fake_like(t.detach(), fake_mode)
                    memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                store[name] = memo[id(t)]


def params_without_grad(gm: fx.GraphModule, input_roles: list[str], output_roles: list[str | None]) -> list[str]:
    """Parameters whose gradient output is missing or None (frozen, or the loss does not reach them)."""
    values = list(gm.graph.output_node().args[0])
    grads = {roles.name(r): v for r, v in zip(output_roles, values, strict=True) if roles.is_grad(r)}
    return [fqn for fqn in roles.names_of(input_roles, roles.PARAM) if grads.get(fqn) is None]


def label_roles(gm: fx.GraphModule) -> tuple[list[str], list[str | None], int]:
    """Role labels on the placeholders and the output node, from their AOT descriptors;
    (input roles, output roles, number of forward outputs)."""
    input_roles = []
    for node in gm.graph.find_nodes(op="placeholder"):
        role = roles.of_descriptor(node.meta.get(M.DESC), fqn=clean_fqn)
        node.meta[M.ROLE] = role
        input_roles.append(role)
    out = gm.graph.output_node()
    descs = out.meta.get(M.DESC) or [None] * len(out.args[0])
    output_roles = [roles.of_descriptor(d, fqn=clean_fqn) for d in descs]
    out.meta[M.ROLE] = output_roles
    num_fwd = sum(1 for r in output_roles if r is not None and not roles.is_grad(r))
    return input_roles, output_roles, num_fwd
