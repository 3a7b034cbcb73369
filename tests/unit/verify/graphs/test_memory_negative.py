"""verify.graphs.memory's CUDA path through a fake allocator (no GPU needed) and the CPU event replay,
aimed at plausible wrong implementations: a stale peak from before the call (no reset), work
still in flight when the stats are read (no synchronize), the memory held before the call counted
(no baseline), frees of older blocks subtracted, a re-used pointer counted twice."""

from __future__ import annotations

import pytest
import torch

from verify.graphs.memory import (
    PeakMemory,
    compare_peaks,
    memory_timeline,
    peak_memory,
    ratio,
    replay_peak,
    replay_series,
    with_fresh_vals,
)

MiB = 1 << 20


class FakeCudaAllocator:
    """``torch.cuda``'s memory API over a counter. Work is asynchronous: what ``fn`` allocates or
    frees lands on the next ``synchronize``, as on a stream. The peak starts stale (16 GiB)."""

    def __init__(self, allocated: int = 100 * MiB):
        self.allocated = allocated
        self.peak = 16 << 30
        self.reserved = self.reserved_peak = 20 << 30
        self.active_peak = 16 << 30
        self.pending: list[int] = []
        self.calls: list[str] = []
        self.devices: list = []  # the device argument of every call that takes one

    def run(self, *deltas: int) -> None:
        self.pending.extend(deltas)

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")
        self.devices.append(device)
        for d in self.pending:
            self.allocated += d
            self.peak = max(self.peak, self.allocated)
            self.active_peak = max(self.active_peak, self.allocated)
            self.reserved = max(self.reserved, self.allocated)
            self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.pending.clear()

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset")
        self.devices.append(device)
        self.peak = self.active_peak = self.allocated
        self.reserved_peak = self.reserved

    def memory_allocated(self, device=None) -> int:
        self.calls.append("memory_allocated")
        self.devices.append(device)
        return self.allocated

    def memory_stats(self, device=None) -> dict:
        self.calls.append("memory_stats")
        self.devices.append(device)
        return {
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.peak": self.reserved_peak,
            "active_bytes.all.peak": self.active_peak,
        }

    def current_device(self) -> int:
        return 3


def test_cuda_peak_is_above_the_baseline_without_the_stale_peak_and_after_sync():
    cuda = FakeCudaAllocator(allocated=100 * MiB)
    # +64, +32 (peak +96), -64, +8: in flight until the measurement synchronizes
    pm = peak_memory(lambda: cuda.run(64 * MiB, 32 * MiB, -64 * MiB, 8 * MiB), device="cuda:0", allocator=cuda, warmup=0)
    assert pm.device == "cuda:0" and pm.source == "cuda-allocator"
    assert pm.peak == 96 * MiB  # not 16 GiB (stale peak), not 196 MiB (baseline), not 0 (no sync)
    assert pm.baseline == 100 * MiB
    assert pm.active == 196 * MiB and pm.reserved == 196 * MiB  # absolute, after empty_cache
    assert cuda.calls == ["synchronize", "empty_cache", "reset", "memory_allocated", "synchronize", "memory_stats"]


def test_cuda_frees_of_memory_from_before_the_call_lower_the_peak():
    cuda = FakeCudaAllocator(allocated=100 * MiB)
    pm = peak_memory(lambda: cuda.run(-50 * MiB, 20 * MiB), device="cuda", allocator=cuda, warmup=0)
    assert pm.device == "cuda:3"  # no index: the allocator's current device
    assert pm.peak == 0  # never above the start


def test_cuda_warmup_runs_before_the_measurement_and_is_not_measured():
    cuda = FakeCudaAllocator(allocated=0)
    sizes = iter([512 * MiB, 1 * MiB])  # the warm-up allocates a lot (and keeps it)
    pm = peak_memory(lambda: cuda.run(next(sizes)), device=None, allocator=cuda, warmup=1)
    assert pm.device == "cuda:3"
    assert pm.peak == 1 * MiB and pm.baseline == 512 * MiB


def test_cuda_and_cpu_measurements_do_not_mix():
    cuda = FakeCudaAllocator()
    gpu = peak_memory(lambda: cuda.run(MiB), device="cuda:0", allocator=cuda, warmup=0)
    cpu = peak_memory(lambda: torch.empty(1000), device="cpu", warmup=0)
    with pytest.raises(ValueError, match="cannot compare a cuda:0 measurement with a cpu one"):
        ratio(gpu, cpu)
    assert ratio(gpu, gpu, "reserved") == 1.0


@pytest.mark.parametrize(
    "events, peak",
    [
        ([(1, 100), (2, 50), (1, 0), (3, 200), (2, 0), (3, 0)], 250),  # 100+50, -100, +200 -> 250
        ([(9, 0), (1, 100)], 100),  # free of a block from before: not subtracted (no negative start)
        ([(9, 0), (1, 100), (9, -1), (2, 10)], 110),  # ... not even later
        ([(1, 100), (1, 0), (1, 60), (2, 60)], 120),  # a pointer re-used after its free
        ([(1, 100), (1, 40), (2, 10)], 100),  # re-allocated while live (lost free): replaced, not added
        ([], 0),
    ],
)
def test_replay_peak(events, peak):
    assert replay_peak(events) == peak


# --- what line-level mutation of verify/graphs/memory.py found untested (mutate --lines --group memory) ---


