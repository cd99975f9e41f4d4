"""The machine's side of booting a workload (spec: infra/BOOT.md): ``python -m gpumigrate.infra.bootagent CONFIG``.

Run by the boot script on a cloud target: reads the keys by name with the instance's own identity,
renders the plan's launch for this machine, starts the workload, reports on the console, and stays
its parent. Prints markers and errors, never a secret.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import gpumigrate
from gpumigrate.control import KEY_FILE_ENV
from gpumigrate.infra.bootstrap import FORMAT, MARKER, ORCHESTRATOR_ONLY_ENV
from gpumigrate.infra.launch import is_up
from gpumigrate.infra.network import own_address
from gpumigrate.interfaces import Host
from gpumigrate.launch import WorkloadLaunch

SECRET_MANAGER = "https://secretmanager.googleapis.com"
# Overrides where the instance reaches GCP Secret Manager (CI serves it on a loopback fake);
# AWS Secrets Manager follows boto3's own AWS_ENDPOINT_URL.
SECRET_MANAGER_ENDPOINT_ENV = "GPUMIGRATE_SECRETMANAGER_ENDPOINT"


class BootFailed(Exception):
    def __init__(self, stage: str, error: str, rc: int | None = None) -> None:
        super().__init__(error)
        self.stage, self.error, self.rc = stage, error, rc


def mark(event: str, **members: Any) -> None:
    print(f"{MARKER} " + json.dumps({"v": 1, "event": event, **members}, sort_keys=True), flush=True)


# ----------------------------------------------------------------------------- secrets
def _aws_secret(name: str, region: str) -> bytes:
    import boto3

    if name.startswith("arn:aws"):
        region = name.split(":")[3]  # a secret named by ARN lives in the ARN's region
    client = boto3.session.Session().client("secretsmanager", region_name=region)
    value = client.get_secret_value(SecretId=name)
    return bytes(value["SecretBinary"]) if "SecretBinary" in value else str(value["SecretString"]).encode()


def _gcp_secret(name: str, project: str | None) -> bytes:
    import base64

    resource = name if name.startswith("projects/") else f"projects/{project}/secrets/{name}"
    endpoint = os.environ.get(SECRET_MANAGER_ENDPOINT_ENV, SECRET_MANAGER).rstrip("/")
    headers = {}
    if not endpoint.startswith("http://"):  # a bearer token never travels unencrypted
        import google.auth
        import google.auth.transport.requests

        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        creds.refresh(google.auth.transport.requests.Request())
        headers["Authorization"] = f"Bearer {creds.token}"
    with httpx.Client(timeout=30, trust_env=False) as client:
        reply = client.get(f"{endpoint}/v1/{resource}/versions/latest:access", headers=headers)
    if reply.status_code != 200:
        raise RuntimeError(f"Secret Manager answered {reply.status_code} for {resource}")
    return base64.b64decode(reply.json()["payload"]["data"])


def read_secret(config: dict[str, Any], name: str) -> bytes:
    try:
        if config["provider"] == "aws":
            return _aws_secret(name, config["region"])
        return _gcp_secret(name, config.get("project"))
    except Exception as exc:  # any failure is reported by name and type only: the value may be in the message
        raise BootFailed("secrets", f"secret {name} could not be read ({type(exc).__name__})") from None


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def place_keys(config: dict[str, Any], boot_dir: Path) -> dict[str, str]:
    """Fetch the keys; return the environment the workload gets for them (references, or the plan's env var)."""
    env = {}
    control = boot_dir / "keys" / "control.key"
    _write_private(control, read_secret(config, config["secrets"]["control_key"]).strip() + b"\n")
    env[KEY_FILE_ENV] = str(control)
    ref, image_secret = config.get("image_key_ref"), config["secrets"].get("image_key")
    if ref and image_secret:
        key = read_secret(config, image_secret).strip()
        if ref.get("file"):
            _write_private(Path(ref["file"]), key + b"\n")
        elif ref.get("env"):
            env[ref["env"]] = key.decode("ascii", "replace")  # the plan names an env var: the workload reads it there
    return env


# ----------------------------------------------------------------------------- the workload
def _inherited_env() -> dict[str, str]:
    """The boot environment minus any control key or state root it carries: the workload uses the ones
    placed here (a key in the environment would win over the key file, CONTROL.md)."""
    return {k: v for k, v in os.environ.items() if k not in ORCHESTRATOR_ONLY_ENV}


def run(config: dict[str, Any], boot_dir: Path) -> int:
    if config.get("format") != FORMAT:
        raise BootFailed("config", f"boot config format {config.get('format')!r}, this agent reads {FORMAT}")
    mark("agent", version=gpumigrate.__version__)
    address = own_address()
    ports = {k: int(v) for k, v in config["ports"].items()}
    key_env = place_keys(config, boot_dir)
    spec = config["launch"]
    contract = {**spec["contract_env"], **key_env, "GPUMIGRATE_HOME": str(boot_dir / "home")}
    launch = WorkloadLaunch(
        argv=tuple(spec["argv"]),
        env=spec["env"],
        cwd=spec["cwd"],
        ready_timeout_s=float(spec["ready_timeout_s"]),
        health_path=spec["health_path"],
        ready_path=spec["ready_path"],
        contract_env=contract,
        plan_dir=str(boot_dir),
    )
    rendered = launch.render(
        host=address,
        agent_port=ports["agent"],
        service_port=ports.get("service"),
        python=sys.executable,
        name=config["name"],
    )
    try:
        proc = subprocess.Popen(rendered.argv, env={**_inherited_env(), **rendered.env}, cwd=rendered.cwd)
    except OSError as exc:
        raise BootFailed("launch", f"{rendered.argv[0]} could not start: {exc.strerror}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    mark("started", pid=proc.pid, address=address, ports=ports)
    start = time.monotonic()
    here = Host(name=config["name"], provider=config["provider"], region=config["region"], address=address, ports=ports)
    while not is_up(here, launch):
        rc = proc.poll()
        if rc is not None:
            raise BootFailed("launch", "the workload exited before it was up", rc)
        if time.monotonic() - start > launch.ready_timeout_s:
            proc.terminate()
            proc.wait(timeout=30)
            what = f"{launch.health_path} did not answer 200" if "service" in ports else "the agent port stayed closed"
            raise BootFailed("health", f"{what} within {launch.ready_timeout_s:g} s")
        time.sleep(0.2)
    mark("ready", address=address, ports=ports, seconds=round(time.monotonic() - start, 1))
    rc = proc.wait()
    mark("exited", rc=rc)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpumigrate.infra.bootagent BOOT_CONFIG", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise BootFailed("config", f"cannot read {path}: {type(exc).__name__}") from None
        return run(config, path.parent)
    except BootFailed as fail:
        extra = {"rc": fail.rc} if fail.rc is not None else {}
        mark("failed", stage=fail.stage, error=fail.error, **extra)
        return fail.rc or 1


if __name__ == "__main__":
    sys.exit(main())
