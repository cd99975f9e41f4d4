"""The orchestrator's side of booting a workload on a cloud target (spec: infra/BOOT.md).

:func:`boot_script` writes the user data / startup script from the plan's launch and the target's
bootstrap settings; :func:`await_boot` watches the instance (console markers, state) and probes the
workload until it serves, fails, or the time is up. Both clouds share this; only the readers of
console output and instance state differ.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import gpumigrate
from gpumigrate.errors import GpumigrateError, InvalidInputError, ProviderError
from gpumigrate.infra.launch import is_up, netloc
from gpumigrate.interfaces import Host
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.plan import Plan, TargetBootstrap, TargetNetwork

FORMAT = "gpumigrate-boot/1"
MARKER = "GPUMIGRATE-BOOT"
_MARKER_RE = re.compile(MARKER + r" (\{.*\})\s*$")
# Environment the orchestrator's launch carries that names paths on the orchestrator: the target sets its own.
ORCHESTRATOR_ONLY_ENV = (
    "GPUMIGRATE_CONTROL_KEY", "GPUMIGRATE_CONTROL_KEY_FILE", "GPUMIGRATE_HOME", "GPUMIGRATE_AGENT_KEY_FILE",
)  # fmt: skip
USER_DATA_LIMIT = 16 * 1024  # EC2's limit on user data before base64; GCE allows more
CONSOLE_TAIL_LINES = 40


@dataclass(frozen=True)
class CloudTarget:
    """What a cloud provider needs from the plan beyond the HostSpec: the target's network and bootstrap
    settings, and where the workload reads the image key (the plan's ``transfer.encryption_key``)."""

    network: TargetNetwork = field(default_factory=TargetNetwork)
    bootstrap: TargetBootstrap | None = None
    image_key_ref: Mapping[str, str] | None = None

    @classmethod
    def from_plan(cls, plan: Plan) -> CloudTarget:
        key = plan.transfer.encryption_key
        ref = {k: v for k, v in key.model_dump().items() if v is not None} if key is not None else None
        return cls(network=plan.target.network, bootstrap=plan.target.bootstrap, image_key_ref=ref)

    def require_bootstrap(self, provider: str) -> TargetBootstrap:
        if self.bootstrap is None:
            raise InvalidInputError(
                f"target.bootstrap is needed to start the workload on a {provider} target: name at least "
                "control_key_secret, and the wheel or machine image that carries gpumigrate"
            )
        return self.bootstrap


def cloud_options(plan: Plan) -> dict[str, Any]:
    """Provider options for a plan's cloud target (``get_provider(name, **cloud_options(plan))``)."""
    return {"target": CloudTarget.from_plan(plan)} if plan.target.provider in ("aws", "gcp") else {}


class BootError(ProviderError):
    """The workload did not come up on the target; ``console`` holds the instance's last output."""

    def __init__(self, message: str, *, console: str = "") -> None:
        tail = "\n".join(console.splitlines()[-CONSOLE_TAIL_LINES:])
        text = f"{message}\n--- console output of the instance (last {CONSOLE_TAIL_LINES} lines) ---\n{tail}"
        super().__init__(text if tail else message + " (the instance's console output is empty)")
        self.console = console


def boot_config(
    *,
    name: str,
    provider: str,
    region: str,
    launch: WorkloadLaunch,
    ports: Mapping[str, int],
    bootstrap: TargetBootstrap,
    image_key_ref: Mapping[str, str] | None,
    project: str | None = None,
) -> dict[str, Any]:
    """The boot config (BOOT.md): everything the machine needs, and no secret."""
    contract = {k: v for k, v in launch.contract_env.items() if k not in ORCHESTRATOR_ONLY_ENV}
    return {
        "format": FORMAT,
        "name": name,
        "provider": provider,
        "region": region,
        "project": project,
        "version": gpumigrate.__version__,
        "ports": dict(ports),
        "launch": {
            "argv": list(launch.argv),
            "env": dict(launch.env),
            "cwd": launch.cwd,
            "ready_timeout_s": launch.ready_timeout_s,
            "health_path": launch.health_path,
            "ready_path": launch.ready_path,
            "contract_env": contract,
        },
        "secrets": {"control_key": bootstrap.control_key_secret, "image_key": bootstrap.image_key_secret},
        "image_key_ref": dict(image_key_ref) if image_key_ref else None,
    }


_SCRIPT_HEAD = """#!/bin/sh
# gpumigrate boot script, format 1 (infra/BOOT.md in the gpumigrate source). It holds no secret:
# the instance reads its keys by name, with its own identity.
set -u
umask 077
mark() { printf 'GPUMIGRATE-BOOT {"v": 1, "event": "failed", "stage": "%s", "error": "%s"}\\n' "$1" "$2"; }
BOOT="${GPUMIGRATE_BOOT_DIR:-/var/lib/gpumigrate}"
mkdir -p "$BOOT" && cd "$BOOT" || { mark setup "cannot create the boot directory"; exit 1; }
cat > "$BOOT/boot.json" <<'GPUMIGRATE_BOOT_CONFIG'
"""

# Download and digest check with the image's own Python: no curl or sha256sum needed on the image.
_FETCH_WHEEL = """import hashlib, sys, urllib.request
url, want, out = sys.argv[1:4]
data = urllib.request.urlopen(url, timeout=600).read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit("the wheel's sha256 is " + got + ", the plan pins " + want)
open(out, "wb").write(data)
"""


def boot_script(config: Mapping[str, Any], bootstrap: TargetBootstrap) -> str:
    """The user data / startup script that installs a pinned gpumigrate and hands over to the boot agent."""
    py = shlex.quote(bootstrap.python)
    lines = [_SCRIPT_HEAD + json.dumps(config, sort_keys=True), "GPUMIGRATE_BOOT_CONFIG", f"PY={py}"]
    if bootstrap.wheel:
        url, _, digest = bootstrap.wheel.partition("#sha256=")
        wheel_name = shlex.quote(urlsplit(url).path.rsplit("/", 1)[-1])
        lines += [
            'printf \'GPUMIGRATE-BOOT {"v": 1, "event": "installing"}\\n\'',
            f'"$PY" -c {shlex.quote(_FETCH_WHEEL)} {shlex.quote(url)} {digest} "$BOOT/"{wheel_name} '
            '|| { mark install "the wheel could not be fetched or its sha256 differs from the pin"; exit 1; }',
            f'"$PY" -m venv "$BOOT/venv" && "$BOOT/venv/bin/pip" install --quiet "$BOOT/"{wheel_name} '
            '|| { mark install "pip could not install the wheel"; exit 1; }',
            'PY="$BOOT/venv/bin/python"',
        ]
    lines += [
        '"$PY" -c "import gpumigrate" 2>/dev/null || { mark install "gpumigrate does not import on this machine"; exit 1; }',
        'exec "$PY" -m gpumigrate.infra.bootagent "$BOOT/boot.json"',
        "",
    ]
    script = "\n".join(lines)
    if len(script.encode()) > USER_DATA_LIMIT:
        raise InvalidInputError(
            f"the boot script is {len(script.encode())} bytes, over the {USER_DATA_LIMIT} bytes EC2 accepts as "
            "user data: shorten workload.launch"
        )
    return script


def markers(console: str) -> list[dict[str, Any]]:
    """The boot markers in a console output, in order; malformed lines are skipped."""
    found = []
    for line in console.splitlines():
        m = _MARKER_RE.search(line)
        if m:
            try:
                doc = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("event"), str):
                found.append(doc)
    return found


