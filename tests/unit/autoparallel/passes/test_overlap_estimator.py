"""The CPU roofline estimator of the overlap scheduler (autoparallel/passes/overlap_estimator.py)
on hand-built FX nodes: exact times worked out by hand from FLOPs, bytes, group sizes and the
configured peak rates, plus config validation and the scoped installation.

The config used below has round rates so the arithmetic is easy to follow:
2 TFLOP/s f32 peak at 50 % efficiency (1e12 FLOP/s reached), 1 TFLOP/s default (0.5e12 reached),
100 GB/s memory, 10 GB/s link, 5 us collective latency.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch

from autoparallel.fx_utils import ALL_GATHER_OUT
from autoparallel.passes.overlap_estimator import (
    RooflineConfig,
    RooflineEstimator,
)
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
CFG = RooflineConfig(
    peak_tflops={torch.float32: 2.0, torch.bfloat16: 8.0},
    default_tflops=1.0,
    mem_gbps=100.0,
    link_gbps=10.0,
    collective_latency_us=5.0,
    efficiency=0.5,
)
EST = RooflineEstimator(CFG)
MEM = 100e9  # bytes / s
LINK = 10e9  # bytes / s
LAT_MS = 5e-3


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0.0)


@pytest.fixture
def b(mesh):
    return GraphBuilder(mesh_groups(mesh))


# --- compute nodes ----------------------------------------------------------------------------


def test_mm_compute_bound(b):
    x, w = b.placeholder("x", (256, 256)), b.placeholder("w", (256, 256))
    mm = b.call(aten.mm.default, x, w)
    flops = 2 * 256 * 256 * 256  # 33.55 MFLOP -> 33.55 us at 1e12 FLOP/s
    nbytes = 3 * 256 * 256 * 4  # 786 kB -> 7.9 us at 100 GB/s: compute bound
    assert flops / 1e12 > nbytes / MEM
    assert EST.compute_ms(mm) == approx(flops / (2.0e12 * 0.5) * 1e3)
    assert EST(mm) == approx(0.033554432)


def test_mm_memory_bound(b):
    x, w = b.placeholder("x", (32, 64)), b.placeholder("w", (64, 16))
    mm = b.call(aten.mm.default, x, w)
    nbytes = (32 * 64 + 64 * 16 + 32 * 16) * 4  # inputs + output = 14336 B
    assert 2 * 32 * 64 * 16 / 1e12 < nbytes / MEM  # 65.5 ns of FLOPs < 143 ns of bytes
    assert EST.compute_ms(mm) == approx(nbytes / MEM * 1e3)
    assert EST.compute_ms(mm) == approx(1.4336e-4)


def test_bmm_uses_the_dtype_peak(b):
    x = b.placeholder("x", (4, 128, 128), dtype=torch.bfloat16)
    y = b.placeholder("y", (4, 128, 128), dtype=torch.bfloat16)
    bmm = b.call(aten.bmm.default, x, y)
    flops = 2 * 4 * 128 * 128 * 128  # 16.8 MFLOP at 8 TFLOP/s * 0.5 -> 4.19 us
    nbytes = 3 * 4 * 128 * 128 * 2  # 393 kB -> 3.93 us
    assert flops / 4e12 > nbytes / MEM
    assert EST.compute_ms(bmm) == approx(flops / 4e12 * 1e3)


def test_dtype_without_peak_uses_default_tflops(b):
    x = b.placeholder("x", (4, 128, 128), dtype=torch.float16)
    y = b.placeholder("y", (4, 128, 128), dtype=torch.float16)
    bmm = b.call(aten.bmm.default, x, y)
    flops = 2 * 4 * 128 * 128 * 128  # at default 1 TFLOP/s * 0.5 -> 33.55 us
    assert EST.compute_ms(bmm) == approx(flops / 0.5e12 * 1e3)


def test_sdpa_counts_both_matmuls(b):
    q = b.placeholder("q", (2, 4, 1024, 64), dtype=torch.bfloat16)
    attn = b.call(aten._scaled_dot_product_flash_attention.default, q, q, q)
    flops = 2 * (2 * 2 * 4 * 1024 * 1024 * 64)  # q @ k^T and p @ v: 2.15 GFLOP
    # 4 MiB of q/k/v/out is far less than 537 us of FLOPs at 4e12 FLOP/s: compute bound
    assert EST.compute_ms(attn) == approx(flops / 4e12 * 1e3)
    assert EST.compute_ms(attn) == approx(0.536870912)


def test_convolution_uses_its_output_shape_and_keyword_arguments(b):
    """The conv FLOP formula reads the output shape and ``transposed`` (given as a keyword)."""
    x, w = b.placeholder("x", (1, 64, 256)), b.placeholder("w", (64, 64, 3))
    conv = b.call(
        aten.convolution.default,
        x,
        w,
        None,
        [1],
        [0],
        [1],
        transposed=False,
        output_padding=[0],
        groups=1,
    )
    assert tuple(conv.meta["val"].shape) == (1, 64, 254)
    flops = 2 * 254 * 3 * 64 * 64  # out positions * kernel * c_out * c_in, batch 1
    nbytes = (64 * 256 + 64 * 64 * 3 + 64 * 254) * 4  # 180 kB -> 1.8 us < 6.2 us of FLOPs
    assert flops / 1e12 > nbytes / MEM
    assert EST.compute_ms(conv) == approx(flops / 1e12 * 1e3)


def test_packet_target_is_counted(b):
    """A node whose target is the op packet (``aten.mm``, not ``aten.mm.default``)."""
    x, w = b.placeholder("x", (256, 256)), b.placeholder("w", (256, 256))
    mm = b.call(aten.mm, x, w)
    assert EST.compute_ms(mm) == approx(2 * 256**3 / 1e12 * 1e3)


def test_elementwise_is_memory_bound_and_counts_kwargs(b):
    x, y = b.placeholder("x", (4, 8)), b.placeholder("y", (4, 8))
    add = b.call(aten.add.Tensor, x, other=y)  # the second input is a kwarg
    assert EST.compute_ms(add) == approx(3 * 32 * 4 / MEM * 1e3)


def test_broadcast_input_bytes_count_once(b):
    x, y = b.placeholder("x", (4, 8)), b.placeholder("y", (1, 8))
    e = b.call(aten.expand.default, y, [4, 8])  # stride 0 on dim 0
    assert tuple(e.meta["val"].stride()) == (0, 1)
    add = b.call(aten.add.Tensor, x, e)
    nbytes = 4 * 8 * 4 + 8 * 4 + 4 * 8 * 4  # x + y read once + out = 288 B
    assert EST.compute_ms(add) == approx(nbytes / MEM * 1e3)


def test_multi_output_node_counts_every_output(b):
    x = b.placeholder("x", (6, 8))
    split = b.call(aten.split.Tensor, x, 2)  # three [2, 8] views: a view op, costs nothing
    assert EST.compute_ms(split) == 0.0
    mx = b.call(aten.max.dim, x, 1)  # values (f32) and indices (i64), each [6]
    assert EST.compute_ms(mx) == approx((6 * 8 * 4 + 6 * 4 + 6 * 8) / MEM * 1e3)
    get = b.call(operator.getitem, mx, 0)  # not an OpOverload: reads both outputs, writes one
    assert EST.compute_ms(get) == approx((6 * 4 + 6 * 8 + 6 * 4) / MEM * 1e3)


def test_free_nodes(b):
    x = b.placeholder("x", (16, 16))
    assert EST.compute_ms(x) == 0.0  # placeholder
    v = b.call(aten.view.default, x, [256])
    assert EST.compute_ms(v) == 0.0 and EST(v) == 0.0  # views cost nothing
    relu = b.call(aten.relu.default, x)
    del relu.meta["val"]
    assert EST.compute_ms(relu) == 0.0  # no value: nothing to estimate from
    assert EST(relu) is None  # the scheduler's own estimate is used instead
    assert EST(x) is None


def test_flop_count_failure_names_the_node(b):
    x, w = b.placeholder("x", (4, 4)), b.placeholder("w", (4, 4))
    mm = b.call(aten.mm.default, x, w)
    mm.args = (x,)
    with pytest.raises(
        ValueError, match=r"node 'mm_default': FLOP count of aten\.mm\.default failed: "
    ):
        EST.compute_ms(mm)


def test_default_config_is_h100():
    est = RooflineEstimator()
    assert est.config == RooflineConfig()
    assert est.config.peak_tflops[torch.bfloat16] == 989.0 and est.config.mem_gbps == 3350.0
    assert RooflineEstimator(CFG).config is CFG


# --- collectives ------------------------------------------------------------------------------


def test_all_gather_moves_the_gathered_buffer(b):
    w = b.all_gather(b.placeholder("x", (2, 64)), "dp")  # [8, 64] f32 = 2048 B over 4 ranks
    ag = w.args[0]
    wire = 2048 * 3 / 4
    assert EST.collective_ms(ag) == approx(LAT_MS + wire / LINK * 1e3)
    assert EST(ag) == approx(0.0051536)
    assert EST(w) == 0.0  # the wait itself costs nothing


def test_override_size_replaces_the_buffer_size(b):
    ag = b.all_gather(b.placeholder("x", (2, 64)), "dp").args[0]
    assert EST.collective_ms(ag, 1000) == approx(LAT_MS + 750 / LINK * 1e3)
    assert EST(ag, override_size=1000) == approx(LAT_MS + 750 / LINK * 1e3)


def test_reduce_scatter_moves_its_input(b):
    rs = b.reduce_scatter(b.placeholder("g", (8, 64)), "dp").args[0]  # 2048 B in, 512 B out
    assert EST.collective_ms(rs) == approx(LAT_MS + 2048 * 3 / 4 / LINK * 1e3)


def test_all_reduce_moves_twice_the_buffer(b):
    ar = b.all_reduce(b.placeholder("g", (8, 64)), "tp").args[0]  # group size 2 from the world
    assert EST.collective_ms(ar) == approx(LAT_MS + 2 * 2048 * 1 / 2 / LINK * 1e3)
    assert EST(ar) == approx(0.0052048)


def test_group_size_can_come_from_the_caller(b):
    ar = b.all_reduce(b.placeholder("g", (8, 64)), "tp").args[0]  # the world says 2
    asked = []

    def eight(node):
        asked.append(node)
        return 8

    est = RooflineEstimator(CFG, group_size=eight)
    assert est.collective_ms(ar) == approx(LAT_MS + 2 * 2048 * 7 / 8 / LINK * 1e3)
    assert asked == [ar]


def test_all_gather_out_uses_its_output(b, mesh):
    x, buf = b.placeholder("x", (2, 64)), b.placeholder("buf", (8, 64))
    ag = b.call(ALL_GATHER_OUT, x, 4, mesh.group_name("dp"), out=buf)
    assert EST.collective_ms(ag) == approx(LAT_MS + 2048 * 3 / 4 / LINK * 1e3)


def test_group_of_one_costs_only_latency(b):
    ag = b.all_gather(b.placeholder("x", (2, 64)), "dp").args[0]
    ag.args = (ag.args[0], 1, ag.args[2])
    assert EST.collective_ms(ag) == approx(LAT_MS)


def test_collective_without_val_names_the_node(b):
    rs = b.reduce_scatter(b.placeholder("g", (8, 64)), "dp").args[0]
    del rs.args[0].meta["val"]
    why = rf"has no meta\['val'\], needed for the runtime of '{rs.name}'"
    with pytest.raises(ValueError, match=rf"node 'g' .*{why}"):
        EST.collective_ms(rs)
    ag = b.all_gather(b.placeholder("x", (2, 64)), "dp").args[0]
    del ag.meta["val"]
    with pytest.raises(ValueError, match=r"needed for its runtime estimate"):
        EST.collective_ms(ag)


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default_tflops", "mem_gbps", "link_gbps", "efficiency"])
@pytest.mark.parametrize("bad", [0, -1, 0.0, math.inf, math.nan, True, "1"])
def test_rates_must_be_finite_and_positive(name, bad):
    with pytest.raises(
        ValueError, match=rf"RooflineConfig\.{name} must be a finite number > 0, got {bad!r}"
    ):
        RooflineConfig(**{name: bad})


@pytest.mark.parametrize("name", ["default_tflops", "mem_gbps", "link_gbps", "efficiency"])
def test_small_positive_rates_are_accepted(name):
    assert getattr(RooflineConfig(**{name: 0.5}), name) == 0.5
    assert getattr(RooflineConfig(**{name: 2}), name) == 2


def test_collective_latency_may_be_zero_but_not_negative():
    assert RooflineConfig(collective_latency_us=0).collective_latency_us == 0
    assert RooflineConfig(collective_latency_us=0.5).collective_latency_us == 0.5
    with pytest.raises(ValueError, match=r"collective_latency_us must be >= 0, got -0\.1"):
        RooflineConfig(collective_latency_us=-0.1)


def test_peak_tflops_must_be_positive():
    assert RooflineConfig(peak_tflops={torch.float32: 0.5}).peak_tflops[torch.float32] == 0.5
    for bad in (0, -1.0):
        with pytest.raises(
            ValueError, match=rf"peak_tflops\[torch\.float32\] must be > 0, got {bad!r}"
        ):
            RooflineConfig(peak_tflops={torch.float32: bad})


# --- the scheduler run --------------------------------------------------------------------------
