"""ADS control plane (state of the world) on a private Unix socket, serving any number of Envoys.

Only an Envoy that proves its node id is served (``access_control.py``): the stream's first request must carry the
node's token in its metadata, and the stream keeps that node id, and writes its status under it, for its
life. Other users of the host cannot connect to the socket at all; a loopback port is opened only where one
is asked for (``--port``), and serves the same proven nodes only.

The desired state lives in a directory (:mod:`gpumigrate.traffic.state`); this server watches it
and pushes changes over one aggregated gRPC stream per Envoy. Per stream and per change it keeps
the safe order of NOTES.md: clusters first (old ∪ new), then the route, then — after ``drain_s`` for
requests still on them — the clusters no route references any more are removed, each step sent
only after Envoy ACKed the previous one. A NACK
(``error_detail``) stops the sequence, Envoy keeps its last good config, and the rejection is
written to ``status/<node>.json`` where :meth:`StateStore.wait_applied` raises it as an error.

Two route configurations go out over RDS, one per listener: the client split and the probe routes
(:mod:`resources`).

The traffic lease (a dead man's switch): while a ramp holds a split, it renews ``lease.json`` every
interval. The watcher notes when it last saw a new renewal, by its own monotonic clock (so the
two processes' clocks never have to agree); after the lease's length without one, it sends 100%
of traffic to the primary by itself, records why in ``desired.json`` (``rolled_back`` with
``trigger: "lease"``) and in its log, and ends the lease. A control plane that starts while a lease
exists gives it one full length from that moment.

Run it in-process (:class:`ControlPlane`) or as its own process::

    python -m gpumigrate.traffic.xds --state-dir D [--port P]    # or: gpumigrate traffic serve
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.control import RefusalLog
from gpumigrate.errors import TrafficError
from gpumigrate.traffic import access_control
from gpumigrate.traffic import resources as res
from gpumigrate.traffic.state import DesiredState, Lease, StateStore, rollback_to_source

log = logging.getLogger("gpumigrate.traffic.xds")

CDS, RDS = res.CLUSTER_TYPE, res.ROUTE_TYPE
_WATCH_S = 0.03  # how often the state file is polled: bounds the time from a weight change to the push
_LEASE_LOOK_S = 0.1  # how often the lease is read: what a lapse may take beyond the lease's own length


@dataclass(frozen=True)
class Snapshot:
    """Resources for one state version, built once and shared by every stream."""

    version: int
    clusters: dict[str, dict[str, Any]]
    routes: dict[str, dict[str, Any]]  # route configuration name → resource


def build_snapshot(state: DesiredState) -> Snapshot:
    ups = {n: (u.host, u.port, u.health_path) for n, u in state.upstreams.items()}
    names = list(state.upstreams)
    # The primary goes first so that its probe route and failover order are stable.
    names.sort(key=lambda n: (n != state.primary, n))
    client = res.route_config(names, state.weights, idempotent=state.idempotent, failover=state.failover)
    probes = res.probe_route_config(names)
    return Snapshot(
        state.version,
        res.clusters_for({n: ups[n] for n in names}),
        {client["name"]: client, probes["name"]: probes},
    )


class LeaseWatch:
    """Acts on a lapsed traffic lease: 100% to the primary, the reason in the state and the log."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.lease: Lease | None = None  # the last renewal seen
        self.seen_at = 0.0  # monotonic seconds when it was first seen

    def check(self, now: float | None = None) -> bool:
        """One look at the lease; True when it had lapsed and was acted on."""
        now = time.monotonic() if now is None else now
        try:
            lease = self.store.lease()
        except TrafficError as exc:  # damaged: judge by the last renewal seen
            log.warning("%s", exc)
            lease = self.lease
        if lease is None:
            self.lease = None
            return False
        if self.lease is None or (lease.holder, lease.seq) != (self.lease.holder, self.lease.seq):
            self.lease, self.seen_at = lease, now
            return False
        if now - self.seen_at < lease.length_s:
            return False
        return self._lapsed(lease, now - self.seen_at)

    def _lapsed(self, lease: Lease, silent: float) -> bool:
        reason = (
            f"traffic lease of {lease.holder} lapsed: no renewal for {silent:.1f}s "
            f"(lease {lease.length_s:g}s); traffic returned to the source"
        )
        try:
            state = self.store.read()
            if state.holds_split() and not state.rolled_back:
                rolled = rollback_to_source(
                    self.store.dir,
                    reason,
                    actor="gpumigrate-control-plane",
                    trigger="lease",
                    lease={**lease.to_json(), "silent_s": round(silent, 3)},
                )
                log.warning("%s (state version %d)", reason, rolled.version)
            else:
                log.info("traffic lease of %s lapsed with no split held; nothing to undo", lease.holder)
            self.store.release_lease(lease.holder)
        except (TrafficError, OSError) as exc:  # try again at the next look
            log.error("cannot act on the lapsed traffic lease of %s: %s", lease.holder, exc)
            return False
        self.lease = None
        return True


