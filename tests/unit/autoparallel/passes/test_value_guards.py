"""Patch value_guards: a model that reads a tensor's value into Python is traced with a real run's
value and guarded (autoparallel/parallelize/traced_values.py, autoparallel/passes/value_guards.py);
boolean-mask indexing (a nonzero inside ATen's kernel) is specialised on the mask's count."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from autoparallel import patches
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.passes.value_guards import GUARD, GUARD_ROWS, PATCH, TRACED_READ, ValueGuardError, guard_reads, same_value
from autoparallel.runtime.steps import joint_graph_executor
from autoparallel.validate import DataDependentError


class MaskBranch(nn.Module):
    """Doubles its output when any mask entry is set (`if mask.any():`, fsmt's padding test) and
    scales by a count read with .item() (a value used as a number, not only a branch)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def doubled_if_any(self, x, mask):
        y = self.proj(x)
        if mask.any():
            y = y * 2
        return y

    def forward(self, x, mask):
        return self.doubled_if_any(x, mask) * (1 + int(mask.sum().item()))


class RandomDrop(nn.Module):
    """Skips its layer on a draw (m2m_100's layer drop: `if torch.rand([]) < p`)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        if torch.rand([]) < 0.5:
            return x
        return self.proj(x)


def _mse(out, target):
    return F.mse_loss(out, target)


def _batch(mask):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, generator=g), torch.tensor(mask), torch.randn(2, 4, generator=g)


def _joint_step(model, traced, run_on):
    """Trace on batch ``traced`` (dp=1), run the joint graph on batch ``run_on``: (joint, loss, grads)."""
    plan = ParallelPlan.fsdp()
    with fake_world("dp=1") as mesh:
        program = ParallelProgram(model, plan, mesh, _mse)
        params = {k: v.detach().clone() for k, v in program.local_parameters().items()}
        inputs = split_batch(run_on, plan, mesh.spec, mesh.coordinate())
        with build_joint_graph(model, plan, mesh, traced, _mse) as joint:
            run = joint_graph_executor(joint.gm, joint.input_roles, joint.output_roles, {})
            loss, grads = run(params, inputs)
    return joint, loss, grads


def _eager(model, batch):
    model.zero_grad()
    loss = _mse(model(*batch[:-1]), batch[-1])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return MaskBranch()


def test_a_batch_with_the_traced_value_is_bitwise_with_eager(model):
    traced = _batch([[True, False, False, False]] * 2)
    same = (traced[0] + 1, torch.tensor([[False, True, False, False], [False, False, False, True]]), traced[2])
    for batch in (traced, same):
        joint, loss, grads = _joint_step(model, traced, batch)
        want_loss, want = _eager(model, batch)
        assert torch.equal(loss, want_loss)
        assert set(grads) == set(want)
        for name, grad in grads.items():
            assert torch.equal(grad, want[name]), name
    assert len(joint.specialised_reads) == 2
    assert "traced with True" in joint.specialised_reads[0] and "traced with 2" in joint.specialised_reads[1]
    assert "test_value_guards.py" in joint.specialised_reads[0]


def test_a_batch_with_another_value_raises_the_guard(model):
    traced = _batch([[True, False, False, False]] * 2)
    other = _batch([[False] * 4] * 2)
    with pytest.raises(ValueGuardError, match=r"if mask.any\(\).*traced with True; this batch gives False"):
        _joint_step(model, traced, other)


class VectorDrop(RandomDrop):
    """Skips its layer on the sum of a vector draw: not a scalar draw, so not replicated."""

    def forward(self, x, mask):
        if torch.rand(2).sum() < 1.0:
            return x
        return self.proj(x)


@pytest.mark.parametrize("model_class, replicated", [(RandomDrop, False), (VectorDrop, True)])
def test_a_read_a_draw_decides_is_refused_where_the_draw_is_not_replicated(model_class, replicated):
    """A scalar draw is replicated over the ranks (patch replicated_draws, its own tests); a read
    of an unreplicated draw would take different branches on different ranks: refused, named."""
    torch.manual_seed(0)
    off = patches.disabled(REPLICATED_DRAWS) if not replicated else contextlib.nullcontext()
    with off, pytest.raises(DataDependentError, match=r"a random draw decides \(aten::rand at .*test_value_guards.py"):
        _joint_step(model_class(), _batch([[True] * 4] * 2), _batch([[True] * 4] * 2))


class CheckedDropout(nn.Module):
    """Checks its activations after dropout (ibert's `assert x.isnan().sum() == 0`): data through a
    draw, whose value the draw does not decide."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = F.dropout(self.proj(x), 0.5, training=True)
        assert h.isnan().sum() == 0
        return h


def test_data_read_after_a_draw_is_taken_and_guarded():
    torch.manual_seed(0)
    batch = _batch([[True] * 4] * 2)
    joint, loss, _ = _joint_step(CheckedDropout(), batch, batch)
    assert [r.split(": ", 1)[1] for r in joint.specialised_reads] == ["traced with True"]
    assert torch.isfinite(loss)


def test_without_the_patch_the_read_is_refused(model):
    traced = _batch([[True, False, False, False]] * 2)
    with patches.disabled(PATCH), pytest.raises(DataDependentError, match="reads a tensor's value into Python"):
        _joint_step(model, traced, traced)


class RowRouter(nn.Module):
    """Routes the rows that have a mask entry through a second projection (`nonzero`: a
    data-dependent shape, as MoE routers pick their tokens)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.proj(x)
        rows = mask.any(-1).nonzero()[:, 0]
        return y.index_add(0, rows, self.expert(y.index_select(0, rows)))


class SplitBySize(nn.Module):
    """Splits rows by sizes read with .tolist() (jetmoe's `expert_size.tolist()` feeding a split)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        sizes = torch.stack([mask[:, 0].sum(), (~mask[:, 0]).sum()]).tolist()
        head, tail = self.proj(x).split(sizes)
        return torch.cat([head * 2, tail])


def test_tolist_sizes_are_traced_and_guarded():
    torch.manual_seed(0)
    model = SplitBySize()
    traced = _batch([[True] * 4, [False] * 4])
    joint, loss, grads = _joint_step(model, traced, traced)
    want_loss, want = _eager(model, traced)
    assert torch.equal(loss, want_loss) and all(torch.equal(g, want[n]) for n, g in grads.items())
    assert [r.rsplit(": ", 1)[1] for r in joint.specialised_reads] == ["traced with 1", "traced with 1"]
    with pytest.raises(ValueGuardError, match=r"tolist\(\).*traced with 1; this batch gives 2"):
        _joint_step(model, traced, _batch([[True] * 4] * 2))


def test_a_nonzero_is_traced_with_its_row_count_and_guarded():
    torch.manual_seed(0)
    model = RowRouter()
    traced = _batch([[True, False, False, False], [False] * 4])
    same = _batch([[False] * 4, [False, True, False, False]])
    for batch in (traced, same):
        joint, loss, grads = _joint_step(model, traced, batch)
        want_loss, want = _eager(model, batch)
        assert torch.equal(loss, want_loss) and all(torch.equal(g, want[n]) for n, g in grads.items())
    assert [r.split(": ", 1)[1] for r in joint.specialised_reads] == ["nonzero traced with size 1"]
    with pytest.raises(ValueGuardError, match=r"nonzero\(\).*traced with size 1; this batch gives 2"):
        _joint_step(model, traced, _batch([[True] * 4] * 2))


def _hand_graph():
    """x -> any -> traced_read mark; x -> sum -> loss: the joint trace's shape, by hand."""
    g = fx.Graph()
    x = g.placeholder("x")
    flag = g.call_function(torch.ops.aten.any.default, (x,))
    g.call_function(TRACED_READ, (flag, 1.0, "model.py:3 (if x.any():): traced with True", False))
    loss = g.call_function(torch.ops.aten.sum.default, (x,))
    g.output((loss, x))
    return fx.GraphModule(nn.Module(), g)


def test_the_pass_turns_each_mark_into_a_guard_on_the_loss():
    gm = _hand_graph()
    report = guard_reads(gm)
    assert report.guarded == ["model.py:3 (if x.any():): traced with True"]
    out = gm.graph.output_node().args[0]
    assert out[0].target is GUARD and out[0].args[0].target is torch.ops.aten.any.default
    assert not [n for n in gm.graph.nodes if "traced_read" in str(n.target)]
    x = torch.tensor([1.0, 0.0])
    assert torch.equal(gm(x)[0], x.sum())
    with pytest.raises(ValueGuardError, match=r"traced with True; this batch gives False"):
        gm(torch.zeros(2))


def test_an_unguarded_mark_refuses_to_run():
    with pytest.raises(RuntimeError, match="left unguarded"):
        _hand_graph()(torch.ones(2))


@pytest.mark.parametrize("got, expected, same", [
    (True, 1.0, True), (False, 1.0, False), (3, 3.0, True), (0.5, 0.5, True), (0.5, 0.25, False),
    (float("nan"), float("nan"), True), (float("nan"), 0.0, False), (0.0, float("nan"), False),
])
def test_same_value(got, expected, same):
    assert same_value(got, expected) is same


masks = st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=2, max_size=2)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(traced=masks, run_on=masks)
def test_never_a_silent_wrong_result(traced, run_on):
    """Traced on one mask, run on another: eager's loss and gradients bitwise, or the guard's
    error; the graph never returns the traced branch's result for another value."""
    torch.manual_seed(0)
    model = MaskBranch()
    batch = _batch(run_on)
    try:
        _, loss, grads = _joint_step(model, _batch(traced), batch)
    except ValueGuardError:
        assert any(map(any, traced)) != any(map(any, run_on)) or sum(map(sum, traced)) != sum(map(sum, run_on))
        return
    want_loss, want = _eager(model, batch)
    assert torch.equal(loss, want_loss) and all(torch.equal(g, want[n]) for n, g in grads.items())


# Boolean-mask indexing: ``x[mask]`` and ``masked_select`` take a nonzero inside ATen's kernel, which
# the eager run records as the mask's count (blt's ``padded_indices[padded_mask]``, t5gemma2).


class MaskedRows(nn.Module):
    """Picks the masked entries (``y[mask]``), scales them when there are more than two (a size that
    decides a branch: what makes the plain trace refuse), writes them back and adds the sum of a
    ``masked_select`` of the other entries."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.proj(x)
        picked = y[mask]
        if picked.shape[0] > 2:
            picked = picked * 2
        y = y.clone()
        y[mask] = picked
        return y + y.masked_select(~mask).sum()


def _line(text: str) -> int:
    lines = inspect.getsource(MaskedRows.forward).splitlines()
    return MaskedRows.forward.__code__.co_firstlineno + next(i for i, line in enumerate(lines) if text in line)


def _mask(rows):
    return _batch([[bool(v) for v in r] for r in rows])


@pytest.fixture
def masked_rows():
    torch.manual_seed(0)
    return MaskedRows()


def test_bool_mask_indexing_is_traced_with_the_count_and_bitwise_with_eager(masked_rows):
    traced = _mask([[1, 0, 1, 1], [0, 1, 0, 0]])
    same = _mask([[0, 1, 0, 0], [1, 1, 1, 0]])  # other rows, the same count (4)
    for batch in (traced, same):
        joint, loss, grads = _joint_step(masked_rows, traced, batch)
        want_loss, want = _eager(masked_rows, batch)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(g, want[n]) for n, g in grads.items())
    assert [r.rsplit(": ", 1)[1] for r in joint.specialised_reads] == ["nonzero traced with size 4"] * 2
    assert [int(r.split(":")[1].split(" ")[0]) for r in joint.specialised_reads] == [_line("y[mask]"), _line("masked_select")]
    assert len(joint.gm.graph.find_nodes(op="call_function", target=GUARD_ROWS)) == 2


def test_another_count_raises_naming_the_line_and_both_counts(masked_rows):
    with pytest.raises(ValueGuardError, match=rf"test_value_guards.py:{_line('y[mask]')} \(picked = y\[mask\]\): "
                       r"nonzero traced with size 4; this batch gives 2"):
        _joint_step(masked_rows, _mask([[1, 0, 1, 1], [0, 1, 0, 0]]), _mask([[1, 0, 0, 0], [0, 1, 0, 0]]))


def test_without_the_patch_bool_mask_indexing_is_refused(masked_rows):
    traced = _mask([[1, 0, 1, 1], [0, 1, 0, 0]])
    with patches.disabled(PATCH), pytest.raises(DataDependentError, match="not traceable"):
        _joint_step(masked_rows, traced, traced)


class BroadcastSelect(nn.Module):
    """``masked_select`` with a mask that broadcasts: its output size is not the mask's count."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.proj(x)
        picked = y.masked_select(mask[:, :1])
        if picked.shape[0] > 2:
            return y * 2
        return y


def test_a_broadcast_masked_select_is_refused_by_name():
    torch.manual_seed(0)
    batch = _mask([[1, 0, 1, 1], [0, 1, 0, 0]])
    with pytest.raises(DataDependentError, match=r"selects with a mask of shape \(2, 1\) broadcast to \(2, 4\)"):
        _joint_step(BroadcastSelect(), batch, batch)



@settings(max_examples=4, deadline=None, derandomize=True)
@given(traced=masks, run_on=masks)
def test_never_a_silent_wrong_result_on_masks(traced, run_on):
    """Traced on one mask, run on another: eager's loss and gradients bitwise, or the guard's error
    (exactly when the counts differ)."""
    torch.manual_seed(0)
    model = MaskedRows()
    batch = _batch(run_on)
    try:
        _, loss, grads = _joint_step(model, _batch(traced), batch)
    except ValueGuardError:
        assert sum(map(sum, traced)) != sum(map(sum, run_on))
        return
    want_loss, want = _eager(model, batch)
    assert torch.equal(loss, want_loss) and all(torch.equal(g, want[n]) for n, g in grads.items())


class MaskedWrite(MaskBranch):
    """Writes one value into the masked entries (``out[mask] = v``: t5gemma2's scatter), whose
    backward takes ``grad[mask]``, a nonzero in a formula with no model frame."""

    def forward(self, x, mask):
        y = self.doubled_if_any(x, mask)
        out = y.clone()
        out[mask] = y.sum()
        return out


def test_a_masked_write_is_guarded_on_its_count_for_its_backward():
    torch.manual_seed(0)
    model = MaskedWrite()
    traced = _mask([[1, 0, 1, 1], [0, 1, 0, 0]])
    joint, loss, grads = _joint_step(model, traced, traced)
    want_loss, want = _eager(model, traced)
    assert torch.equal(loss, want_loss) and all(torch.equal(g, want[n]) for n, g in grads.items())
    assert any(r.endswith("(out[mask] = y.sum()): nonzero traced with size 4") for r in joint.specialised_reads)
    with pytest.raises(ValueGuardError, match=r"out\[mask\] = y.sum\(\)\): nonzero traced with size 4; this batch gives 1"):
        _joint_step(model, traced, _mask([[1, 0, 0, 0], [0, 0, 0, 0]]))
