"""The device and topology a plan is priced for, as data.

A plan is only as good as the machine it assumes, and the anchor's worst surprise was a cost
model that silently fell back to other numbers when a device was unknown. So the profile is an
explicit dataclass that every cost reads from, the shipped profiles are looked up by name with
an error for unknown names, and a user can pass their own profile (in code or as a JSON file).

Mesh dims map onto links innermost-first: the last mesh dim takes consecutive ranks, so it stays
inside a node while the product of it and the dims inside it fits ``gpus_per_node``; the others
cross nodes. ``mesh_links`` overrides the link of a named mesh dim.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

_DTYPE_NAMES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Link:
    """One collective link: per-rank bus bandwidth (GB/s) and fixed latency per collective (us)."""

    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"Link.bandwidth_gbps must be a finite number > 0, got {self.bandwidth_gbps!r}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"Link.latency_us must be a finite number >= 0, got {self.latency_us!r}")


@dataclass(frozen=True)
class DeviceProfile:
    """Peak rates of one device and the links between devices.

    ``peak_tflops`` is dense peak by dtype (``default_tflops`` for other dtypes); compute reaches
    ``efficiency`` of peak and of ``mem_bandwidth_gbps``; every non-view kernel costs at least
    ``launch_floor_us``.
    """

    name: str
    peak_tflops: Mapping[torch.dtype, float]
    default_tflops: float
    mem_bandwidth_gbps: float
    efficiency: float
    launch_floor_us: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    mesh_links: Mapping[str, Link] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("default_tflops", "mem_bandwidth_gbps", "efficiency"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"DeviceProfile {self.name!r}: {attr} must be a finite number > 0, got {v!r}")
        if self.efficiency > 1:
            raise ValueError(f"DeviceProfile {self.name!r}: efficiency is a fraction of peak (<= 1), got {self.efficiency!r}")
        if not self.launch_floor_us >= 0:
            raise ValueError(f"DeviceProfile {self.name!r}: launch_floor_us must be >= 0, got {self.launch_floor_us!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"DeviceProfile {self.name!r}: gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        for dt, v in self.peak_tflops.items():
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"DeviceProfile {self.name!r}: peak_tflops[{dt}] must be > 0, got {v!r}")

    def tflops(self, dtype: torch.dtype) -> float:
        return float(self.peak_tflops.get(dtype, self.default_tflops))

    def links(self, mesh_dims: tuple[tuple[str, int], ...]) -> dict[str, Link]:
        """The link of every mesh dim (``(name, size)`` pairs, outermost first)."""
        out: dict[str, Link] = {}
        inner = 1
        for name, size in reversed(mesh_dims):
            inner *= size
            out[name] = self.mesh_links.get(name) or (self.intra_node if inner <= self.gpus_per_node else self.inter_node)
        return {name: out[name] for name, _ in mesh_dims}

    def describe(self) -> str:
        return self.name

    # --- JSON, so a user can bring their own machine ------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["peak_tflops"] = {_dtype_name(k): v for k, v in sorted(self.peak_tflops.items(), key=lambda kv: str(kv[0]))}
        d["mesh_links"] = {k: asdict(v) for k, v in sorted(self.mesh_links.items())}
        return d

    @classmethod
    def from_json(cls, data: Mapping, *, source: str = "profile") -> DeviceProfile:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown DeviceProfile fields {unknown}; known: {sorted(known)}")
        missing = sorted(f for f in known if f not in data and f != "mesh_links")
        if missing:
            raise ValueError(f"{source}: DeviceProfile fields missing: {missing}")
        peak = {}
        for k, v in dict(data["peak_tflops"]).items():
            if k not in _DTYPE_NAMES:
                raise ValueError(f"{source}: peak_tflops key {k!r} is not a dtype name; use one of {sorted(_DTYPE_NAMES)}")
            peak[_DTYPE_NAMES[k]] = float(v)
        return cls(
            name=str(data["name"]),
            peak_tflops=peak,
            default_tflops=float(data["default_tflops"]),
            mem_bandwidth_gbps=float(data["mem_bandwidth_gbps"]),
            efficiency=float(data["efficiency"]),
            launch_floor_us=float(data["launch_floor_us"]),
            gpus_per_node=int(data["gpus_per_node"]),
            intra_node=Link(**data["intra_node"]),
            inter_node=Link(**data["inter_node"]),
            mesh_links={k: Link(**v) for k, v in dict(data.get("mesh_links") or {}).items()},
        )


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# H100 SXM: dense TFLOP/s (fp32 without TF32), HBM3, NVLink 4 (450 GB/s per direction per GPU),
# 400 Gb/s InfiniBand per GPU between nodes.
H100 = DeviceProfile(
    name="h100",
    peak_tflops={torch.float64: 67.0, torch.float32: 67.0, torch.bfloat16: 989.0, torch.float16: 989.0},
    default_tflops=67.0,
    mem_bandwidth_gbps=3350.0,
    efficiency=0.7,
    launch_floor_us=7.0,
    gpus_per_node=8,
    intra_node=Link(bandwidth_gbps=450.0, latency_us=10.0),
    inter_node=Link(bandwidth_gbps=50.0, latency_us=20.0),
)

# A100 SXM 80GB: NVLink 3 (300 GB/s), 200 Gb/s InfiniBand per GPU.
A100 = DeviceProfile(
    name="a100",
    peak_tflops={torch.float64: 19.5, torch.float32: 19.5, torch.bfloat16: 312.0, torch.float16: 312.0},
    default_tflops=19.5,
    mem_bandwidth_gbps=2039.0,
    efficiency=0.7,
    launch_floor_us=7.0,
    gpus_per_node=8,
    intra_node=Link(bandwidth_gbps=300.0, latency_us=10.0),
    inter_node=Link(bandwidth_gbps=25.0, latency_us=20.0),
)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (H100, A100)}
DEFAULT_PROFILE = "h100"


def get_profile(profile: str | DeviceProfile | None = None) -> DeviceProfile:
    """A shipped profile by name, a JSON file of one, or the profile itself; never a silent default.

    ``None`` means the documented default (``h100``); any other unknown name is an error.
    """
    if profile is None:
        return PROFILES[DEFAULT_PROFILE]
    if isinstance(profile, DeviceProfile):
        return profile
    name = str(profile)
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"device profile file {name!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"device profile file {name!r} is not valid JSON: {e}") from None
        return DeviceProfile.from_json(data, source=name)
    raise ValueError(
        f"unknown device profile {name!r}; shipped profiles: {sorted(PROFILES)} "
        "(or pass a DeviceProfile, or a .json file written by DeviceProfile.to_json)"
    )


def with_links(profile: DeviceProfile, **links: Link) -> DeviceProfile:
    """``profile`` with the named mesh dims on the given links."""
    return replace(profile, mesh_links={**profile.mesh_links, **links})
