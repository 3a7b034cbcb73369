"""Peak memory of a callable, measured for real, plus a static estimate from a graph.

``peak_memory(fn, device=...)`` runs ``fn`` ``warmup`` times, then once more while measuring:

* **CUDA**: the caching allocator's statistics. ``synchronize``, ``empty_cache`` (after the
  warm-up, so reserved memory starts from what is in use), ``reset_peak_memory_stats``, run,
  ``synchronize``; then ``allocated_bytes.all.peak`` (minus what was allocated at the start),
  ``reserved_bytes.all.peak`` and ``active_bytes.all.peak`` (both absolute, as torchtitan's SAC
  peak-memory test compares them).
* **CPU**: torch has no CPU allocator statistics, so the run is profiled
  (``torch.profiler.profile(activities=[CPU], profile_memory=True)``) and its allocation and
  free events (real allocations of tensor storage, any thread) are replayed in time order,
  matched by pointer. The peak is the largest number of bytes that blocks *allocated during the
  call* ever held at once: parameters, inputs and optimizer state that existed before are not
  in it; gradients, activations and temporaries created by the call are. Frees of blocks that
  existed before the call do not lower it (the profiler reports those only for blocks
  allocated under an earlier profiling session, so counting them would make a measurement
  depend on what was profiled before it). ``export_memory_timeline`` is built from the same
  events but needs ``record_shapes``/``with_stack`` and a categorization pass (0.6 s for a
  0.15 s debug-preset step here, and it is deprecated); the replay takes milliseconds.
  ``detailed=True`` turns ``record_shapes`` and ``with_stack`` on and keeps the profiler in
  ``PeakMemory.profile`` for callers that want the timeline or per-op tables.

The CUDA statistics are read through an allocator object with ``torch.cuda``'s memory API
(``synchronize``, ``empty_cache``, ``reset_peak_memory_stats``, ``memory_allocated``,
``memory_stats``, ``current_device``); ``peak_memory(allocator=...)`` replaces ``torch.cuda``, so
the CUDA path is tested on machines without a GPU. The CPU replay is :func:`replay_peak`.

On both devices ``peak`` is "allocated during the call, above the start"; on CUDA, frees of
memory that existed before the call (``zero_grad(set_to_none=True)`` at the start of a step)
do lower it, on CPU they do not. Compare measurements from one device only (:func:`ratio`
refuses to mix them); :func:`compare_peaks` builds the readable report tests print.

``static_peak(gm)`` estimates the peak of running a graph once from its FakeTensor values
(``verify.graphs.liveness.static_peak_bytes``), after re-propagating fresh fake values through a copy of
the graph: passes such as the remat pass copy a node's ``meta["val"]`` onto its duplicate, and
two nodes sharing one fake storage would be counted as one long-lived tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from autoparallel.fx_utils import copy_graph_module, node_val
from verify.graphs.liveness import static_peak_bytes

__all__ = [
    "MemoryTimeline",
    "PeakMemory",
    "compare_peaks",
    "memory_timeline",
    "peak_memory",
    "ratio",
    "replay_peak",
    "replay_series",
    "static_peak",
    "with_fresh_vals",
]

_MiB = float(1 << 20)
METRICS = ("peak", "reserved", "active")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """One measurement. Every size is in bytes.

    ``peak``: peak bytes allocated during the call above the start (see the module docstring
    for the one difference between CPU and CUDA).
    ``baseline``: bytes allocated when the call started (CUDA only; ``None`` on CPU, where the
    profiler only sees its own allocations). ``reserved`` / ``active``: CUDA caching-allocator
    absolute peaks during the call (``None`` on CPU). ``events``: CPU allocation events replayed.
    """

    device: str
    source: str
    peak: int
    baseline: int | None = None
    reserved: int | None = None
    active: int | None = None
    events: int | None = None
    profile: Any = dataclasses.field(default=None, repr=False, compare=False)

    def metric(self, name: str) -> int:
        if name not in METRICS:
            raise ValueError(f"unknown memory metric {name!r}; valid metrics: {list(METRICS)}")
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"metric {name!r} is not measured on {self.device} ({self.source})")
        return value

    def describe(self) -> str:
        parts = [f"peak {self.peak / _MiB:.2f} MiB"]
        if self.reserved is not None:
            parts.append(f"reserved {self.reserved / _MiB:.2f} MiB")
        if self.active is not None:
            parts.append(f"active {self.active / _MiB:.2f} MiB")
        if self.baseline is not None:
            parts.append(f"baseline {self.baseline / _MiB:.2f} MiB")
        return f"{', '.join(parts)} [{self.device}, {self.source}]"


def _resolve_device(device: torch.device | str | None, allocator: Any) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", allocator.current_device())
            if allocator is not torch.cuda or torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        if allocator is torch.cuda and not torch.cuda.is_available():
            raise ValueError(f"peak_memory: device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", allocator.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"peak_memory: device must be 'cpu' or 'cuda[:i]', got {device!r}")
    return dev


def peak_memory(
    fn: Callable[[], Any],
    *,
    device: torch.device | str | None = None,
    warmup: int = 1,
    detailed: bool = False,
    allocator: Any = None,
) -> PeakMemory:
    """Run ``fn()`` ``warmup`` times, then measure the peak memory of one more call.

    ``device=None`` means the current CUDA device when CUDA is available, else CPU. Pass the
    device the work runs on explicitly in tests: a CPU workload measured on a CUDA machine with
    ``device=None`` would report the (idle) GPU. ``fn``'s return value is dropped before the
    measurement ends, so what it returns is counted only while it was alive inside the call.
    ``allocator``: where CUDA statistics come from (default ``torch.cuda``; see the module
    docstring); with one given, ``device=None`` means its current device.
    """
    if not callable(fn):
        raise ValueError(f"peak_memory: fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"peak_memory: warmup must be an int >= 0, got {warmup!r}")
    allocator = torch.cuda if allocator is None else allocator
    dev = _resolve_device(device, allocator)
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        return _cuda_peak(fn, dev, allocator)
    return _cpu_peak(fn, detailed)


def _cuda_peak(fn: Callable[[], Any], dev: torch.device, cuda: Any) -> PeakMemory:
    cuda.synchronize(dev)
    cuda.empty_cache()
    cuda.reset_peak_memory_stats(dev)
    baseline = cuda.memory_allocated(dev)
    fn()
    cuda.synchronize(dev)
    stats = cuda.memory_stats(dev)
    return PeakMemory(
        device=str(dev),
        source="cuda-allocator",
        peak=int(stats["allocated_bytes.all.peak"]) - baseline,
        baseline=baseline,
        reserved=int(stats["reserved_bytes.all.peak"]),
        active=int(stats["active_bytes.all.peak"]),
    )


def _allocation_events(prof: Any) -> list[Any]:
    from torch._C._profiler import _EventType

    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError as exc:  # pragma: no cover - guards a torch API change
        raise RuntimeError(
            "peak_memory: this torch's profiler has no kineto_results.experimental_event_tree(); "
            "verify/graphs/memory.py must be ported to its memory timeline API"
        ) from exc
    events: list[Any] = []
    stack = list(roots)
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            events.append(ev)
        stack.extend(ev.children)
    events.sort(key=lambda e: e.start_time_ns)
    return events


def replay_series(events: Iterable[tuple[int, int]]) -> list[int]:
    """Bytes held by blocks allocated during the events, after each of the time-ordered
    ``(pointer, size)`` events (size > 0: allocation; size <= 0: free of that pointer).

    A free of a block allocated before the events is skipped: the profiler reports such frees
    only when the block was allocated under an earlier profiling session, so counting them would
    make the number depend on what was profiled before. A pointer allocated again while live (a
    lost free event) replaces the old block instead of being counted twice.
    """
    live: dict[int, int] = {}  # pointer -> bytes, for blocks allocated during the events
    current = 0
    out = []
    for ptr, size in events:
        if size > 0:
            current += size - live.get(ptr, 0)
            live[ptr] = size
        else:
            current -= live.pop(ptr, 0)
        out.append(current)
    return out


def replay_peak(events: Iterable[tuple[int, int]]) -> int:
    """Peak of :func:`replay_series`: the most bytes held at once by blocks allocated during
    the events."""
    return max(replay_series(events), default=0)


def _pointer_sizes(events: list[Any]) -> list[tuple[int, int]]:
    return [(ev.extra_fields.ptr, ev.extra_fields.alloc_size) for ev in events]


def _profile_cpu(fn: Callable[[], Any], detailed: bool) -> tuple[Any, list[Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=detailed,
        with_stack=detailed,
    ) as prof:
        fn()
    return prof, _allocation_events(prof)


def _cpu_peak(fn: Callable[[], Any], detailed: bool) -> PeakMemory:
    prof, events = _profile_cpu(fn, detailed)
    peak = replay_peak(_pointer_sizes(events))
    return PeakMemory(
        device="cpu",
        source="cpu-profiler",
        peak=peak,
        events=len(events),
        profile=prof if detailed else None,
    )


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    """Measured CPU memory over one call: ``times_ms[i]`` (from the first allocation event) and
    ``bytes[i]`` held after event ``i`` by blocks allocated during the call (the quantity
    :func:`peak_memory` takes the maximum of, so ``peak == max(bytes)``)."""

    times_ms: tuple[float, ...]
    bytes: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(self.bytes, default=0)


def memory_timeline(fn: Callable[[], Any], *, warmup: int = 1) -> MemoryTimeline:
    """Run ``fn()`` ``warmup`` times, then profile one more call on CPU and return its memory
    timeline (allocation events replayed as :func:`peak_memory` does)."""
    if not callable(fn):
        raise ValueError(f"memory_timeline: fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"memory_timeline: warmup must be an int >= 0, got {warmup!r}")
    for _ in range(warmup):
        fn()
    _, events = _profile_cpu(fn, False)
    held = replay_series(_pointer_sizes(events))
    t0 = events[0].start_time_ns if events else 0
    return MemoryTimeline(tuple((ev.start_time_ns - t0) / 1e6 for ev in events), tuple(held))


# --------------------------------------------------------------------------------------------
# Ratios and reports
# --------------------------------------------------------------------------------------------


def ratio(a: PeakMemory, b: PeakMemory, metric: str = "peak") -> float:
    """``a.metric / b.metric`` (e.g. traced / eager). Raises ValueError when ``b`` is 0."""
    if a.device.split(":")[0] != b.device.split(":")[0]:
        raise ValueError(f"cannot compare a {a.device} measurement with a {b.device} one")
    den = b.metric(metric)
    if den <= 0:
        raise ValueError(
            f"ratio: the reference measurement's {metric} is {den} bytes; nothing to compare"
        )
    return a.metric(metric) / den


def compare_peaks(
    runs: Mapping[str, PeakMemory], *, reference: str, metrics: tuple[str, ...] | None = None
) -> str:
    """A readable table: one row per run, MiB per metric and the ratio to ``reference``."""
    if reference not in runs:
        raise ValueError(f"reference {reference!r} is not one of the runs {list(runs)}")
    ref = runs[reference]
    if metrics is None:
        metrics = tuple(m for m in METRICS if getattr(ref, m) is not None)
    width = max(len(name) for name in runs)
    header = f"{'run':<{width}}  " + "  ".join(
        f"{m + ' MiB':>12}  {'x ' + reference:>{len(reference) + 2}}" for m in metrics
    )
    lines = [f"peak memory on {ref.device} ({ref.source})", header]
    for name, pm in runs.items():
        cells = []
        for m in metrics:
            cells.append(
                f"{pm.metric(m) / _MiB:>12.2f}  {ratio(pm, ref, m):>{len(reference) + 2}.3f}"
            )
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Static estimate
# --------------------------------------------------------------------------------------------


def with_fresh_vals(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes hold freshly propagated FakeTensor values."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    copy_gm = copy_graph_module(gm)  # node meta dicts are copied, so gm is not touched
    vals = [node_val(ph, "static_peak (its fake inputs)") for ph in copy_gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise ValueError("static_peak: the placeholders' meta['val'] are not FakeTensors")
    FakeTensorProp(copy_gm, mode).propagate_dont_convert_inputs(*vals)
    return copy_gm


def static_peak(gm: fx.GraphModule, *, refresh: bool = True) -> int:
    """Static peak bytes of running ``gm`` once (inputs live throughout, outputs to the end).

    ``refresh=True`` re-propagates fake values on a copy first (see the module docstring).
    """
    return static_peak_bytes(with_fresh_vals(gm) if refresh else gm)
