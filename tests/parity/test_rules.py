"""The parity rules on rows (fast path): exact ids, abs+rel tolerance, NaN/Inf, missing/extra rows, shapes."""

from __future__ import annotations

import math

import pytest

from gpumigrate.errors import InvalidInputError
from gpumigrate.interfaces import OutputComparator
from gpumigrate.parity.comparator import ToleranceComparator
from gpumigrate.parity.rules import Rules, build_frame


def rows(**cases: tuple[list[int], list[float]]) -> list[dict]:
    return [{"id": cid, "tokens": toks, "logprobs": lps, "host": "h"} for cid, (toks, lps) in cases.items()]


SOURCE = rows(a=([1, 2, 3], [-1.0, -2.0, -0.5]), b=([7], [-100.0]))
CMP = ToleranceComparator(atol=1e-4, rtol=1e-3)


def test_comparator_implements_the_protocol() -> None:
    assert isinstance(CMP, OutputComparator)


def test_identical_outputs_pass_with_zero_error() -> None:
    report = CMP.compare(SOURCE, SOURCE)
    assert report.passed and report.cases == 2 and report.max_abs_err == 0.0 and report.failures == ()


def test_host_and_other_unlisted_fields_are_not_compared() -> None:
    target = [dict(r, host="other", model="x") for r in SOURCE]
    assert CMP.compare(SOURCE, target).passed


def test_within_abs_plus_rel_tolerance_passes() -> None:
    # allowed at -100: 1e-4 + 1e-3 * 100 = 0.1001; at -1: 0.0011
    target = rows(a=([1, 2, 3], [-1.001, -2.0, -0.5]), b=([7], [-100.1]))
    report = CMP.compare(SOURCE, target)
    assert report.passed, report.failures
    assert report.max_abs_err == pytest.approx(0.1, rel=1e-6)


def test_outside_tolerance_fails_with_worst_position() -> None:
    target = rows(a=([1, 2, 3], [-1.0, -2.01, -0.5]), b=([7], [-100.0]))
    report = CMP.compare(SOURCE, target)
    assert not report.passed
    assert len(report.failures) == 1
    assert "case a" in report.failures[0] and "outside tolerance" in report.failures[0]
    assert "position 1" in report.failures[0]


def test_relative_tolerance_scales_with_the_source_value() -> None:
    # The same 0.05 error is fine at -100 (allowed 0.1001) but not at -1 (allowed 0.0011).
    assert CMP.compare(SOURCE, rows(a=([1, 2, 3], [-1.0, -2.0, -0.5]), b=([7], [-100.05]))).passed
    assert not CMP.compare(SOURCE, rows(a=([1, 2, 3], [-1.05, -2.0, -0.5]), b=([7], [-100.0]))).passed


def test_a_different_token_id_fails_exactly() -> None:
    target = rows(a=([1, 9, 3], [-1.0, -2.0, -0.5]), b=([7], [-100.0]))
    report = CMP.compare(SOURCE, target)
    assert not report.passed
    assert "'tokens' differs at 1 of 3 positions" in report.failures[0]
    assert "source 2, target 9" in report.failures[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_on_target_where_source_is_finite_fails(bad: float) -> None:
    target = rows(a=([1, 2, 3], [-1.0, bad, -0.5]), b=([7], [-100.0]))
    report = CMP.compare(SOURCE, target)
    assert not report.passed
    assert "non-finite" in report.failures[0] and "position 1" in report.failures[0]


def test_nan_where_the_source_also_has_nan_passes() -> None:
    src = rows(a=([1], [math.nan]))
    assert CMP.compare(src, rows(a=([1], [math.nan]))).passed
    assert not CMP.compare(src, rows(a=([1], [-1.0]))).passed  # the source's NaN is not "anything goes"


def test_missing_case_fails_with_a_readable_reason() -> None:
    report = CMP.compare(SOURCE, SOURCE[:1])
    assert not report.passed
    assert report.failures == ("case b: missing on the target (no output row for this golden case)",)


def test_extra_case_fails() -> None:
    report = CMP.compare(SOURCE, [*SOURCE, {"id": "zzz", "tokens": [1], "logprobs": [-1.0]}])
    assert not report.passed
    assert any("case zzz: extra on the target" in f for f in report.failures)


def test_shape_change_fails_naming_both_lengths() -> None:
    target = rows(a=([1, 2], [-1.0, -2.0]), b=([7], [-100.0]))
    report = CMP.compare(SOURCE, target)
    assert not report.passed
    assert "case a: shape change in 'tokens': 3 values on the source, 2 on the target" in report.failures
    assert "case a: shape change in 'logprobs': 3 values on the source, 2 on the target" in report.failures


def test_a_field_missing_on_the_target_fails() -> None:
    target = [{"id": "a", "tokens": [1, 2, 3]}, SOURCE[1]]
    report = CMP.compare(SOURCE, target)
    assert not report.passed
    assert "case a: field 'logprobs' is missing on the target (3 values on the source)" in report.failures


def test_no_rows_at_all_is_a_failure_not_a_pass() -> None:
    report = CMP.compare([], [])
    assert not report.passed and report.cases == 0
    assert "no cases were compared" in report.failures[0]


def test_scalar_class_labels_compare_exactly() -> None:
    src = [{"id": "img1", "label": "cat", "scores": [0.9, 0.1]}]
    assert CMP.compare(src, [{"id": "img1", "label": "cat", "scores": [0.90001, 0.1]}]).passed
    report = CMP.compare(src, [{"id": "img1", "label": "dog", "scores": [0.9, 0.1]}])
    assert not report.passed and "source 'cat', target 'dog'" in report.failures[0]


def test_frame_has_one_row_per_case_field_position() -> None:
    frame = build_frame(SOURCE, SOURCE, Rules())
    # case a: presence + 3 tokens + 3 logprobs; case b: presence + 1 + 1
    assert len(frame) == 7 + 3
    assert set(frame["kind"]) == {"case", "exact", "tolerant"}


@pytest.mark.parametrize(
    "kwargs", [{"atol": -1.0}, {"rtol": math.nan}, {"exact_fields": ("x",), "tolerant_fields": ("x",)}]
)
def test_bad_rules_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        Rules(**kwargs)


def test_duplicate_or_missing_case_ids_are_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="twice"):
        CMP.compare(SOURCE + SOURCE[:1], SOURCE)
    with pytest.raises(InvalidInputError, match="no 'id'"):
        CMP.compare([{"tokens": [1]}], SOURCE)


def test_non_numbers_in_a_float_field_fail_unless_identical() -> None:
    src = rows(a=([1], [-1.0]))
    assert not CMP.compare(src, rows(a=([1], ["oops"]))).passed  # type: ignore[list-item]
    assert not CMP.compare(rows(a=([1], ["x"])), rows(a=([1], ["y"]))).passed  # type: ignore[list-item]
    assert not CMP.compare(src, [{"id": "a", "tokens": [1], "logprobs": [None]}]).passed
