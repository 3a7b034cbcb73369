"""Hypothesis strategies for synthetic FSDP/TP-style FX graphs, and the builder they use.

A generated graph is described by plain data first (:class:`GraphSpec`: a list of
:class:`OpSpec`), then materialised by :func:`build_synthetic` into an ``fx.GraphModule`` with
FakeTensor ``val`` on every node, role labels on placeholders and outputs, and the group-name ->
mesh-dim map in ``gm.meta``. Building node by node in order makes every graph a valid DAG in
topological order, and a spec shrinks well: each op picks its operands by index modulo what
exists so far, so deleting any op still leaves a valid program.

What the generated graphs contain (FSDP/TP style):

* parameter placeholders -> (optional bf16 cast) -> all-gather on a random group -> wait ->
  (cast back) -> used by a pair of matmuls on an activation;
* activations: unary/binary compute, view chains that compose to the identity, TP-style
  all-reduces and all-gathers of activations (collectives that depend on other collectives);
* gradients: ``mm(act.t(), act)`` -> reduce-scatter or all-reduce -> wait -> (cast) -> output
  (role ``grad:*``); the loss (role ``loss``) is the sum of the last activation.

:class:`GraphBuilder` is also the convenient way to write hand-built graphs in tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.mesh import FLAT_SEP, ParallelMesh, attach_group_dims

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

Groups = Mapping[str, tuple[str, int]]  # mesh-dim label -> (process-group name, group size)


def mesh_groups(mesh: ParallelMesh) -> dict[str, tuple[str, int]]:
    """``{label: (group name, size)}`` for every group of a mesh (``dp``, ``tp``, ``dp*tp``)."""
    labels = dict.fromkeys(mesh.group_dims.values())
    return {label: (mesh.group_name(label), mesh.size(label)) for label in labels}


class GraphBuilder:
    """Build an FX graph node by node, computing each node's FakeTensor ``val`` as it goes.

    Values are computed on ``meta`` tensors (about 10x cheaper than FakeTensor dispatch) and
    wrapped as FakeTensors of device ``cpu`` in one FakeTensorMode, which is what PyTorch's
    bucketing merge functions need; views keep sharing their base's storage.
    """

    def __init__(self, groups: Groups, fake_mode: FakeTensorMode | None = None):
        self.groups = dict(groups)
        self.mode = fake_mode if fake_mode is not None else FakeTensorMode()
        self.graph = fx.Graph()
        self._meta: dict[fx.Node, Any] = {}
        self._n_params = 0

    def _set_val(self, node: fx.Node, meta_val: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        cpu = torch.device("cpu")
        self._meta[node] = meta_val
        node.meta[M.VAL] = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: FakeTensor(self.mode, t, cpu), meta_val
        )

    # -- nodes ---------------------------------------------------------------------------------

    def placeholder(
        self, name: str, shape: Sequence[int], dtype=torch.float32, role: str | None = None
    ) -> fx.Node:
        node = self.graph.placeholder(name)
        self._set_val(node, torch.empty(tuple(shape), dtype=dtype, device="meta"))
        if role is not None:
            node.meta[M.ROLE] = role
        return node

    def param(self, shape: Sequence[int], dtype=torch.float32) -> fx.Node:
        i = self._n_params
        self._n_params += 1
        return self.placeholder(f"p{i}", shape, dtype, role=roles.param(f"p{i}"))

    def call(self, target, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)

        def val(a):
            return self._meta[a] if isinstance(a, fx.Node) else a

        margs = torch.utils._pytree.tree_map(val, args)
        mkwargs = torch.utils._pytree.tree_map(val, kwargs)
        self._set_val(node, target(*margs, **mkwargs))
        return node

    def group(self, label: str) -> tuple[str, int]:
        try:
            return self.groups[label]
        except KeyError:
            raise ValueError(
                f"no group for mesh dim {label!r}; have {sorted(self.groups)}"
            ) from None

    def all_gather(self, x: fx.Node, label: str) -> fx.Node:
        """``wait(all_gather_into_tensor(x))`` on mesh dim ``label``; returns the wait."""
        name, size = self.group(label)
        return self.call(
            _c10d.wait_tensor.default,
            self.call(_c10d.all_gather_into_tensor.default, x, size, name),
        )

    def reduce_scatter(self, x: fx.Node, label: str, op: str = "sum") -> fx.Node:
        name, size = self.group(label)
        return self.call(
            _c10d.wait_tensor.default,
            self.call(_c10d.reduce_scatter_tensor.default, x, op, size, name),
        )

    def all_reduce(self, x: fx.Node, label: str, op: str = "sum") -> fx.Node:
        name, _ = self.group(label)
        return self.call(
            _c10d.wait_tensor.default, self.call(_c10d.all_reduce.default, x, op, name)
        )

    def output(
        self, values: Sequence[fx.Node], roles: Sequence[str | None] | None = None
    ) -> fx.GraphModule:
        out = self.graph.output(tuple(values))
        if roles is not None:
            out.meta[M.ROLE] = list(roles)
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        attach_group_dims(gm, {name: label for label, (name, _) in self.groups.items()})
        gm.graph.lint()
        return gm


# --- specs ---------------------------------------------------------------------------------------

KINDS = (
    "param_ag",  # new param -> all-gather -> used by mm(mm(act, W.t()), W)
    "param_ag_bf16",  # the same with a bf16 cast before the all-gather and back after it
    "param_ag_padded",  # an uneven FSDP shard: all-gather -> narrow dropping 1 padding row -> used
    "use_weight",  # reuse an earlier gathered weight on an activation
    "unary",  # relu / tanh / neg
    "binary",  # add / mul of two activations
    "view_chain",  # t -> t, or view(-1) -> view(B, H): composes to the identity
    "act_all_reduce",  # TP-style: activation all-reduce (sum), result used further
    "act_all_gather",  # activation all-gather, then view + sum back to [B, H]
    "grad_rs",  # mm(a.t(), b) -> reduce-scatter -> output
    "grad_ar",  # mm(a.t(), b) -> all-reduce -> output
    "grad_rs_padded",  # mm(a.t(), b) narrowed by 1 row, zero-padded back -> reduce-scatter -> output
    # Two weight all-gathers on dims L1, L2, then activation all-gathers on L1 of what the L2
    # weight computed and on L2 of what the L1 weight computed: each same-dim pair is
    # independent, but bucketing both pairs closes a cycle.
    "crossed_gathers",
    # A parameter sharded over two mesh dims: all-gather over one, (views composing to the
    # identity,) all-gather over the other: the chain chained all-gather fusion rewrites.
    "param_ag_chain",
)


@dataclass(frozen=True)
class OpSpec:
    kind: str
    a: int = 0  # operand choices, counted back from the most recent, modulo what exists
    b: int = 0
    label: str = "dp"  # mesh dim of a collective
    rows: int = 1  # parameter shard rows
    variant: int = 0  # which unary op / reduce op / view chain / output cast


@dataclass(frozen=True)
class GraphSpec:
    hidden: int
    batch: int
    ops: tuple[OpSpec, ...] = field(default_factory=tuple)


@dataclass
class SyntheticGraph:
    spec: GraphSpec
    gm: fx.GraphModule


_UNARY = (aten.relu.default, aten.tanh.default, aten.neg.default)
_BINARY = (aten.add.Tensor, aten.mul.Tensor)
_REDUCE_OPS = ("sum", "avg")


def build_synthetic(
    spec: GraphSpec, groups: Groups, fake_mode: FakeTensorMode | None = None
) -> SyntheticGraph:
    """Materialise ``spec`` with the given groups (label -> (name, size))."""
    b = GraphBuilder(groups, fake_mode)
    H, B = spec.hidden, spec.batch
    acts = [b.placeholder("x", (B, H), role=roles.input_(0))]
    weights: list[fx.Node] = []
    grads: list[fx.Node] = []

    def pick(seq, i):  # 0 is the most recent: small draws (what Hypothesis favours) chain ops
        return seq[-1 - i % len(seq)]

    def use(act: fx.Node, w: fx.Node) -> fx.Node:
        h = b.call(aten.mm.default, act, b.call(aten.t.default, w))
        return b.call(aten.mm.default, h, w)

    for op in spec.ops:
        k = op.kind
        if k in ("param_ag", "param_ag_bf16"):
            _, size = b.group(op.label)
            p = b.param((op.rows, H))
            src = p
            if k == "param_ag_bf16":
                src = b.call(torch.ops.prims.convert_element_type.default, p, torch.bfloat16)
            w = b.all_gather(src, op.label)
            if k == "param_ag_bf16":
                w = b.call(torch.ops.prims.convert_element_type.default, w, torch.float32)
            weights.append(w)
            acts.append(use(pick(acts, op.a), w))
        elif k == "param_ag_padded":
            _, size = b.group(op.label)
            w = b.all_gather(b.param((op.rows, H)), op.label)
            w = b.call(aten.slice.Tensor, w, 0, 0, op.rows * size - 1)  # the true rows
            weights.append(w)
            acts.append(use(pick(acts, op.a), w))
        elif k == "use_weight":
            if weights:
                acts.append(use(pick(acts, op.a), pick(weights, op.b)))
        elif k == "unary":
            acts.append(b.call(_UNARY[op.variant % len(_UNARY)], pick(acts, op.a)))
        elif k == "binary":
            acts.append(
                b.call(_BINARY[op.variant % len(_BINARY)], pick(acts, op.a), pick(acts, op.b))
            )
        elif k == "view_chain":
            a = pick(acts, op.a)
            if op.variant % 2:
                v = b.call(aten.t.default, b.call(aten.t.default, a))
            else:
                v = b.call(aten.view.default, b.call(aten.view.default, a, [B * H]), [B, H])
            acts.append(b.call(aten.relu.default, v))
        elif k == "act_all_reduce":
            acts.append(b.all_reduce(pick(acts, op.a), op.label, "sum"))
        elif k == "act_all_gather":
            _, size = b.group(op.label)
            g = b.all_gather(pick(acts, op.a), op.label)
            acts.append(
                b.call(aten.sum.dim_IntList, b.call(aten.view.default, g, [size, B, H]), [0])
            )
        elif k in ("grad_rs", "grad_ar", "grad_rs_padded"):
            gin = b.call(
                aten.mm.default, b.call(aten.t.default, pick(acts, op.a)), pick(acts, op.b)
            )
            if k == "grad_rs_padded":  # the gradient of H - 1 true rows, padded to H
                gin = b.call(aten.slice.Tensor, gin, 0, 0, H - 1)
                gin = b.call(aten.constant_pad_nd.default, gin, [0, 0, 0, 1], 0.0)
            red = _REDUCE_OPS[op.variant // 3]  # mostly "sum": one key, more to bucket
            if k in ("grad_rs", "grad_rs_padded"):
                g = b.reduce_scatter(gin, op.label, red)
            else:
                g = b.all_reduce(gin, op.label, red)
            if op.variant >= 2:
                g = b.call(torch.ops.prims.convert_element_type.default, g, torch.float64)
            grads.append(g)
        elif k == "crossed_gathers":
            labels = sorted(b.groups)
            l1, l2 = op.label, labels[op.variant % len(labels)]
            base = pick(acts, op.a)
            act1 = use(base, b.all_gather(b.param((op.rows, H)), l1))
            act2 = use(base, b.all_gather(b.param((op.rows, H)), l2))
            for label, src in ((l1, act2), (l2, act1)):
                _, size = b.group(label)
                g = b.all_gather(src, label)
                acts.append(
                    b.call(aten.sum.dim_IntList, b.call(aten.view.default, g, [size, B, H]), [0])
                )
        elif k == "param_ag_chain":
            dims = sorted(label for label in b.groups if FLAT_SEP not in label)
            if len(dims) < 2:  # a 1-D mesh has no chain: an ordinary parameter all-gather
                w = b.all_gather(b.param((op.rows, H)), op.label)
            else:
                first, second = (dims[0], dims[1]) if op.variant % 2 == 0 else (dims[1], dims[0])
                w = b.all_gather(b.param((op.rows, H)), first)
                if op.variant >= 2:
                    shape = list(b._meta[w].shape)
                    w = b.call(aten.reshape.default, b.call(aten.reshape.default, w, [-1]), shape)
                w = b.all_gather(w, second)
            weights.append(w)
            acts.append(use(pick(acts, op.a), w))
        else:
            raise ValueError(f"unknown op kind {k!r}; valid: {KINDS}")
    loss = b.call(aten.sum.default, acts[-1])
    labels = [roles.LOSS, *(roles.grad(f"g{i}") for i in range(len(grads)))]
    return SyntheticGraph(spec, b.output([loss, *grads], labels))


# Collectives are what the passes act on: draw them more often than plain compute.
WEIGHTED_KINDS = (
    *KINDS,
    "param_ag",
    "param_ag",
    "param_ag",
    "grad_rs",
    "grad_rs",
    "grad_ar",
    "crossed_gathers",
)


def op_specs(
    labels: Sequence[str], kinds: Sequence[str] = WEIGHTED_KINDS
) -> st.SearchStrategy[OpSpec]:
    return st.builds(
        OpSpec,
        kind=st.sampled_from(tuple(kinds)),
        a=st.integers(0, 63),
        b=st.integers(0, 63),
        # The first label (the data-parallel dim) is drawn most, as in FSDP graphs.
        label=st.sampled_from((*labels, *[labels[0]] * 2 * len(labels))),
        rows=st.sampled_from((1, 2, 4)),
        variant=st.integers(0, 3),
    )


def graph_specs(
    labels: Sequence[str],
    *,
    min_ops: int = 2,
    max_ops: int = 24,
    hidden: int = 8,
    kinds: Sequence[str] = WEIGHTED_KINDS,
) -> st.SearchStrategy[GraphSpec]:
    """Specs over the mesh dims ``labels``; ``hidden`` must be divisible by every group size."""
    return st.builds(
        GraphSpec,
        hidden=st.just(hidden),
        batch=st.sampled_from((2, 4)),
        ops=st.lists(op_specs(labels, kinds), min_size=min_ops, max_size=max_ops).map(tuple),
    )


def synthetic_graphs(
    mesh: ParallelMesh,
    *,
    min_ops: int = 2,
    max_ops: int = 24,
    kinds: Sequence[str] = WEIGHTED_KINDS,
    repeats: int = 1,
) -> st.SearchStrategy[SyntheticGraph]:
    """Built graphs on ``mesh``'s groups (its world must be running when they are merged).
    ``repeats``: the drawn ops run that many times in a row, as a model's blocks do."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    groups = mesh_groups(mesh)
    hidden = max(8, max(size for _, size in groups.values()))
    labels = list(mesh.spec.names) + [lab for lab in groups if lab not in mesh.spec.names]
    return graph_specs(labels, min_ops=min_ops, max_ops=max_ops, hidden=hidden, kinds=kinds).map(
        lambda spec: build_synthetic(replace(spec, ops=spec.ops * repeats), groups)
    )


