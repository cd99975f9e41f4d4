"""Adapters from the phases to the sibling libraries: the only place that knows their call shapes.

Each function is a thin translation (argument names, result shapes to small JSON-able dicts), so a
change in a sibling's API is one edit here. Siblings are imported lazily: a migration that never
ramps never imports Envoy's stubs, and ``gpumigrate --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpumigrate.errors import InvalidInputError, ProviderError, SnapshotError
from gpumigrate.interfaces import Host


def as_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return obj
    for attr in ("to_dict", "as_dict", "to_record", "model_dump"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn()
    if is_dataclass(obj):
        return asdict(obj)
    return dict(vars(obj))


def redact(url: str) -> str:
    """Drop credentials from a URL before it reaches the audit log."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return url.replace(f"{parts.username or ''}:{parts.password or ''}@", "").replace(f"{parts.username}@", "")
    return url


# ----------------------------------------------------------------------------- infra
def provider_options(name: str, ctx: Any = None) -> dict[str, Any]:
    """Provider options from the environment and the run (endpoints for moto in tests; nothing secret).

    A local target is detached by default: after the cutover it IS the service, so it must outlive
    the ``gpumigrate migrate`` process. The demo attaches it, so nothing outlives the demo.
    """
    if name == "aws" and os.environ.get("AWS_ENDPOINT_URL"):
        return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    if name == "local" and ctx is not None:
        return {"attached": bool(ctx.get("target_attached", False))}
    return {}


def _provider_for(ctx: Any) -> Any:
    from gpumigrate.infra import get_provider

    return get_provider(ctx.plan.target.provider, **provider_options(ctx.plan.target.provider, ctx))


def _host(ctx: Any) -> Host:
    return Host(**ctx.need("target_host"))


def start_target_workload(provider: Any, host: Host, ctx: Any) -> dict[str, Any]:
    """Start the workload on the target, waiting for the snapshot (``--await-restore``).

    Local hosts run the reference inference server as a supervised process; cloud hosts are expected
    to boot the workload from their machine image, listening on the ports the host reports.
    """
    plan = ctx.plan
    if plan.snapshot.backend != "agent":
        # The restored process IS the workload (CRIU restores its sockets): nothing to start here.
        port = int(urlsplit(plan.workload.endpoint or "http://x:80").port or 80)
        return {"target_endpoint": f"http://{host.address}:{port}", "target_agent": None}
    service_port, agent_port = host.ports.get("service"), host.ports.get("agent")
    if service_port is None or agent_port is None:
        raise ProviderError(f"host {host.name} reports no 'service'/'agent' ports: cannot place the workload")
    endpoint, agent_addr = f"http://{host.address}:{service_port}", f"{host.address}:{agent_port}"
    if alive(endpoint):  # a retried or resumed provision: the workload already runs there
        return {"target_endpoint": endpoint, "target_agent": agent_addr}
    if plan.workload.kind != "inference":
        raise InvalidInputError(
            "the flows start inference workloads on a target; training targets must be "
            "started with the training job's --await-restore on the target host"
        )
    argv = [
        sys.executable,
        "-m",
        "gpumigrate.workloads.inference",
        "--host",
        host.address,
        "--port",
        str(service_port),
        "--agent-port",
        str(agent_port),
        "--name",
        host.name,
        "--await-restore",
        *_same_model_args(ctx.get("source_info") or {}),
    ]
    spawn = getattr(provider, "spawn", None)
    if spawn is None:
        raise ProviderError(
            f"provider {host.provider} cannot start processes on {host.name}: "
            "boot the workload from the machine image instead"
        )
    spawn(host, argv, name="workload")
    wait_alive(endpoint, timeout_s=120)
    return {"target_endpoint": endpoint, "target_agent": agent_addr}


def _same_model_args(info: dict[str, Any]) -> list[str]:
    """The target allocates the source's model shape (same seed/size/dtype/device) to restore into."""
    args = [
        "--seed",
        str(info.get("seed", 0)),
        "--dtype",
        str(info.get("dtype", "float32")),
        "--device",
        str(info.get("device") or "cpu"),
    ]
    if info.get("params_mb"):
        return [*args, "--params-mb", str(info["params_mb"])]
    return [*args, "--size", str(info.get("size") or "tiny")]


