"""AgentClient: the flows' and the CLI's handle on an agent's control address (PROTOCOL.md).

Every request is signed with the control key (``gpumigrate.control``, channel ``agent``) and every
reply must carry a signature bound to that request; an unsigned or forged reply is a failure.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from typing import Any

from gpumigrate import control, errors
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.interfaces import RoundStats
from gpumigrate.snapshot.errors import EnvironmentMismatchError, ImageMismatchError
from gpumigrate.snapshot.precopy import Convergence, converge

_ERRORS: dict[str, type[GpumigrateError]] = {
    "AuthError": control.AuthError,
    "ImageMismatchError": ImageMismatchError,
    "EnvironmentMismatchError": EnvironmentMismatchError,
    **{
        n: getattr(errors, n)
        for n in (
            "SnapshotError",
            "IntegrityError",
            "DecryptionError",
            "NotFoundError",
            "TransferError",
            "InvalidInputError",
            "PolicyDeniedError",
        )
    },
}


CHANNEL = "agent"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise errors.InvalidInputError(f"agent address {address!r} is not HOST:PORT (e.g. 127.0.0.1:17070)")
    return host.strip("[]"), int(port)


class AgentClient:
    """One persistent connection to an agent; thread-safe; reconnects once if the connection dropped.

    ``key``: the control key (bytes), or ``key_ref`` its reference (``{"env": NAME}`` / ``{"file":
    PATH}``); neither: ``gpumigrate.control.load_key()`` (the environment, else the state root's
    ``control.key``), read at the first call.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 600.0,
        key: bytes | None = None,
        key_ref: Mapping[str, str] | None = None,
    ) -> None:
        self.address = address
        self._addr = parse_address(address)
        self.timeout_s = timeout_s
        self._key = key
        self._key_ref = dict(key_ref) if key_ref else None
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._lock = threading.Lock()
        self._next = 0

    def _control_key(self) -> bytes:
        if self._key is None:
            self._key = control.load_key(self._key_ref)
        return self._key

    def _connect(self) -> None:
        try:
            self._sock = socket.create_connection(self._addr, timeout=self.timeout_s)
        except OSError as exc:
            raise SnapshotError(f"cannot reach the snapshot agent at {self.address}: {exc.strerror or exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rwb")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._file.close()
                self._sock.close()
                self._sock = None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, cmd: str, **args: Any) -> Any:
        with self._lock:
            self._next += 1
            body = {"id": self._next, "cmd": cmd, "args": args}
            for attempt in (0, 1):
                if self._sock is None:
                    self._connect()  # first: an unreachable agent is the news, whatever the key
                key = self._control_key()
                # Signed afresh for each attempt: a resent request would be refused as a replay.
                signed = control.sign_request(key, CHANNEL, body)
                try:
                    self._file.write((json.dumps(signed) + "\n").encode())
                    self._file.flush()
                    raw = self._file.readline()
                    if raw:
                        break
                except OSError:
                    pass
                self._sock = None  # dropped: reconnect once (commands are idempotent or guarded by state)
                if attempt:
                    raise SnapshotError(f"the snapshot agent at {self.address} closed the connection during {cmd!r}")
        try:
            reply = json.loads(raw)
        except json.JSONDecodeError:
            raise SnapshotError(
                f"the snapshot agent at {self.address} answered {cmd!r} with something not JSON"
            ) from None
        if not isinstance(reply, dict):
            raise SnapshotError(f"the snapshot agent at {self.address} answered {cmd!r} with something not an object")
        if "auth" not in reply and not reply.get("ok"):
            # Unsigned: the agent refused our signature (it cannot know we share its key), or an impostor
            # answered. Either way a failure; its text is shown, never trusted for anything else.
            err = reply.get("error") or {}
            raise control.AuthError(
                f"the snapshot agent at {self.address} refused {cmd!r}: {err.get('message', 'no reason given')}",
                hint="the orchestrator and the workload must share one control key (GPUMIGRATE_CONTROL_KEY_FILE)",
            )
        reply = control.verify_reply(key, CHANNEL, signed["auth"]["nonce"], reply)
        if reply.get("ok"):
            return reply["result"]
        err = reply.get("error") or {}
        cls = _ERRORS.get(err.get("type", ""), SnapshotError)
        exc = cls.__new__(cls)
        GpumigrateError.__init__(exc, err.get("message", "agent error"), hint=err.get("hint"))
        raise exc

    # Thin typed wrappers -------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return self.call("info")

    def precopy(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.call("precopy", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}))

    def precopy_until(
        self, store: str, key_ref: Mapping[str, str], *, max_rounds: int, max_downtime_ms: float
    ) -> Convergence:
        """Pre-copy rounds until the dirty set fits ``max_downtime_ms`` or stops shrinking."""
        images: list[str] = []

        def one() -> RoundStats:
            res = self.precopy(store, key_ref)
            images.append(res["image"]["id"])
            return RoundStats(**res["stats"])

        out = converge(one, max_rounds=max_rounds, max_downtime_ms=max_downtime_ms)
        out.images = images
        return out

    def freeze(self) -> dict[str, Any]:
        return self.call("freeze")

    def final(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.call("final", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}))

    def resume(self) -> dict[str, Any]:
        return self.call("resume")

    def restore(
        self,
        store: str,
        image_id: str,
        key_ref: Mapping[str, str],
        *,
        policy: Mapping[str, str] | None = None,
        ready: bool = True,
        rank: int | None = None,
    ) -> dict[str, Any]:
        extra = {} if rank is None else {"rank": rank}
        return self.call(
            "restore",
            store=store,
            image_id=image_id,
            key_ref=dict(key_ref),
            policy=dict(policy or {}),
            ready=ready,
            **extra,
        )

    def zeroize(self) -> dict[str, Any]:
        return self.call("zeroize")