def _failure(events: list[dict[str, Any]]) -> str | None:
    for ev in events:
        if ev["event"] == "failed":
            rc = f" (exit status {ev['rc']})" if ev.get("rc") is not None else ""
            return f"failed at {ev.get('stage', '?')}: {ev.get('error', 'no reason given')}{rc}"
        if ev["event"] == "exited":
            return f"the workload exited with status {ev.get('rc')}"
        if ev["event"] == "agent" and ev.get("version") != gpumigrate.__version__:
            return (
                f"the machine runs gpumigrate {ev.get('version')}, this orchestrator {gpumigrate.__version__}: "
                "pin the same version (target.bootstrap.wheel or the machine image)"
            )
    return None


def await_boot(
    host: Host,
    launch: WorkloadLaunch,
    *,
    console: Callable[[], str],
    state: Callable[[], str],
    running: str,
    timeout_s: float,
    poll_s: float = 2.0,
) -> Host:
    """Wait until the workload on ``host`` serves (BOOT.md); raise :class:`BootError` otherwise.

    ``console`` reads the instance's console output, ``state`` its lifecycle state (``running`` is
    the value that means it runs).
    """
    what = f"bootstrap of {host.name} ({host.instance_id})"
    if "agent" not in host.ports:
        raise ProviderError(f"{what}: the host record names no agent port")
    start = time.monotonic()
    deadline = start + timeout_s
    text = ""
    while True:
        text = console()
        events = markers(text)
        failure = _failure(events)
        if failure:
            raise BootError(f"{what} {failure}", console=text)
        current = state()
        if current != running:
            raise BootError(f"{what} failed: the instance is {current}", console=text)
        if is_up(host, launch, with_agent=True):
            started = next((e for e in events if e["event"] == "agent"), {})
            meta = {**host.meta, "boot_seconds": round(time.monotonic() - start, 1), "version": started.get("version")}
            return replace(host, meta=meta)
        if time.monotonic() >= deadline:
            where = (
                f"http://{netloc(host.address, host.ports['service'])}{launch.health_path}"
                if "service" in host.ports
                else f"the agent port {netloc(host.address, host.ports['agent'])}"
            )
            if any(e["event"] == "ready" for e in events):
                why = (
                    f"the machine reports its workload ready, but {where} does not answer from here (nor, maybe, "
                    "its agent port): check target.network (public_ip, orchestrator, frontdoor) against where this runs"
                )
            else:
                why = f"the workload never answered {where}"
            raise BootError(f"{what} timed out after {timeout_s:g} s: {why}", console=text)
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


class BootingProvider(Protocol):
    """What :func:`boot_or_terminate` reads of a cloud provider (AWS and GCP both)."""

    poll_interval_s: float

    def console_output(self, host: Host) -> str: ...

    def terminate(self, host: Host) -> None: ...


def boot_or_terminate(
    provider: BootingProvider,
    host: Host,
    launch: WorkloadLaunch,
    *,
    state: Callable[[Host], str],
    running: str,
    timeout_s: float,
) -> Host:
    """:func:`await_boot` with ``provider``'s console reader; on any failure the instance is terminated
    (a GPU machine whose workload did not come up is never left running, whatever the caller does)."""
    try:
        return await_boot(
            host,
            launch,
            console=lambda: provider.console_output(host),
            state=lambda: state(host),
            running=running,
            timeout_s=timeout_s,
            poll_s=provider.poll_interval_s,
        )
    except GpumigrateError:
        provider.terminate(host)
        raise