def target_store_url(host: Host, plan_store: str) -> str:
    """Where the target reads the image: its own disk for local hosts, else the plan's shared store."""
    if host.provider == "local" and host.workdir and plan_store.startswith("file://"):
        return "file://" + str(Path(host.workdir) / "store")
    return plan_store


def terminate_target(ctx: Any) -> bool:
    _provider_for(ctx).terminate(_host(ctx))
    return True


# ----------------------------------------------------------------------------- HTTP health
def alive(url: str, *, path: str = "/healthz", timeout_s: float = 2.0) -> bool:
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as c:
            return c.get(url.rstrip("/") + path).status_code == 200
    except httpx.HTTPError:
        return False


def wait_alive(url: str, *, timeout_s: float, path: str = "/healthz") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive(url, path=path):
            return
        time.sleep(0.1)
    raise ProviderError(f"{url}{path} did not answer within {timeout_s:.0f}s")


def wait_ready(url: str, *, timeout_s: float) -> None:
    wait_alive(url, timeout_s=timeout_s, path="/readyz")


def service_info(url: str) -> dict[str, Any]:
    from gpumigrate.parity.environment import fetch_info

    return fetch_info(url)


# ----------------------------------------------------------------------------- snapshot
class _Agent:
    """The snapshot agent's client with results flattened to the few fields the flow keeps."""

    def __init__(self, address: str, side: str) -> None:
        from gpumigrate.snapshot.client import AgentClient

        self.side = side
        self.client = AgentClient(address)

    @staticmethod
    def _flat(out: Any) -> dict[str, Any]:
        d = as_dict(out)
        stats, image = as_dict(d.get("stats")), as_dict(d.get("image"))
        flat = {**stats, **image}  # RoundStats (round, chunks_*, bytes_dirty, seconds) + ImageRef (id, bytes_*)
        flat["image_id"] = image.get("id") or d.get("image_id")
        return {k: v for k, v in flat.items() if isinstance(v, (str, int, float, bool, type(None)))}

    def precopy(
        self, store: str, key_ref: dict | None, parent: str | None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self._flat(self.client.precopy(store, key_ref or {}, parent=parent, options=options))

    def freeze(self) -> None:
        self.client.freeze()

    def final(
        self, store: str, key_ref: dict | None, parent: str | None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = self._flat(self.client.final(store, key_ref or {}, parent=parent, options=options))
        if not out.get("image_id"):
            raise SnapshotError(f"the {self.side} agent committed no image")
        return out

    def resume(self) -> None:
        self.client.resume()

    def restore(self, store: str, image_id: str, key_ref: dict | None, policy: dict[str, str]) -> dict[str, Any]:
        return as_dict(self.client.restore(store, image_id, key_ref or {}, policy=policy))

    def zeroize(self) -> dict[str, Any]:
        return as_dict(self.client.zeroize())


def agent(address: str | None, side: str) -> _Agent:
    if not address:
        raise InvalidInputError(f"the {side} has no snapshot agent address (workload.agent in the plan)")
    return _Agent(address, side)


def host_level_snapshot(ctx: Any) -> dict[str, Any]:
    """cuda-driver / CRIU: act on the source process where it lives, through that host's Prefect worker."""
    from gpumigrate.flows.host_actions import dispatch

    plan = ctx.plan
    pid = ctx.get("source_info", {}).get("pid")
    if not pid:
        raise InvalidInputError(
            f"the {plan.snapshot.backend} backend acts on the source process by pid, and "
            f"{plan.workload.endpoint}/v1/info reports none"
        )
    params: dict[str, Any] = {"backend": plan.snapshot.backend, "pid": int(pid)}
    if plan.snapshot.backend == "criu":
        params.update(images_dir=str(ctx.migration.dir / "criu-dump"), store=ctx.store_url(), key_ref=ctx.key_ref())
    out = dispatch(plan.workload.source_host, "checkpoint", params)
    ctx.put(source_pid=int(pid))
    if out.get("image_id"):
        ctx.put(image_id=out["image_id"], image=out)
    return {k: v for k, v in out.items() if isinstance(v, (str, int, float, bool))}


def host_level_restore(ctx: Any) -> dict[str, Any]:
    """cuda-driver: resume the suspended process (same host); criu: restore the dumped tree on the target."""
    from gpumigrate.flows.host_actions import dispatch

    plan = ctx.plan
    if plan.snapshot.backend == "cuda-driver":
        out = dispatch(plan.workload.source_host, "restore", {"backend": "cuda-driver", "pid": ctx.need("source_pid")})
    else:
        host = ctx.need("target_host")
        out = dispatch(
            host["name"],
            "restore",
            {
                "backend": "criu",
                "store": ctx.get("target_store") or ctx.store_url(),
                "image_id": ctx.need("image_id"),
                "images_dir": str(Path(host.get("workdir") or ctx.migration.dir) / "criu-restore"),
                "key_ref": ctx.key_ref(),
            },
        )
    return {k: v for k, v in out.items() if isinstance(v, (str, int, float, bool))}


# ----------------------------------------------------------------------------- transfer
def resolve_key(key_ref: dict[str, str] | None) -> bytes | None:
    if not key_ref:
        return None
    from gpumigrate.transfer import resolve_key as _resolve

    return _resolve(env=key_ref.get("env"), file=key_ref.get("file"))


def push_image(
    src: str, dst: str, image_id: str, key: bytes | None, *, parallelism: int, progress: Any
) -> dict[str, Any]:
    from gpumigrate.transfer import push

    kwargs: dict[str, Any] = {"key": key, "parallelism": parallelism, "progress": progress}
    rate = os.environ.get("GPUMIGRATE_TRANSFER_RATE_LIMIT")  # bytes/s: emulate a slow link (tests, demos)
    if rate:
        kwargs["rate_limit"] = float(rate)
    stats = as_dict(push(src, dst, image_id, **kwargs))
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str)) and k != "image_id"}


