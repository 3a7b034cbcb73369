"""The per-stage digest: equal for bitwise-equal traces, different for any bit, dtype, shape,
name or rank order that differs (what lets two runs be compared without their tensors)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from autoparallel.runtime.steps import StepTrace
from verify.parity.digest import stage_digests, trace_digest


def _ranks(n: int = 2) -> list:
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(r)
        trace = StepTrace(
            losses=[torch.tensor(1.5 + r)],
            grads=[{"w": torch.randn(3, 2, generator=g), "frozen": None}],
            buffers=[{"bn.running_mean": torch.zeros(2)}],
            params={"w": torch.randn(3, 2, generator=g)},
            optimizer_state={"w": {"exp_avg": torch.ones(3, 2), "exp_avg_sq": torch.ones(3, 2)}},
        )
        out.append(SimpleNamespace(coord=(r,), traces={"eager": trace, "joint": copy.deepcopy(trace)}))
    return out


def test_bitwise_equal_traces_have_equal_digests():
    ranks = _ranks()
    d = stage_digests(ranks, ["eager", "joint", "not run"])
    assert set(d) == {"eager", "joint"} and d["eager"] == d["joint"]
    assert trace_digest(_ranks(), "eager") == d["eager"], "the digest depends on the values, not on the objects"


def test_one_bit_of_one_tensor_changes_the_digest():
    ranks = _ranks()
    before = trace_digest(ranks, "joint")
    w = ranks[1].traces["joint"].optimizer_state["w"]["exp_avg_sq"]
    w.view(torch.int32)[0, 0] ^= 1  # the last bit of one element
    assert trace_digest(ranks, "joint") != before
    assert trace_digest(ranks, "eager") == before


def test_dtype_shape_name_none_and_rank_order_are_in_the_digest():
    base = trace_digest(_ranks(), "eager")
    changes = {
        "dtype": lambda t: t.grads[0].__setitem__("w", t.grads[0]["w"].double()),
        "shape": lambda t: t.grads[0].__setitem__("w", t.grads[0]["w"].reshape(2, 3)),
        "name": lambda t: t.params.__setitem__("v", t.params.pop("w")),
        "none": lambda t: t.grads[0].__setitem__("frozen", torch.zeros(())),
        "bf16": lambda t: t.losses.__setitem__(0, t.losses[0].bfloat16()),
    }
    for what, change in changes.items():
        ranks = _ranks()
        change(ranks[0].traces["eager"])
        assert trace_digest(ranks, "eager") != base, what
    swapped = _ranks()[::-1]
    assert trace_digest(swapped, "eager") != base, "rank order"
