"""How parity asks a workload its golden questions and which answers it compares: the plan's ``parity.request``.

One definition for every caller: the smoke test (``output.run_output_parity``) and the ramp's live probes
(the flow gives ``traffic``'s prober the queries of :func:`build_requests` and the comparator of
:func:`comparator_for`), so the probes ask exactly what the smoke test asked and judge it the same way.
Format: ``FORMAT.md`` beside this file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.interfaces import ParityQuery
from gpumigrate.parity.comparator import ToleranceComparator
from gpumigrate.parity.rules import Rules
from gpumigrate.plan import ParityRequest, StreamRequest

if TYPE_CHECKING:
    import httpx

    from gpumigrate.parity.golden import GoldenCase


def _fill(template: Any, case: GoldenCase, values: Mapping[str, Any]) -> Any:
    """The template with every string that is exactly ``{name}`` replaced by the case's value of ``name``."""
    if isinstance(template, str) and len(template) > 2 and template[0] == "{" and template[-1] == "}":
        name = template[1:-1]
        if name.isidentifier():
            if name not in values:
                raise InvalidInputError(
                    f"golden case {case.id}: parity.request.body uses {{{name}}}, and the case has no {name!r} "
                    f"(it has {', '.join(sorted(values)) or 'nothing'})"
                )
            return values[name]
    if isinstance(template, Mapping):
        return {k: _fill(v, case, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, case, values) for v in template]
    return template


def _params(body: Any, case: GoldenCase) -> dict[str, str]:
    """A GET asks through the query string: each top-level member, strings as is, others as JSON."""
    if not isinstance(body, Mapping):
        raise InvalidInputError(f"golden case {case.id}: a GET request needs an object of query parameters")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in body.items()}


def build_requests(cases: Sequence[GoldenCase], request: ParityRequest) -> list[ParityQuery]:
    """One request per golden case. ``body: null`` sends the case without its id; otherwise the template,
    filled from the case (``{id}`` included). Raises InvalidInputError naming the case for a placeholder
    the case cannot fill: nothing is sent."""
    out: list[ParityQuery] = []
    for case in cases:
        values = {"id": case.id, **case.request}
        body = dict(case.request) if request.body is None else _fill(request.body, case, values)
        get = request.method == "GET"
        out.append(ParityQuery(case=case.id, method=request.method, path=request.path,
                               body=None if get else body, params=_params(body, case) if get else {},
                               headers=dict(request.headers)))  # fmt: skip
    return out


def stream_bodies(cases: Sequence[GoldenCase], stream: StreamRequest) -> list[Any]:
    """The bodies of the plan's streamed request (``parity.stream``), one per golden case (the template filled from
    it), or the body as it is when there are no cases; InvalidInputError names a placeholder a case cannot fill."""
    if not cases:
        return [stream.body]
    return [_fill(stream.body, case, {"id": case.id, **case.request}) for case in cases]


def rules_for(request: ParityRequest, *, atol: float, rtol: float) -> Rules:
    """The comparison the plan's ``compare`` list asks for: numeric fields within their atol/rtol (the field's
    own, else the plan's), exact fields equal; every listed field required in every answer."""
    exact = tuple(f.field for f in request.compare if f.kind == "exact")
    numeric = [f for f in request.compare if f.kind == "numeric"]
    tolerances = tuple(
        (f.field, atol if f.atol is None else f.atol, rtol if f.rtol is None else f.rtol) for f in numeric
    )
    return Rules(atol=atol, rtol=rtol, exact_fields=exact, tolerant_fields=tuple(f.field for f in numeric),
                 tolerances=tolerances, required=True)  # fmt: skip


def comparator_for(request: ParityRequest, *, atol: float, rtol: float) -> ToleranceComparator:
    """The fast comparator for live probes, judging by the same rules as the smoke test."""
    return ToleranceComparator(rules=rules_for(request, atol=atol, rtol=rtol))


def ask(client: httpx.Client, query: ParityQuery) -> tuple[dict[str, Any] | None, str | None]:
    """Send one query; (the JSON answer, None) or (None, why not), the why naming method and path."""
    import httpx

    what = f"{query.method} {query.path}"
    try:
        resp = client.request(query.method, query.path, json=query.body, params=dict(query.params) or None,
                              headers=dict(query.headers))  # fmt: skip
    except httpx.HTTPError as exc:
        return None, f"{what}: request failed: {type(exc).__name__}: {exc}"
    if resp.status_code == 404:
        return None, f"{what} answered HTTP 404: the service has no such path (parity.request.path)"
    if resp.status_code != 200:
        return None, f"{what} answered HTTP {resp.status_code}: {resp.text[:200]}"
    try:
        answer = resp.json()
    except ValueError:
        return None, f"{what}: the answer is not JSON"
    if not isinstance(answer, dict):
        return None, f"{what}: the answer is not a JSON object"
    return answer, None
