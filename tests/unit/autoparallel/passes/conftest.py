"""Fixtures of the pass tests: a graph builder for FSDP all-gather graphs (``mesh``: tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from autoparallel import roles
from verify.graphs.generators import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 64  # hidden size of the hand-built graphs: an f32 [r, 64] shard gathers to r * gs * 256 B


def _fsdp_graph(mesh, labels, *, ag_bytes=1024, gap=0, chain=False):
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (1, H), role=roles.input_(0))
    acc = x
    prev = None
    for label in labels:
        gs = b.group(label)[1]
        rows = ag_bytes // (4 * H * gs)
        assert rows * 4 * H * gs == ag_bytes, "pick ag_bytes divisible by 4*H*group size"
        for _ in range(gap):
            acc = b.call(aten.relu.default, acc)
        src = b.param((rows, H))
        if chain and prev is not None:
            src = b.call(aten.add.Tensor, src, b.call(aten.sum.dim_IntList, prev, [0], True))
        w = b.all_gather(src, label)
        prev = w
        acc = b.call(aten.add.Tensor, acc, b.call(aten.sum.dim_IntList, w, [0], True))
    return b.output([b.call(aten.sum.default, acc)], [roles.LOSS])


@pytest.fixture
def fsdp_graph(mesh):
    """``fsdp_graph(labels, ag_bytes=1024, gap=0, chain=False)``: one parameter all-gather per mesh
    dim label (in order), ``gap`` relu nodes before each, each gathered weight added into a
    running activation; ``chain``: each all-gather's input depends on the previous gathered
    weight (so each is a descendant of the previous one)."""
    return lambda labels, **kw: _fsdp_graph(mesh, labels, **kw)
