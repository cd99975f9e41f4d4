"""parity.request: a service that is not the reference server, asked and judged the way its plan says.

The service here is the tests' own (an embeddings endpoint on real loopback sockets), so nothing in the
parity path can lean on the reference server's fields.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from gpumigrate.errors import InvalidInputError, ParityError
from gpumigrate.interfaces import ParityQuery
from gpumigrate.parity.output import load_golden, run_output_parity
from gpumigrate.parity.request import build_requests, comparator_for
from gpumigrate.parity.training import compare_losses, training_parity
from gpumigrate.plan import ParityRequest, TrainingParity


def _embed(sentence: str, drift: float) -> list[float]:
    digest = hashlib.sha256(sentence.encode()).digest()
    return [round(b / 255.0 - 0.5, 6) + drift for b in digest[:8]]


def embedder(*, drift: float = 0.0, route: str = "/v2/embed", flat_batch: bool = False) -> Any:
    """The service's routes: POST ``route`` embeds ``inputs`` (a tenant header required); GET /label echoes."""

    def answer(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        if method == "GET":
            query = parse_qs(urlsplit(path).query)
            return 200, {"label": query.get("text", [""])[0].upper(), "n": int(query.get("n", ["0"])[0])}
        if path != route:
            return 404, {"detail": "Not Found"}
        if headers.get("x-tenant") != "t1":
            return 403, {"detail": "tenant header missing"}
        req = json.loads(body)
        vectors = [_embed(s, drift) for s in req["inputs"]]
        batch = [v for vec in vectors for v in vec] if flat_batch else vectors  # flat: the same numbers, reshaped
        return 200, {"data": [{"embedding": v, "index": i} for i, v in enumerate(vectors)], "batch": batch,
                     "model": "mini", "usage": {"tokens": len(req["inputs"])}, "echo": req.get("tag")}  # fmt: skip

    return answer


@pytest.fixture
def source(json_http: Callable[[Any], str]) -> str:
    return json_http(embedder())


@pytest.fixture
def twin(json_http: Callable[[Any], str]) -> str:
    return json_http(embedder())


@pytest.fixture
def drifted(json_http: Callable[[Any], str]) -> str:
    return json_http(embedder(drift=1e-3))


@pytest.fixture
def other_route(json_http: Callable[[Any], str]) -> str:
    return json_http(embedder(route="/v3/embed"))


@pytest.fixture
def flat(json_http: Callable[[Any], str]) -> str:
    return json_http(embedder(flat_batch=True))


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    f = tmp_path / "golden.jsonl"
    f.write_text('{"id": "one", "text": "hello"}\n{"id": "two", "text": "world", "tag": "x"}\n')
    return f


def request(**over: Any) -> ParityRequest:
    doc: dict[str, Any] = {
        "method": "POST", "path": "/v2/embed", "body": {"inputs": ["{text}"], "tag": "{id}"},
        "headers": {"x-tenant": "t1"},
        "compare": [{"field": "data.0.embedding", "kind": "numeric"}, {"field": "model", "kind": "exact"},
                    {"field": "echo", "kind": "exact"}],
    }  # fmt: skip
    doc.update(over)
    return ParityRequest.model_validate(doc)


def test_each_golden_case_becomes_one_request(golden: Path) -> None:
    queries = build_requests(load_golden(golden), request())
    assert queries[1] == ParityQuery(case="two", method="POST", path="/v2/embed",
                                     body={"inputs": ["world"], "tag": "two"}, headers={"x-tenant": "t1"})  # fmt: skip
    as_is = build_requests(load_golden(golden), request(body=None))
    assert as_is[1].body == {"text": "world", "tag": "x"}  # body null: the case minus its id
    get = build_requests(load_golden(golden), request(method="GET", body={"text": "{text}", "n": 3}))
    assert get[0].body is None and get[0].params == {"text": "hello", "n": "3"}


def test_a_placeholder_the_case_cannot_fill_is_bad_input(golden: Path) -> None:
    with pytest.raises(InvalidInputError, match="golden case one: parity.request.body uses {prompt}"):
        build_requests(load_golden(golden), request(body={"inputs": ["{prompt}"]}))


def test_same_service_passes_on_named_fields(source: str, twin: str, golden: Path, tmp_path: Path) -> None:
    result = run_output_parity(source, twin, golden, atol=1e-6, rtol=0, out_dir=tmp_path, request=request())
    assert result.passed, result.failures
    doc = json.loads((tmp_path / "parity.json").read_text())
    assert doc["meta"]["path"] == "/v2/embed" and doc["rules"]["tolerant_fields"] == ["data.0.embedding"]


def test_numeric_drift_fails_naming_the_field_and_a_field_tolerance_admits_it(
    source: str, drifted: str, golden: Path
) -> None:
    failed = run_output_parity(source, drifted, golden, atol=1e-6, rtol=0, out_dir=None, use_gx=False,
                               request=request())  # fmt: skip
    assert not failed.passed
    assert any("'data.0.embedding' outside tolerance at 8 positions" in f for f in failed.failures), failed.failures
    wide = request(compare=[{"field": "data.0.embedding", "kind": "numeric", "atol": 2e-3}])
    assert run_output_parity(source, drifted, golden, atol=1e-6, rtol=0, out_dir=None, request=wide).passed


def test_a_missing_field_fails_naming_it(source: str, twin: str, golden: Path) -> None:
    ask = request(compare=[{"field": "data.0.score", "kind": "numeric"}])
    result = run_output_parity(source, twin, golden, atol=1e-6, rtol=0, out_dir=None, request=ask)
    assert not result.passed
    assert "case one: field 'data.0.score' is missing from the answers of both source and target" in result.failures[0]


def test_a_reshaped_batch_fails_even_with_the_same_numbers(source: str, flat: str, golden: Path) -> None:
    ask = request(compare=[{"field": "batch", "kind": "numeric"}])
    result = run_output_parity(source, flat, golden, atol=1e-6, rtol=0, out_dir=None, request=ask)
    assert not result.passed and any("'batch (shape)' differs" in f for f in result.failures), result.failures


def test_a_path_the_target_lacks_fails_naming_it(source: str, other_route: str, golden: Path) -> None:
    result = run_output_parity(source, other_route, golden, atol=1e-6, rtol=0, out_dir=None, request=request())
    assert not result.passed
    assert any("POST /v2/embed answered HTTP 404: the service has no such path (parity.request.path)" in f
               for f in result.failures), result.failures  # fmt: skip


def test_a_wrong_path_on_both_sides_names_it(source: str, twin: str, golden: Path) -> None:
    with pytest.raises(ParityError, match="POST /v2/embd answered HTTP 404"):
        run_output_parity(source, twin, golden, atol=1e-6, rtol=0, out_dir=None, request=request(path="/v2/embd"))


def test_get_requests_carry_the_case_in_the_query_string(source: str, twin: str, golden: Path) -> None:
    ask = request(method="GET", path="/label", body={"text": "{text}", "n": 2},
                  compare=[{"field": "label", "kind": "exact"}, {"field": "n", "kind": "exact"}])  # fmt: skip
    assert run_output_parity(source, twin, golden, atol=0, rtol=0, out_dir=None, request=ask).passed


def test_probe_comparator_judges_like_the_smoke_test() -> None:
    cmp = comparator_for(request(), atol=1e-6, rtol=0)
    src = [{"id": "p0", "data": [{"embedding": [0.1, 0.2]}], "model": "mini", "echo": "a"}]
    assert cmp.compare(src, src).passed
    bad = [{"id": "p0", "data": [{"embedding": [0.1, 0.3]}], "model": "mini", "echo": "a"}]
    report = cmp.compare(src, bad)
    assert not report.passed and "'data.0.embedding' outside tolerance" in report.failures[0]


def test_cli_checks_by_the_plan_and_by_options(
    source: str, twin: str, drifted: str, golden: Path, tmp_path: Path, repo: Path, cli_cmd: list[str], gm_home: Path
) -> None:
    plan = yaml.safe_load((repo / "examples" / "local-demo.yaml").read_text())
    plan["workload"]["endpoint"] = source
    plan["parity"]["golden_inputs"] = str(golden)
    plan["parity"]["request"] = request().model_dump(mode="json")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli_cmd, "parity", "check", *args, "--no-environment", "--fast", "--json"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    ok = check(str(plan_file), "--target", twin)
    assert ok.returncode == 0, ok.stderr
    bad = check(str(plan_file), "--target", drifted)
    assert bad.returncode == 1 and "data.0.embedding" in bad.stderr
    wrong = check(str(plan_file), "--target", twin, "--path", "/v2/nowhere")
    assert wrong.returncode == 1 and "POST /v2/nowhere answered HTTP 404" in wrong.stderr
    plain = check("--source", source, "--target", twin, "--inputs", str(golden), "--method", "get", "--path",
                  "/label", "--field", "label:exact")  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.splitlines()[-1])["passed"] is True


