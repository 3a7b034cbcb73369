"""Fake and real worlds, named device meshes, and the group-name -> mesh-dim registry.

Process-group names are counters ("1", "3", ...) that shift with creation order, so a graph that
spells them is only meaningful together with a map from name to mesh dimension. Every mesh built
here records that map (``ParallelMesh.group_dims``); graphs carry a copy in
``gm.meta[GM_GROUP_DIMS]``; canonical text, stats and the gloo runtime name groups through it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoparallel import meta as M

_DIM_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class MeshSpec:
    """Ordered mesh dimensions, e.g. ``(("dp", 4), ("tp", 2))``; row-major rank layout."""

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self):
        if not self.dims:
            raise ValueError("a mesh needs at least one dimension, e.g. 'dp=8'")
        seen = set()
        for name, size in self.dims:
            if not isinstance(name, str) or not _DIM_RE.match(name):
                raise ValueError(f"mesh dim name {name!r} is not an identifier")
            if name in seen:
                raise ValueError(f"mesh dim {name!r} appears twice")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dim {name!r} has size {size!r}; sizes must be ints >= 1")
            seen.add(name)

    @classmethod
    def parse(cls, text: str | MeshSpec | Mapping[str, int]) -> MeshSpec:
        """``"dp=4,tp=2"`` (or a mapping, or a MeshSpec) -> MeshSpec."""
        if isinstance(text, MeshSpec):
            return text
        if isinstance(text, Mapping):
            return cls(tuple((str(k), int(v)) for k, v in text.items()))
        dims = []
        for part in str(text).split(","):
            name, sep, size = part.strip().partition("=")
            if not sep or not size.strip().isdigit():
                raise ValueError(f"bad mesh {text!r}: expected 'name=size[,name=size]', e.g. 'dp=4,tp=2'")
            dims.append((name.strip(), int(size)))
        return cls(tuple(dims))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def size(self, dim: str) -> int:
        for n, s in self.dims:
            if n == dim:
                return s
        raise ValueError(f"unknown mesh dim {dim!r}; this mesh has {list(self.names)}")

    def coordinate(self, rank: int) -> dict[str, int]:
        """Row-major coordinate of ``rank`` (the layout init_device_mesh uses)."""
        coord = {}
        for name, size in reversed(self.dims):
            coord[name] = rank % size
            rank //= size
        return {n: coord[n] for n in self.names}

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims)


FLAT_SEP = "*"


@dataclass
class ParallelMesh:
    """A DeviceMesh plus the registry that names its process groups by mesh dimension."""

    spec: MeshSpec
    device_mesh: DeviceMesh
    group_dims: dict[str, str] = field(default_factory=dict)  # group name -> "dp" / "tp" / "dp*tp"
    # Labels whose group already has a label in group_dims (a mesh with a size-1 dim: "dp=1,tp=2"
    # has one group for "tp" and "dp*tp"): label -> group name.
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def flat_label(self) -> str:
        return FLAT_SEP.join(self.spec.names)

    def group_name(self, label: str) -> str:
        """Process-group name of mesh dim ``label`` ("dp", "tp" or the flattened "dp*tp")."""
        for name, lab in self.group_dims.items():
            if lab == label:
                return name
        if label in self.aliases:
            return self.aliases[label]
        known = sorted({*self.group_dims.values(), *self.aliases})
        raise ValueError(f"unknown mesh dim {label!r}; known: {known}")

    def group(self, label: str) -> dist.ProcessGroup:
        return dist.distributed_c10d._resolve_process_group(self.group_name(label))

    def size(self, label: str) -> int:
        if label == self.flat_label:
            return self.spec.world_size
        return self.spec.size(label)

    def coordinate(self) -> dict[str, int]:
        return self.spec.coordinate(dist.get_rank())


def build_mesh(spec: MeshSpec | str | Mapping[str, int], device_type: str = "cpu") -> ParallelMesh:
    """Build a named mesh on the running default world and record its group names.

    Must run outside FakeTensorMode (mesh construction reads real tensors).
    """
    spec = MeshSpec.parse(spec)
    if not dist.is_initialized():
        raise RuntimeError("no default process group: enter fake_world(...) or start a real world first")
    if dist.get_world_size() != spec.world_size:
        raise ValueError(
            f"mesh {spec} needs {spec.world_size} ranks but the running world has {dist.get_world_size()}"
        )
    dm = init_device_mesh(device_type, spec.shape, mesh_dim_names=spec.names)
    pmesh = ParallelMesh(spec, dm)

    def record(group_name: str, label: str) -> None:
        # One group can serve two labels when a dim has size 1 ("dp=1,tp=2": the tp group is the
        # flattened one). Graphs name it by the first label (a single dim before the flat one).
        if group_name in pmesh.group_dims:
            pmesh.aliases[label] = group_name
        else:
            pmesh.group_dims[group_name] = label

    for name in spec.names:
        record(dm[name].get_group().group_name, name)
    if len(spec.dims) > 1:
        flat = dm._flatten(pmesh.flat_label.replace(FLAT_SEP, "_"))
        record(flat.get_group().group_name, pmesh.flat_label)
    if len(spec.dims) == 1 or spec.world_size == 1:
        # A 1-D mesh's only group may be WORLD itself; record it under that name too.
        world_name = dist.group.WORLD.group_name
        pmesh.group_dims.setdefault(world_name, spec.names[0] if len(spec.dims) == 1 else pmesh.flat_label)
    return pmesh


@contextlib.contextmanager
def fake_world(spec: MeshSpec | str | Mapping[str, int], rank: int = 0) -> Iterator[ParallelMesh]:
    """A fake world of ``spec.world_size`` ranks (FakeStore process group) and its named mesh.

    Starts the fake process group only if no default group is running, and tears down exactly
    what it started, so it can be entered many times in one process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = MeshSpec.parse(spec)
    started = False
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
        started = True
    try:
        yield build_mesh(spec)
    finally:
        if started:
            dist.destroy_process_group()


def group_dims_of(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The group-name -> mesh-dim map a graph was traced with (empty if it has none)."""
    return dict(getattr(gm, "meta", {}).get(M.GM_GROUP_DIMS, {}))


def attach_group_dims(gm: torch.fx.GraphModule, group_dims: Mapping[str, str]) -> None:
    gm.meta[M.GM_GROUP_DIMS] = dict(group_dims)


def dim_label(group_name: str, group_dims: Mapping[str, str], *, where: str = "") -> str:
    """Mesh-dim label of a process-group name, with an error that says what to do."""
    try:
        return group_dims[str(group_name)]
    except KeyError:
        at = f" (at {where})" if where else ""
        raise ValueError(
            f"unknown process group {group_name!r}{at}: it is not in the graph's mesh registry "
            f"{dict(group_dims)}; build graphs through autoparallel.mesh so groups are named"
        ) from None
