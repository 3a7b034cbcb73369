"""An analytic roofline runtime estimator, so Inductor's overlap scheduler runs on a CPU.

``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` needs a runtime for
every compute node and collective. Its own roofline (``estimate_roofline_runtime_ms``) asks
``torch.utils._runtime_estimation`` for the GPU's DRAM bandwidth and peak FLOPs, which imports
triton, and it runs for every compute node even when a custom estimator is given. So
:class:`RooflineEstimator` estimates from configurable peak rates (:class:`RooflineConfig`):
compute nodes by ``max(FLOPs / peak FLOPs, bytes moved / memory bandwidth)``, collectives by bytes
and group size with a ring model plus a fixed latency. ``autoparallel.passes.overlap_scheduling``
passes it to the scheduler (``custom_runtime_estimation``) and routes the built-in roofline
through it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_REDUCE,
    COLLECTIVE_LAUNCHES,
    WAIT,
    group_size_of,
    node_val,
    tensor_bytes,
)

log = logging.getLogger(__name__)

# Dense peak TFLOP/s of one H100 SXM by dtype (fp32 without TF32).
_H100_TFLOPS = {
    torch.float64: 67.0,
    torch.float32: 67.0,
    torch.bfloat16: 989.0,
    torch.float16: 989.0,
}


@dataclass(frozen=True)
class RooflineConfig:
    """Peak rates of the device the schedule is made for (defaults: one H100 SXM).

    ``peak_tflops`` by dtype (``default_tflops`` for other dtypes), ``mem_gbps`` device memory
    bandwidth, ``link_gbps`` per-rank collective bus bandwidth, ``collective_latency_us`` fixed
    cost per collective launch, ``efficiency`` the fraction of peak compute reached.
    """

    peak_tflops: Mapping[torch.dtype, float] = field(default_factory=lambda: dict(_H100_TFLOPS))
    default_tflops: float = 67.0
    mem_gbps: float = 3350.0
    link_gbps: float = 450.0
    collective_latency_us: float = 10.0
    efficiency: float = 0.75

    def __post_init__(self) -> None:
        for name in ("default_tflops", "mem_gbps", "link_gbps", "efficiency"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (v > 0 and math.isfinite(v))
            ):
                raise ValueError(f"RooflineConfig.{name} must be a finite number > 0, got {v!r}")
        if self.collective_latency_us < 0:
            raise ValueError(
                f"collective_latency_us must be >= 0, got {self.collective_latency_us!r}"
            )
        for dt, v in self.peak_tflops.items():
            if not v > 0:
                raise ValueError(f"peak_tflops[{dt}] must be > 0, got {v!r}")


def _flop_key(target: Any) -> Any | None:
    from torch.utils.flop_counter import flop_registry

    key = getattr(target, "overloadpacket", None)
    if key in flop_registry:
        return key
    return target if target in flop_registry else None


def _accessed_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading ``t``: stride-0 (broadcast) dims count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= int(size)
    return n * t.element_size()


class RooflineEstimator:
    """``estimator(node, override_size) -> ms | None``, the scheduler's custom estimation hook.

    ``group_size(node)`` gives a collective's group size; the default reads its ``group_size``
    argument or asks the running world. A report that estimates graphs after their fake world
    is gone passes one computed from the mesh.
    """

    def __init__(
        self,
        config: RooflineConfig | None = None,
        group_size: Callable[[fx.Node], int] | None = None,
    ):
        self.config = config if config is not None else RooflineConfig()
        self.group_size = group_size if group_size is not None else group_size_of

    def compute_ms(self, node: fx.Node) -> float:
        """Roofline time of one op: views and nodes without a tensor value cost nothing."""
        target = node.target
        if node.op != "call_function":
            return 0.0
        if isinstance(target, torch._ops.OpOverload) and target.is_view:
            return 0.0
        out = node.meta.get(M.VAL)
        if out is None:
            return 0.0

        def val(a):
            return a.meta.get(M.VAL) if isinstance(a, fx.Node) else a

        args = pytree.tree_map(val, node.args)
        kwargs = pytree.tree_map(val, node.kwargs)
        in_bytes = sum(
            _accessed_bytes(t)
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        )
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = in_bytes + sum(_accessed_bytes(t) for t in outs)
        cfg = self.config
        seconds = nbytes / (cfg.mem_gbps * 1e9)
        key = _flop_key(target)
        if key is not None and outs:
            from torch.utils.flop_counter import flop_registry

            try:
                flops = flop_registry[key](*args, **kwargs, out_val=out)
            except Exception as exc:
                raise ValueError(
                    f"node {node.name!r}: FLOP count of {target} failed: {exc}"
                ) from exc
            tflops = cfg.peak_tflops.get(outs[0].dtype, cfg.default_tflops)
            seconds = max(seconds, float(flops) / (tflops * 1e12 * cfg.efficiency))
        return seconds * 1e3

    def collective_ms(self, node: fx.Node, override_size: int | None = None) -> float:
        """Ring model: all-gather / reduce-scatter move ``(n-1)/n`` of the full buffer per rank,
        all-reduce twice that; plus a fixed launch latency."""
        n = self.group_size(node)
        if override_size is not None:
            nbytes = int(override_size)
        elif node.target in (ALL_GATHER, ALL_GATHER_OUT):
            nbytes = tensor_bytes(node_val(node, "its runtime estimate"))
        else:
            nbytes = tensor_bytes(
                node_val(node.all_input_nodes[0], f"the runtime of {node.name!r}")
            )
        factor = 2.0 if node.target is ALL_REDUCE else 1.0
        wire = factor * nbytes * (n - 1) / n if n > 1 else 0.0
        cfg = self.config
        return (cfg.collective_latency_us * 1e-6 + wire / (cfg.link_gbps * 1e9)) * 1e3

    def __call__(self, node: fx.Node, override_size: int | None = None) -> float | None:
        if node.op != "call_function":
            return None
        if node.target in COLLECTIVE_LAUNCHES:
            return self.collective_ms(node, override_size)
        if node.target is WAIT:
            return 0.0
        if M.VAL not in node.meta:
            return None
        return self.compute_ms(node)


__all__ = [
    "RooflineConfig",
    "RooflineEstimator",
]
