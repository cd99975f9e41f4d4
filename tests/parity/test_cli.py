"""``gpumigrate parity check`` as a real subprocess: exit 0 pass, 1 parity failure, 2 bad input or denied."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

ATOL, RTOL = "1e-4", "1e-3"
# Without a plan, the request is named on the command line: the reference server's is no default.
ASK = ("--path", "/v1/generate", "--field", "tokens:exact", "--field", "text:exact", "--field", "logprobs:numeric")


def run(cli_cmd: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cli_cmd, "parity", "check", *args], capture_output=True, text=True, timeout=120)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_check_passes_for_same_weights(cli_cmd, gm_home: Path, source_server, twin_server, golden_small: Path,
                                       tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "out"
    proc = run(cli_cmd, "--source", source_server.url, "--target", twin_server.url, "--inputs", str(golden_small),
               "--atol", ATOL, "--rtol", RTOL, "--out", str(out), "--json", *ASK)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = last_json(proc)
    assert doc["passed"] is True and doc["cases"] == 6 and doc["judged_by"] == "great_expectations"
    assert doc["environment"]["checked"] is True and doc["environment"]["passed"] is True
    assert (out / "parity.html").is_file() and (out / "parity-gx-validation.json").is_file()
    assert "parity holds" in proc.stderr


def test_check_fails_with_exit_1_for_other_weights(cli_cmd, gm_home: Path, source_server, other_seed_server,
                                                   golden_small: Path) -> None:  # fmt: skip
    # --no-environment: the weights digest differs too, which would deny (exit 2) before outputs are compared.
    proc = run(cli_cmd, "--source", source_server.url, "--target", other_seed_server.url, "--inputs",
               str(golden_small), "--no-environment", "--fast", "--json", *ASK)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    doc = last_json(proc)
    assert doc["passed"] is False and doc["failures"] and doc["judged_by"] == "rules"
    assert "parity FAILED" in proc.stderr and "Traceback" not in proc.stderr
    assert Path(doc["artifacts"]["json"]).is_relative_to(gm_home)  # default --out is under GPUMIGRATE_HOME


def test_plan_forbidding_a_weights_difference_denies_with_exit_2(cli_cmd, gm_home: Path, repo: Path, source_server,
                                                                  other_seed_server, golden_small: Path,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    plan = yaml.safe_load((repo / "examples" / "local-demo.yaml").read_text())
    plan["workload"]["endpoint"] = source_server.url
    plan["parity"]["golden_inputs"] = str(golden_small)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    proc = run(cli_cmd, str(plan_file), "--target", other_seed_server.url, "--json")
    assert proc.returncode == 2, proc.stderr
    doc = last_json(proc)
    assert doc["denied"] == "environment-parity"
    assert "weights_digest" in {v["field"] for v in doc["environment"]["violations"]}
    assert "forbidden" in proc.stderr and "output parity not run" in proc.stderr
    assert Path(doc["environment"]["report"]).is_file()


def test_bad_inputs_are_exit_2_without_traceback(cli_cmd, gm_home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "max_new_tokens": 4}\nnot json\n')
    cases = [
        (["--source", "http://127.0.0.1:9", "--target", "http://127.0.0.1:9", "--inputs", str(bad), *ASK], "line 2"),
        (["--source", "http://127.0.0.1:9", "--inputs", str(bad)], "no target"),
        (["--source", "ftp://x", "--target", "http://127.0.0.1:9", "--inputs", str(bad), *ASK], "source URL"),
        (["--source", "http://127.0.0.1:9", "--target", "http://127.0.0.1:9", "--inputs", str(tmp_path / "none"),
          *ASK], "no such file"),
        ([str(tmp_path / "missing-plan.yaml"), "--target", "http://127.0.0.1:9"], "no such file"),
        (["--source", "http://127.0.0.1:9", "--target", "http://127.0.0.1:9", "--inputs", str(bad)], "--path PATH"),
        (["--source", "http://127.0.0.1:9", "--target", "http://127.0.0.1:9", "--inputs", str(bad), "--path", "/x",
          "--field", "emb:fuzzy"], "NAME:numeric"),
        (["--source", "http://127.0.0.1:9", "--target", "http://127.0.0.1:9", "--inputs", str(bad), "--path", "x",
          "--field", "emb:numeric"], "parity request is not valid: path"),
    ]  # fmt: skip
    for args, needle in cases:
        proc = run(cli_cmd, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_check_a_migration_under_way_by_id(cli_cmd, gm_home: Path, repo: Path, source_server, twin_server,
                                           golden_small: Path) -> None:  # fmt: skip
    from gpumigrate.state import Migration

    plan = yaml.safe_load((repo / "examples" / "local-demo.yaml").read_text())
    plan["workload"]["endpoint"] = source_server.url
    plan["parity"]["golden_inputs"] = str(golden_small)
    m = Migration.create("parity-cli-test", yaml.safe_dump(plan), root=gm_home / "migrations")
    m.update(runtime={"target_endpoint": twin_server.url})
    proc = run(cli_cmd, "--migration", m.id, "--fast", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = last_json(proc)
    assert doc["passed"] is True and doc["cases"] == 6
    assert Path(doc["artifacts"]["html"]).is_relative_to(m.artifacts)
    assert run(cli_cmd, "--migration", "no-such-migration").returncode == 2
