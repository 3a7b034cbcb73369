"""Per-pass differential execution (translation validation) on N simulated ranks in one process.

A graph-in/graph-out pass must not change what its graphs compute. This module runs a pass's
input and its output on the same random inputs and compares the outputs bitwise
(:mod:`verify.parity.compare`), on every rank of the world the graphs were built for, with no process
group: ``torch.distributed._local_tensor.LocalTensorMode`` holds one tensor per simulated rank
in each ``LocalTensor`` and runs every collective (all-gather, reduce-scatter, all-reduce, the
``_out`` all-gather of a merged bucket) on those shards, for each group of the mesh at once.
A fake world (``autoparallel.mesh.fake_world``) supplies the group names and their rank lists.

What a program is
    One joint graph, or a (forward, backward) pair. A pair runs as AOT runs it: the forward on
    the inputs, then the backward on the values the forward saved (outputs ``saved:<k>`` feed
    backward placeholders ``saved:<k>``), the parameters and inputs it reads, and the tangents.
    Inputs are matched by role (``param:<fqn>``, ``input:<i>``, ``tangent:loss``, ...; a
    placeholder without a role by its name), so the joint graph, the first partition's pair and
    every later pair read the same values. A program's *result* is its user outputs and
    gradients by role (``loss``, ``output:<i>``, ``grad:<fqn>``); a pair's saved values are
    compared too when both sides save the same signature (the collective passes never change
    it; a partitioner may).

Inputs
    Random, deterministic per (role, rank, seed) (a CRC of the role, not Python's salted hash):
    floats from a normal distribution, integer inputs uniform in the range their uses allow
    (embedding rows, the classes of a loss), so token ids and labels stay valid. An integer
    input whose range cannot be read from its uses is an error naming it.

Where LocalTensorMode cannot stand in for a real world (and what covers that instead)
    * Rank-specific graphs. Merged all-gathers are built for one rank: PyTorch's merge
      (``all_gather_merge_fn_to_trace``) copies the bucket's inputs into
      ``out.narrow(0, numel * rank, numel)`` and gathers that slice in place, with ``rank``
      baked in as a constant. Here one graph (rank 0's) runs for every simulated rank, which
      is value-correct only because LocalTensor's all-gather reads every input before writing
      the output. So a wrong copy-in offset is invisible to this execution (on NCCL it would
      race); :func:`check_copy_in_offsets` checks that offset statically on graphs built for
      other ranks instead (tests/golden/test_pass_invariants.py).
    * Reduction order. LocalTensor sums in rank order, gloo and NCCL in their own, so values
      here are compared only with values computed here, never with a real world's.
    * Ops without a LocalTensor rule (``_c10d_functional_autograd``, ``symm_mem``, point-to-point
      inside a compiled region) raise NotImplementedError naming the op; none occurs in the
      pipeline's graphs today. Python-level (not dispatcher) rank logic, e.g. an ``if rank == 0``
      in a graph module's code, cannot be seen by the mode at all; FX graphs have none.
    * The trace itself (eager program -> joint graph) is not a graph-in/graph-out pass: the
      joint graph is checked against the eager parallel program on a gloo world
      (tests/parity/test_joint_parity.py).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import ALL_GATHER_OUT, group_of, schema_arg
from autoparallel.mesh import MeshSpec, ParallelMesh, fake_world, group_dims_of
from autoparallel.runtime.rebind import rebind_groups
from verify.graphs.canon import own_scope
from verify.parity.compare import ParityReport, TensorDiff, diff_tensors
from verify.stages.pipeline_run import intra_op_threads

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]

aten = torch.ops.aten


# --- keys: what a placeholder reads and an output means ----------------------------------------


def input_key(ph: fx.Node) -> str:
    """The placeholder's role, or ``placeholder:<name>`` for one without."""
    role = ph.meta.get(M.ROLE)
    return role if isinstance(role, str) else f"placeholder:{ph.name}"


