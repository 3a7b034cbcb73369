"""verify.parity.compare on unequal inputs: every way two runs can differ must be reported as not bitwise.

Each test names the plausible weaker checker it kills (``allclose``, ``torch.equal``, skipping a
missing tensor, comparing only the first step, ...).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from autoparallel.runtime.steps import StepTrace
from verify.parity.compare import (
    ORACLE_SAFETY,
    OracleReport,
    OracleTolerance,
    ParityReport,
    TensorDiff,
    check_within,
    compare_tensors,
    compare_traces,
    diff_tensors,
    merge_reports,
    module_scales,
    oracle_tolerance,
)


def _f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


F32_ONE_ULP = _f32_from_bits(0x3F800001)  # 1.0000001192092896 in float32
QUIET_NAN = _f32_from_bits(0x7FC00000)
OTHER_NAN = _f32_from_bits(0x7FC00001)  # NaN with another payload


def test_one_ulp_difference_is_not_bitwise_although_allclose_passes_it():
    x = torch.tensor([1.0, 2.0, 3.0])
    y = torch.tensor([1.0, 2.0, 3.0])
    y[0] = F32_ONE_ULP
    assert torch.allclose(x, y) and not torch.equal(x, y)  # an allclose checker would say "equal"
    d = diff_tensors("w", x, y)
    assert not d.equal
    assert d.differing == 1 and d.numel == 3
    assert d.max_abs == pytest.approx(2.0**-23)
    assert "1 of 3 elements differ in bits" in d.note
    assert "first at [0]: 1.0 vs 1.0000001192092896" in d.note
    report = compare_tensors({"w": x}, {"w": y})
    assert not report.bitwise
    with pytest.raises(AssertionError, match=r"(?s)1 differ.*w: max \|diff\| 1\.192e-07"):
        report.assert_bitwise()


@pytest.mark.parametrize("dtype, int_dtype", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float64, torch.int64)])
def test_one_ulp_difference_in_other_float_dtypes(dtype, int_dtype):
    x = torch.ones(4, dtype=dtype)
    y = (x.view(int_dtype) + torch.tensor([0, 0, 0, 1], dtype=int_dtype)).view(dtype)  # last bit of one element
    assert torch.allclose(x.double(), y.double(), rtol=1e-2)
    d = diff_tensors("t", x, y)
    assert not d.equal and d.differing == 1 and 0 < d.max_abs < 1e-2


@pytest.mark.parametrize("missing_in", ["a", "b"])
def test_tensor_missing_on_either_side_is_reported_not_skipped(missing_in):
    t = {"w1": torch.ones(2), "w2": torch.ones(2)}
    partial = {"w1": torch.ones(2)}
    a, b = (partial, t) if missing_in == "a" else (t, partial)
    report = compare_tensors(a, b, a_name="eager", b_name="compiled")
    assert [d.name for d in report.diffs] == ["w1", "w2"]
    (miss,) = report.mismatches()
    assert miss.name == "w2" and miss.max_abs == math.inf
    assert miss.note == f"missing in {'eager' if missing_in == 'a' else 'compiled'}"
    assert not report.bitwise
    assert "w2: max |diff| inf; missing in" in report.summary()


def test_shape_mismatch_with_the_same_elements():
    x = torch.arange(6.0)
    d = diff_tensors("w", x.view(2, 3), x.view(3, 2))
    assert not d.equal and d.max_abs == math.inf
    assert d.note == "shape (2, 3) vs (3, 2)"
    assert not diff_tensors("w", torch.ones(3), torch.ones(1, 3)).equal  # broadcastable is not equal


def test_dtype_mismatch_with_equal_values():
    x = torch.tensor([1.0, 0.5])
    d = diff_tensors("w", x, x.double())
    assert not d.equal and d.max_abs == math.inf
    assert d.note == "dtype torch.float32 vs torch.float64"
    assert "shape (2,) vs (3,); dtype torch.float32 vs torch.bfloat16" == diff_tensors(
        "w", x, torch.ones(3, dtype=torch.bfloat16)
    ).note


def test_nan_with_the_same_bits_is_equal_unlike_torch_equal():
    x = torch.tensor([QUIET_NAN, 1.0])
    assert not torch.equal(x, x.clone())  # torch.equal would call a reproduced NaN a mismatch
    assert diff_tensors("w", x, x.clone()).equal


def test_nan_against_a_number_is_a_mismatch_with_infinite_max_abs():
    x = torch.tensor([QUIET_NAN, 1.0])
    y = torch.tensor([0.0, 1.0])
    for a, b in ((x, y), (y, x)):
        d = diff_tensors("w", a, b)
        assert not d.equal
        assert d.max_abs == math.inf  # a tolerance check on max_abs can never pass it
        assert "1 NaN vs number" in d.note


def test_nan_payloads_that_differ_are_a_mismatch():
    d = diff_tensors("w", torch.tensor([QUIET_NAN]), torch.tensor([OTHER_NAN]))
    assert not d.equal and d.max_abs == math.inf
    assert "1 NaN vs NaN with other bits" in d.note


def test_negative_zero_against_positive_zero_is_a_bitwise_difference():
    x = torch.tensor([0.0, 1.0])
    y = torch.tensor([-0.0, 1.0])
    assert torch.equal(x, y)  # torch.equal (and ==) would call them equal
    d = diff_tensors("w", x, y)
    assert not d.equal
    assert d.max_abs == 0.0
    assert "1 signed zero (-0.0 vs +0.0)" in d.note
    assert "first at [0]: 0.0 vs -0.0" in d.note


def test_infinities():
    inf = math.inf
    assert diff_tensors("w", torch.tensor([inf, -inf]), torch.tensor([inf, -inf])).equal
    d = diff_tensors("w", torch.tensor([inf]), torch.tensor([-inf]))
    assert not d.equal and d.max_abs == inf
    d = diff_tensors("w", torch.tensor([inf]), torch.tensor([3.0e38]))
    assert not d.equal and d.max_abs == inf


def test_empty_tensors():
    assert diff_tensors("w", torch.empty(0, 3), torch.empty(0, 3)).equal
    assert not diff_tensors("w", torch.empty(0, 3), torch.empty(3, 0)).equal
    assert not diff_tensors("w", torch.empty(0), torch.empty(0, dtype=torch.int64)).equal


def test_a_report_of_zero_tensors_never_claims_bitwise():
    for report in (ParityReport("a", "b"), compare_tensors({}, {})):
        assert not report.bitwise
        assert "nothing compared (0 tensors)" in report.summary()
        with pytest.raises(AssertionError, match="nothing compared"):
            report.assert_bitwise()
        assert report.to_dict()["bitwise"] is False


def test_integer_bool_and_complex_tensors():
    assert not diff_tensors("i", torch.tensor([1, 2]), torch.tensor([1, 3])).equal
    assert diff_tensors("i", torch.tensor([1, 2]), torch.tensor([1, 2])).max_abs == 0.0
    assert diff_tensors("i", torch.tensor([1, 2]), torch.tensor([1, 5])).max_abs == 3.0
    assert not diff_tensors("b", torch.tensor([True]), torch.tensor([False])).equal
    z = torch.tensor([1 + 1j, 2 + 2j])
    w = z.clone()
    w[1] = 2 + 2.5j  # only the imaginary part differs
    d = diff_tensors("z", z, w)
    assert not d.equal and d.differing == 1 and d.max_abs == pytest.approx(0.5)
    assert "first at [1]" in d.note


def test_strides_device_and_requires_grad_do_not_matter():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    y = x.t().contiguous().t()  # same values, other strides
    assert y.stride() != x.stride()
    assert diff_tensors("w", x, y).equal
    assert diff_tensors("w", x.requires_grad_(), y).equal
    y2 = y.clone()
    y2[2, 3] += 1.0
    assert not diff_tensors("w", x.t(), y2.t()).equal  # a transposed mismatch is still found
    assert "first at [3, 2]" in diff_tensors("w", x.t(), y2.t()).note


def test_non_tensor_values_are_mismatches_not_crashes():
    report = compare_tensors({"w": torch.ones(1)}, {"w": None})
    (d,) = report.diffs
    assert not d.equal and d.note == "b is not a tensor: NoneType"
    with pytest.raises(ValueError, match="w: cannot compare a torch.sparse_coo tensor"):
        diff_tensors("w", torch.ones(2).to_sparse(), torch.ones(2).to_sparse())


def test_summary_lists_mismatches_only_and_cuts_long_lists():
    a = {f"w{i:02d}": torch.zeros(1) for i in range(15)}
    b = {k: (torch.ones(1) if i % 2 else torch.zeros(1)) for i, k in enumerate(a)}
    report = compare_tensors(a, b)
    summary = report.summary(limit=3)
    assert summary.splitlines()[0] == "a vs b: 15 tensors, 7 differ, max |diff| 1.000e+00"
    assert [ln.split(":")[0].strip() for ln in summary.splitlines()[1:4]] == ["w01", "w03", "w05"]
    assert summary.splitlines()[-1] == "  ... and 4 more"
    assert report.to_dict() == {"a": "a", "b": "b", "bitwise": False, "tensors": 15, "mismatches": 7, "max_abs_diff": 1.0}


def _trace(losses, grads) -> StepTrace:
    return StepTrace([torch.tensor(v) for v in losses], [{k: torch.tensor(v) for k, v in g.items()} for g in grads])


def test_compare_traces_finds_a_mismatch_in_a_late_step_and_in_the_loss_alone():
    a = _trace([1.0, 0.5, 0.25], [{"w": [1.0]}, {"w": [2.0]}, {"w": [3.0]}])
    late = _trace([1.0, 0.5, 0.25], [{"w": [1.0]}, {"w": [2.0]}, {"w": [3.5]}])
    report = compare_traces(a, late, a_name="eager", b_name="joint")
    assert len(report.diffs) == 6
    assert [d.name for d in report.mismatches()] == ["step2/grad:w"]
    loss_only = _trace([1.0, 0.5, 0.3], [{"w": [1.0]}, {"w": [2.0]}, {"w": [3.0]}])
    assert [d.name for d in compare_traces(a, loss_only).mismatches()] == ["step2/loss"]
    assert compare_traces(a, _trace([1.0, 0.5, 0.25], [{"w": [1.0]}, {"w": [2.0]}, {"w": [3.0]}])).bitwise


def test_compare_traces_reports_a_gradient_missing_in_one_step():
    a = _trace([1.0, 1.0], [{"w": [1.0], "v": [1.0]}, {"w": [1.0], "v": [1.0]}])
    b = _trace([1.0, 1.0], [{"w": [1.0], "v": [1.0]}, {"w": [1.0]}])
    (miss,) = compare_traces(a, b, a_name="eager", b_name="joint").mismatches()
    assert miss.name == "step1/grad:v" and miss.note == "missing in joint"


def test_compare_traces_refuses_runs_of_different_lengths():
    a = _trace([1.0, 1.0], [{"w": [1.0]}, {"w": [1.0]}])
    with pytest.raises(ValueError, match="eager ran 2 steps but joint ran 1"):
        compare_traces(a, _trace([1.0], [{"w": [1.0]}]), a_name="eager", b_name="joint")
    with pytest.raises(ValueError, match="joint: 2 losses but 1 gradient sets"):
        compare_traces(a, _trace([1.0, 1.0], [{"w": [1.0]}]), a_name="eager", b_name="joint")


def test_merge_reports_keeps_every_rank_and_refuses_mixed_comparisons():
    ok = compare_tensors({"w": torch.ones(1)}, {"w": torch.ones(1)}, a_name="eager", b_name="joint")
    bad = compare_tensors({"w": torch.ones(1)}, {"w": torch.zeros(1)}, a_name="eager", b_name="joint")
    merged = merge_reports([ok, bad, ok], ["rank0", "rank1", "rank2"])
    assert [d.name for d in merged.diffs] == ["rank0/w", "rank1/w", "rank2/w"]
    assert [d.name for d in merged.mismatches()] == ["rank1/w"]
    assert merged.mismatches()[0].differing == 1  # the details survive the renaming
    assert not merged.bitwise
    with pytest.raises(ValueError, match="no reports to merge"):
        merge_reports([], [])
    other = compare_tensors({"w": torch.ones(1)}, {"w": torch.ones(1)}, a_name="eager", b_name="compiled")
    with pytest.raises(ValueError, match="different comparisons"):
        merge_reports([ok, other], ["rank0", "rank1"])
    with pytest.raises(ValueError):
        merge_reports([ok, ok], ["rank0"])  # a prefix per report


def test_compare_traces_compares_buffers_and_reports_a_buffer_one_run_never_updated():
    a = _trace([1.0], [{"w": [1.0]}])
    a.buffers = [{"bn.running_mean": torch.tensor([0.1]), "bn.num_batches_tracked": torch.tensor(1)}]
    same = _trace([1.0], [{"w": [1.0]}])
    same.buffers = [{k: v.clone() for k, v in a.buffers[0].items()}]
    assert compare_traces(a, same).bitwise and len(compare_traces(a, same).diffs) == 4
    stale = _trace([1.0], [{"w": [1.0]}])
    stale.buffers = [{"bn.running_mean": torch.tensor([0.0]), "bn.num_batches_tracked": torch.tensor(0)}]
    assert sorted(d.name for d in compare_traces(a, stale).mismatches()) == [
        "step0/buffer:bn.num_batches_tracked", "step0/buffer:bn.running_mean"]
    none = _trace([1.0], [{"w": [1.0]}])  # an executor that keeps no buffers at all
    assert {d.note for d in compare_traces(a, none, b_name="joint").mismatches()} == {"missing in joint"}


# --- the oracle: single-device eager within a derived tolerance ------------------------------------


def test_oracle_tolerance_follows_the_formula():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    tol = oracle_tolerance(model, (torch.randn(2, 8),), slices=2)
    # two weights; width: max(fan-in 64, rows 16) + 2 slices
    assert (tol.dtype, tol.layers, tol.width) == (torch.float32, 2, 66)
    assert tol.rtol == pytest.approx(ORACLE_SAFETY * 2.0**-24 * math.sqrt(2 * 66))
    bf16 = oracle_tolerance(model, (torch.randn(2, 8),), slices=2, compute_dtype=torch.bfloat16)
    assert bf16.rtol == pytest.approx(tol.rtol * 2.0**16)  # u(bf16) / u(fp32)
    assert "sqrt(2 layers * width 66)" in tol.describe()
    with pytest.raises(ValueError, match="no unit roundoff for torch.int64"):
        _ = OracleTolerance(torch.int64, 1, 1).rtol


def test_check_within_fails_what_a_max_diff_report_would_only_print():
    ref = torch.tensor([1.0, -2.0])
    assert check_within("w", ref, ref + 1e-7, rtol=1e-6).passed  # bound 2e-6
    over = check_within("w", ref, ref + torch.tensor([0.0, 1e-5]), rtol=1e-6)
    assert not over.passed and over.max_abs == pytest.approx(1e-5, rel=1e-2) and over.bound == pytest.approx(2e-6)
    for got, note in ((torch.tensor([1.0, float("nan")]), "NaN"), (torch.ones(3), "shape/dtype"), (None, "missing")):
        c = check_within("w", ref, got, rtol=1.0)  # even a huge tolerance cannot pass these
        assert not c.passed and c.max_abs == float("inf") and note in c.note
    ints = check_within("n", torch.tensor(3), torch.tensor(4), rtol=1.0)
    assert not ints.passed and ints.note == "integers: exact"


def test_a_gradient_is_judged_at_its_module_scale():
    """A bias before a normalisation has an exactly-zero gradient made of cancelling terms: at its
    own scale its rounding noise (1e-9) looked like a 33% error on the conv net."""
    grads = {"conv.weight": torch.tensor([0.5, -0.25]), "conv.bias": torch.tensor([1e-9]), "head.bias": torch.tensor([2.0])}
    assert module_scales(grads) == {"conv.weight": 0.5, "conv.bias": 0.5, "head.bias": 2.0}


def test_oracle_report_passes_only_when_every_tensor_is_within_its_bound():
    tol = OracleTolerance(torch.float32, 1, 1)
    report = OracleReport(tol)
    assert not report.passed and "nothing compared" in report.summary()
    report.checks = [check_within("loss", torch.tensor(1.0), torch.tensor(1.0), tol.rtol)]
    assert report.passed and report.worst_ratio == 0.0
    report.checks.append(check_within("grad:w", torch.tensor([1.0]), torch.tensor([2.0]), tol.rtol))
    assert not report.passed and [c.name for c in report.failures()] == ["grad:w"]
    assert "FAIL: 1 of 2 beyond tolerance" in report.summary() and "grad:w: |diff| 1.000e+00 > bound" in report.summary()
    with pytest.raises(AssertionError, match="grad:w"):
        report.assert_passed()
    assert report.to_dict()["failures"] == 1 and report.to_dict()["tolerance"]["layers"] == 1


# --- exact fields and text (each kills a line-level mutant that the checks above let through) ---------


def test_every_field_of_each_kind_of_verdict():
    inf = float("inf")
    x, y = torch.zeros(2), torch.zeros(3)
    assert diff_tensors("w", x, y) == TensorDiff("w", False, inf, "shape (2,) vs (3,)", 0, 3)
    assert diff_tensors("w", torch.zeros(2), torch.zeros(2, dtype=torch.float64)) == TensorDiff(
        "w", False, inf, "dtype torch.float32 vs torch.float64", 0, 2)
    assert diff_tensors("w", torch.ones(4), torch.ones(4)) == TensorDiff("w", True, 0.0, "", 0, 4)
    d = diff_tensors("w", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    assert d == TensorDiff("w", False, 2.0, "1 of 2 elements differ in bits; first at [1]: 2.0 vs 4.0", 1, 2)
    assert diff_tensors("w", [1.0], torch.ones(1)) == TensorDiff("w", False, inf, "a is not a tensor: list")
    assert diff_tensors("w", torch.ones(1), (1,)).note == "b is not a tensor: tuple"
    (missing, *rest) = compare_tensors({"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)},
                                       {"b": torch.ones(1), "c": torch.zeros(1)}, a_name="eager", b_name="joint").diffs
    assert missing == TensorDiff("a", False, inf, "missing in joint")
    assert [d.name for d in rest] == ["b", "c"] and not rest[1].equal  # comparing goes on after a missing one


def test_max_abs_is_computed_wider_than_the_values():
    # In float32, 1e8 - 1 rounds to 1e8; the report must say 99999999.
    d = diff_tensors("w", torch.tensor([1e8]), torch.tensor([1.0]))
    assert d.max_abs == 99999999.0


def test_nan_payload_counts_only_differing_nans():
    x = torch.tensor([QUIET_NAN, QUIET_NAN, 1.0])
    y = torch.tensor([QUIET_NAN, 1.0, OTHER_NAN])
    d = diff_tensors("w", x, y)
    assert d.note.startswith("2 of 3 elements differ in bits; 2 NaN vs number; first at [1]")
    both = diff_tensors("w", torch.tensor([QUIET_NAN, QUIET_NAN]), torch.tensor([QUIET_NAN, OTHER_NAN]))
    assert "1 NaN vs NaN with other bits" in both.note and "NaN vs number" not in both.note


def test_complex_tensors_of_two_dims_find_the_differing_element():
    z = torch.zeros(2, 3, dtype=torch.complex64)
    w = z.clone()
    w[1, 2] = 0.5j
    d = diff_tensors("z", z, w)
    assert (d.differing, d.numel) == (1, 6) and "first at [1, 2]" in d.note


def test_summary_text_exactly():
    equal = compare_tensors({"w": torch.ones(1)}, {"w": torch.ones(1)})
    assert equal.summary() == "a vs b: 1 tensors, bitwise equal, max |diff| 0.000e+00"
    no_note = ParityReport("a", "b", [TensorDiff("w", False, 1.0)])
    assert no_note.summary().splitlines()[1] == "  w: max |diff| 1.000e+00"
    eleven = ParityReport("a", "b", [TensorDiff(f"w{i}", False, 1.0, "n") for i in range(11)])
    assert eleven.summary().splitlines()[1:] == [f"  w{i}: max |diff| 1.000e+00; n" for i in range(10)] + ["  ... and 1 more"]
    ten = ParityReport("a", "b", eleven.diffs[:10])
    assert len(ten.summary().splitlines()) == 11 and "more" not in ten.summary()
    twelve = ParityReport("a", "b", [*eleven.diffs, TensorDiff("w11", False, 1.0)])
    assert twelve.summary(limit=10).splitlines()[-1] == "  ... and 2 more"


def test_compare_traces_names_its_sides():
    a = _trace([1.0], [{"w": [1.0], "v": [1.0]}])
    report = compare_traces(a, _trace([1.0], [{"w": [1.0]}]))
    assert (report.a, report.b) == ("a", "b")
    assert report.mismatches()[0].note == "missing in b"
    named = compare_traces(_trace([1.0], [{"w": [1.0]}]), a, a_name="eager", b_name="joint")
    assert (named.a, named.b) == ("eager", "joint") and named.mismatches()[0].note == "missing in eager"


def test_merge_reports_keeps_the_comparison_names_and_says_why_it_refuses():
    one = compare_tensors({"w": torch.ones(1)}, {"w": torch.ones(1)}, a_name="eager", b_name="joint")
    merged = merge_reports([one], ["rank0"])
    assert (merged.a, merged.b) == ("eager", "joint")
    with pytest.raises(ValueError) as e:
        merge_reports([], [])
    assert str(e.value) == "no reports to merge"


# --- parameters without a gradient (frozen, or the loss does not reach them) ---------------------


def _gradless_trace(f_grads, f_final) -> StepTrace:
    t = StepTrace([torch.tensor(1.0)] * len(f_grads),
                  [{"w": torch.tensor([1.0]), "f": None if g is None else torch.tensor([g])} for g in f_grads])
    t.params = {"w": torch.tensor([0.5]), "f": torch.tensor([f_final])}
    return t


def test_no_gradient_on_both_sides_is_equal_and_against_a_tensor_is_not():
    assert diff_tensors("g", None, None).equal
    assert not diff_tensors("g", None, torch.zeros(1)).equal and not diff_tensors("g", torch.zeros(1), None).equal
    assert check_within("grad:f", None, None, 1e-6).passed
    assert not check_within("grad:f", None, torch.zeros(1), 1e-6).passed
    assert not check_within("grad:f", torch.zeros(1), None, 1e-6).passed
    assert module_scales({"m.w": torch.tensor([2.0]), "m.f": None}) == {"m.w": 2.0, "m.f": 2.0}


def test_a_parameter_without_a_gradient_must_end_where_the_reference_left_it():
    """A frozen parameter that another form of the program changes (an in-place write, an update
    without a recorded gradient) fails, though every loss and gradient matches."""
    a = _gradless_trace([None, None], 3.0)
    same = compare_traces(a, _gradless_trace([None, None], 3.0))
    assert same.bitwise and "final/param:f" in [d.name for d in same.diffs]
    assert "final/param:w" not in [d.name for d in same.diffs]  # trained parameters: their gradients say it
    moved = compare_traces(a, _gradless_trace([None, None], 3.5), b_name="joint")
    assert [d.name for d in moved.mismatches()] == ["final/param:f"]
    got_one = compare_traces(a, _gradless_trace([None, 0.0], 3.0))  # the graph gives a gradient eager does not
    assert [d.name for d in got_one.mismatches()] == ["step1/grad:f"]
    assert [d.name for d in compare_traces(_gradless_trace([None, 0.0], 3.0), a).mismatches()] == ["step1/grad:f"]