class _Refused(Exception):
    """The stream did not prove the node id it claims: it ends UNAUTHENTICATED, having seen nothing."""


class _Stream:
    """One Envoy's ADS stream: what it has ACKed, what is in flight, what comes next."""

    def __init__(self, plane: ControlPlane, request_iterator: Any, context: Any) -> None:
        self.plane = plane
        self.context = context
        self.requests: queue.Queue[Any] = queue.Queue()
        self.node = ""
        self.subscribed: dict[str, list[str]] = {}
        self.acked: dict[str, Any] = {CDS: None, RDS: None}  # resources Envoy runs now, per type (name → dict)
        self.acked_version: dict[str, str] = {}
        self.inflight: tuple[str, str, Any, int] | None = None  # (type, nonce, resources, state version)
        self.nacked_version = -1
        self.nack: dict[str, Any] | None = None
        self.applied = -1
        self.nonce = 0
        self.route_acked_at = 0.0
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True).start()

    def _read(self, request_iterator: Any) -> None:
        try:
            for req in request_iterator:
                self.requests.put(req)
        except Exception:  # the stream was cancelled: Envoy went away or we stop
            pass
        self.requests.put(None)

    def run(self) -> Iterator[Any]:
        from envoy.service.discovery.v3 import discovery_pb2

        try:
            while not self.plane.stopping.is_set():
                try:
                    req = self.requests.get(timeout=_WATCH_S)
                except queue.Empty:
                    req = False
                if req is None:
                    break
                if req is not False:
                    try:
                        self._on_request(req)
                    except _Refused as exc:
                        import grpc

                        self.context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
                if self.inflight is None:
                    step = self._next_step(self.plane.snapshot())
                    if step is not None:
                        type_url, resources, version = step
                        self.nonce += 1
                        nonce = str(self.nonce)
                        self.inflight = (type_url, nonce, resources, version)
                        yield discovery_pb2.DiscoveryResponse(
                            version_info=str(version),
                            type_url=type_url,
                            nonce=nonce,
                            resources=[res.to_any(r, type_url) for r in _as_list(type_url, resources)],
                        )
        finally:
            if self.node:
                self._write_status(connected=False)

    def _on_request(self, req: Any) -> None:
        if not self.node:
            self._prove(str(req.node.id))
            self.node = req.node.id  # bound to this stream for its life: later requests' node ids are not read
            log.info("envoy %s connected", self.node)
            self._write_status(connected=True)
        type_url = req.type_url
        if type_url not in (CDS, RDS):
            return
        self.subscribed[type_url] = list(req.resource_names)
        if not req.response_nonce:
            # A new subscription (or a re-subscription): it gets the current resources in full.
            self.acked[type_url] = None
            return
        if self.inflight is None or req.response_nonce != self.inflight[1] or type_url != self.inflight[0]:
            return  # a reply to an older response: superseded
        _, _, resources, version = self.inflight
        self.inflight = None
        if req.HasField("error_detail") and req.error_detail.code != 0:
            self.nacked_version = version
            self.nack = {
                "type": "CDS" if type_url == CDS else "RDS",
                "version": version,
                "error": req.error_detail.message[:2000],
            }
            log.warning("envoy %s NACKed %s version %s: %s", self.node, self.nack["type"], version, self.nack["error"])
        else:
            self.acked[type_url] = resources
            self.acked_version[type_url] = req.version_info
            if type_url == RDS:
                self.route_acked_at = time.monotonic()
        self._write_status(connected=True)

    def _prove(self, node: str) -> None:
        """The stream's first request names its node, and its metadata carries that node's token (access_control.py)."""
        metadata = {str(k): v for k, v in (self.context.invocation_metadata() or ())}
        token = metadata.get(access_control.TOKEN_HEADER)
        if not node or not access_control.node_proven(
            self.plane.store.dir, node, token if isinstance(token, str) else None
        ):
            why = "no node token" if token is None else "a token that is not this node's"
            self.plane.refuse(node, why)
            raise _Refused(
                f"node {node[:80]!r} is not served: {why} (an Envoy of this front door carries its token in "
                f"{access_control.TOKEN_HEADER})"
            )

    def _next_step(self, snap: Snapshot | None) -> tuple[str, Any, int] | None:
        if snap is None or snap.version == self.nacked_version:
            return None
        cds = self.acked[CDS]
        if CDS in self.subscribed:
            current = cds or {}
            if cds is None or any(current.get(k) != v for k, v in snap.clusters.items()):
                return CDS, {**current, **snap.clusters}, snap.version  # add/modify first, remove nothing
        if RDS in self.subscribed:
            wanted = {n: r for n, r in snap.routes.items() if n in self.subscribed[RDS]}
            if self.acked[RDS] != wanted:
                return RDS, wanted, snap.version
        if CDS in self.subscribed and cds is not None and set(cds) - set(snap.clusters):
            # No route references these any more; requests already on them get drain_s to finish.
            if time.monotonic() - self.route_acked_at < self.plane.drain_s:
                return None
            return CDS, dict(snap.clusters), snap.version
        if CDS in self.subscribed and RDS in self.subscribed and self.applied != snap.version:
            self.applied = snap.version
            self.nack = None
            self._write_status(connected=True)
        return None

    def _write_status(self, *, connected: bool) -> None:
        try:
            self.plane.store.write_status(
                self.node,
                {
                    "node": self.node,
                    "connected": connected,
                    "applied": self.applied,
                    "acked": {"cds": self.acked_version.get(CDS), "rds": self.acked_version.get(RDS)},
                    "nack": self.nack,
                    "updated": time.time(),
                },
            )
        except OSError as exc:  # a full disk must not take the stream (and Envoy's config) down
            log.warning("cannot write status for %s: %s", self.node, exc)


