"""Who may hold one of the receiver's connections: a deadline on the whole handshake, and two caps.

A connection that has not authenticated (TLS handshake, then a HELLO signed with the control key) holds a thread
and a socket for nothing: it gets ``handshake_timeout_s`` from ``accept()`` for all of it, however slowly it
trickles bytes (a per-read timeout alone let a byte every few seconds hold a connection forever). At most
``max_unauthenticated`` such connections are kept; a new one sheds the oldest, so a flood of idle clients can hold
the receiver for no longer than one deadline and a real sender, whose handshake takes milliseconds, still gets in.
Authenticated connections (senders holding the control key) have a cap of their own, ``max_clients``, which
unauthenticated ones never count against. Every shed connection is counted by reason, and logged at a bounded rate.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from gpumigrate.errors import InvalidInputError

log = logging.getLogger("gpumigrate.transfer.receiver")

HANDSHAKE_DEADLINE = "handshake_deadline"
UNAUTHENTICATED_CAP = "unauthenticated_cap"
CLIENTS_CAP = "clients_cap"


@dataclass(frozen=True)
class ReceiverLimits:
    """How long a client may take to prove itself, and how many connections the receiver keeps."""

    handshake_timeout_s: float = 10.0  # accept() to a verified HELLO, all of it
    max_unauthenticated: int = 16  # connections still proving themselves; the oldest is shed past it
    max_clients: int = 64  # authenticated connections (a sender opens one per --parallelism)

    def __post_init__(self) -> None:
        if not self.handshake_timeout_s > 0 or self.max_unauthenticated < 1 or self.max_clients < 1:
            raise InvalidInputError(
                f"receiver limits {self} are out of range",
                hint="the handshake timeout must be positive, and each connection cap at least 1",
            )


class RateLimitedLog:
    """At most ``burst`` warnings per ``period_s`` seconds; the ones held back are counted and the next warning
    written says how many (a flood of refusals must not flood the log that an operator reads)."""

    def __init__(self, logger: logging.Logger, *, period_s: float = 10.0, burst: int = 5) -> None:
        self.logger, self.period_s, self.burst = logger, period_s, burst
        self._lock = threading.Lock()
        self._window = 0.0
        self._written = 0
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self.period_s:
                self._window, self._written = now, 0
            if self._written >= self.burst:
                self._held += 1
                return
            self._written += 1
            held, self._held = self._held, 0
        suffix = f" ({held} more like it were not logged)" if held else ""
        self.logger.warning(message + suffix, *args)

    def flush(self) -> None:
        """Say how many warnings were held back since the last one written (at the end of a run)."""
        with self._lock:
            held, self._held = self._held, 0
        if held:
            self.logger.warning("%d more warnings like the last were not logged (rate limit)", held)


class Admission:
    """The receiver's connections by state: still proving themselves (with a deadline each) or authenticated."""

    def __init__(self, limits: ReceiverLimits) -> None:
        self.limits = limits
        self.shed: Counter[str] = Counter()
        self.log = RateLimitedLog(log)
        self._cond = threading.Condition()
        # Each connection by its accepted socket object, with a duplicate of its descriptor (``handle``): wrapping the
        # socket in TLS detaches the object, and the handle can still shut the connection down, with no risk that
        # its number was reused meanwhile. Unauthenticated ones in accept order: the oldest (first deadline) first.
        self._pending: dict[socket.socket, tuple[float, str, socket.socket]] = {}
        self._clients: dict[socket.socket, socket.socket] = {}
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="gm-recv-deadline", daemon=True)
        self._reaper.start()

    def admit(self, raw: socket.socket, peer: str) -> None:
        """A new connection, unauthenticated until :meth:`authenticate`; the oldest such one is shed at the cap."""
        victims: list[tuple[float, str, socket.socket]] = []
        handle = raw.dup()
        with self._cond:
            while len(self._pending) >= self.limits.max_unauthenticated:
                victims.append(self._pending.pop(next(iter(self._pending))))
            self._pending[raw] = (time.monotonic() + self.limits.handshake_timeout_s, peer, handle)
            self._cond.notify()
        why = f"{self.limits.max_unauthenticated} unauthenticated connections already"
        for _, who, victim in victims:
            self._shed(victim, who, UNAUTHENTICATED_CAP, why)

    def authenticate(self, raw: socket.socket) -> str | None:
        """Move a connection whose HELLO verified to the authenticated ones; the reason it may not (None: it may)."""
        with self._cond:
            if raw not in self._pending:
                return "the handshake took longer than allowed, or the connection was shed"
            _, _, handle = self._pending.pop(raw)
            if len(self._clients) >= self.limits.max_clients:
                self.shed[CLIENTS_CAP] += 1
                handle.close()
                return f"the receiver serves {self.limits.max_clients} authenticated connections already"
            self._clients[raw] = handle
        return None

    def forget(self, raw: socket.socket) -> None:
        """The connection's thread is done with it (call before closing it)."""
        with self._cond:
            pending = self._pending.pop(raw, None)
            handle = self._clients.pop(raw, None) or (pending[2] if pending else None)
        if handle is not None:
            handle.close()

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"unauthenticated": len(self._pending), "authenticated": len(self._clients)}

    def close(self) -> None:
        """Stop the deadline thread and shut every connection down (their threads see the end and finish)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            handles = [entry[2] for entry in self._pending.values()] + list(self._clients.values())
        self._reaper.join(timeout=5)
        self.log.flush()
        for handle in handles:
            with contextlib.suppress(OSError):
                handle.shutdown(socket.SHUT_RDWR)

    def _shed(self, handle: socket.socket, peer: str, reason: str, why: str) -> None:
        with self._cond:
            self.shed[reason] += 1
        self.log.warning("receiver shed the connection from %s: %s", peer, why)
        with contextlib.suppress(OSError):
            handle.shutdown(socket.SHUT_RDWR)  # its thread's blocked read returns and it closes the socket
        handle.close()

    def _reap(self) -> None:
        """Shed every connection still unauthenticated at its deadline (woken by the next deadline or a new one)."""
        while True:
            expired: list[tuple[socket.socket, str]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for raw, (deadline, peer, handle) in list(self._pending.items()):
                    if deadline > now:
                        break
                    del self._pending[raw]
                    expired.append((handle, peer))
                if not expired:
                    first = next(iter(self._pending.values()), None)
                    self._cond.wait(None if first is None else first[0] - now)
                    continue
            for handle, peer in expired:
                why = f"no signed HELLO within {self.limits.handshake_timeout_s:g}s of connecting"
                self._shed(handle, peer, HANDSHAKE_DEADLINE, why)
