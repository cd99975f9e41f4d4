"""Parity reports kept in the migration's artifacts: ``parity.json``, ``parity.html``, GX's result JSON.

The HTML is self-contained (no scripts, no external assets) so it opens from a Prefect artifact link,
a CI artifact store or a laptop. Every value is HTML-escaped; URLs are written without credentials.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumigrate.atomic import atomic_write_bytes, atomic_write_json
from gpumigrate.parity.rules import ABSENT, Rules, Verdict, field_value

if TYPE_CHECKING:
    from gpumigrate.parity.gx_suite import GXOutcome
    from gpumigrate.parity.result import OutputParityResult

REPORT_VERSION = 1
SHOW_VALUES = 24  # values per field shown in the HTML; the JSON keeps the per-case verdicts

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0;width:100%}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left;font-size:13px}
th{background:#f3f3f3} .pass{color:#176617;font-weight:bold} .fail{color:#a11;font-weight:bold}
code{font-size:12px;word-break:break-all} .reason{color:#a11}
"""


def _fmt_num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _values(row: Mapping[str, Any] | None, name: str) -> str:
    if row is None:
        return "(no row)"
    value = field_value(row, name)
    if value is None or value is ABSENT:
        return "(absent)"
    if isinstance(value, list | tuple):
        shown = ", ".join(f"{v:.5g}" if isinstance(v, float) else str(v) for v in value[:SHOW_VALUES])
        more = f" … (+{len(value) - SHOW_VALUES})" if len(value) > SHOW_VALUES else ""
        return f"[{shown}{more}] ({len(value)} value{'' if len(value) == 1 else 's'})"
    return str(value)[:400]


def render_html(
    result: OutputParityResult,
    verdict: Verdict,
    rules: Rules,
    source_rows: Sequence[Mapping[str, Any]],
    target_rows: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any],
    gx_outcome: GXOutcome | None,
) -> str:
    esc = html.escape
    src = {str(r.get("id")): r for r in source_rows}
    tgt = {str(r.get("id")): r for r in target_rows}
    fields = [
        f
        for f in (*rules.exact_fields, *rules.tolerant_fields)
        if any(field_value(r, f) is not ABSENT for r in (*source_rows, *target_rows))
    ]
    status = '<span class="pass">PASSED</span>' if result.passed else '<span class="fail">FAILED</span>'
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>gpumigrate output parity</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Output parity: {status}</h1>",
        "<table>",
        f"<tr><th>source</th><td>{esc(str(meta.get('source_url', '—')))}</td></tr>",
        f"<tr><th>target</th><td>{esc(str(meta.get('target_url', '—')))}</td></tr>",
        f"<tr><th>golden inputs</th><td>{esc(str(meta.get('inputs', '—')))}</td></tr>",
        f"<tr><th>cases</th><td>{result.cases}</td></tr>",
        f"<tr><th>max abs err</th><td>{_fmt_num(result.max_abs_err)}</td></tr>",
        f"<tr><th>tolerance</th><td>|source − target| ≤ {rules.atol:g} + {rules.rtol:g}·|source| "
        f"for {esc(', '.join(rules.tolerant_fields))}; exact for {esc(', '.join(rules.exact_fields))}</td></tr>",
        f"<tr><th>judged by</th><td>{esc(result.judged_by)} in {result.judge_seconds:.3f} s "
        f"(whole check {result.seconds:.3f} s)</td></tr>",
        "</table>",
    ]
    if gx_outcome is not None:
        failed = gx_outcome.failed_expectations
        out.append(f"<p>Great Expectations suite: {'all expectations met' if not failed else esc('; '.join(failed))}"
                   " (full result in parity-gx-validation.json)</p>")  # fmt: skip
    if result.failures:
        out.append("<h2>Failures</h2><ul>")
        out += [f"<li class='reason'>{esc(reason)}</li>" for reason in result.failures]
        out.append("</ul>")
    out.append("<h2>Cases</h2><table><tr><th>case</th><th>verdict</th><th>max abs err</th><th>max excess</th>"
               "<th>field</th><th>source</th><th>target</th></tr>")  # fmt: skip
    for case, cv in verdict.per_case.items():
        span = max(1, len(fields))
        mark = '<span class="pass">pass</span>' if cv.passed else '<span class="fail">FAIL</span>'
        for i, name in enumerate(fields or ["—"]):
            head = ""
            if i == 0:
                reasons = "".join(f"<div class='reason'>{esc(r)}</div>" for r in cv.reasons)
                head = (f"<td rowspan={span}><code>{esc(case)}</code></td><td rowspan={span}>{mark}{reasons}</td>"
                        f"<td rowspan={span}>{_fmt_num(cv.max_abs_err)}</td>"
                        f"<td rowspan={span}>{_fmt_num(cv.max_excess)}</td>")  # fmt: skip
            out.append(f"<tr>{head}<td>{esc(name)}</td><td><code>{esc(_values(src.get(case), name))}</code></td>"
                       f"<td><code>{esc(_values(tgt.get(case), name))}</code></td></tr>")  # fmt: skip
    out.append("</table>")
    out.append(f"<p><small>written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by gpumigrate</small></p>")
    out.append("</body></html>")
    return "\n".join(out)


def write_reports(
    out_dir: Path,
    *,
    result: OutputParityResult,
    verdict: Verdict,
    rules: Rules,
    gx_outcome: GXOutcome | None,
    source_rows: Sequence[Mapping[str, Any]],
    target_rows: Sequence[Mapping[str, Any]],
    meta: dict[str, Any],
) -> dict[str, str]:
    """Write the three files atomically; return name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "parity.json", "html": out_dir / "parity.html"}
    if gx_outcome is not None:
        paths["gx"] = out_dir / "parity-gx-validation.json"
        atomic_write_json(paths["gx"], gx_outcome.result_json)
    artifacts = {name: str(p) for name, p in paths.items()}
    doc = {
        "version": REPORT_VERSION,
        **result.to_dict(),
        "artifacts": artifacts,
        "rules": {
            "atol": rules.atol,
            "rtol": rules.rtol,
            "exact_fields": list(rules.exact_fields),
            "tolerant_fields": list(rules.tolerant_fields),
        },  # fmt: skip
        "failed_checks": verdict.failed_checks,
        "gx_failed_expectations": gx_outcome.failed_expectations if gx_outcome else None,
        "meta": meta,
        "per_case": [
            {
                "case": cv.case,
                "passed": cv.passed,
                "max_abs_err": cv.max_abs_err,
                "max_excess": cv.max_excess,
                "reasons": cv.reasons,
            }
            for cv in verdict.per_case.values()
        ],  # fmt: skip
    }
    atomic_write_json(paths["json"], doc)
    page = render_html(result, verdict, rules, source_rows, target_rows, meta, gx_outcome)
    atomic_write_bytes(paths["html"], page.encode("utf-8"))
    return artifacts
