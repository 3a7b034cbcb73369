"""verify.parity.collective_check on real gloo worlds: a graph whose all-gather differs in size on
one rank is caught before it runs, on every rank, naming the node and its module path; the same
graph run unchecked is what gloo aborts on (the control: the planted mismatch is real)."""

import pytest
import torch
import torch.distributed as dist
from torch import fx

from autoparallel import meta as M
from autoparallel.runtime import RankFailedError
from verify.graphs.collective_agreement import CollectiveMismatchError
from verify.parity.collective_check import agree_on_collectives
from verify.parity.ordered_collectives import run_parity_world

_c10d = torch.ops._c10d_functional


def _gather_graph(rows: int, world: int, group: str) -> fx.GraphModule:
    """x -> all_gather(x) over the world -> wait -> output; ``x`` has ``rows`` rows of 4."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = torch.empty(rows, 4)
    ag = g.call_function(_c10d.all_gather_into_tensor.default, (x, world, group))
    ag.meta[M.VAL] = torch.empty(rows * world, 4)
    M.custom_meta(ag)[M.MODULE_PATH] = "head"
    w = g.call_function(_c10d.wait_tensor.default, (ag,))
    w.meta[M.VAL] = ag.meta[M.VAL]
    g.output(w)
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {group: "dp"}
    return gm


def _rank(rank, world, check: bool, planted: bool):
    rows = 3 if planted and rank == 1 else 2  # rank 1 gathers 3 rows, the others 2
    gm = _gather_graph(rows, world, dist.group.WORLD.group_name)
    if check:
        agree_on_collectives([("planted", gm)])
    return gm(torch.full((rows, 4), float(rank))).shape


def test_ranks_that_agree_run():
    assert run_parity_world(_rank, 2, args=(True, False)) == [torch.Size([4, 4])] * 2


def test_a_planted_size_mismatch_is_named_on_every_rank_before_it_runs():
    with pytest.raises(RankFailedError) as info:
        run_parity_world(_rank, 2, args=(True, True), timeout_s=60)
    err = info.value
    text = str(err)
    assert err.exitcode is not None and err.exitcode >= 0, text  # a Python exception, not a signal
    assert "SIGABRT" not in text and "signal" not in text, text
    assert CollectiveMismatchError.__name__ in text
    text = err.remote_traceback or ""  # the launcher's message shortens the error; its traceback has all
    assert CollectiveMismatchError.__name__ in text
    assert "graph 'planted', collective #0" in text
    assert "float32[2, 4]" in text and "float32[3, 4]" in text  # each side's sizes
    assert "at node 'all_gather_into_tensor_default' in head" in text  # the node and its module path
    assert "rank 1 issues" in text


def test_control_unchecked_the_planted_mismatch_aborts_in_gloo():
    """Without the check the same graphs reach gloo, which kills the ranks natively: what the
    check exists to prevent (if gloo ever raised instead, this control would say so)."""
    with pytest.raises(RankFailedError) as info:
        run_parity_world(_rank, 2, args=(False, True), timeout_s=60)
    assert "SIGABRT" in str(info.value) or "size" in str(info.value), str(info.value)