def output_keys(gm: fx.GraphModule) -> list[str | None]:
    """One key per output entry: its role, ``out:<i>`` without one, None for a None entry."""
    out = gm.graph.output_node()
    values = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    labels = out.meta.get(M.ROLE) or [None] * len(values)
    keys: list[str | None] = []
    for i, (v, label) in enumerate(zip(values, labels, strict=True)):
        keys.append(None if v is None else label if isinstance(label, str) else f"out:{i}")
    return keys


# --- random inputs -----------------------------------------------------------------------------

_VIEWISH = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.clone.default,
        aten.flatten.using_ints,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
    }
)
_LOSSES = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, aten.nll_loss_backward.default})


def _index_bound(node: fx.Node, seen: set[fx.Node] | None = None) -> int | None:
    """The exclusive upper bound its uses put on an integer tensor's values, or None if no use
    says: an embedding's row count, a loss's class count (through view-like ops)."""
    seen = seen if seen is not None else set()
    bounds = []
    for user in node.users:
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target is aten.embedding.default and user.args[1] is node:
            bounds.append(int(user.args[0].meta[M.VAL].shape[0]))
        elif user.target is aten.embedding_dense_backward.default and user.args[1] is node:
            bounds.append(int(user.args[2]))
        elif user.target in _LOSSES and node in user.args[:2]:
            logits = user.args[0] if user.target is not aten.nll_loss_backward.default else user.args[1]
            bounds.append(int(logits.meta[M.VAL].shape[-1]))
        elif user.target in _VIEWISH and user.args[0] is node:
            b = _index_bound(user, seen)
            if b is not None:
                bounds.append(b)
    return min(bounds) if bounds else None


def _seed(key: str, rank: int, seed: int) -> int:
    return (zlib.crc32(key.encode()) * 1_000_003 + rank * 7919 + seed) % (2**63)


def random_tensor(shape, dtype: torch.dtype, key: str, rank: int, seed: int = 0, high: int | None = None) -> torch.Tensor:
    """Deterministic random values for ``key`` on ``rank`` (see the module docstring)."""
    g = torch.Generator().manual_seed(_seed(key, rank, seed))
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(tuple(shape), generator=g, dtype=dtype if dtype.itemsize >= 4 else torch.float32).to(dtype)
    if high is None:
        raise ValueError(f"integer input {key!r}: cannot tell the range of its values from its uses; pass its values")
    return torch.randint(0, high, tuple(shape), generator=g, dtype=dtype)


PerRank = tuple  # one value per simulated rank, rank r at index r


@dataclass
class Feeds:
    """The inputs of every program compared in one check: per key, one tensor per rank, made on
    first use and reused, so two programs that read ``param:w`` read the same shards. A key
    read with two shapes or dtypes is an error naming the placeholder."""

    ranks: int
    seed: int = 0
    given: Mapping[str, PerRank] = field(default_factory=dict)  # key -> per-rank tensors
    # Each simulated rank draws from its own CPU generator seeded ``draw_seed`` (None: the ranks share
    # one seeded ``seed``). A rank's graphs traced for a slice whose reads follow a draw (dropout
    # before an MoE router) hold only the routing that draw gives: every simulated rank must draw it.
    draw_seed: int | None = None
    _made: dict[str, PerRank] = field(default_factory=dict)
    _sig: dict[str, tuple] = field(default_factory=dict)

    def value(self, ph: fx.Node) -> PerRank:
        key = input_key(ph)
        if key in self.given:
            return tuple(self.given[key])
        val = ph.meta.get(M.VAL)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"placeholder {ph.name!r} ({key}) has no tensor meta['{M.VAL}']: cannot make an input for it")
        sig = (tuple(val.shape), val.dtype)
        if key in self._made:
            if self._sig[key] != sig:
                raise ValueError(
                    f"placeholder {ph.name!r} reads {key!r} as {sig}, but another graph of this check read it as "
                    f"{self._sig[key]}; the programs compared do not take the same inputs"
                )
            return self._made[key]
        exact = val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool
        high = None if exact else _index_bound(ph)
        self._made[key] = tuple(random_tensor(val.shape, val.dtype, key, r, self.seed, high) for r in range(self.ranks))
        self._sig[key] = sig
        return self._made[key]


