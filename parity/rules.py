"""The one definition of the output-parity rules, shared by the GX suite and the fast path.

Source and target outputs become one pandas frame with a row per (case, field, position). The rules
compute boolean/float *verdict columns* on that frame; a row passes when every check in :data:`CHECKS`
holds. The Great Expectations suite (``gx_suite``) expresses exactly those checks as expectations,
and the fast path (``evaluate``) evaluates them with numpy, so both always judge the same columns.

Rules (see FORMAT.md beside this file):

- a case present on one side only is a failure (missing or extra row);
- a field with a different number of values on each side is a shape change: the extra positions are
  present on one side only, so they fail the same presence checks;
- exact fields (token ids, labels, classes, text) must be equal, value by value;
- tolerant fields (logprobs, scores) must satisfy ``|s - t| <= atol + rtol * |s|``, computed as
  ``excess = |s - t| - (atol + rtol * |s|)`` and checked ``excess <= 0``;
- a non-finite value (NaN, ±Inf) must be matched by the same non-finite value on the other side:
  NaN on the target where the source is finite is a failure, whatever the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from gpumigrate.errors import InvalidInputError

CASE_FIELD = "(case)"  # the presence row every case gets, so an empty or missing case still shows

DEFAULT_EXACT_FIELDS = ("tokens", "token_ids", "label", "labels", "class", "classes", "text")
DEFAULT_TOLERANT_FIELDS = ("logprobs", "scores", "probs", "logits")


@dataclass(frozen=True)
class Check:
    """One rule on one verdict column: ``true`` means every value is True, ``le_zero`` every value <= 0."""

    column: str
    kind: Literal["true", "le_zero"]
    meaning: str


# The checks, in the order reasons are reported. Null in any verdict column is a failure too.
CHECKS: tuple[Check, ...] = (
    Check("in_source", "true", "present on the source (no extra rows or values on the target)"),
    Check("in_target", "true", "present on the target (no missing rows or values)"),
    Check("exact_equal", "true", "exact fields equal"),
    Check("finite_ok", "true", "no NaN/Inf on the target where the source is finite"),
    Check("excess", "le_zero", "float fields within atol + rtol*|source|"),
)

FRAME_COLUMNS = (
    "case", "field", "kind", "position", "in_source", "in_target", "exact_equal", "finite_ok",
    "excess", "abs_err", "source_value", "target_value",
)  # fmt: skip


@dataclass(frozen=True)
class Rules:
    """Which fields are compared and how. Fields not listed (``host``, ``model``) are never compared.

    A field name is a dotted path into the answer (``data.0.embedding``: integer parts index lists).
    ``tolerances`` overrides atol/rtol per tolerant field. With ``required`` (rules built from a plan's
    ``parity.request.compare``) a listed field absent from an answer is a failure that names it;
    without, a field absent on both sides is not compared."""

    atol: float = 1e-5
    rtol: float = 1e-4
    exact_fields: tuple[str, ...] = DEFAULT_EXACT_FIELDS
    tolerant_fields: tuple[str, ...] = DEFAULT_TOLERANT_FIELDS
    tolerances: tuple[tuple[str, float, float], ...] = ()  # (field, atol, rtol)
    required: bool = False

    def __post_init__(self) -> None:
        for name, value in [("atol", self.atol), ("rtol", self.rtol)] + [
            (f"{which} of {f}", v) for f, a, r in self.tolerances for which, v in (("atol", a), ("rtol", r))
        ]:
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidInputError(f"{name} must be a finite number >= 0, got {value!r}")
        both = set(self.exact_fields) & set(self.tolerant_fields)
        if both:
            raise InvalidInputError(f"fields {sorted(both)} are listed as both exact and tolerant: choose one")

    def tolerance(self, name: str) -> tuple[float, float]:
        """(atol, rtol) for a tolerant field."""
        for field_name, atol, rtol in self.tolerances:
            if field_name == name:
                return atol, rtol
        return self.atol, self.rtol


@dataclass
class CaseVerdict:
    case: str
    passed: bool
    max_abs_err: float | None
    max_excess: float | None
    reasons: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    """What the rules say about a frame; ``failures`` are readable reasons, one per failing case/field."""

    passed: bool
    cases: int
    max_abs_err: float | None
    failures: list[str]
    per_case: dict[str, CaseVerdict]
    failed_checks: dict[str, int]  # verdict column -> number of failing rows


def _case_id(row: Mapping[str, Any], side: str, index: int) -> str:
    if "id" not in row:
        raise InvalidInputError(f"{side} row {index} has no 'id': every output row must carry its golden case id")
    return str(row["id"])


def _index(rows: Sequence[Mapping[str, Any]], side: str) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for i, row in enumerate(rows):
        cid = _case_id(row, side, i)
        if cid in out:
            raise InvalidInputError(f"{side} rows hold case id {cid!r} twice: case ids must be unique")
        out[cid] = row
    return out


ABSENT = object()  # what field_value returns for a path the answer does not have


def field_value(row: Mapping[str, Any] | None, name: str) -> Any:
    """The value at a dotted path (``data.0.embedding``) of an answer, or ``ABSENT``."""
    if row is None:
        return ABSENT
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return ABSENT
    return value


def _values(row: Mapping[str, Any] | None, name: str, *, flatten: bool = False) -> list[Any] | None:
    """A field as a list of values; None when the row or the field is absent. ``flatten`` unrolls nested
    arrays (a batch of embeddings) into one list, row by row."""
    value = field_value(row, name)
    if value is ABSENT or value is None:
        return None
    if isinstance(value, list | tuple | np.ndarray):
        return _flat(value) if flatten else list(value)
    return [value]


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple | np.ndarray):
        return [v for item in value for v in _flat(item)]
    return [value]


def _shape(value: Any) -> Any:
    """The nesting of an array (its length, then each item's shape where items are arrays), so that
    flattening never hides a reshape; None for a scalar."""
    if not isinstance(value, list | tuple | np.ndarray):
        return None
    inner = [_shape(v) for v in value]
    return [len(value)] if all(i is None for i in inner) else [len(value), inner]


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # not a number at all: judged like NaN (a failure unless both sides agree)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _equal(s: Any, t: Any) -> bool:
    try:
        return bool(s == t)
    except ValueError:  # array-valued entries (e.g. top-k ids per position)
        return bool(np.array_equal(np.asarray(s), np.asarray(t)))


def build_frame(source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]], rules: Rules) -> pd.DataFrame:
    """One row per (case, field, position) with the verdict columns computed by the rules."""
    src, tgt = _index(source, "source"), _index(target, "target")
    order = list(src) + [cid for cid in tgt if cid not in src]
    cols: dict[str, list[Any]] = {name: [] for name in FRAME_COLUMNS}
    tol_idx: list[int] = []
    tol_src: list[float] = []
    tol_tgt: list[float] = []
    tol_odd: list[bool] = []
    tol_atol: list[float] = []
    tol_rtol: list[float] = []

    def add(case: str, name: str, kind: str, pos: int, s_in: bool, t_in: bool, s: Any, t: Any) -> int:
        cols["case"].append(case)
        cols["field"].append(name)
        cols["kind"].append(kind)
        cols["position"].append(pos)
        cols["in_source"].append(s_in)
        cols["in_target"].append(t_in)
        cols["exact_equal"].append(kind != "exact" or (s_in and t_in and _equal(s, t)))
        cols["source_value"].append(s)
        cols["target_value"].append(t)
        return len(cols["case"]) - 1

    for cid in order:
        s_row, t_row = src.get(cid), tgt.get(cid)
        add(cid, CASE_FIELD, "case", 0, s_row is not None, t_row is not None, None, None)
        if s_row is None or t_row is None:
            continue  # the presence row says it all
        for kind, names in (("exact", rules.exact_fields), ("tolerant", rules.tolerant_fields)):
            for name in names:
                s_vals = _values(s_row, name, flatten=kind == "tolerant")
                t_vals = _values(t_row, name, flatten=kind == "tolerant")
                if s_vals is None and t_vals is None:
                    if rules.required:  # a field the plan names must be in the answers
                        add(cid, name, kind, 0, False, False, None, None)
                    continue
                if kind == "tolerant":
                    s_shape, t_shape = _shape(field_value(s_row, name)), _shape(field_value(t_row, name))
                    if any(
                        isinstance(x, list) and len(x) > 1 for x in (s_shape, t_shape)
                    ):  # nested arrays: the flattening must not hide a reshape
                        add(cid, f"{name} (shape)", "exact", 0, True, True, s_shape, t_shape)
                atol, rtol = rules.tolerance(name)
                s_vals, t_vals = s_vals or [], t_vals or []
                for pos in range(max(len(s_vals), len(t_vals))):
                    s_in, t_in = pos < len(s_vals), pos < len(t_vals)
                    s = s_vals[pos] if s_in else None
                    t = t_vals[pos] if t_in else None
                    i = add(cid, name, kind, pos, s_in, t_in, s, t)
                    if kind == "tolerant" and s_in and t_in:
                        tol_idx.append(i)
                        tol_src.append(_to_float(s))
                        tol_tgt.append(_to_float(t))
                        tol_atol.append(atol)
                        tol_rtol.append(rtol)
                        # A value that is not a number at all (a string, null) must equal its counterpart.
                        tol_odd.append(not (_is_number(s) and _is_number(t)) and not _equal(s, t))

    n = len(cols["case"])
    finite_ok = np.ones(n, dtype=bool)
    excess = np.zeros(n, dtype=np.float64)
    abs_err = np.full(n, np.nan, dtype=np.float64)
    if tol_idx:
        idx = np.asarray(tol_idx)
        s_arr, t_arr = np.asarray(tol_src), np.asarray(tol_tgt)
        s_fin, t_fin = np.isfinite(s_arr), np.isfinite(t_arr)
        both = s_fin & t_fin
        # Non-finite values must match exactly: NaN with NaN, +Inf with +Inf.
        same_nonfinite = ~s_fin & ~t_fin & ((np.isnan(s_arr) & np.isnan(t_arr)) | (s_arr == t_arr))
        finite_ok[idx] = (both | same_nonfinite) & ~np.asarray(tol_odd, dtype=bool)
        with np.errstate(invalid="ignore"):
            err = np.abs(s_arr - t_arr)
            allowed = np.asarray(tol_atol) + np.asarray(tol_rtol) * np.abs(s_arr)
        # Excess is only defined where both are finite; elsewhere finite_ok carries the verdict.
        excess[idx] = np.where(both, err - allowed, 0.0)
        abs_err[idx] = np.where(both, err, np.nan)
    frame = pd.DataFrame({k: cols[k] for k in FRAME_COLUMNS if k not in ("finite_ok", "excess", "abs_err")})
    frame["finite_ok"] = finite_ok
    frame["excess"] = excess
    frame["abs_err"] = abs_err
    frame["position"] = frame["position"].astype("int64")
    for name in ("in_source", "in_target", "exact_equal"):
        frame[name] = frame[name].astype(bool)
    return frame[list(FRAME_COLUMNS)]


def failing_mask(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per check, which rows fail it (nulls fail). The fast path's whole judgement."""
    masks: dict[str, np.ndarray] = {}
    for check in CHECKS:
        col = frame[check.column]
        if check.kind == "true":
            ok = col.notna().to_numpy() & (col.to_numpy() == True)  # noqa: E712 (object columns too)
        else:
            values = pd.to_numeric(col, errors="coerce").to_numpy(dtype=np.float64)
            with np.errstate(invalid="ignore"):
                ok = values <= 0  # NaN compares False: a null excess fails
        masks[check.column] = ~ok
    return masks


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field_reasons(case: str, name: str, group: pd.DataFrame, masks: dict[str, np.ndarray], rules: Rules) -> list[str]:
    idx = group.index.to_numpy()
    reasons: list[str] = []
    n_src, n_tgt = int(group["in_source"].sum()), int(group["in_target"].sum())
    if rules.required and n_src == n_tgt == 0:
        reasons.append(f"case {case}: field '{name}' is missing from the answers of both source and target "
                       "(parity.request.compare names it)")  # fmt: skip
    elif rules.required and n_src == 0:
        reasons.append(f"case {case}: field '{name}' is missing from the source's answer "
                       "(parity.request.compare names it)")  # fmt: skip
    elif n_src != n_tgt:
        if n_tgt == 0:
            reasons.append(
                f"case {case}: field '{name}' is missing on the target ({_plural(n_src, 'value')} on the source)"
            )
        elif n_src == 0:
            reasons.append(
                f"case {case}: field '{name}' is extra on the target ({_plural(n_tgt, 'value')}, none on the source)"
            )
        else:
            reasons.append(
                f"case {case}: shape change in '{name}': {_plural(n_src, 'value')} on the source, {n_tgt} on the target"
            )
    bad = idx[masks["exact_equal"][idx] & group["in_source"].to_numpy() & group["in_target"].to_numpy()]
    if len(bad):
        first = group.loc[bad[0]]
        reasons.append(
            f"case {case}: '{name}' differs at {len(bad)} of {min(n_src, n_tgt)} positions; first at position "
            f"{int(first['position'])}: source {_fmt(first['source_value'])}, target {_fmt(first['target_value'])}"
        )
    bad = idx[masks["finite_ok"][idx]]
    if len(bad):
        first = group.loc[bad[0]]
        reasons.append(
            f"case {case}: '{name}' is non-finite or mismatched at {_plural(len(bad), 'position')}; first at position "
            f"{int(first['position'])}: source {_fmt(_to_float(first['source_value']))}, "
            f"target {_fmt(_to_float(first['target_value']))}"
        )
    bad = idx[masks["excess"][idx]]
    if len(bad):
        worst = group.loc[bad].sort_values("excess", ascending=False).iloc[0]
        s = _to_float(worst["source_value"])
        atol, rtol = rules.tolerance(name)
        reasons.append(
            f"case {case}: '{name}' outside tolerance at {_plural(len(bad), 'position')}; worst at position "
            f"{int(worst['position'])}: source {_fmt(s)}, target {_fmt(_to_float(worst['target_value']))}, "
            f"abs err {_fmt(float(worst['abs_err']))} > allowed {_fmt(atol + rtol * abs(s))} "
            f"(atol {atol:g} + rtol {rtol:g} * |source|)"
        )
    return reasons


def _per_case_max(codes: np.ndarray, n_cases: int, values: np.ndarray, use: np.ndarray) -> list[float | None]:
    """Largest of ``values`` per case over the rows in ``use`` (None where a case has none)."""
    best = np.full(n_cases, -np.inf)
    np.maximum.at(best, codes[use], values[use])
    return [float(v) if np.isfinite(v) else None for v in best]


def evaluate(frame: pd.DataFrame, rules: Rules) -> Verdict:
    """Judge a frame with numpy: the fast path, and the source of readable reasons for both paths.

    Verdicts and per-case maxima are vectorised; readable reasons are built only for failing cases,
    so a passing live probe costs about a millisecond.
    """
    frame = frame.reset_index(drop=True)  # reasons index rows by position
    masks = failing_mask(frame)
    any_bad = np.zeros(len(frame), dtype=bool)
    for mask in masks.values():
        any_bad |= mask
    codes, uniques = pd.factorize(frame["case"], sort=False)
    n_cases = len(uniques)
    bad_case = np.zeros(n_cases, dtype=bool)
    np.logical_or.at(bad_case, codes, any_bad)
    errs = frame["abs_err"].to_numpy(dtype=np.float64)
    measured = ~np.isnan(errs)  # tolerant values finite on both sides
    max_abs = _per_case_max(codes, n_cases, errs, measured)
    max_exc = _per_case_max(codes, n_cases, frame["excess"].to_numpy(dtype=np.float64), measured)
    per_case: dict[str, CaseVerdict] = {}
    failures: list[str] = []
    for i, case in enumerate(uniques):
        verdict = CaseVerdict(case=str(case), passed=not bad_case[i], max_abs_err=max_abs[i], max_excess=max_exc[i])
        if not verdict.passed:
            verdict.reasons = _case_reasons(str(case), frame[codes == i], masks, any_bad, rules)
        per_case[str(case)] = verdict
        failures.extend(verdict.reasons)
    if frame.empty:
        failures.append("no cases were compared: the golden set produced no output rows")
    return Verdict(
        passed=not frame.empty and not bool(any_bad.any()),
        cases=n_cases,
        max_abs_err=float(errs[measured].max()) if measured.any() else None,
        failures=failures,
        per_case=per_case,
        failed_checks={name: int(mask.sum()) for name, mask in masks.items() if mask.any()},
    )


def _case_reasons(
    case: str, group: pd.DataFrame, masks: dict[str, np.ndarray], any_bad: np.ndarray, rules: Rules
) -> list[str]:
    presence = group[group["field"] == CASE_FIELD].iloc[0]
    if not presence["in_target"]:
        return [f"case {case}: missing on the target (no output row for this golden case)"]
    if not presence["in_source"]:
        return [f"case {case}: extra on the target (the source has no such case)"]
    reasons: list[str] = []
    for name, fgroup in group[group["field"] != CASE_FIELD].groupby("field", sort=False):
        if any_bad[fgroup.index.to_numpy()].any():
            reasons.extend(_field_reasons(case, str(name), fgroup, masks, rules))
    return reasons or [f"case {case}: failed a parity check"]  # never a silent failure
