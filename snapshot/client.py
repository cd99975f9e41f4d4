"""AgentClient: the orchestrator's side of an agent's control address (PROTOCOL.md).

The snapshot backends, ``World`` and the CLI reach a workload's engine only through it; the workload's
side is ``server.py``. On each connection the client first asks who is there (``hello``, answered with the
agent's id and epoch, signed with its agent key and bound to a fresh challenge), refuses an agent other
than the one it was told to expect (``agent=``), then signs every request with that agent's key
(``gpumigrate.agent_keys``, derived from the control key) for that agent's ``id#epoch`` only, and accepts
only replies signed bound to that request; an unsigned or forged reply is a failure. Its typed wrappers are
named ``request_<command>``: each sends one command and decodes the reply (``replies.py``).
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Mapping
from typing import Any

from gpumigrate import agent_keys, control, errors
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.interfaces import Restored, Round, StepLosses
from gpumigrate.snapshot.errors import AgentUnreachableError, EnvironmentMismatchError, ImageMismatchError
from gpumigrate.snapshot.precopy import Convergence, converge
from gpumigrate.snapshot.replies import AgentInfo, Zeroized, decode_round, decode_steps

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

    ``key``: the deployment's control key (bytes), or ``key_ref`` its reference (``{"env": NAME}`` / ``{"file":
    PATH}``); neither: ``gpumigrate.control.load_key()`` (the environment, else the state root's
    ``control.key``), read at the first call. ``agent``: the agent id expected there (or the id its ranks extend):
    any other is refused; ``source``: the agent there is a migration's source, never one of its targets.
    ``lend_key``: a target's grant to ask its source for ``lend`` only (``agent/fill.py``), in place of a control
    key.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 600.0,
        key: bytes | None = None,
        key_ref: Mapping[str, str] | None = None,
        agent: str | None = None,
        source: bool = False,
        lend_key: bytes | None = None,
    ) -> None:
        self.address = address
        self.source = source
        self._addr = parse_address(address)
        self.timeout_s = timeout_s
        self._key = key
        self._key_ref = dict(key_ref) if key_ref else None
        self.expect = agent
        self._lend_key = lend_key
        self.agent: str | None = None  # who answered the last hello: its id and epoch, and its key
        self.epoch: str | None = None
        self._agent_key: bytes | None = None
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._lock = threading.Lock()
        self._next = 0

    def _control_key(self) -> bytes:
        if self._key is None:
            self._key = control.load_key(self._key_ref)
        return self._key

    def _connect(self, cmd: str) -> None:
        try:
            self._sock = socket.create_connection(self._addr, timeout=self.timeout_s)
        except OSError as exc:
            raise AgentUnreachableError(
                f"cannot reach the snapshot agent at {self.address}: {exc.strerror or exc}"
            ) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rwb")
        try:
            self._hello(cmd)
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        if self._sock is not None:
            self._file.close()
            self._sock.close()
            self._sock = None

    def _hello(self, cmd: str) -> None:
        """Who is there: its id and epoch, proven by a signature bound to a fresh challenge (``server.py``)."""
        challenge = secrets.token_hex(16)
        hello: dict[str, Any] = {"id": 0, "cmd": "hello", "challenge": challenge}
        if self._lend_key is not None:
            hello["grant"] = True
        try:
            self._file.write((json.dumps(hello) + "\n").encode())
            self._file.flush()
            raw = self._file.readline()
        except OSError as exc:
            raise AgentUnreachableError(f"the snapshot agent at {self.address} dropped the connection: {exc}") from None
        reply = self._decode(raw, "hello")
        if "auth" not in reply:
            err = reply.get("error") or {}
            raise control.AuthError(
                f"the snapshot agent at {self.address} refused {cmd!r}: {err.get('message', 'no reason given')}",
                hint="the orchestrator and the workload must run the same gpumigrate, with one control key",
            )
        result = reply.get("result")
        result = result if isinstance(result, dict) else {}
        try:
            agent = agent_keys.check_pinned(result.get("agent"), self.expect, source=self.source)
            key = self._lend_key if self._lend_key is not None else agent_keys.agent_key(self._control_key(), agent)
            body = control.verify_hello(key, CHANNEL, challenge, reply)
        except control.AuthError as exc:
            raise control.AuthError(
                f"the snapshot agent at {self.address} refused {cmd!r}: {exc.message}",
                hint="the orchestrator and the workload must share one control key (GPUMIGRATE_CONTROL_KEY_FILE)",
            ) from None
        epoch = body["result"].get("epoch")
        if not isinstance(epoch, str) or not 8 <= len(epoch) <= 64 or not epoch.isalnum():
            raise control.AuthError(f"the snapshot agent at {self.address} gave no valid epoch in its hello")
        self.agent, self.epoch, self._agent_key = agent, epoch, key

    def _decode(self, raw: bytes, cmd: str) -> dict[str, Any]:
        if not raw:
            raise AgentUnreachableError(f"the snapshot agent at {self.address} closed the connection during {cmd!r}")
        try:
            reply = json.loads(raw)
        except ValueError:
            raise AgentUnreachableError(
                f"the snapshot agent at {self.address} answered {cmd!r} with something not JSON"
            ) from None
        if not isinstance(reply, dict):
            raise AgentUnreachableError(
                f"the snapshot agent at {self.address} answered {cmd!r} with something not an object"
            )
        return reply

    def identify(self) -> tuple[str, str]:
        """(agent id, epoch) of the agent there, proven by its hello."""
        with self._lock:
            if self._sock is None:
                self._connect("hello")
            assert self.agent is not None and self.epoch is not None
            return self.agent, self.epoch

    def close(self) -> None:
        with self._lock:
            self._drop()

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
                    self._connect(cmd)  # first: an unreachable agent is the news, whatever the key
                key: bytes = self._agent_key or b""  # set by the hello of _connect
                # Signed afresh for each attempt, for the agent's current epoch: a resent request would be refused.
                signed = control.sign_request(key, CHANNEL, body, audience=f"{self.agent}#{self.epoch}")
                if self._lend_key is not None:
                    signed["auth"]["grant"] = True
                try:
                    self._file.write((json.dumps(signed) + "\n").encode())
                    self._file.flush()
                    raw = self._file.readline()
                    if raw:
                        break
                except OSError:
                    pass
                self._drop()  # dropped: reconnect once (commands are idempotent or guarded by state)
                if attempt:
                    raise AgentUnreachableError(
                        f"the snapshot agent at {self.address} closed the connection during {cmd!r}"
                    )
        reply = self._decode(raw, cmd)
        if "auth" not in reply and not reply.get("ok"):
            # Unsigned: the agent refused our signature, or an impostor answered. Either way a failure; its text is
            # shown, never trusted for anything else.
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

    def lend_grant(self, source: str, *, expect: str | None = None) -> dict[str, str]:
        """The grant that lets the agent here (a target) ask the source agent at ``source`` to ``lend``, and only
        that: the source's lend key (of its current epoch) sealed to this agent's key. Needs the control key."""
        with AgentClient(source, key=self._control_key(), timeout_s=30.0, agent=expect, source=True) as src:
            src_agent, src_epoch = src.identify()
            assert src._agent_key is not None
            lend = agent_keys.lend_key(src._agent_key, src_epoch)
        target, _ = self.identify()
        assert self._agent_key is not None
        audience = f"{src_agent}#{src_epoch}"
        return {
            "source": audience,
            "sealed": agent_keys.seal(self._agent_key, agent_keys.grant_label(audience, target), lend),
        }

    # Typed wrappers: each reply is decoded here, once (PROTOCOL.md names the fields) ---------------
    def request_info(self) -> AgentInfo:
        return AgentInfo.decode(self.call("info"))

    def request_precopy(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> Round:
        reply = self.call("precopy", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}))
        return decode_round(reply)

    def precopy_until(
        self, store: str, key_ref: Mapping[str, str], *, max_rounds: int, max_downtime_ms: float
    ) -> Convergence:
        """Pre-copy rounds until the dirty set fits ``max_downtime_ms`` or stops shrinking."""
        return converge(
            lambda: self.request_precopy(store, key_ref), max_rounds=max_rounds, max_downtime_ms=max_downtime_ms
        )

    def request_freeze(self, lease_s: float | None = None) -> int:
        """Freeze at the safe point; with ``lease_s`` the source resumes by itself unless :meth:`request_renew` is
        called. Returns the safe points it completed before it parked (its step)."""
        reply = self.call("freeze") if lease_s is None else self.call("freeze", lease_s=lease_s)
        return int(reply.get("steps") or 0)

    def request_renew(self, lease_s: float | None = None) -> bool:
        """Extend a freeze's lease (and the hold of sealed work in flight); whether the agent is still frozen or holding."""
        args = {} if lease_s is None else {"lease_s": lease_s}
        reply = self.call("renew", **args)
        return bool(reply.get("frozen") or reply.get("holding"))

    def request_advance(self, steps: int, *, timeout_s: float | None = None) -> StepLosses:
        """Let a frozen training source take exactly ``steps`` more steps, then freeze it again."""
        args: dict[str, Any] = {"steps": steps}
        if timeout_s is not None:
            args["timeout_s"] = timeout_s
        return decode_steps(self.call("advance", **args))

    def request_metrics(self, since: int = 0) -> StepLosses:
        """Steps taken and the losses reported after step ``since``."""
        return decode_steps(self.call("metrics", since=since))

    def request_final(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> Round:
        reply = self.call("final", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}))
        return decode_round(reply)

    def request_resume(self) -> None:
        self.call("resume")

    def request_hand_over(self, target: str) -> dict[str, Any]:
        """The source's sealed work in flight goes on at ``target`` (the restored target's service URL)."""
        reply: dict[str, Any] = self.call("hand_over", target=target)
        return reply

    def request_take_back(self) -> dict[str, Any]:
        """The source's sealed work in flight goes on at the source (a rollback)."""
        reply: dict[str, Any] = self.call("take_back")
        return reply

    def request_restore(
        self,
        store: str,
        image_id: str,
        key_ref: Mapping[str, str],
        *,
        policy: Mapping[str, str] | None = None,
        ready: bool = True,
        rank: int | None = None,
        source: str | None = None,
    ) -> Restored:
        extra: dict[str, Any] = {} if rank is None else {"rank": rank}
        if source is not None:  # the target copies the source's tensors from its memory (snapshot/fill.py)
            extra.update(source=source, grant=self.lend_grant(source))
        reply = self.call(
            "restore",
            store=store,
            image_id=image_id,
            key_ref=dict(key_ref),
            policy=dict(policy or {}),
            ready=ready,
            **extra,
        )
        return Restored(
            image_id=str(reply["image"]),
            seconds=float(reply["seconds"]),
            bytes_loaded=int(reply["bytes_loaded"]),
            chunks_loaded=int(reply["chunks_loaded"]),
            chunks_skipped=int(reply["chunks_skipped"]),
            ready=bool(reply["ready"]),
            environment=dict(reply.get("environment") or {}),
            from_source=dict(reply.get("from_source") or {}),
        )

    def request_zeroize(self) -> Zeroized:
        reply = self.call("zeroize")
        return Zeroized(
            regions=int(reply["zeroized_regions"]),
            bytes=int(reply["zeroized_bytes"]),
            verified=bool(reply["verified"]),
            devices=tuple(reply.get("devices") or ()),
            seconds=float(reply["seconds"]),
        )


def agent_environment(
    address: str | None, *, timeout_s: float = 30.0, agent: str | None = None, source: bool = False
) -> dict[str, Any]:
    """The environment facts the agent at ``address`` reports (the core's collector, run in the workload's
    process: ``info``'s ``environment``); {} where there is no agent to ask. ``agent``, ``source``: who is
    expected there (:class:`AgentClient`)."""
    if not address:
        return {}
    with AgentClient(address, timeout_s=timeout_s, agent=agent, source=source) as client:
        return dict(client.request_info().environment)
