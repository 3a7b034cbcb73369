"""What ``autoparallel.planner.batch_local`` claims, on generated convolutions: the op on each
rank's local tensors computes the plan's placements when the batch is split over several mesh dims.

Hypothesis draws a mesh (2x2, 2x3, 2x2x2), which mesh dims split the batch (at least two: the
hybrid placement DTensor's handler refuses), and a 2-D convolution (channels, groups, kernel,
stride, padding, bias). Each block of rows a rank holds (row-major over the splitting mesh dims,
as ``Shard(0)`` on each gives it) and runs ``aten.convolution`` and
``aten.convolution_backward`` on them, as the lowering does; the reference is the unsharded op:

* the ranks' outputs and input gradients, put back in rank order, are the unsharded ones;
* their weight and bias gradients (``Partial(sum)``) add up to the unsharded ones;
* and the rule takes exactly these placements (``runs_batch_local``).

The negative test splits a spatial dim instead (a halo exchange's case, which the rule leaves to
DTensor) and watches the reassembled output differ.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.planner.batch_local import runs_batch_local

aten = torch.ops.aten
MESHES = ((2, 2), (2, 3), (2, 2, 2))


@st.composite
def convolutions(draw):
    sizes = draw(st.sampled_from(MESHES))
    split = draw(st.sets(st.sampled_from(range(len(sizes))), min_size=2))
    rows = 1
    for d in split:
        rows *= sizes[d]
    groups = draw(st.sampled_from((1, 2)))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    return dict(sizes=sizes, split=tuple(sorted(split)), batch=rows * draw(st.integers(1, 2)), cin=cin, cout=cout, groups=groups,
                kernel=draw(st.integers(1, 3)), stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, 1)),
                bias=draw(st.booleans()), hw=draw(st.integers(3, 6)))


def _blocks(c) -> int:
    """How many blocks of rows the splitting mesh dims make (ranks on the other mesh dims repeat them)."""
    n = 1
    for d in c["split"]:
        n *= c["sizes"][d]
    return n


def _args(c):
    g = torch.Generator().manual_seed(c["batch"] * 131 + c["cin"] * 17 + c["kernel"])
    x = torch.randn(c["batch"], c["cin"], c["hw"], c["hw"], generator=g, dtype=torch.float64)
    w = torch.randn(c["cout"], c["cin"] // c["groups"], c["kernel"], c["kernel"], generator=g, dtype=torch.float64)
    b = torch.randn(c["cout"], generator=g, dtype=torch.float64) if c["bias"] else None
    return x, w, b


def _conv(c, x, w, b):
    s, p = [c["stride"]] * 2, [c["padding"]] * 2
    return aten.convolution.default(x, w, b, s, p, [1, 1], False, [0, 0], c["groups"])


def _conv_backward(c, grad, x, w):
    s, p = [c["stride"]] * 2, [c["padding"]] * 2
    bias = [c["cout"]] if c["bias"] else None
    return aten.convolution_backward.default(grad, x, w, bias, s, p, [1, 1], False, [0, 0], c["groups"], [True, True, c["bias"]])


def _placement(c, shard):
    return tuple(shard if d in c["split"] else Replicate() for d in range(len(c["sizes"])))


@given(convolutions())
def test_the_local_convolution_on_each_ranks_rows_is_the_planned_placement(c):
    x, w, b = _args(c)
    out = _conv(c, x, w, b)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    gi, gw, gb = _conv_backward(c, grad, x, w)
    n = _blocks(c)
    rows = c["batch"] // n
    outs, gis, gws, gbs = [], [], [], []
    for k in range(n):  # a rank's block: row-major over the splitting mesh dims, as Shard(0) on each
        mine = slice(k * rows, (k + 1) * rows)
        outs.append(_conv(c, x[mine], w, b))
        l_gi, l_gw, l_gb = _conv_backward(c, grad[mine], x[mine], w)
        gis.append(l_gi)
        gws.append(l_gw)
        gbs.append(l_gb)
    torch.testing.assert_close(torch.cat(outs), out)
    torch.testing.assert_close(torch.cat(gis), gi)
    torch.testing.assert_close(sum(gws), gw)  # Partial(sum) over the splitting mesh dims
    if c["bias"]:
        torch.testing.assert_close(sum(gbs), gb)
    s0, rep = _placement(c, Shard(0)), tuple(Replicate() for _ in c["sizes"])
    partial = _placement(c, Partial())
    assert runs_batch_local(aten.convolution.default, [s0, rep] + ([rep] if c["bias"] else []), [s0])
    assert runs_batch_local(aten.convolution_backward.default, [s0, s0, rep], [s0, partial, partial])


def test_a_spatial_split_is_no_local_convolution():
    """Negative: a 3x3 convolution with padding, its width split in two, each half convolved alone:
    the halves' edges miss their neighbour's columns, so the reassembled output differs (what
    DTensor's halo exchange is for), and the rule does not take the placement."""
    c = dict(sizes=(2, 2), split=(0, 1), batch=4, cin=2, cout=2, groups=1, kernel=3, stride=1, padding=1, bias=False, hw=6)
    x, w, b = _args(c)
    halves = [_conv(c, x[..., :3], w, b), _conv(c, x[..., 3:], w, b)]
    assert not torch.allclose(torch.cat(halves, dim=-1), _conv(c, x, w, b))
    rep, hybrid_and_spatial = (Replicate(),) * 3, (Shard(0), Shard(0), Shard(3))
    assert not runs_batch_local(aten.convolution.default, [hybrid_and_spatial, rep], [hybrid_and_spatial])
