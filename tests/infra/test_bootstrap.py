"""The boot script, its markers and the port rules, without a cloud: the script runs here under sh."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpumigrate.errors import InvalidInputError
from gpumigrate.infra.bootstrap import BootError, boot_config, boot_script, markers
from gpumigrate.infra.network import port_rules, source_address_towards
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.plan import TargetBootstrap, TargetNetwork


def _config(launch: WorkloadLaunch, boot: TargetBootstrap) -> dict:
    return boot_config(
        name="gm-x",
        provider="aws",
        region="eu-central-1",
        launch=launch,
        ports={"service": 8000, "agent": 7070},
        bootstrap=boot,
        image_key_ref={"file": "/etc/gpumigrate/image.key"},
    )


def test_config_drops_the_orchestrators_key_and_home() -> None:
    launch = WorkloadLaunch(
        argv=("serve",),
        contract_env={
            "GPUMIGRATE_AWAIT_RESTORE": "1",
            "GPUMIGRATE_CONTROL_KEY": "00" * 32,
            "GPUMIGRATE_CONTROL_KEY_FILE": "/home/op/.gpumigrate/control.key",
            "GPUMIGRATE_HOME": "/home/op/.gpumigrate",
        },
    )
    cfg = _config(launch, TargetBootstrap(control_key_secret="ck"))
    assert cfg["launch"]["contract_env"] == {"GPUMIGRATE_AWAIT_RESTORE": "1"}
    assert cfg["secrets"] == {"control_key": "ck", "image_key": None}
    assert "00" * 32 not in json.dumps(cfg)


def test_script_is_bounded_by_the_user_data_limit() -> None:
    boot = TargetBootstrap(control_key_secret="ck")
    with pytest.raises(InvalidInputError, match="over the 16384 bytes"):
        boot_script(_config(WorkloadLaunch(argv=("serve", "x" * 17000)), boot), boot)


def test_markers_are_found_inside_prefixed_console_lines() -> None:
    console = "\n".join(
        [
            '[   12.3] cloud-init[901]: GPUMIGRATE-BOOT {"v": 1, "event": "agent", "version": "0.1.0"}',
            "Jan 1 00:00:01 vm google_metadata_script_runner[77]: startup-script: GPUMIGRATE-BOOT {broken",
            'GPUMIGRATE-BOOT {"v": 1, "event": "failed", "stage": "launch", "rc": 3}\r',
            "GPUMIGRATE-BOOT [1, 2]",
        ]
    )
    assert [m["event"] for m in markers(console)] == ["agent", "failed"]


def test_boot_error_keeps_only_the_console_tail() -> None:
    err = BootError("boom", console="\n".join(f"line {i}" for i in range(100)))
    assert "line 99" in str(err) and "line 59" not in str(err) and "line 60" in str(err)
    assert "console output is empty" in str(BootError("boom", console=""))


def _wheel(tmp_path: Path) -> tuple[Path, str]:
    """A tiny real wheel named gpumigrate (installs offline: no dependencies)."""
    path = tmp_path / "gpumigrate-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("gpumigrate/__init__.py", "")
        zf.writestr("gpumigrate-0.0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpumigrate\nVersion: 0.0.1\n")
        zf.writestr(
            "gpumigrate-0.0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(
            "gpumigrate-0.0.1.dist-info/RECORD",
            "gpumigrate/__init__.py,,\ngpumigrate-0.0.1.dist-info/METADATA,,\n"
            "gpumigrate-0.0.1.dist-info/WHEEL,,\ngpumigrate-0.0.1.dist-info/RECORD,,\n",
        )
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _run_script(tmp_path: Path, wheel_url: str) -> tuple[int, str]:
    # model_construct: a file:// URL stands in for the https one the plan requires (no network here)
    boot = TargetBootstrap.model_construct(
        wheel=wheel_url, python=sys.executable, control_key_secret="ck", image_key_secret=None, identity=None
    )
    script = tmp_path / "user-data"
    script.write_text(boot_script(_config(WorkloadLaunch(argv=("serve",)), boot), boot))
    env = {**os.environ, "GPUMIGRATE_BOOT_DIR": str(tmp_path / "boot")}
    out = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env, timeout=300, check=False)
    return out.returncode, out.stdout + out.stderr


def test_wheel_with_another_digest_is_refused(tmp_path: Path) -> None:
    wheel, _ = _wheel(tmp_path)
    rc, output = _run_script(tmp_path, f"file://{wheel}#sha256={'0' * 64}")
    [failed] = [m for m in markers(output) if m["event"] == "failed"]
    assert rc == 1 and failed["stage"] == "install" and "sha256" in failed["error"]
    assert not (tmp_path / "boot" / "venv").exists()  # nothing installed from an unverified file


@pytest.mark.slow
def test_pinned_wheel_installs_into_its_own_venv(tmp_path: Path) -> None:
    wheel, digest = _wheel(tmp_path)
    rc, output = _run_script(tmp_path, f"file://{wheel}#sha256={digest}")
    assert (tmp_path / "boot" / "venv" / "bin" / "python").exists()
    # the stand-in wheel has no boot agent: the script got past the install and handed over
    assert rc != 0 and "No module named 'gpumigrate.infra'" in output
    assert [m["event"] for m in markers(output)] == ["installing"]


def test_port_rules_auto_explicit_and_public() -> None:
    auto = port_rules(TargetNetwork(), "127.0.0.7")
    here = source_address_towards("127.0.0.7") + "/32"
    assert [(r.name, r.port, r.cidrs) for r in auto] == [("agent", 7070, (here,)), ("service", 8000, (here,))]
    explicit = port_rules(TargetNetwork(orchestrator=["10.0.1.20"], frontdoor=["10.0.2.0/24", "fd00::/64"]))
    assert explicit[0].cidrs == ("10.0.1.20/32",)
    assert explicit[1].v4() == ["10.0.1.20/32", "10.0.2.0/24"] and explicit[1].v6() == ["fd00::/64"]
    assert [r.name for r in port_rules(TargetNetwork(orchestrator=["10.0.1.20"]), service=False)] == ["agent"]
    with pytest.raises(InvalidInputError, match="required with public_ip"):
        port_rules(
            TargetNetwork.model_construct(public_ip=True, orchestrator=[], frontdoor=[], service_port=1, agent_port=2)
        )
