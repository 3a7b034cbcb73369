"""Rank-ordered reductions make a bucketed reduction bitwise equal to reducing each tensor alone,
whatever the bucket layout, at 3, 4 and 8 ranks (verify.parity.ordered_collectives); with gloo's own
reductions the same property fails, which is why the mode exists.

Each example is one gloo world that reduces a batch of random bucket layouts (shard sizes per
tensor) three ways per layout: reduce_scatter per tensor against one reduce_scatter of the
FSDP-style bucket (every rank's shards side by side, rank-major) and against the coalesced
form, and all_reduce per tensor against one all_reduce of their concatenation.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from verify.parity.ordered_collectives import NATIVE, RANK_ORDERED, run_parity_world

_c10d = torch.ops._c10d_functional

# A world per example: a fifth of the profile's examples (the tier's 25 -> 5, CI's deep 200 -> 40),
# each reducing up to 8 layouts.
EXAMPLES = max(4, settings.default.max_examples // 5)

layouts = st.lists(st.lists(st.integers(1, 80), min_size=2, max_size=6), min_size=1, max_size=8)


def _rank_layouts(rank: int, world: int, layouts: list[list[int]], seed: int) -> list[tuple[bool, bool, bool]]:
    name = dist.group.WORLD.group_name
    verdicts = []
    for i, sizes in enumerate(layouts):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i * 101 + rank)
        grads = [torch.randn(world * s, generator=g) for s in sizes]
        alone = [_c10d.wait_tensor(_c10d.reduce_scatter_tensor(t, "sum", world, name)) for t in grads]
        bucket = torch.cat([t.view(world, s) for t, s in zip(grads, sizes, strict=True)], dim=1).reshape(-1)
        bucketed = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(bucket, "sum", world, name)).split(sizes)
        coalesced = _c10d.reduce_scatter_tensor_coalesced(grads, "sum", world, name)
        summed = [_c10d.wait_tensor(_c10d.all_reduce(t, "sum", name)) for t in grads]
        flat = _c10d.wait_tensor(_c10d.all_reduce(torch.cat(grads), "sum", name)).split([world * s for s in sizes])
        verdicts.append((
            all(torch.equal(a, b) for a, b in zip(alone, bucketed, strict=True)),
            all(torch.equal(a, _c10d.wait_tensor(b)) for a, b in zip(alone, coalesced, strict=True)),
            all(torch.equal(a, b) for a, b in zip(summed, flat, strict=True)),
        ))
    return verdicts


def _differing_layouts(world: int, layouts: list[list[int]], seed: int, mode: str) -> list[tuple[list[int], str]]:
    ranks = run_parity_world(_rank_layouts, world, args=(layouts, seed), mode=mode)
    kinds = ("bucketed reduce_scatter", "coalesced reduce_scatter", "concatenated all_reduce")
    return [(sizes, kind) for i, sizes in enumerate(layouts) for k, kind in enumerate(kinds)
            if not all(r[i][k] for r in ranks)]


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.sampled_from([3, 4, 8]), layouts=layouts, seed=st.integers(0, 2**16))
def test_rank_ordered_bucketed_reductions_equal_the_per_tensor_ones(world, layouts, seed):
    assert _differing_layouts(world, layouts, seed, RANK_ORDERED) == []


@pytest.mark.parametrize("world", [4])
def test_with_native_reductions_the_property_finds_a_counterexample(world):
    """The negative side: the same property on gloo's own reductions fails (it adds in a
    layout-dependent order above 2 ranks). No shrinking: each try is a world."""

    @settings(max_examples=10, phases=[Phase.generate], database=None)
    @given(layouts=layouts.filter(lambda ls: len(ls) >= 4), seed=st.integers(0, 2**16))
    def native_property(layouts, seed):
        assert _differing_layouts(world, layouts, seed, NATIVE) == []

    with pytest.raises(AssertionError):
        native_property()