def test_every_cuda_call_names_the_measured_device():
    """device=None with an allocator: its current device (3); each statistic is read for it, not
    for whatever device is current when the call runs."""
    cuda = FakeCudaAllocator()
    pm = peak_memory(lambda: cuda.run(MiB), allocator=cuda, warmup=0)
    assert pm.device == "cuda:3"
    assert cuda.devices and set(cuda.devices) == {torch.device("cuda", 3)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default needs a machine without CUDA")
def test_device_none_without_cuda_measures_cpu():
    assert peak_memory(lambda: torch.empty(1024)).device == "cpu"


def test_defaults_one_warmup_call_and_no_profile_kept():
    calls = []
    pm = peak_memory(lambda: calls.append(torch.empty(256)), device="cpu")
    assert len(calls) == 2 and pm.profile is None
    assert peak_memory(lambda: torch.empty(256), device="cpu", detailed=True).profile is not None
    calls.clear()
    memory_timeline(lambda: calls.append(torch.empty(256)))
    assert len(calls) == 2
    calls.clear()
    memory_timeline(lambda: calls.append(1), warmup=0)  # 0 is allowed
    assert len(calls) == 1


@pytest.mark.parametrize("measure", [peak_memory, memory_timeline])
@pytest.mark.parametrize("warmup", [-1, True, "2", 1.0])
def test_warmup_must_be_a_non_negative_int(measure, warmup):
    with pytest.raises(ValueError, match=rf"{measure.__name__}: warmup must be an int >= 0, got {warmup!r}"):
        measure(lambda: None, warmup=warmup, **({"device": "cpu"} if measure is peak_memory else {}))


@pytest.mark.parametrize("measure", [peak_memory, memory_timeline])
def test_fn_must_be_callable_and_the_error_names_its_type(measure):
    with pytest.raises(ValueError, match=rf"^{measure.__name__}: fn must be callable, got int$"):
        measure(42)


def test_memory_timeline_is_in_milliseconds_from_the_first_event():
    tl = memory_timeline(lambda: [torch.empty(1 << 16) for _ in range(3)])
    assert tl.times_ms[0] == 0.0 and list(tl.times_ms) == sorted(tl.times_ms)
    assert tl.times_ms[-1] < 60_000  # a few allocations: well under a minute, in ms
    assert tl.peak == max(tl.bytes) > 0
    empty = memory_timeline(lambda: None)  # no allocation at all: an empty timeline
    assert empty.times_ms == () and empty.peak == 0


def test_replay_series_counts_a_one_byte_block():
    assert replay_series([(1, 1), (2, 8), (1, 0)]) == [1, 9, 8]


def test_describe_names_every_measured_quantity():
    cuda = PeakMemory(device="cuda:0", source="cuda-allocator", peak=3 * MiB, baseline=MiB, reserved=8 * MiB, active=4 * MiB)
    assert cuda.describe() == "peak 3.00 MiB, reserved 8.00 MiB, active 4.00 MiB, baseline 1.00 MiB [cuda:0, cuda-allocator]"
    cpu = PeakMemory(device="cpu", source="cpu-profiler", peak=MiB // 2)
    assert cpu.describe() == "peak 0.50 MiB [cpu, cpu-profiler]"


def test_ratio_accepts_a_one_byte_reference_and_the_table_is_exact():
    a = PeakMemory(device="cpu", source="cpu-profiler", peak=3)
    assert ratio(a, PeakMemory(device="cpu", source="cpu-profiler", peak=1)) == 3.0
    runs = {"eager": PeakMemory(device="cpu", source="cpu-profiler", peak=4 * MiB),
            "traced": PeakMemory(device="cpu", source="cpu-profiler", peak=2 * MiB)}
    assert compare_peaks(runs, reference="eager").splitlines() == [
        "peak memory on cpu (cpu-profiler)",
        "run         peak MiB  x eager",
        "eager           4.00    1.000",
        "traced          2.00    0.500",
    ]


def test_cuda_table_has_a_column_pair_per_metric_and_a_metric_subset_on_request():
    """The caching allocator's three metrics side by side (built by hand: no GPU needed), and
    ``metrics=`` choosing some of them."""
    def cuda(peak, reserved, active):
        return PeakMemory(device="cuda:0", source="cuda-allocator", peak=peak * MiB, baseline=0,
                          reserved=reserved * MiB, active=active * MiB)

    runs = {"eager_sac": cuda(4, 8, 2), "traced": cuda(2, 8, 1)}
    assert compare_peaks(runs, reference="eager_sac").splitlines() == [
        "peak memory on cuda:0 (cuda-allocator)",
        "run            peak MiB  x eager_sac  reserved MiB  x eager_sac    active MiB  x eager_sac",
        "eager_sac          4.00        1.000          8.00        1.000          2.00        1.000",
        "traced             2.00        0.500          8.00        1.000          1.00        0.500",
    ]
    assert compare_peaks(runs, reference="traced", metrics=("active",)).splitlines()[1:] == [
        "run          active MiB  x traced",
        "eager_sac          2.00     2.000",
        "traced             1.00     1.000",
    ]


def test_static_peak_refuses_real_placeholder_values_by_name():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)  # a real tensor, not a FakeTensor
    g.output(x)
    with pytest.raises(ValueError, match=r"^static_peak: the placeholders' meta\['val'\] are not FakeTensors$"):
        with_fresh_vals(torch.fx.GraphModule(torch.nn.Module(), g))
