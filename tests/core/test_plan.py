"""Plan validation: the examples pass; every bad plan exits 2 naming its field path."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from gpumigrate.errors import PlanError
from gpumigrate.plan import load_plan, parse_plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
BASE = yaml.safe_load((REPO / "examples" / "local-demo.yaml").read_text())


def test_examples_exist_for_each_provider() -> None:
    providers = {load_plan(p).target.provider for p in EXAMPLES}
    assert {"local", "aws", "gcp"} <= providers


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    plan = load_plan(path)
    assert plan.version == 1
    assert plan.traffic.stages[-1].weight == 100


def _set(doc: dict, dotted: str, value: object) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return doc


_DELETE = object()

# (case id, dotted path to change, new value, field path expected in the message)
BAD_PLANS = [
    ("missing-workload", "workload", _DELETE, "workload"),
    ("bad-kind", "workload.kind", "batch", "workload.kind"),
    ("bad-name", "workload.name", "Tiny LM!", "workload.name"),
    ("bad-endpoint", "workload.endpoint", "ftp://x", "workload.endpoint"),
    ("bad-agent", "workload.agent", "nohostport", "workload.agent"),
    ("agent-port-range", "workload.agent", "127.0.0.1:70000", "workload.agent"),
    ("bad-provider", "target.provider", "azure", "target.provider"),
    ("bad-region", "target.region", "EU Central", "target.region"),
    ("gpu-count-range", "target.gpu_count", 99, "target.gpu_count"),
    ("gpu-model", "target.gpu_model", "RTX9999", "target.gpu_model"),
    ("no-jurisdictions", "data.allowed_jurisdictions", [], "data.allowed_jurisdictions"),
    ("bad-jurisdiction", "data.allowed_jurisdictions", ["europe"], "data.allowed_jurisdictions"),
    ("bad-classification", "data.classification", "secret-ish", "data.classification"),
    ("bad-backend", "snapshot.backend", "vmotion", "snapshot.backend"),
    ("negative-rounds", "snapshot.precopy_rounds", -1, "snapshot.precopy_rounds"),
    ("zero-downtime-budget", "snapshot.max_downtime_ms", 0, "snapshot.max_downtime_ms"),
    ("bad-store", "transfer.store", "ftp://host/x", "transfer.store"),
    ("key-in-plan", "transfer.encryption_key", {"value": "00ff"}, "transfer.encryption_key.value"),
    ("key-two-refs", "transfer.encryption_key", {"env": "A", "file": "/k"}, "transfer.encryption_key"),
    ("parallelism", "transfer.parallelism", 0, "transfer.parallelism"),
    ("rate-not-a-rate", "transfer.rate_limit", "fast", "transfer.rate_limit"),
    ("rate-below-1MiB", "transfer.rate_limit", "100KB/s", "transfer.rate_limit"),
    ("bad-pacing", "transfer.pacing", "gentle", "transfer.pacing"),
    ("bad-compression", "transfer.compression", "lzma", "transfer.compression"),
    ("negative-atol", "parity.atol", -1, "parity.atol"),
    ("bad-env-policy", "parity.environment", {"torch": "ignore"}, "parity.environment.torch"),
    ("weight-over-100", "traffic.stages.0.weight", 150, "traffic.stages[0].weight"),
    ("weights-decrease", "traffic.stages", [{"weight": 50}, {"weight": 25}, {"weight": 100}], "traffic.stages"),
    ("no-cutover", "traffic.stages", [{"weight": 10}, {"weight": 50}], "traffic.stages"),
    ("interval-zero", "traffic.analysis_interval_s", 0, "traffic.analysis_interval_s"),
    ("success-rate-range", "traffic.gates.min_success_rate", 1.5, "traffic.gates.min_success_rate"),
    ("unknown-field", "traffic.speed", "fast", "traffic.speed"),
    ("bad-version", "version", 2, "version"),
    ("launch-empty-argv", "workload.launch.argv", [], "workload.launch.argv"),
    ("launch-bad-placeholder", "workload.launch.argv", ["serve", "--port", "{port}"], "workload.launch.argv"),
    ("launch-unbalanced-brace", "workload.launch.argv", ["serve", "{service_port"], "workload.launch.argv"),
    ("launch-bad-env-name", "workload.launch.env", {"1BAD": "x"}, "workload.launch.env"),
    ("launch-env-placeholder", "workload.launch.env", {"PORT": "{nope}"}, "workload.launch.env"),
    ("bad-ready-path", "workload.ready_path", "readyz", "workload.ready_path"),
    ("parity-bad-path", "parity.request.path", "http://x/y", "parity.request.path"),
    ("parity-no-compare", "parity.request.compare", [], "parity.request.compare"),
    ("parity-bad-field", "parity.request.compare.0.field", "a..b", "parity.request.compare[0].field"),
    ("parity-bad-kind", "parity.request.compare.0.kind", "fuzzy", "parity.request.compare[0].kind"),
    ("parity-bad-method", "parity.request.method", "DELETE", "parity.request.method"),
    ("training-steps", "parity.training", {"steps": 0}, "parity.training.steps"),
    ("control-key-inline", "workload.control_key", {"value": "00"}, "workload.control_key.value"),
    ("agent-backend-without-launch", "workload.launch", _DELETE, "workload.launch"),
    ("golden-inputs-without-request", "parity.request", _DELETE, "parity.request"),
    ("freeze-lease-zero", "snapshot.freeze_lease_s", 0, "snapshot.freeze_lease_s"),
    ("freeze-lease-over-a-day", "snapshot.freeze_lease_s", 86_401, "snapshot.freeze_lease_s"),
    ("rank-gpus-twice", "target.rank_gpus", [0, 0], "target.rank_gpus"),
    ("rank-gpus-per-rank", "target.rank_gpus", [1, 0], "target.rank_gpus"),  # the demo's workload has one rank
    ("rank-gpus-negative", "target.rank_gpus", [-1], "target.rank_gpus[0]"),
]


def test_cross_field_rules() -> None:
    aws = yaml.safe_load((REPO / "examples" / "aws-eu.yaml").read_text())
    with pytest.raises(PlanError) as info:
        parse_plan(_set(aws, "target.instance_type", _DELETE), "aws")
    assert any("instance_type" in m for _, m in info.value.problems)
    with pytest.raises(PlanError) as info:
        parse_plan(_set(aws, "target.zone", "us-east-1a"), "aws")
    assert any("not in region" in m for _, m in info.value.problems)
    with pytest.raises(PlanError) as info:
        parse_plan(_set(aws, "snapshot.backend", "cuda-driver"), "aws")
    assert any("cuda-driver" in m for _, m in info.value.problems)


AWS = yaml.safe_load((REPO / "examples" / "aws-eu.yaml").read_text())
WHEEL = "https://example.com/gpumigrate-0.1.0-py3-none-any.whl"
# Cloud target fields, on the AWS example: (case id, dotted path, new value, field path expected)
BAD_CLOUD_TARGETS = [
    ("fallback-other-region", "target.fallback_zones", ["us-east-1a"], "target"),
    ("fallback-is-zone", "target.fallback_zones", ["eu-central-1a"], "target"),
    ("orchestrator-everyone", "target.network.orchestrator", ["0.0.0.0/0"], "target.network.orchestrator"),
    ("orchestrator-not-ip", "target.network.orchestrator", ["orchestrator.local"], "target.network.orchestrator"),
    ("frontdoor-everyone", "target.network.frontdoor", ["::/0"], "target.network.frontdoor"),
    ("same-ports", "target.network.agent_port", 8000, "target.network"),
    ("port-range", "target.network.service_port", 70000, "target.network.service_port"),
    ("wheel-unpinned", "target.bootstrap.wheel", WHEEL, "target.bootstrap.wheel"),
    ("wheel-http", "target.bootstrap.wheel", "http://x/g.whl#sha256=" + "0" * 64, "target.bootstrap.wheel"),
    ("no-control-secret", "target.bootstrap.control_key_secret", _DELETE, "target.bootstrap.control_key_secret"),
    ("secret-name", "target.bootstrap.image_key_secret", "two words", "target.bootstrap.image_key_secret"),
    ("python-shell", "target.bootstrap.python", "python3; rm -rf /", "target.bootstrap.python"),
    ("no-image-secret", "target.bootstrap.image_key_secret", _DELETE, "(plan)"),
]


BAD_CASES = [(BASE, *b) for b in BAD_PLANS] + [(AWS, *b) for b in BAD_CLOUD_TARGETS]


@pytest.mark.parametrize(("base", "case", "path", "value", "field"), BAD_CASES, ids=[b[1] for b in BAD_CASES])
def test_bad_plan_names_field(base: dict, case: str, path: str, value: object, field: str) -> None:
    with pytest.raises(PlanError) as info:
        parse_plan(_set(base, path, value), case)
    fields = [f for f, _ in info.value.problems]
    assert field in fields, f"{case}: expected {field} in {fields}"


def test_the_workload_contract_is_required_and_says_where_to_look() -> None:
    """The flow starts a workload only from its launch and asks it only through parity.request."""
    for dotted, field in (("workload.launch", "workload.launch"), ("parity.request", "parity.request")):
        with pytest.raises(PlanError) as info:
            parse_plan(_set(BASE, dotted, _DELETE), "plan")
        [(where, message)] = info.value.problems
        assert where == field and "examples/" in message, (where, message)
    # Host-level backends restore the process itself: no launch. No golden inputs: no request.
    assert parse_plan(_set(_set(BASE, "workload.launch", _DELETE), "snapshot.backend", "criu"), "plan")
    assert parse_plan(_set(_set(BASE, "parity.request", _DELETE), "parity.golden_inputs", _DELETE), "plan")


def test_cloud_target_fields_and_defaults() -> None:
    plan = parse_plan(AWS, "aws")
    assert plan.target.fallback_zones == ["eu-central-1b", "eu-central-1c"]
    assert plan.target.bootstrap is not None and plan.target.bootstrap.wheel and not plan.target.network.public_ip
    bare = parse_plan(_set(_set(AWS, "target.network", _DELETE), "target.bootstrap", _DELETE), "bare")
    assert (bare.target.network.service_port, bare.target.network.agent_port) == (8000, 7070)
    assert bare.target.network.orchestrator == [] and bare.target.bootstrap is None
    public = _set(AWS, "target.network", {"public_ip": True})
    with pytest.raises(PlanError, match="public_ip needs 'orchestrator'"):
        parse_plan(public, "public")
    with pytest.raises(PlanError, match="cloud targets"):
        parse_plan(_set(BASE, "target.network", {"public_ip": False, "agent_port": 7071}), "local")


def test_launch_placeholders_and_literal_braces() -> None:
    plan = parse_plan(
        _set(
            BASE,
            "workload.launch",
            {"argv": ["{python}", "-c", "print({{1: 2}})", "{agent_addr}"], "env": {"A": "{host}"}},
        ),
        "braces",
    )
    assert plan.workload.launch is not None and plan.workload.launch.argv[2] == "print({{1: 2}})"


def test_not_yaml_and_not_mapping(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("workload: [unclosed\n")
    with pytest.raises(PlanError) as info:
        load_plan(broken)
    assert info.value.problems[0][0] == "(yaml)"
    broken.write_text("version: 1\nworkload:\n  name: x\n   kind: [inference\n")
    with pytest.raises(PlanError) as info:
        load_plan(broken)
    assert info.value.problems[0][0] == "(yaml)"
    assert info.value.problems[0][1].startswith("not valid YAML (line 4, column 8): ")  # where it is
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(PlanError):
        load_plan(listy)
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path / "missing.yaml")
    assert "no such file" in info.value.problems[0][1]
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path)
    assert info.value.exit_code == 2
    assert info.value.problems == [("(file)", "is a directory: give a plan file (YAML) inside it")]


def test_cli_validate_exit_codes(tmp_path: Path, cli_cmd: list[str]) -> None:
    # its own state root: validation records policy decisions in <home>/audit/policy.jsonl
    env = {**os.environ, "GPUMIGRATE_HOME": str(tmp_path / "home")}
    ok = subprocess.run([*cli_cmd, "plan", "validate", *map(str, EXAMPLES)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_set(BASE, "traffic.stages.0.weight", 150)))
    out = subprocess.run([*cli_cmd, "plan", "validate", str(bad), "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert "traffic.stages[0].weight" in out.stderr
    assert "Traceback" not in out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["valid"] is False
    assert doc["plans"][0]["problems"][0]["field"] == "traffic.stages[0].weight"
    folder = subprocess.run([*cli_cmd, "plan", "validate", str(tmp_path)], capture_output=True, text=True, env=env)
    assert folder.returncode == 2 and "is a directory" in folder.stderr and "no such file" not in folder.stderr
    assert "Traceback" not in folder.stderr


def _validate(cli_cmd: list[str], plan: Path, home: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "GPUMIGRATE_HOME": str(home)}
    out = subprocess.run([*cli_cmd, "plan", "validate", str(plan), "--json"], capture_output=True, text=True, env=env)
    assert "Traceback" not in out.stderr
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def test_validate_loads_the_golden_inputs_and_fills_the_request_from_each_case(
    tmp_path: Path, cli_cmd: list[str]
) -> None:
    """What the parity phase would find only after the source froze is exit 2 at `plan validate` (the flow's
    preflight runs the same check): a golden file that is missing, a case that cannot fill the template."""
    byo = yaml.safe_load((REPO / "examples" / "byo" / "plan.yaml").read_text())
    (tmp_path / "golden.jsonl").write_text('{"id": "a", "text": "hi"}\n{"id": "b", "words": "no text here"}\n')
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(byo))
    out, doc = _validate(cli_cmd, plan, tmp_path / "home")
    assert out.returncode == 2 and doc["valid"] is False
    problem = doc["plans"][0]["problems"][0]
    assert problem["field"] == "parity.golden_inputs"
    assert (
        problem["message"]
        == "golden case b: parity.request.body uses {text}, and the case has no 'text' (it has id, words)"
    )

    (tmp_path / "golden.jsonl").write_text('{"id": "a", "text": "hi"}\n')
    out, doc = _validate(cli_cmd, plan, tmp_path / "home")
    assert out.returncode == 0 and doc["plans"][0]["golden_cases"] == 1

    (tmp_path / "golden.jsonl").unlink()
    out, doc = _validate(cli_cmd, plan, tmp_path / "home")
    assert out.returncode == 2 and "no such file" in doc["plans"][0]["problems"][0]["message"]
    assert str(tmp_path / "golden.jsonl") in out.stdout + out.stderr


def test_validate_applies_the_flows_rules_for_a_training_plan(tmp_path: Path, cli_cmd: list[str]) -> None:
    train = yaml.safe_load((REPO / "examples" / "train" / "plan.yaml").read_text())
    train["traffic"] = {"stages": [{"weight": 100, "hold_s": 1}]}
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(train))
    out, doc = _validate(cli_cmd, plan, tmp_path / "home")
    assert out.returncode == 2 and doc["valid"] is False
    assert "a training job has no clients to shift" in doc["plans"][0]["denied"]["message"]


def test_an_unknown_field_names_the_closest_allowed_one_and_lists_them(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["workload"]["kindd"] = doc["workload"].pop("kind")
    doc["traffic"] = {"stages": [{"weight": 10, "hld_s": 3}]}
    with pytest.raises(PlanError) as info:
        parse_plan(doc)
    problems = dict(info.value.problems)
    assert problems["workload.kindd"].startswith("unknown field: did you mean 'kind'? allowed here: agent,")
    assert problems["traffic.stages[0].hld_s"] == "unknown field: did you mean 'hold_s'? allowed here: hold_s, weight"


def test_a_health_path_that_is_the_ready_path_is_refused_naming_the_rule(tmp_path: Path, cli_cmd: list[str]) -> None:
    """A target awaits its restore unready: the flow waits on the health path to start it, which must answer 200
    then. A plan that points both at one path would wait ready_timeout_s on every target (issue 35, finding 1)."""
    doc = _set(_set(BASE, "workload.health_path", "/ready"), "workload.ready_path", "/ready")
    with pytest.raises(PlanError) as info:
        parse_plan(doc)
    [(field, message)] = info.value.problems
    assert field == "workload.ready_path"
    assert message.startswith("/ready is also workload.health_path: they must differ")
    assert "also while a target awaits its restore" in message
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(doc))
    out, result = _validate(cli_cmd, plan, tmp_path / "home")
    assert out.returncode == 2 and result["plans"][0]["problems"][0]["field"] == "workload.ready_path"
