"""verify.parity.ordered_collectives on real gloo worlds: each reduction computes the rank-ordered fold
its definition says, the kernels exist only inside the scope, the launcher's mode reaches the
ranks, and a reduction it cannot order is an error naming it."""

import pytest
import torch
import torch.distributed as dist

from verify.parity import ordered_collectives as oc

_c10d = torch.ops._c10d_functional


def _contribution(rank: int, shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _folded(world: int, shape, op: str = "sum") -> torch.Tensor:
    """The rank-ordered fold, written out by hand (the independent side)."""
    acc = _contribution(0, shape).clone()
    for r in range(1, world):
        x = _contribution(r, shape)
        acc = acc + x if op in ("sum", "avg") else acc * x if op == "product" else torch.maximum(acc, x)
    return acc / world if op == "avg" else acc


def _rank_every_reduction(rank, world):
    name = dist.group.WORLD.group_name
    shape = (world * 3, 5)
    x = _contribution(rank, shape)
    out = {}
    for op in ("sum", "avg", "product", "max"):
        out[f"all_reduce {op}"] = _c10d.wait_tensor(_c10d.all_reduce(x, op, name))
        out[f"reduce_scatter {op}"] = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, op, world, name))
    y = x.clone()
    _c10d.wait_tensor(_c10d.all_reduce_(y, "sum", name))
    out["all_reduce_"] = y
    out["all_reduce_coalesced"] = _c10d.all_reduce_coalesced([x, x[:2]], "sum", name)
    ys = [x.clone(), x[:2].clone()]
    _c10d.all_reduce_coalesced_(ys, "sum", name)
    out["all_reduce_coalesced_"] = ys
    out["reduce_scatter_coalesced"] = _c10d.reduce_scatter_tensor_coalesced([x, x[: world]], "sum", world, name)
    buf = torch.empty(3, 5)
    _c10d.reduce_scatter_tensor_out(x, "sum", world, name, out=buf)
    out["reduce_scatter_out"] = buf
    scalar = torch.tensor(float(rank + 1))
    out["all_reduce 0-d"] = _c10d.wait_tensor(_c10d.all_reduce(scalar, "sum", name))
    try:
        _c10d.all_reduce(x, "bxor", name)
    except NotImplementedError as e:
        out["bxor"] = str(e)
    try:
        _c10d.reduce_scatter_tensor(x[:1], "sum", world, name)  # 1 row over 3 ranks
    except ValueError as e:
        out["undivided"] = str(e)
    return out


@pytest.mark.parametrize("world", [3])
def test_every_reduction_is_the_rank_ordered_fold(world):
    ranks = oc.run_parity_world(_rank_every_reduction, world, mode=oc.RANK_ORDERED)
    shape = (world * 3, 5)
    for rank, out in enumerate(ranks):
        mine = slice(rank * 3, rank * 3 + 3)
        for op in ("sum", "avg", "product", "max"):
            assert torch.equal(out[f"all_reduce {op}"], _folded(world, shape, op)), op
            assert torch.equal(out[f"reduce_scatter {op}"], _folded(world, shape, op)[mine]), op
        full = _folded(world, shape)
        assert torch.equal(out["all_reduce_"], full)
        for key in ("all_reduce_coalesced", "all_reduce_coalesced_"):
            assert [t.shape for t in out[key]] == [full.shape, (2, 5)]
            assert torch.equal(out[key][0], full) and torch.equal(out[key][1], full[:2]), key
        a, b = out["reduce_scatter_coalesced"]
        assert torch.equal(a, full[mine]) and torch.equal(b, full[rank : rank + 1])
        assert torch.equal(out["reduce_scatter_out"], full[mine])
        assert out["all_reduce 0-d"].shape == () and out["all_reduce 0-d"].item() == sum(range(1, world + 1))
        assert "reduce op 'bxor' is not supported" in out["bxor"] and "--native-collectives" in out["bxor"]
        assert out["undivided"] == f"reduce_scatter_tensor: dim 0 (1) over a group of {world} (group_size {world})"


def _rank_kernels(rank, world):
    return torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::reduce_scatter_tensor", "CPU")


def test_the_kernels_exist_only_inside_the_scope_and_the_mode_reaches_the_ranks():
    has_cpu_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(  # noqa: E731
        "_c10d_functional::all_reduce", "CPU")
    assert not has_cpu_kernel()
    with oc.rank_ordered_reductions():
        assert has_cpu_kernel()
    assert not has_cpu_kernel()
    assert oc.run_parity_world(_rank_kernels, 2) == [True, True]  # the default: rank-ordered
    with oc.native_collectives():
        assert oc.current_mode() == oc.NATIVE
        assert oc.run_parity_world(_rank_kernels, 2) == [False, False]
        with oc.native_collectives(False):
            assert oc.run_parity_world(_rank_kernels, 2) == [True, True]
    assert oc.current_mode() == oc.RANK_ORDERED
    with pytest.raises(ValueError, match="collectives mode 'ordered'"):
        oc.run_parity_world(_rank_kernels, 2, mode="ordered")
