"""verify.graphs.memory (peak memory on CPU/CUDA, ratios, static estimate) and verify.parity.launch (gated worlds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel.trainer import sac_stages
from verify.graphs.memory import (
    PeakMemory,
    compare_peaks,
    memory_timeline,
    peak_memory,
    ratio,
    static_peak,
)
from verify.graphs.liveness import static_peak_bytes
from verify.parity.launch import gated_backend, run_gated
from verify.parity.trainer import traced_step

MB4 = 1_000_000  # float32 elements in 4 MB


def _known_pattern():
    a = torch.empty(MB4)  # 4 MB live
    b = torch.empty(MB4)  # 8 MB
    del a  # 4 MB
    c = torch.empty(2 * MB4)  # 12 MB: the peak
    del b, c


def test_cpu_peak_of_a_known_allocation_pattern():
    pm = peak_memory(_known_pattern, device="cpu")
    assert pm.device == "cpu" and pm.source == "cpu-profiler"
    assert 12_000_000 <= pm.peak < 12_000_000 + 64 * 1024, pm.describe()
    assert pm.events >= 4
    assert pm.reserved is None and pm.active is None


def test_memory_alive_before_the_call_is_not_counted():
    x = torch.zeros(4 * MB4)  # 16 MB allocated outside

    def inplace():
        x.add_(1.0)
        y = torch.empty(MB4)
        del y

    pm = peak_memory(inplace, device="cpu")
    assert 4_000_000 <= pm.peak < 4_000_000 + 64 * 1024, pm.describe()


def test_frees_of_older_memory_do_not_change_the_peak():
    """Memory allocated in an earlier measured call and freed in this one is not subtracted:
    the result must not depend on what was profiled before."""
    holder = {}
    peak_memory(lambda: holder.setdefault("x", torch.empty(MB4)), device="cpu", warmup=0)

    def swap():
        holder.pop("x", None)  # 4 MB allocated (and tracked) during the previous measurement
        y = torch.empty(MB4)
        del y

    pm = peak_memory(swap, device="cpu", warmup=0)
    assert 4_000_000 <= pm.peak < 4_000_000 + 64 * 1024, pm.describe()


def test_memory_timeline_steps_through_the_known_pattern():
    tl = memory_timeline(_known_pattern)
    assert len(tl.times_ms) == len(tl.bytes) >= 4
    assert list(tl.times_ms) == sorted(tl.times_ms) and tl.times_ms[0] == 0.0
    assert 12_000_000 <= tl.peak < 12_000_000 + 64 * 1024
    big = [b for b in tl.bytes if b >= 3_900_000]  # small allocator noise aside
    levels = [round(b / 4_000_000) for b in big]
    assert [lv for i, lv in enumerate(levels) if i == 0 or lv != levels[i - 1]] == [1, 2, 1, 3, 2]
    assert tl.bytes[-1] < 64 * 1024  # all freed at the end
    with pytest.raises(ValueError, match="fn must be callable"):
        memory_timeline(None)
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        memory_timeline(lambda: None, warmup=True)


def test_warmup_calls_and_bad_arguments():
    calls = []
    peak_memory(lambda: calls.append(1), device="cpu", warmup=2)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        peak_memory(lambda: None, device="cpu", warmup=-1)
    with pytest.raises(ValueError, match="fn must be callable"):
        peak_memory(42, device="cpu")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        peak_memory(lambda: None, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            peak_memory(lambda: None, device="cuda")


def test_ratio_and_report():
    a = PeakMemory(device="cpu", source="cpu-profiler", peak=3 << 20)
    b = PeakMemory(device="cpu", source="cpu-profiler", peak=4 << 20)
    assert ratio(a, b) == 0.75
    text = compare_peaks({"eager": b, "traced": a}, reference="eager")
    assert "peak memory on cpu (cpu-profiler)" in text
    lines = text.splitlines()
    assert lines[-1].split() == ["traced", "3.00", "0.750"]
    assert lines[-2].split() == ["eager", "4.00", "1.000"]
    with pytest.raises(ValueError, match="reference 'nope' is not one of the runs"):
        compare_peaks({"eager": b}, reference="nope")
    with pytest.raises(ValueError, match="'reserved' is not measured on cpu"):
        ratio(a, b, "reserved")
    with pytest.raises(ValueError, match="unknown memory metric 'rss'"):
        ratio(a, b, "rss")
    with pytest.raises(ValueError, match="nothing to compare"):
        ratio(a, PeakMemory(device="cpu", source="cpu-profiler", peak=0))
    cuda = PeakMemory(device="cuda:0", source="cuda-allocator", peak=1, reserved=2, active=3)
    with pytest.raises(ValueError, match="cannot compare a cuda:0 measurement with a cpu one"):
        ratio(cuda, b)


def test_static_peak_of_a_small_graph():
    def f(x):
        y = x * 2  # 4 MB
        z = y + 1  # 4 MB, y dies after
        return z.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.empty(MB4))
    # input 4 MB (live throughout) + y + z at the add.
    assert static_peak(gm) == static_peak_bytes(gm) == 12_000_000
    gm.graph.find_nodes(op="placeholder")[0].meta.pop(M.VAL)
    with pytest.raises(ValueError, match=r"node 'x_1' \(.*\) has no meta\['val'\], needed for static_peak"):
        static_peak(gm)


def test_static_peak_refresh_separates_duplicated_values():
    """A remat duplicate copies its original's fake value; without refresh they look like one
    tensor alive from the forward to the backward."""
    _, remat = sac_stages(traced_step("tiny", batch=2, module_stack=True), "op")
    assert static_peak(remat) < static_peak(remat, refresh=False)


def _all_reduce_rank(rank: int, world_size: int, device: str) -> float:
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    return float(t[0])


def test_run_gated_uses_gloo_on_cpu():
    if torch.cuda.device_count() < 2:
        assert gated_backend(2) == "gloo"
        with pytest.raises(RuntimeError, match="2 CUDA devices with NCCL required"):
            gated_backend(2, require_gpu=True)
    assert run_gated(_all_reduce_rank, 2) == [3.0, 3.0]
