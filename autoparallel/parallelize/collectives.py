"""Explicit collectives with the autograd rules of FSDP, DDP and Megatron TP.

They are written as autograd Functions over ``_c10d_functional`` ops on plain tensors (the
SimpleFSDP approach), so tracing yields a joint graph whose collectives are ordinary FX nodes
that passes can see, tag, bucket and fuse. Groups are passed by name; names come from the mesh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_c10d = torch.ops._c10d_functional


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor.default(t)


class FSDPAllGather(torch.autograd.Function):
    """Shard -> (cast to param dtype) -> all-gather on dim 0 (-> narrow to ``rows``); grad:
    (pad to the gathered length with zeros ->) cast to reduce dtype -> reduce-scatter (avg) ->
    cast back to the shard's dtype.

    ``rows`` is the parameter's true dim 0 when its shards are padded (``ParamSharding.padded``),
    else None: the gathered padded shards are narrowed back to the true size, and the gradient
    gets zero rows where the padding was, so each rank's reduce-scattered gradient has the shape
    of its padded shard and exactly zero padding rows. Without padding nothing is added.
    """

    @staticmethod
    def forward(ctx, shard, group_name: str, group_size: int, param_dtype, reduce_dtype, rows: int | None = None):
        ctx.group_name, ctx.group_size = group_name, group_size
        ctx.reduce_dtype, ctx.shard_dtype = reduce_dtype, shard.dtype
        ctx.padding = 0 if rows is None else shard.shape[0] * group_size - rows
        x = shard if param_dtype is None or param_dtype == shard.dtype else shard.to(param_dtype)
        full = _wait(_c10d.all_gather_into_tensor.default(x, group_size, group_name))
        return full.narrow(0, 0, rows) if ctx.padding else full

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.reduce_dtype is None or ctx.reduce_dtype == grad.dtype else grad.to(ctx.reduce_dtype)
        if ctx.padding:
            g = F.pad(g, [0, 0] * (g.dim() - 1) + [0, ctx.padding])  # zero rows at the end of dim 0
        out = _wait(_c10d.reduce_scatter_tensor.default(g.contiguous(), "avg", ctx.group_size, ctx.group_name))
        if out.dtype != ctx.shard_dtype:
            out = out.to(ctx.shard_dtype)
        return out, None, None, None, None, None


class DDPGradAllReduce(torch.autograd.Function):
    """Identity forward; gradient averaged over the data-parallel group."""

    @staticmethod
    def forward(ctx, param, group_name: str):
        ctx.group_name = group_name
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return _wait(_c10d.all_reduce.default(grad.contiguous(), "avg", ctx.group_name)), None


class CopyToTPRegion(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce (sum) of the input gradient."""

    @staticmethod
    def forward(ctx, x, group_name: str):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _wait(_c10d.all_reduce.default(grad.contiguous(), "sum", ctx.group_name)), None


class ReduceFromTPRegion(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group_name: str):
        return _wait(_c10d.all_reduce.default(x.contiguous(), "sum", group_name))

    @staticmethod
    def backward(ctx, grad):
        return grad, None
