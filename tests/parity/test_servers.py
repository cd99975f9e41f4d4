"""Output and environment parity against real inference-server processes (the workloads' reference server)."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumigrate.errors import ParityError
from gpumigrate.parity.comparator import GXComparator, ToleranceComparator
from gpumigrate.parity.environment import (
    EnvironmentParityError,
    check_environment,
    fetch_info,
    normalize_facts,
    run_probe,
)
from gpumigrate.parity.output import load_golden, query_outputs, run_output_parity

ATOL, RTOL = 1e-4, 1e-3


def test_same_weights_with_a_different_thread_count_pass(source_server, twin_server, golden_small: Path,
                                                         tmp_path: Path) -> None:  # fmt: skip
    result = run_output_parity(source_server.url, twin_server.url, golden_small, atol=ATOL, rtol=RTOL, out_dir=tmp_path)
    assert result.passed, result.failures
    assert result.cases == 6 and result.judged_by == "great_expectations"
    assert result.max_abs_err is not None and result.max_abs_err <= ATOL + RTOL * 20
    assert json.loads((tmp_path / "parity.json").read_text())["passed"] is True
    assert "PASSED" in (tmp_path / "parity.html").read_text()


def test_different_weights_fail(source_server, other_seed_server, golden_small: Path, tmp_path: Path) -> None:
    result = run_output_parity(source_server.url, other_seed_server.url, golden_small, atol=ATOL, rtol=RTOL,
                               out_dir=tmp_path)  # fmt: skip
    assert not result.passed
    assert any("'tokens' differs" in f or "outside tolerance" in f for f in result.failures)


def test_drifted_outputs_fail(source_server, drifted_twin: str, golden_small: Path, tmp_path: Path) -> None:
    result = run_output_parity(source_server.url, drifted_twin, golden_small, atol=ATOL, rtol=RTOL, out_dir=tmp_path)
    assert not result.passed and result.cases == 6
    assert result.max_abs_err is not None and result.max_abs_err > ATOL


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("nan", "case greeting: 'logprobs' is non-finite or mismatched at 1 position; first at position 0"),
        ("inf", "case greeting: 'logprobs' is non-finite or mismatched at 1 position; first at position 0"),
        ("truncate", "case greeting: shape change in 'tokens': 6 values on the source, 5 on the target"),
        ("drop_logprobs", "case greeting: field 'logprobs' is missing on the target (6 values on the source)"),
        ("error", "case greeting: missing on the target (no output row for this golden case)"),
    ],
)
def test_damaged_target_fails_with_a_readable_reason(
    source_server, damaged_target: Callable[[str, str], str], golden_small: Path, mode: str, expected: str
) -> None:
    target = damaged_target(mode, "hello world")  # only the "greeting" case is damaged
    result = run_output_parity(source_server.url, target, golden_small, atol=ATOL, rtol=RTOL, out_dir=None)
    assert not result.passed
    assert any(expected in f for f in result.failures), result.failures
    assert all(f.startswith("case greeting") for f in result.failures)
    if mode == "error":
        assert any("the target did not answer: POST /v1/generate answered HTTP 500" in f for f in result.failures)


def test_undamaged_proxy_passes(source_server, damaged_target, golden_small: Path) -> None:
    target = damaged_target("none", "")
    assert run_output_parity(source_server.url, target, golden_small, atol=ATOL, rtol=RTOL, out_dir=None).passed


def test_live_probe_fast_path_agrees_with_gx_on_real_outputs(source_server, twin_server, drifted_twin,
                                                             golden_small: Path) -> None:  # fmt: skip
    cases = load_golden(golden_small)[:3]
    src_rows, src_err = query_outputs(source_server.url, cases)
    tgt_rows, tgt_err = query_outputs(drifted_twin, cases)
    assert not src_err and not tgt_err
    fast = ToleranceComparator(ATOL, RTOL).compare(src_rows, tgt_rows)
    gx = GXComparator(ATOL, RTOL).compare(src_rows, tgt_rows)
    assert not fast.passed and fast == gx


def test_unreachable_source_is_a_parity_error(twin_server, golden_small: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ParityError, match="nothing to compare the target against"):
        run_output_parity(dead, twin_server.url, golden_small, atol=ATOL, rtol=RTOL, out_dir=None)


def test_unreachable_target_fails_every_case(source_server, golden_small: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = run_output_parity(source_server.url, dead, golden_small, atol=ATOL, rtol=RTOL, out_dir=None)
    assert not result.passed and result.cases == 6
    assert sum("missing on the target" in f for f in result.failures) == 6


def test_environment_of_twin_passes_and_other_weights_are_denied(source_server, twin_server,
                                                                 other_seed_server) -> None:  # fmt: skip
    src = fetch_info(source_server.url)
    twin = check_environment(src, fetch_info(twin_server.url), {})
    assert twin.passed, twin.violations
    assert "threads" in [d.field for d in twin.notes]
    other = check_environment(src, fetch_info(other_seed_server.url), {"weights_digest": "must_match"})
    assert {"weights_digest", "model"} <= {d.field for d in other.violations}
    with pytest.raises(EnvironmentParityError, match="weights_digest"):
        other.raise_if_forbidden()


def test_host_probe_speaks_the_same_vocabulary_as_the_servers_info(source_server) -> None:
    """Preflight compares a running source with a bare host's probe: host facts only, same names."""
    probe = run_probe([sys.executable, "-m", "gpumigrate.parity.probe"], timeout_s=120)
    info = fetch_info(source_server.url)
    report = check_environment(info, probe, {}, scope="host")
    assert report.passed, report.violations
    assert {"torch", "gpu_model", "python", "lightning"} <= set(report.compared)
    assert normalize_facts(probe)["torch"] == normalize_facts(info)["torch"]
    assert not check_environment(info, {**probe, "torch": "0.0.1"}, {}, scope="host").passed