def _as_list(type_url: str, resources: Any) -> list[dict[str, Any]]:
    return list(resources.values())


class ControlPlane:
    """The gRPC ADS server plus the watcher of the state directory."""

    def __init__(
        self, state_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = None, drain_s: float = 2.0
    ) -> None:
        self.store = StateStore(state_dir)
        self.drain_s = drain_s  # between the route dropping a cluster and the cluster's removal
        self.host = host
        self.port = port  # None: the private socket only; 0: also a free loopback port
        self.socket_path = access_control.xds_socket(self.store.dir)
        self.refused = 0  # streams that did not prove their node
        self._refusal_log = RefusalLog(log)
        self.stopping = threading.Event()
        self._snap: Snapshot | None = None
        self._lock = threading.Lock()
        self._server: Any = None
        self._watcher: threading.Thread | None = None
        self.lease_watch = LeaseWatch(self.store)

    def snapshot(self) -> Snapshot | None:
        with self._lock:
            return self._snap

    def refuse(self, node: str, why: str) -> None:
        with self._lock:
            self.refused += 1
        self._refusal_log.warning("refused an xDS stream claiming node %r: %s", node[:80], why)

    def _refresh(self) -> None:
        version = self.store.version()
        if version < 0 or (self._snap is not None and self._snap.version == version):
            return
        try:
            snap = build_snapshot(self.store.read())
        except TrafficError as exc:
            log.error("ignoring unreadable state: %s", exc)
            return
        with self._lock:
            self._snap = snap

    def _watch(self) -> None:
        next_lease_look = 0.0
        while not self.stopping.wait(_WATCH_S):
            now = time.monotonic()
            if now >= next_lease_look:
                next_lease_look = now + _LEASE_LOOK_S
                self.lease_watch.check(now)
            self._refresh()

    def start(self) -> ControlPlane:
        import grpc
        from envoy.service.discovery.v3 import ads_pb2_grpc

        plane = self

        # The generated base class (ads_pb2_grpc.AggregatedDiscoveryServiceServicer) only answers UNIMPLEMENTED;
        # the stubs ship no types, so the servicer is a plain class with both of the service's methods.
        class Servicer:
            def StreamAggregatedResources(self, request_iterator: Any, context: Any) -> Iterator[Any]:  # noqa: N802
                yield from _Stream(plane, request_iterator, context).run()

            def DeltaAggregatedResources(self, request_iterator: Any, context: Any) -> Iterator[Any]:  # noqa: N802
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "delta xDS is not served: Envoy uses the ADS stream")
                yield from ()

        self._refresh()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32),
            options=[("grpc.keepalive_time_ms", 10_000), ("grpc.so_reuseport", 0)],
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(Servicer(), self._server)
        self.socket_path = access_control.xds_socket(self.store.dir)  # its private directory again, were it removed
        if self._server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise TrafficError(f"control plane cannot listen on {self.socket_path}")
        if self.port is not None:
            bound = self._server.add_insecure_port(f"{self.host}:{self.port}")
            if bound == 0:
                raise TrafficError(f"control plane cannot listen on {self.host}:{self.port} (port in use?)")
            self.port = bound
        self._server.start()
        os.chmod(self.socket_path, access_control.PRIVATE_FILE)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="xds-watch")
        self._watcher.start()
        where = f"{self.socket_path}" + (f" and {self.host}:{self.port}" if self.port is not None else "")
        log.info("control plane on %s, state %s", where, self.store.dir)
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self._server is not None:
            self._server.stop(grace=0).wait(5)
            self._server = None
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        access_control.remove_socket(self.socket_path)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(state_dir: str | Path, port: int | None = None, host: str = "127.0.0.1") -> None:
    """Run a control plane until SIGTERM/SIGINT. Prints ``listening <socket or port>`` once ready."""
    plane = ControlPlane(state_dir, host=host, port=port).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"listening {plane.port if plane.port is not None else plane.socket_path}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    plane.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gpumigrate.traffic.xds", description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--port", type=int, default=None, help="also a loopback port (its streams need node tokens too)")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.state_dir, args.port, args.host)


if __name__ == "__main__":
    main()
