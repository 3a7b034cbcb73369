"""What a candidate costs: roofline compute with a launch floor, alpha-beta redistribution.

* **Compute** reuses the project's CPU roofline (:class:`RooflineEstimator`, the overlap
  scheduler's estimator) on the node's global shapes, with the device profile's rates; a
  candidate divides that by the number of ranks that split the work (every mesh dim on which
  an output or input is sharded or partial), and every non-view kernel costs at least the
  profile's launch floor.
* **Redistribution** follows DTensor's own redistribute plan (``_gen_transform_infos``: the
  steps a DTensor would run, one mesh dim at a time) and prices each step on that mesh dim's
  link: ``latency + wire bytes / bandwidth`` with ring wire bytes (all-gather, reduce-scatter
  and all-to-all move ``(n-1)/n`` of the buffer, all-reduce twice that). Shard -> Partial and
  Partial -> another Partial have no plan and cost infinity. Local steps (Replicate -> Shard,
  Replicate -> Partial) are free. Uneven (padded) shards are priced at their padded size.

All costs are in microseconds. Caches live on the :class:`CostModel` instance, which is built
for one (profile, mesh): nothing is shared across profiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from autoparallel.mesh import MeshSpec
from autoparallel.passes.overlap_estimator import RooflineConfig, RooflineEstimator
from autoparallel.planner.profile import DeviceProfile
from autoparallel.planner.strategies import Candidate, Placements
from autoparallel.planner.strided import sharded_dim

INF = math.inf

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
COLLECTIVE_KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)
_WIRE_FACTOR = {ALL_GATHER: 1.0, REDUCE_SCATTER: 1.0, ALL_REDUCE: 2.0, ALL_TO_ALL: 1.0}


@dataclass(frozen=True)
class Move:
    """One collective of a redistribution: its kind, mesh dim, per-rank buffer bytes and time."""

    kind: str
    mesh_dim: str
    nbytes: int
    us: float


@dataclass(frozen=True)
class Redistribution:
    us: float
    steps: tuple[Move, ...]

    @property
    def possible(self) -> bool:
        return math.isfinite(self.us)


IMPOSSIBLE = Redistribution(INF, ())
FREE = Redistribution(0.0, ())


def local_shape(shape: Sequence[int], placements: Placements, sizes: Sequence[int]) -> list[int]:
    """Per-rank shape under ``placements`` (padded: ceil division, mesh dims in order)."""
    out = list(shape)
    for p, n in zip(placements, sizes, strict=True):
        d = sharded_dim(p)
        if d is not None:
            out[d] = -(-out[d] // n)
    return out


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class CostModel:
    """Costs for one device profile on one mesh."""

    def __init__(self, profile: DeviceProfile, spec: MeshSpec, device_mesh):
        self.profile = profile
        self.spec = spec
        self.names = spec.names
        self.sizes = spec.shape
        self.device_mesh = device_mesh
        self.links = profile.links(spec.dims)
        self._roofline = RooflineEstimator(
            RooflineConfig(
                peak_tflops=dict(profile.peak_tflops),
                default_tflops=profile.default_tflops,
                mem_gbps=profile.mem_bandwidth_gbps,
                efficiency=profile.efficiency,
            )
        )
        self._redist: dict[tuple, Redistribution] = {}
        self._transforms: dict[tuple, tuple | None] = {}
        self._tables: dict[tuple, np.ndarray] = {}
        self._codes: dict[Placements, tuple] = {}
        self._local: dict[tuple, int] = {}
        self._partials: dict[str, Placement] = {}  # code text -> Partial (codes hash as plain strings)
        self._by_codes: dict[tuple, Redistribution] = {}
        self._patterns: dict[tuple, tuple | None] = {}
        self.dtensor_plans = 0  # redistribute plans asked of DTensor (the rest are single steps)

    # --- compute ----------------------------------------------------------------------------
    def global_compute_us(self, node: fx.Node) -> float:
        """Roofline time of the unsharded op (0 for views and non-ops), launch floor included."""
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0
        if node.target.is_view:
            return 0.0
        return max(self._roofline.compute_ms(node) * 1e3, self.profile.launch_floor_us)

    def split_factor(self, cand: Candidate) -> int:
        """Ranks sharing the work of ``cand``: mesh dims where anything is sharded or partial."""
        factor = 1
        for i, n in enumerate(self.sizes):
            for pl in (*cand.outs, *cand.ins):
                if pl is not None and not isinstance(pl[i], Replicate):
                    factor *= n
                    break
        return factor

    def compute_us(self, global_us: float, cand: Candidate) -> float:
        if global_us == 0.0:
            return 0.0
        return max(global_us / self.split_factor(cand), self.profile.launch_floor_us)

    # --- communication ----------------------------------------------------------------------
    def collective_us(self, kind: str, mesh_dim: int, buffer_bytes: int) -> float:
        n = self.sizes[mesh_dim]
        link = self.links[self.names[mesh_dim]]
        wire = _WIRE_FACTOR[kind] * buffer_bytes * (n - 1) / n
        return link.latency_us + wire / (link.bandwidth_gbps * 1e3)  # GB/s = 1e3 bytes/us

    def table(self, meta: TensorMeta, dsts: Sequence[Placements], srcs: Sequence[Placements]) -> np.ndarray:
        """``cost[u, v]`` of moving ``srcs[v]`` into ``dsts[u]`` (microseconds, inf if impossible)."""
        key = (tuple(meta.shape), meta.dtype, tuple(dsts), tuple(srcs))
        got = self._tables.get(key)
        if got is None:
            shape, size = tuple(meta.shape), meta.dtype.itemsize
            us = [self.codes(u) for u in dsts]
            vs = [self.codes(v) for v in srcs]
            got = np.array([[self.redistribute_codes(shape, size, v, u).us for v in vs] for u in us], dtype=np.float64).reshape(len(dsts), len(srcs))
            got.setflags(write=False)
            self._tables[key] = got
        return got

    def redistribute(self, meta: TensorMeta, src: Placements, dst: Placements) -> Redistribution:
        """Cost and collectives of moving a tensor from ``src`` to ``dst`` placements."""
        if src == dst:
            return FREE
        key = (tuple(meta.shape), meta.dtype, src, dst)
        got = self._redist.get(key)
        if got is None:
            got = self._redist[key] = self.redistribute_codes(tuple(meta.shape), meta.dtype.itemsize, self.codes(src), self.codes(dst))
        return got

    def redistribute_codes(self, shape: tuple, itemsize: int, src: tuple, dst: tuple) -> Redistribution:
        if src == dst:
            return FREE
        key = (shape, itemsize, src, dst)
        got = self._by_codes.get(key)
        if got is None:
            got = self._by_codes[key] = self._plan(shape, itemsize, src, dst)
        return got

    def codes(self, placements: Placements) -> tuple:
        """Placements as plain tuples, ``("R",)``, ``("S", d)``, ``("P", placement)`` (cheap to test)."""
        got = self._codes.get(placements)
        if got is None:
            got = tuple(self.code(p) for p in placements)
            self._codes[placements] = got
        return got

    def _local_bytes(self, shape: tuple, itemsize: int, codes: tuple) -> int:
        key = (shape, itemsize, codes)
        got = self._local.get(key)
        if got is None:
            out = list(shape)
            for c, n in zip(codes, self.sizes, strict=True):
                if c[0] == "S":
                    out[c[1]] = -(-out[c[1]] // n)
            got = self._local[key] = math.prod(out) * itemsize
        return got

    def _plan(self, shape: tuple, itemsize: int, src: tuple, dst: tuple) -> Redistribution:
        transforms = self.transforms(src, dst)
        if transforms is None:
            return IMPOSSIBLE
        current = list(src)
        steps: list[Move] = []
        total = 0.0
        for i, a, b in transforms:
            before = self._local_bytes(shape, itemsize, tuple(current))
            current[i] = b
            after = self._local_bytes(shape, itemsize, tuple(current))
            kind, buf = _step_kind(a[0], b[0], before, after, self.sizes[i])
            if kind is None:
                if buf is None:
                    return IMPOSSIBLE
                continue  # local step
            us = self.collective_us(kind, i, buf)
            steps.append(Move(kind, self.names[i], buf, us))
            total += us
        return Redistribution(total, tuple(steps))

    def transforms(self, src: tuple, dst: tuple) -> tuple | None:
        """DTensor's redistribute plan from ``src`` to ``dst`` codes: ``(mesh dim, from, to)`` steps.

        The plan depends on which tensor dims are sharded where, not on sizes or on the dims'
        numbers: it is asked of DTensor once per pattern (dims renumbered in order of first
        use, on a shape every mesh dim divides), and a change on one mesh dim that no other
        mesh dim's sharding interferes with is that single step. ``None`` if there is no plan.
        """
        key = (src, dst)
        if key in self._transforms:
            return self._transforms[key]
        got = _single_step(src, dst)
        if got is None and not _never_possible(src, dst):
            dims = list(dict.fromkeys(c[1] for c in (*src, *dst) if c[0] == "S"))
            renum = {d: k for k, d in enumerate(dims)}
            norm = (_renumber(src, renum), _renumber(dst, renum))
            if norm not in self._patterns:
                self._patterns[norm] = self._ask_dtensor(*norm, max(len(dims), 1))
            pattern = self._patterns[norm]
            back = {k: d for d, k in renum.items()}
            got = None if pattern is None else tuple((i, _renumber(a, back), _renumber(b, back)) for i, a, b in pattern)
        self._transforms[key] = got
        return got

    def _ask_dtensor(self, src: tuple, dst: tuple, ndim: int) -> tuple | None:
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

        self.dtensor_plans += 1
        side = 2 * math.prod(self.sizes)
        shape = (side,) * ndim
        meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), torch.float32)
        try:
            infos = _gen_transform_infos_non_cached(
                DTensorSpec(self.device_mesh, self.placements(src), tensor_meta=meta),
                DTensorSpec(self.device_mesh, self.placements(dst), tensor_meta=meta),
            )
        except Exception as e:
            raise ValueError(f"DTensor has no redistribute plan from {self.placements(src)} to {self.placements(dst)}: {e}") from e
        return tuple((info.mesh_dim, self.code(info.src_dst_placements[0]), self.code(info.src_dst_placements[1])) for info in infos)

    def code(self, p: Placement) -> tuple:
        """A placement as a plain tuple: ``("R",)``, ``("S", d)``, ``("P", text)``; a strided
        shard ``("S", d, split_factor)`` (a shard to every step's pricing, its own pattern)."""
        if isinstance(p, Shard):
            return ("S", p.dim)
        if isinstance(p, _StridedShard):
            return ("S", p.dim, p.split_factor)
        if isinstance(p, Replicate):
            return ("R",)
        if isinstance(p, Partial):
            text = repr(p)
            self._partials.setdefault(text, p)
            return ("P", text)
        raise ValueError(f"the planner does not price placement {p!r}")

    def placements(self, codes: tuple) -> Placements:
        return tuple(_shard(c) if c[0] == "S" else Replicate() if c[0] == "R" else self._partials[c[1]] for c in codes)


def _shard(code: tuple) -> Placement:
    return Shard(code[1]) if len(code) == 2 else _StridedShard(code[1], split_factor=code[2])


def _renumber(codes, renum: dict[int, int]):
    if codes and isinstance(codes[0], str):  # a single code
        return ("S", renum[codes[1]], *codes[2:]) if codes[0] == "S" else codes
    return tuple(("S", renum[c[1]], *c[2:]) if c[0] == "S" else c for c in codes)


def _step_kind(a: str, b: str, before: int, after: int, n: int) -> tuple[str | None, int | None]:
    """(collective kind, per-rank buffer bytes); (None, 0) for local steps, (None, None) if impossible.

    Gathers and scatters move ``n`` padded shards (FSDP2 pads dim 0 to a multiple of the mesh dim).
    """
    if a == "S" and b == "R":
        return ALL_GATHER, before * n
    if a == "P" and b == "R":
        return ALL_REDUCE, before
    if a == "P" and b == "S":
        return REDUCE_SCATTER, after * n
    if a == "S" and b == "S":
        return ALL_TO_ALL, before
    if a == "R" and b in ("S", "P"):
        return None, 0
    return None, None  # Shard -> Partial, Partial -> other Partial


def _single_step(src: tuple, dst: tuple) -> tuple | None:
    """The plan when one mesh dim changes and the tensor dims it touches are sharded on no other
    mesh dim: that one step (DTensor's greedy planner does the same; a test checks it)."""
    diff = [i for i, (a, b) in enumerate(zip(src, dst, strict=True)) if a != b]
    if len(diff) != 1:
        return None
    (i,) = diff
    touched = {c[1] for c in (src[i], dst[i]) if c[0] == "S"}
    for j, (a, b) in enumerate(zip(src, dst, strict=True)):
        if j != i and any(c[0] == "S" and c[1] in touched for c in (a, b)):
            return None
    if _never_possible(src, dst):
        return None
    return ((i, src[i], dst[i]),)


def _never_possible(src: tuple, dst: tuple) -> bool:
    """Into a Partial only from Replicate (a local split), never from a Shard or another Partial."""
    for a, b in zip(src, dst, strict=True):
        if a != b and b[0] == "P" and a[0] != "R":
            return True
    return False


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))