def verify_image(store: str, image_id: str, key: bytes | None) -> None:
    from gpumigrate.transfer import verify

    verify(store, image_id, key=key)


# ----------------------------------------------------------------------------- parity
def environment_parity(source_info: dict, target_info: dict, policy: dict[str, str]) -> dict[str, Any]:
    from gpumigrate.parity.environment import check_environment

    report = check_environment(source_info, target_info, policy)
    d = as_dict(report)
    d["differences"] = [v.get("text") for v in d.get("violations", [])]
    return d


def host_environment_parity(plan: Any, source_info: dict[str, Any]) -> dict[str, Any]:
    """Preflight: the target host's facts against the source's, host-level facts only (no workload yet).

    A local target runs on this machine, so its facts are collected here; a cloud target's facts are
    known once it runs, so the check is deferred to the parity phase (which compares everything).
    Returns the audit record; ``report`` (removed before recording by the caller) on a violation.
    """
    if plan.target.provider != "local" or not source_info:
        return {"passed": None, "deferred": "the target's facts are checked in the parity phase, once it runs"}
    from gpumigrate.parity.environment import check_environment
    from gpumigrate.parity.probe import collect

    report = check_environment(source_info, collect(), plan.parity.environment, scope="host")
    out = as_dict(report)
    out["differences"] = [v.get("text") for v in out.get("violations", [])]
    if not report.passed:
        out["report"] = report
    return out


def output_parity(source_url: str, target_url: str, inputs: Path, *, atol: float, rtol: float, out_dir: Path) -> dict:
    from gpumigrate.parity.output import run_output_parity

    res = run_output_parity(source_url, target_url, inputs, atol=atol, rtol=rtol, out_dir=out_dir)
    d = as_dict(res)
    d["failures"] = list(d.get("failures", []))[:20]
    return d


# ----------------------------------------------------------------------------- traffic
def traffic_dir(ctx: Any) -> Path:
    """The front door's control-plane state: runtime override, else ``<state root>/traffic/<workload>``."""
    explicit = ctx.get("traffic_state_dir")
    if explicit:
        return Path(explicit)
    from gpumigrate.flows.frontdoor import default_dir

    return default_dir(ctx.plan.workload.name)


def run_ramp(ctx: Any) -> dict[str, Any]:
    from gpumigrate.flows.ramp_wiring import run_ramp as _run

    return _run(ctx)


def traffic_to_source(ctx: Any, reason: str) -> dict[str, float] | None:
    """100% source in one update, if a front door exists and ever sent traffic to the target."""
    d = traffic_dir(ctx)
    from gpumigrate.traffic.state import StateStore, rollback_to_source

    store = StateStore(d)
    if not store.exists():
        return None
    before = store.read()
    if all(w == 0 for name, w in before.weights.items() if name != before.primary):
        return None  # already all on the source (never ramped, or the controller rolled back itself)
    state = rollback_to_source(d, reason)
    return dict(state.weights)