# ----------------------------------------------------------------------------- training
def test_losses_are_bit_exact_by_default(tmp_path: Path) -> None:
    losses = [2.302585, 2.1, 1.95]
    same = training_parity(losses, list(losses), TrainingParity(steps=3), out_dir=tmp_path)
    assert same.passed and same.cases == 3 and same.max_abs_err == 0.0
    assert json.loads((tmp_path / "parity.json").read_text())["meta"]["bit_exact"] is True
    one_ulp = [losses[0], float.__add__(losses[1], 2.220446049250313e-16 * 2), losses[2]]
    off = compare_losses(losses, one_ulp)
    assert not off.passed and "case step-1: 'loss' outside tolerance" in off.failures[0]
    assert compare_losses(losses, one_ulp, atol=1e-12).passed


def test_a_missing_step_or_a_nan_fails() -> None:
    assert "case step-2: missing on the target" in compare_losses([1.0, 0.9, 0.8], [1.0, 0.9]).failures[0]
    nan = compare_losses([1.0, 0.9], [1.0, float("nan")])
    assert not nan.passed and "non-finite" in nan.failures[0]
    with pytest.raises(InvalidInputError, match="target loss of step-1 is str, not a number"):
        compare_losses([1.0, 0.9], [1.0, "0.9"])  # type: ignore[list-item]