def gradients_in_order(mesh: ParallelMesh, order: Sequence[int], rows: Sequence[int] | None = None,
                       hidden: int = 8) -> fx.GraphModule:
    """Parameters ``p0..pN-1`` (``rows[i]`` rows each), each one's reduce-scattered gradient
    computed in ``order`` (the graph's order), the outputs labelled in parameter order as every
    rank labels them: what two ranks' graphs traced per rank look like when their routing makes
    them compute the same gradients in other orders."""
    rows = list(rows) if rows is not None else [4] * len(order)
    aten = torch.ops.aten
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (4, hidden), role=roles.input_(0))
    params = [b.param((r, hidden)) for r in rows]
    grads = {}
    for i in order:
        w = b.call(aten.add.Tensor, params[i], 0.0)  # the full weight, as a gathered one would be
        g = b.call(aten.mm.default, b.call(aten.t.default, b.call(aten.mm.default, x, b.call(aten.t.default, w))), x)
        grads[i] = b.reduce_scatter(b.call(aten.cat.default, [g, g]), mesh.spec.names[0])
    out = [b.call(aten.sum.default, x)] + [grads[i] for i in range(len(order))]
    return b.output(out, [roles.LOSS] + [roles.grad(f"p{i}") for i in range(len(order))])


def example_inputs(gm: fx.GraphModule, seed: int = 0) -> list[torch.Tensor]:
    """Real tensors for ``gm``'s placeholders (shapes/dtypes of their vals), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        v = node.meta[M.VAL]
        out.append(torch.randn(tuple(v.shape), generator=g, dtype=torch.float32).to(v.dtype))
    return out


__all__ = [
    "KINDS",
    "WEIGHTED_KINDS",
    "GraphBuilder",
    "GraphSpec",
    "OpSpec",
    "SyntheticGraph",
    "build_synthetic",
    "example_inputs",
    "gradients_in_order",
    "graph_specs",
    "mesh_groups",
    "op_specs",
    "synthetic_graphs",
]
