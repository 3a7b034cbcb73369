"""verify.memory's CUDA path through a fake allocator (no GPU needed) and the CPU event replay,
aimed at plausible wrong implementations: a stale peak from before the call (no reset), work
still in flight when the stats are read (no synchronize), the memory held before the call counted
(no baseline), frees of older blocks subtracted, a re-used pointer counted twice."""

from __future__ import annotations

import pytest
import torch

from verify.memory import peak_memory, ratio, replay_peak

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

    def run(self, *deltas: int) -> None:
        self.pending.extend(deltas)

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")
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
        self.peak = self.active_peak = self.allocated
        self.reserved_peak = self.reserved

    def memory_allocated(self, device=None) -> int:
        self.calls.append("memory_allocated")
        return self.allocated

    def memory_stats(self, device=None) -> dict:
        self.calls.append("memory_stats")
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
