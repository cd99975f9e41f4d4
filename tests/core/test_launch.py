"""Rendering a plan's workload.launch for one host (gpumigrate/launch.py)."""

from __future__ import annotations

from pathlib import Path

from gpumigrate.launch import AGENT_ADDR_ENV, AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.plan import load_plan

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_plan_renders_with_the_host_ports_and_the_env_contract() -> None:
    plan = load_plan(REPO / "examples" / "local-demo.yaml")
    launch = WorkloadLaunch.from_plan(
        plan.workload, plan_dir="/plans", await_restore=True, contract_env={"GPUMIGRATE_CONTROL_KEY_FILE": "/k"}
    )
    out = launch.render(host="10.213.2.2", agent_port=7071, service_port=8001, python="/py", name="local-b")
    assert out.argv[:3] == ["/py", "-m", "gpumigrate.workloads.inference"]
    assert out.argv[out.argv.index("--port") + 1] == "8001"
    assert out.argv[out.argv.index("--host") + 1] == "10.213.2.2"
    assert out.env[AGENT_ADDR_ENV] == "10.213.2.2:7071"
    assert out.env[AWAIT_RESTORE_ENV] == "1"
    assert out.env["GPUMIGRATE_CONTROL_KEY_FILE"] == "/k"
    assert out.cwd is None


def test_bind_address_cwd_and_literal_braces() -> None:
    launch = WorkloadLaunch(argv=("{python}", "-c", "print({{1: 2}})", "{agent_addr}"), cwd="svc", plan_dir="/plans")
    out = launch.render(host="1.2.3.4", bind="0.0.0.0", agent_port=7070, service_port=None, python="p", name="n")
    assert out.argv == ["p", "-c", "print({1: 2})", "0.0.0.0:7070"]
    assert out.cwd == "/plans/svc"
    assert AWAIT_RESTORE_ENV not in out.env
