"""Output parity: the golden set run against source and target directly, judged by the rules.

The flows call :func:`run_output_parity` in the parity phase with the services' own URLs (never
through Envoy, so a half-shifted split cannot hide a difference) and the plan's ``parity.request``
(how each golden case becomes a request, which answer fields are compared and how: ``request.py``).
Results go to the directory the caller gives (the migration's ``artifacts/``): ``parity.json``,
``parity.html`` and GX's validation result ``parity-gx-validation.json``. Formats: FORMAT.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from gpumigrate.errors import ParityError
from gpumigrate.interfaces import ParityQuery
from gpumigrate.parity.golden import GoldenCase, load_golden
from gpumigrate.parity.request import ask, build_requests, rules_for
from gpumigrate.parity.result import OutputParityResult
from gpumigrate.parity.rules import Rules, build_frame, evaluate
from gpumigrate.parity.urls import check_url, redact_url
from gpumigrate.plan import ParityRequest

__all__ = [
    "DEFAULT_PATH", "GoldenCase", "OutputParityResult", "check_url", "compare_outputs", "load_golden",
    "query_outputs", "redact_url", "run_output_parity",
]  # fmt: skip

# Until the integration wave makes parity.request required, a plan without one is asked as before: each
# case POSTed to this path and compared by the default rules. A plan with a request never uses it.
DEFAULT_PATH = "/v1/generate"


def _queries(cases: Sequence[GoldenCase], request: ParityRequest | None, path: str) -> list[ParityQuery]:
    if request is not None:
        return build_requests(cases, request)
    return [ParityQuery(case=c.id, method="POST", path=path, body=c.request) for c in cases]


def query_outputs(
    url: str,
    cases: Sequence[GoldenCase],
    *,
    request: ParityRequest | None = None,
    path: str = DEFAULT_PATH,
    timeout_s: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Ask ``url`` every case in order (``request``: the plan's parity.request). Returns (rows: the answers
    with their case id, errors by case id: each names the method and path)."""
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    timeout = timeout_s if timeout_s is not None else (request.timeout_s if request is not None else 30.0)
    with httpx.Client(base_url=url, timeout=timeout, trust_env=False) as client:
        for query in _queries(cases, request, path):
            answer, error = ask(client, query)
            if answer is None:
                errors[query.case] = str(error)
            else:
                rows.append({**answer, "id": query.case})
    return rows, errors


def compare_outputs(
    source_rows: Sequence[Mapping[str, Any]],
    target_rows: Sequence[Mapping[str, Any]],
    *,
    rules: Rules,
    out_dir: str | Path | None = None,
    use_gx: bool = True,
    target_errors: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
    started: float | None = None,
) -> OutputParityResult:
    """Judge rows already collected (by GX or the fast path) and write the reports to ``out_dir``.

    ``started`` is the ``time.perf_counter()`` at which the caller began (querying included).
    """
    t0 = time.perf_counter()
    frame = build_frame(source_rows, target_rows, rules)
    verdict = evaluate(frame, rules)
    gx_outcome = None
    passed = verdict.passed
    failures = list(verdict.failures)
    for cid, err in (target_errors or {}).items():
        failures.append(f"case {cid}: the target did not answer: {err}")
        if cid in verdict.per_case:
            verdict.per_case[cid].reasons.append(f"the target did not answer: {err}")
    if use_gx:
        from gpumigrate.parity.gx_suite import validate_frame

        gx_outcome = validate_frame(frame)
        if gx_outcome.success != verdict.passed:
            failures.append(
                f"GX suite and rules disagree (gx={gx_outcome.success}, rules={verdict.passed}): failing closed"
            )
        passed = passed and gx_outcome.success
    judge_seconds = time.perf_counter() - t0
    result = OutputParityResult(
        passed=passed, cases=verdict.cases, max_abs_err=verdict.max_abs_err, failures=failures,
        seconds=time.perf_counter() - (started if started is not None else t0), judge_seconds=judge_seconds,
        judged_by="great_expectations" if use_gx else "rules",
    )  # fmt: skip
    if out_dir is not None:
        from gpumigrate.parity.report import write_reports

        result.artifacts = write_reports(
            Path(out_dir), result=result, verdict=verdict, rules=rules, gx_outcome=gx_outcome,
            source_rows=source_rows, target_rows=target_rows, meta=dict(meta or {}),
        )  # fmt: skip
    return result


def run_output_parity(
    source_url: str,
    target_url: str,
    inputs_path: str | Path,
    *,
    atol: float,
    rtol: float,
    out_dir: str | Path | None,
    use_gx: bool = True,
    request: ParityRequest | None = None,
    path: str = DEFAULT_PATH,
    timeout_s: float | None = None,
    rules: Rules | None = None,
) -> OutputParityResult:
    """Run the golden set against both services directly and compare.

    ``request`` is the plan's ``parity.request`` (its path, body template, compared fields); without one,
    the cases are POSTed to ``path`` and judged by ``rules`` (default :class:`Rules`). Raises
    InvalidInputError (exit 2) for a bad URL, golden file or body template, ParityError (exit 1) when the
    source itself cannot answer (nothing to compare against; the message names the method and path). A
    target that fails a case (a 404 included) is a parity failure of that case, in the result.
    """
    t0 = time.perf_counter()
    source_url, target_url = check_url(source_url, "source"), check_url(target_url, "target")
    if rules is None:
        rules = rules_for(request, atol=atol, rtol=rtol) if request is not None else Rules(atol=atol, rtol=rtol)
    cases = load_golden(inputs_path)
    _queries(cases, request, path)  # a template the cases cannot fill is bad input before anything is sent
    ask_kw: dict[str, Any] = {"request": request, "path": path, "timeout_s": timeout_s}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="parity-query") as pool:
        src_future = pool.submit(query_outputs, source_url, cases, **ask_kw)
        tgt_future = pool.submit(query_outputs, target_url, cases, **ask_kw)
        source_rows, source_errors = src_future.result()
        target_rows, target_errors = tgt_future.result()
    if source_errors:
        first = next(iter(source_errors.items()))
        raise ParityError(
            f"the source {redact_url(source_url)} failed {len(source_errors)} of {len(cases)} golden cases "
            f"(first: case {first[0]}: {first[1]}): nothing to compare the target against"
        )
    meta = {"source_url": redact_url(source_url), "target_url": redact_url(target_url),
            "inputs": str(Path(inputs_path).resolve()), "method": request.method if request else "POST",
            "path": request.path if request else path}  # fmt: skip
    result = compare_outputs(
        source_rows,
        target_rows,
        rules=rules,
        out_dir=out_dir,
        use_gx=use_gx,
        target_errors=target_errors,
        meta=meta,
        started=t0,
    )
    return result
