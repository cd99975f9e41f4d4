"""The GX suite and the fast path judge the same frame the same way; reports are written and readable."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from gpumigrate.parity.comparator import GXComparator, ToleranceComparator
from gpumigrate.parity.gx_suite import validate_frame
from gpumigrate.parity.output import compare_outputs, redact_url
from gpumigrate.parity.rules import Rules, build_frame, evaluate

ATOL, RTOL = 1e-4, 1e-3


def _case(cid: str, n: int, rng: random.Random) -> dict:
    return {"id": cid, "tokens": [rng.randrange(260) for _ in range(n)],
            "logprobs": [-rng.uniform(0.01, 8.0) for _ in range(n)]}  # fmt: skip


def _damage(rows: list[dict], kind: str, rng: random.Random) -> list[dict]:
    out = [dict(r, tokens=list(r["tokens"]), logprobs=list(r["logprobs"])) for r in rows]
    victim = out[rng.randrange(len(out))]
    pos = rng.randrange(len(victim["tokens"]))
    if kind == "tiny_noise":  # within tolerance everywhere
        for r in out:
            r["logprobs"] = [v * (1 + 1e-5) for v in r["logprobs"]]
    elif kind == "drift":
        victim["logprobs"][pos] += 0.5
    elif kind == "token":
        victim["tokens"][pos] = (victim["tokens"][pos] + 1) % 260
    elif kind == "nan":
        victim["logprobs"][pos] = math.nan
    elif kind == "inf":
        victim["logprobs"][pos] = -math.inf
    elif kind == "truncate":
        victim["tokens"].pop()
        victim["logprobs"].pop()
    elif kind == "grow":
        victim["tokens"].append(1)
        victim["logprobs"].append(-1.0)
    elif kind == "missing":
        out.remove(victim)
    elif kind == "extra":
        out.append({"id": "extra-case", "tokens": [1], "logprobs": [-1.0]})
    elif kind == "no_field":
        del victim["logprobs"]
    return out


KINDS = ["none", "tiny_noise", "drift", "token", "nan", "inf", "truncate", "grow", "missing", "extra", "no_field"]


@pytest.mark.parametrize("kind", KINDS)
def test_gx_and_fast_path_agree(kind: str) -> None:
    rng = random.Random(KINDS.index(kind))
    source = [_case(f"c{i}", rng.randrange(1, 9), rng) for i in range(5)]
    target = source if kind == "none" else _damage(source, kind, rng)
    fast = ToleranceComparator(ATOL, RTOL).compare(source, target)
    gx = GXComparator(ATOL, RTOL).compare(source, target)
    assert fast.passed == gx.passed == (kind in ("none", "tiny_noise"))
    assert fast.failures == gx.failures  # same frame, same readable reasons
    assert fast.max_abs_err == gx.max_abs_err


@pytest.mark.parametrize("kind", KINDS[1:])
def test_gx_flags_exactly_the_columns_the_rules_flag(kind: str) -> None:
    rules = Rules(atol=ATOL, rtol=RTOL)
    rng = random.Random(100 + KINDS.index(kind))
    source = [_case(f"c{i}", rng.randrange(2, 7), rng) for i in range(4)]
    frame = build_frame(source, _damage(source, kind, rng), rules)
    outcome = validate_frame(frame)
    gx_columns = {r["expectation_config"]["kwargs"].get("column") for r in outcome.result_json["results"]
                  if not r["success"]}  # fmt: skip
    assert gx_columns == set(evaluate(frame, rules).failed_checks)


def test_gx_and_fast_path_agree_on_random_damage() -> None:
    rng = random.Random(7)
    for trial in range(12):  # bounded: ~20 ms per GX validation
        source = [_case(f"t{trial}-{i}", rng.randrange(1, 6), rng) for i in range(3)]
        target = _damage(source, rng.choice(KINDS[1:]), rng)
        fast = ToleranceComparator(ATOL, RTOL).compare(source, target)
        gx = GXComparator(ATOL, RTOL).compare(source, target)
        assert fast.passed == gx.passed, (trial, fast.failures)


def test_reports_are_written_with_verdicts_per_case(tmp_path: Path) -> None:
    rng = random.Random(3)
    source = [_case(f"case-{i}", 4, rng) for i in range(3)]
    target = _damage(source, "nan", rng)
    meta = {"source_url": redact_url("http://user:hunter2@127.0.0.1:9/"), "target_url": "http://127.0.0.1:10"}
    result = compare_outputs(source, target, rules=Rules(atol=ATOL, rtol=RTOL), out_dir=tmp_path, meta=meta)
    assert not result.passed and result.judged_by == "great_expectations"
    assert set(result.artifacts) == {"json", "html", "gx"}
    doc = json.loads((tmp_path / "parity.json").read_text())
    assert doc["passed"] is False and doc["cases"] == 3 and doc["version"] == 1
    assert doc["failed_checks"] == {"finite_ok": 1}
    assert [c["passed"] for c in doc["per_case"]].count(False) == 1
    gx_doc = json.loads((tmp_path / "parity-gx-validation.json").read_text())
    assert gx_doc["success"] is False
    page = (tmp_path / "parity.html").read_text()
    assert "FAILED" in page and all(f"case-{i}" in page for i in range(3)) and "non-finite" in page
    everything = page + (tmp_path / "parity.json").read_text()
    assert "hunter2" not in everything and "user" not in meta["source_url"]


def test_fast_path_needs_no_great_expectations_files(tmp_path: Path) -> None:
    rng = random.Random(5)
    source = [_case("only", 3, rng)]
    result = compare_outputs(source, source, rules=Rules(), out_dir=tmp_path, use_gx=False)
    assert result.passed and result.judged_by == "rules"
    assert set(result.artifacts) == {"json", "html"}
    assert result.summary() == {"passed": True, "cases": 1, "max_abs_err": 0.0}
