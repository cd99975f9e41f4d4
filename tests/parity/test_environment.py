"""Environment parity: policy decisions, the probe as a real process, and the error a forbidden difference raises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpumigrate.errors import EXIT_INVALID, InvalidInputError, ParityError, PolicyDeniedError
from gpumigrate.parity.environment import EnvironmentParityError, check_environment, normalize_facts, run_probe
from gpumigrate.plan import load_plan

FACTS = {
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "lightning": "2.6.6",
    "torch_cuda": "13.0",
    "cudnn": 91000,
    "num_threads": 1,
    "gpu_model": "NVIDIA H100 80GB HBM3",
    "gpu_memory_bytes": 85_000_000_000,
    "driver_version": "580.159",
    "env": {"OMP_NUM_THREADS": "1"},
    "weights_digest": "blake3:aaaa",
    "model": "tinylm-tiny-float32-s0",
    "dtype": "float32",
    "host": "src",
    "pid": 11,
}


def test_identical_environments_pass_even_with_different_hosts() -> None:
    report = check_environment(FACTS, {**FACTS, "host": "dst", "pid": 99}, {})
    assert report.passed and not report.violations and not report.notes
    assert "weights_digest" in report.compared and "host" not in report.compared


def test_different_weights_violate_the_default_policy_and_deny_with_exit_2() -> None:
    report = check_environment(FACTS, {**FACTS, "weights_digest": "blake3:bbbb"}, {})
    assert not report.passed
    assert [d.field for d in report.violations] == ["weights_digest"]
    with pytest.raises(EnvironmentParityError) as info:
        report.raise_if_forbidden()
    err = info.value
    assert isinstance(err, PolicyDeniedError) and isinstance(err, ParityError)
    assert err.exit_code == EXIT_INVALID and err.rule == "environment-parity"
    assert "weights_digest: source 'blake3:aaaa', target 'blake3:bbbb' (must_match)" in str(err)


def test_driver_may_differ_by_default_with_a_note() -> None:
    report = check_environment(FACTS, {**FACTS, "driver_version": "575.51"}, {})
    assert report.passed
    assert [d.field for d in report.notes] == ["driver"]
    assert "output parity decides" in report.notes[0].note


def test_the_plan_policy_overrides_defaults_field_by_field() -> None:
    target = {**FACTS, "driver_version": "575.51", "weights_digest": "blake3:bbbb"}
    report = check_environment(FACTS, target, {"driver": "must_match", "weights_digest": "may_differ"})
    assert [d.field for d in report.violations] == ["driver"]
    assert [d.field for d in report.notes] == ["weights_digest"]


def test_env_vars_can_be_required_to_match() -> None:
    target = {**FACTS, "env": {"OMP_NUM_THREADS": "4"}}
    assert check_environment(FACTS, target, {}).passed
    report = check_environment(FACTS, target, {"env.OMP_NUM_THREADS": "must_match"})
    assert [d.field for d in report.violations] == ["env.OMP_NUM_THREADS"]


def test_a_must_match_fact_unknown_on_the_target_is_a_violation() -> None:
    target = {k: v for k, v in FACTS.items() if k != "gpu_model"}
    report = check_environment(FACTS, target, {})
    assert [d.field for d in report.violations] == ["gpu_model"]
    assert report.violations[0].note == "unknown on the target"


def test_less_gpu_memory_on_the_target_is_noted() -> None:
    report = check_environment(FACTS, {**FACTS, "gpu_memory_bytes": 40_000_000_000}, {})
    assert report.passed and "LESS GPU memory" in report.notes[0].note


def test_policy_values_are_validated() -> None:
    with pytest.raises(InvalidInputError, match="must_match or may_differ"):
        check_environment(FACTS, FACTS, {"torch": "sometimes"})


def test_aliases_map_onto_the_policy_vocabulary() -> None:
    facts = normalize_facts({"torch_version": "2", "driver_version": "580", "num_threads": 2, "env": {"A": "1"}})
    assert facts == {"torch": "2", "driver": "580", "threads": 2, "env.A": "1"}


def test_the_demo_plans_policy_forbids_a_torch_difference(repo: Path) -> None:
    plan = load_plan(repo / "examples" / "local-demo.yaml")
    report = check_environment(FACTS, {**FACTS, "torch": "2.12.0+cpu"}, plan.parity.environment)
    assert [d.field for d in report.violations] == ["torch"]


def test_probe_runs_as_a_process_and_digests_weights(tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\x01" * 1000)
    cmd = [sys.executable, "-m", "gpumigrate.parity.probe", "--no-torch", "--weights", str(weights)]
    facts = run_probe(cmd, timeout_s=60)
    assert facts["python"].startswith("3.") and facts["gpu_model"] == "none"
    assert len(facts["weights_digest"]) == 64
    assert check_environment(facts, facts, {}).passed
    # The probe reports only allow-listed environment variables, never secrets.
    env = {"GPUMIGRATE_DEMO_KEY": "s3cret", "OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "gpumigrate.parity.probe", "--no-torch"], capture_output=True,
                         text=True, timeout=60, env=env, check=True)  # fmt: skip
    assert "s3cret" not in out.stdout
    assert json.loads(out.stdout)["env"] == {"OMP_NUM_THREADS": "3"}


def test_a_failing_probe_is_a_parity_error() -> None:
    with pytest.raises(ParityError, match="exited 2"):
        run_probe([sys.executable, "-m", "gpumigrate.parity.probe", "--weights", "/nonexistent"], timeout_s=60)
    with pytest.raises(ParityError, match="JSON object"):
        run_probe([sys.executable, "-c", "print('hello')"], timeout_s=60)


def test_host_scope_skips_workload_facts_a_fresh_target_cannot_know() -> None:
    host_probe = {k: v for k, v in FACTS.items() if k not in ("weights_digest", "model", "dtype", "num_threads")}
    assert not check_environment(FACTS, host_probe, {}).passed  # a running workload must report them
    report = check_environment(FACTS, host_probe, {}, scope="host")
    assert report.passed and "weights_digest" not in report.compared
    denied = check_environment(FACTS, {**host_probe, "torch": "2.9.0"}, {}, scope="host")
    assert [d.field for d in denied.violations] == ["torch"]


def test_secret_looking_env_vars_are_compared_by_digest_never_written(tmp_path: Path) -> None:
    src = {**FACTS, "env": {"HF_TOKEN": "hf_supersecret", "OMP_NUM_THREADS": "1"}}
    tgt = {**FACTS, "env": {"HF_TOKEN": "hf_othersecret", "OMP_NUM_THREADS": "1"}}
    assert check_environment(src, src, {"env.HF_TOKEN": "must_match"}).passed
    report = check_environment(src, tgt, {"env.HF_TOKEN": "must_match"})
    assert [d.field for d in report.violations] == ["env.HF_TOKEN"]
    report.write(tmp_path / "environment.json")
    written = (tmp_path / "environment.json").read_text()
    assert "supersecret" not in written and "othersecret" not in written and "redacted sha256:" in written
    with pytest.raises(EnvironmentParityError) as info:
        report.raise_if_forbidden()
    assert "supersecret" not in str(info.value)


@pytest.mark.gpu
def test_probe_reports_the_gpu_driver_and_cuda_on_a_gpu_host() -> None:
    facts = normalize_facts(run_probe([sys.executable, "-m", "gpumigrate.parity.probe"], timeout_s=180))
    assert facts["gpu_model"] != "none" and facts["gpu_memory_bytes"] > 0
    assert facts["driver"] and facts["cuda"] and facts["cudnn"]
    changed = check_environment(facts, {**facts, "gpu_model": "NVIDIA A10G"}, {})
    assert [d.field for d in changed.violations] == ["gpu_model"]
    assert check_environment(facts, {**facts, "driver": "0.0"}, {}).passed