# --- running programs ---------------------------------------------------------------------------
#
# The lockstep engine: every rank runs its own graph on plain tensors, node by node in step; a
# collective node gathers the ranks' arguments into LocalTensors and runs under LocalTensorMode,
# which implements it for every group of the mesh at once. Compute runs at eager speed (the full
# LocalTensorMode engine below dispatches every op through the subclass: about 31 s of CPU for one
# tiny-LLaMA joint graph at 8 ranks, against well under a second here), and ranks may run
# different graphs (rank-specific constants) as long as the graphs line up node for node.

LOCKSTEP = "lockstep"
LOCAL_TENSOR = "local_tensor"  # the whole graph under LocalTensorMode (slow; a cross-check)
ENGINES = (LOCKSTEP, LOCAL_TENSOR)


def _is_collective(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace in ("_c10d_functional", "c10d")


def _aligned(gms: Sequence[fx.GraphModule]) -> list[list[fx.Node]]:
    nodes = [list(gm.graph.nodes) for gm in gms]
    for r, ns in enumerate(nodes[1:], 1):
        if len(ns) != len(nodes[0]):
            raise ValueError(f"rank {r}'s graph has {len(ns)} nodes, rank 0's {len(nodes[0])}: lockstep needs graphs that line up")
        for a, b in zip(nodes[0], ns, strict=True):
            if (a.op, a.target) != (b.op, b.target):
                raise ValueError(f"rank {r}'s node {b.name!r} ({b.target}) does not line up with rank 0's {a.name!r} ({a.target})")
    return nodes


def _collective(node: fx.Node, per_rank_args: list[tuple], ranks: int) -> PerRank:
    """Run one collective for all ranks: tensor leaves become LocalTensors, other leaves must agree."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.utils import _pytree as pytree

    flat = [pytree.tree_flatten(a) for a in per_rank_args]
    spec = flat[0][1]
    leaves = []
    for j, leaf in enumerate(flat[0][0]):
        column = [f[0][j] for f in flat]
        if isinstance(leaf, torch.Tensor):
            leaves.append(LocalTensor(dict(enumerate(column))))
        elif all(x == leaf for x in column):
            leaves.append(leaf)
        else:
            raise ValueError(f"collective {node.name!r}: argument {j} differs between ranks ({column}); a collective's "
                             "non-tensor arguments must agree on every rank")
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    with LocalTensorMode(ranks):
        out = node.target(*args, **kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        # Waited here, on the LocalTensors the work was registered with: the graph's own
        # wait_tensor node gets per-rank tensors re-wrapped, which the work registry does not know,
        # and every collective stayed registered (unwaited) until the process ended.
        for x in out_leaves:
            if isinstance(x, LocalTensor):
                torch.ops._c10d_functional.wait_tensor(x)
    per_rank = []
    for r in range(ranks):
        mine = [x._local_tensors[r] if isinstance(x, LocalTensor) else x for x in out_leaves]
        per_rank.append(pytree.tree_unflatten(mine, out_spec))
    return tuple(per_rank)


def _draws(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _on_generator(state: list[torch.Tensor] | None, fn):
    """``fn()`` drawing from the CPU generator state ``state[0]`` (kept updated); None: as is."""
    if state is None:
        return fn()
    saved = torch.get_rng_state()
    torch.set_rng_state(state[0])
    try:
        return fn()
    finally:
        state[0] = torch.get_rng_state()
        torch.set_rng_state(saved)


def _run_lockstep(gms: Sequence[fx.GraphModule], args: list[PerRank], record: dict | None, prefix: str,
                  generators: list[list[torch.Tensor]] | None = None) -> list[PerRank]:
    ranks = len(gms)
    nodes = _aligned(gms)
    interps = [fx.Interpreter(gm, garbage_collect_values=False) for gm in gms]
    feed = iter(args)
    result: list[PerRank] = []
    for column in zip(*nodes, strict=True):
        node = column[0]
        if node.op == "placeholder":
            values = next(feed)
        elif node.op == "output":
            outs = [it.fetch_args_kwargs_from_env(n)[0][0] for it, n in zip(interps, column, strict=True)]
            outs = [list(o) if isinstance(o, (list, tuple)) else [o] for o in outs]
            result = [tuple(o[i] for o in outs) for i in range(len(outs[0]))]
            break
        elif _is_collective(node):
            values = _collective(node, [it.fetch_args_kwargs_from_env(n) for it, n in zip(interps, column, strict=True)], ranks)
        elif generators is not None and _draws(node):
            values = tuple(_on_generator(g, lambda it=it, n=n: it.run_node(n)) for it, n, g in zip(interps, column, generators, strict=True))
        else:
            values = tuple(it.run_node(n) for it, n in zip(interps, column, strict=True))
        for it, n, v in zip(interps, column, values, strict=True):
            it.env[n] = v
        if record is not None and node.op != "placeholder":
            record[f"{prefix}{node.name}"] = (node, values)
    return result


def run_ranks(gms: Sequence[fx.GraphModule], args: Sequence[PerRank]) -> list[PerRank]:
    """Rank r's graph ``gms[r]`` on ``args`` (one value per rank per placeholder), in lockstep in
    the running fake world: its outputs, one value per rank (graphs without roles: a move)."""
    return _run_lockstep(gms, list(args), None, "")


def _run_local_tensor(gm: fx.GraphModule, args: list[PerRank], record: dict | None, prefix: str) -> list[PerRank]:
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    ranks = len(args[0]) if args else 1

    def split(v):
        if isinstance(v, LocalTensor):
            return tuple(v._local_tensors[r] for r in range(ranks))
        if isinstance(v, (list, tuple)):
            parts = [split(x) for x in v]
            return tuple(type(v)(p[r] for p in parts) for r in range(ranks))
        return (v,) * ranks

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if record is not None and n.op not in ("placeholder", "output"):
                record[f"{prefix}{n.name}"] = (n, split(out))
            return out

    with LocalTensorMode(ranks):
        outs = Recorder(gm, garbage_collect_values=record is None).run(
            *[LocalTensor(dict(enumerate(a))) for a in args], enable_io_processing=False
        )
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return [split(o) for o in outs]


def run_graph(gm: fx.GraphModule | Sequence[fx.GraphModule], feeds: Feeds, extra: Mapping[str, PerRank] | None = None, *,
              record: dict[str, Any] | None = None, prefix: str = "", engine: str = LOCKSTEP,
              generators: list[list[torch.Tensor]] | None = None) -> dict[str, PerRank]:
    """Run ``gm`` on every rank (or ``gm[r]`` on rank r) on ``extra`` by key, else ``feeds``, in
    the running fake world; outputs by key, one value per rank. ``record`` collects every node's
    per-rank values under ``prefix + name``."""
    gms = [gm] * feeds.ranks if isinstance(gm, fx.GraphModule) else list(gm)
    if len(gms) != feeds.ranks:
        raise ValueError(f"{len(gms)} graphs for {feeds.ranks} ranks")
    extra = extra or {}
    args = [extra[input_key(ph)] if input_key(ph) in extra else feeds.value(ph) for ph in gms[0].graph.find_nodes(op="placeholder")]
    if engine == LOCKSTEP:
        outs = _run_lockstep(gms, args, record, prefix, generators)
    elif engine == LOCAL_TENSOR:
        if generators is not None:
            raise ValueError("the local_tensor engine draws from one generator; per-rank draws need the lockstep engine")
        if any(g is not gms[0] for g in gms):
            raise ValueError("the local_tensor engine runs one graph for every rank; rank-specific graphs need the lockstep engine")
        outs = _run_local_tensor(gms[0], args, record, prefix)
    else:
        raise ValueError(f"unknown engine {engine!r}; engines: {list(ENGINES)}")
    return {k: v for k, v in zip(output_keys(gms[0]), outs, strict=True) if k is not None}


@dataclass
class ProgramResult:
    """What a program computed: user outputs and gradients by key (``result``), and for a pair
    its saved values by key (``saved``) with their signature."""

    result: dict[str, PerRank]
    saved: dict[str, PerRank] = field(default_factory=dict)
    saved_signature: tuple = ()


def _signature(values: Mapping[str, PerRank]) -> tuple:
    return tuple((k, tuple(v[0].shape), v[0].dtype) for k, v in values.items() if isinstance(v[0], torch.Tensor))


def run_program(graphs: Graphs, feeds: Feeds, *, record: dict[str, Any] | None = None, engine: str = LOCKSTEP) -> ProgramResult:
    """Run one graph, or a (forward, backward) pair composed as AOT composes it. The CPU
    generator is seeded with ``feeds.seed`` for the run (and restored after), so two programs
    whose random ops draw in the same order draw the same masks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(feeds.seed)
        generators = None
        if feeds.draw_seed is not None:  # one generator per simulated rank, the forward's draws carried to the backward
            torch.manual_seed(feeds.draw_seed)
            generators = [[torch.get_rng_state()] for _ in range(feeds.ranks)]
        return _run_program(graphs, feeds, record=record, engine=engine, generators=generators)


def _run_program(graphs: Graphs, feeds: Feeds, *, record: dict[str, Any] | None, engine: str,
                 generators: list[list[torch.Tensor]] | None = None) -> ProgramResult:
    if not isinstance(graphs, tuple):
        return ProgramResult(run_graph(graphs, feeds, record=record, engine=engine, generators=generators))
    fw, bw = graphs
    fw_out = run_graph(fw, feeds, record=record, prefix="fw/", engine=engine, generators=generators)
    saved = {k: v for k, v in fw_out.items() if roles.is_saved(k)}
    result = {k: v for k, v in fw_out.items() if not roles.is_saved(k)}
    bw_out = run_graph(bw, feeds, saved, record=record, prefix="bw/", engine=engine, generators=generators)
    clash = sorted(set(result) & set(bw_out))
    if clash:
        raise ValueError(f"forward and backward both output {clash}: cannot tell their results apart")
    result.update(bw_out)
    return ProgramResult(result, saved, _signature(saved))


# --- the world ----------------------------------------------------------------------------------


@contextlib.contextmanager
def simulated_world(mesh: MeshSpec | str, world: ParallelMesh | None = None) -> Iterator[ParallelMesh]:
    """A fake world of ``mesh``: its group names and rank lists are what LocalTensorMode's
    collectives read. Nothing communicates. One intra-op thread inside: the tensors are small,
    and on a shared 2-core box a second thread only spins. ``world``: a running world's mesh to
    read the groups of instead (inside a rank of a gloo world, whose graphs name its groups:
    LocalTensorMode only reads their rank lists, so nothing communicates there either)."""
    if world is not None:
        with intra_op_threads(1):
            yield world
        return
    with fake_world(MeshSpec.parse(mesh)) as fake, intra_op_threads(1):
        yield fake


def bind(graphs: Graphs, world: ParallelMesh) -> Graphs:
    """``graphs`` naming ``world``'s process groups (copies where their names differ)."""
    if isinstance(graphs, tuple):
        return tuple(bind(g, world) for g in graphs)  # type: ignore[return-value]
    dims = group_dims_of(graphs)
    if not dims or dims == world.group_dims:
        return graphs
    return rebind_groups(graphs, world.group_dims)


# --- comparing ----------------------------------------------------------------------------------


def compare_results(a: Mapping[str, PerRank], b: Mapping[str, PerRank], a_name: str, b_name: str,
                    report: ParityReport | None = None) -> ParityReport:
    """Every key of either side, every rank, bitwise (``key@rank<r>``)."""
    report = report if report is not None else ParityReport(a_name, b_name)
    for key in sorted(set(a) | set(b), key=_key_order):
        if key not in a or key not in b:
            missing = a_name if key not in a else b_name
            report.diffs.append(TensorDiff(key, False, float("inf"), f"missing in {missing}"))
            continue
        for r, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            report.diffs.append(diff_tensors(f"{key}@rank{r}", x, y))
    return report


def _key_order(key: str) -> tuple:
    """Loss and user outputs first, then saved values, then gradients (what a reader looks at first)."""
    kind = roles.kind(key)
    rank = {roles.LOSS: 0, roles.OUTPUT: 1, roles.SAVED: 2, roles.GRAD: 3}.get(kind, 4)
    return (rank, _natural(key))


def _natural(text: str) -> tuple:
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


@dataclass
class NodeDiff:
    """The first node of the second program whose value differs from the node of the same name,
    op and type in the first (forward first, then backward), with the note of both values."""

    graph: str  # "fw" / "bw" / "" for a single graph
    node: str
    op: str
    rank: int
    note: str
    module: str | None = None  # the module path that created the node (verify.graphs.canon.own_scope)
    max_abs: float = 0.0  # the largest |difference| of its values on that rank

    def describe(self) -> str:
        where = f"{self.graph} " if self.graph else ""
        module = f" in module {self.module!r}" if self.module else " (no module path)"
        return f"{where}node {self.node!r} ({self.op}){module} on rank {self.rank}, max |diff| {self.max_abs:.3e}: {self.note}"


def _tensor_leaves(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def first_differing_node(a: Mapping[str, Any], b: Mapping[str, Any]) -> NodeDiff | None:
    """Walk ``b``'s recorded nodes in execution order; the first whose counterpart in ``a`` (same
    graph side and name) holds a tensor of the same shape with other bits on some rank, or the
    same values in another floating dtype. A counterpart computed by another op is named with
    both ops (a flipped op)."""
    for key, (node, values) in b.items():
        if key not in a or node.target in _UNINITIALISED:
            continue
        other_node, others = a[key]
        for r, (v, o) in enumerate(zip(values, others, strict=True)):
            for x, y in zip(_tensor_leaves(o), _tensor_leaves(v), strict=False):
                if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                    continue
                if x.shape != y.shape or x.layout != torch.strided or x.dtype.is_floating_point != y.dtype.is_floating_point:
                    continue
                d = diff_tensors(key, x, y) if x.dtype == y.dtype else _dtype_diff(key, x, y)
                if not d.equal:
                    graph, _, name = key.rpartition("/")
                    op = _op_name(node)
                    if other_node.target != node.target:
                        op = f"{_op_name(other_node)} -> {op}"
                    return NodeDiff(graph, name, op, r, d.note, own_scope(node) or own_scope(other_node), d.max_abs)
    return None


# Ops whose result is memory nobody wrote (what a later op fills in, e.g. dropout's
# ``empty_like(x).bernoulli_(1 - p)``): two runs hold different garbage, which is no difference.
_UNINITIALISED = frozenset({
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
    aten.new_empty.default, aten.new_empty_strided.default,
})


def _dtype_diff(key: str, x: torch.Tensor, y: torch.Tensor) -> TensorDiff:
    """A node of the same name and op computing in another floating dtype (a cast moved or
    dropped): a difference, its size measured in float64."""
    d = diff_tensors(key, x.double(), y.double())
    return TensorDiff(key, False, d.max_abs, f"computed in {y.dtype}, not {x.dtype}; {d.note or 'values equal in float64'}",
                      d.differing, d.numel)


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}"
    return getattr(t, "__name__", str(t))


@dataclass
class PassCheck:
    """One comparison of two programs: ``a`` (a pass's input, or configuration A's stage) and
    ``b``. ``same_code``: not run, the two are the same code (equal by construction)."""

    name: str
    a: str
    b: str
    report: ParityReport
    note: str = ""
    first_node: NodeDiff | None = None
    same_code: bool = False

    @property
    def equal(self) -> bool:
        return self.same_code or self.report.bitwise

    def first_output(self) -> TensorDiff | None:
        bad = self.report.mismatches()
        return bad[0] if bad else None

    def summary(self) -> str:
        if self.same_code:
            return f"{self.name}: same code as {self.a}: equal by construction (not run)"
        if self.equal:
            tail = f" ({self.note})" if self.note else ""
            return f"{self.name}: values equal ({len(self.report.diffs)} tensors bitwise){tail}"
        lines = [f"{self.name}: VALUES DIFFER ({len(self.report.mismatches())} of {len(self.report.diffs)} tensors)"]
        out = self.first_output()
        lines.append(f"  first differing output: {out.name}: {out.note}")
        if self.first_node is not None:
            lines.append(f"  first differing node: {self.first_node.describe()}")
        if self.note:
            lines.append(f"  ({self.note})")
        return "\n".join(lines)


def compare_programs(name: str, a: Graphs, b: Graphs, feeds: Feeds, *, a_name: str = "before", b_name: str = "after",
                     locate: bool = True, cache: dict | None = None) -> PassCheck:
    """Run ``a`` and ``b`` on ``feeds`` (inside :func:`simulated_world`) and compare their results;
    when they differ and ``locate``, run both again recording every node and name the first
    node that differs. ``cache`` (``id(graphs) -> ProgramResult``) skips re-running a program."""
    ra = _cached(a, feeds, cache)
    rb = _cached(b, feeds, cache)
    report = ParityReport(a_name, b_name)
    note = ""
    if ra.saved_signature and ra.saved_signature == rb.saved_signature:
        compare_results(ra.saved, rb.saved, a_name, b_name, report)
    elif ra.saved_signature or rb.saved_signature:
        note = (f"saved values differ in signature ({len(ra.saved)} vs {len(rb.saved)}): user outputs and "
                "gradients compared, saved values not")
    compare_results(ra.result, rb.result, a_name, b_name, report)
    check = PassCheck(name, a_name, b_name, report, note)
    if not check.equal and locate:
        rec_a: dict[str, Any] = {}
        rec_b: dict[str, Any] = {}
        run_program(a, feeds, record=rec_a)
        run_program(b, feeds, record=rec_b)
        check.first_node = first_differing_node(rec_a, rec_b)
    return check


def _cached(graphs: Graphs, feeds: Feeds, cache: dict | None) -> ProgramResult:
    if cache is None:
        return run_program(graphs, feeds)
    key = id(graphs[0]) if isinstance(graphs, tuple) else id(graphs)
    if key not in cache:
        cache[key] = (graphs, run_program(graphs, feeds))  # keep graphs alive: ids stay unique
    return cache[key][1]


# --- rank-specific constants --------------------------------------------------------------------


def copy_in_offsets(gm: fx.GraphModule) -> list[tuple[str, int, int]]:
    """For every in-place all-gather (``all_gather_into_tensor_out(inp, n, group, out=buf)``):
    ``(node name, offset of inp in buf in elements, numel of inp)``."""
    out = []
    for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT):
        inp = node.args[0].meta[M.VAL]
        buf = schema_arg(node, "out").meta[M.VAL]
        out.append((node.name, inp.storage_offset() - buf.storage_offset(), inp.numel()))
    return out


def check_copy_in_offsets(gm: fx.GraphModule, rank_in_group: Mapping[str, int]) -> list[str]:
    """Problems (empty: none) with the copy-in slices of ``gm``'s in-place all-gathers: on a rank
    whose index in group ``g`` is ``rank_in_group[g]``, each must gather ``buf[i*n:(i+1)*n]``.
    The one rank-specific constant LocalTensorMode cannot check by running rank 0's graph."""
    problems = []
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, offset, numel in copy_in_offsets(gm):
        group = group_of(by_name[name])
        want = rank_in_group[group] * numel
        if offset != want:
            problems.append(f"{name}: copies in at element {offset}, rank {rank_in_group[group]} of group {group} must at {want}")
    return problems


__all__ = [
    "Feeds",
    "NodeDiff",
    "PassCheck",
    "ProgramResult",
    "bind",
    "check_copy_in_offsets",
    "compare_programs",
    "compare_results",
    "copy_in_offsets",
    "first_differing_node",
    "input_key",
    "output_keys",
    "random_tensor",
    "run_graph",
    "run_program",
    "run_ranks",
    "simulated_world",
]
