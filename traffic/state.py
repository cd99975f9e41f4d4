"""The control plane's desired state, kept in a directory so any process can read and change it.

Format: ``traffic/STATE_FORMAT.md``. The ramp controller writes weights here; the control plane
(in-process or ``gpumigrate traffic serve``) watches the file and pushes the change to every
Envoy over ADS; ``rollback_to_source`` works from any process (``gpumigrate rollback ID`` after
the flow ended). Writes are atomic (temp file, fsync, rename) and serialised by an flock, so two
writers never lose each other's update and a restarted control plane resends exactly this state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import InvalidInputError, TrafficError
from gpumigrate.filelock import FileLock
from gpumigrate.traffic.access_control import PRIVATE_FILE, private_dir

DESIRED = "desired.json"
STATUS_DIR = "status"
LEASE = "lease.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Upstream:
    name: str
    host: str
    port: int
    health_path: str = "/readyz"


@dataclass
class DesiredState:
    """What every Envoy should run. ``version`` increases by one on every change."""

    upstreams: dict[str, Upstream]
    weights: dict[str, float]  # percent of client traffic per upstream; sums to 100
    primary: str = "source"  # where a rollback sends all traffic
    idempotent: bool = True  # retry resets and 5xx on the other side (inference calls are pure)
    version: int = 0
    rolled_back: dict[str, Any] | None = None  # {"reason", "actor", "ts"} once rolled back
    updated: float = field(default_factory=time.time)
    failover: bool = True  # split over X_failover aggregates; False = plain split (benchmark baseline)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = FORMAT_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DesiredState:
        if d.get("format") != FORMAT_VERSION:
            raise TrafficError(f"traffic state format {d.get('format')!r} is not supported (expected {FORMAT_VERSION})")
        ups = {k: Upstream(**v) for k, v in d["upstreams"].items()}
        return cls(
            upstreams=ups,
            weights={k: float(v) for k, v in d["weights"].items()},
            primary=d["primary"],
            idempotent=bool(d.get("idempotent", True)),
            version=int(d["version"]),
            rolled_back=d.get("rolled_back"),
            updated=float(d.get("updated", 0)),
            failover=bool(d.get("failover", True)),
        )

    def holds_split(self) -> bool:
        """True while any traffic goes somewhere other than the primary."""
        return any(w > 0 for name, w in self.weights.items() if name != self.primary)

    def validate(self) -> None:
        if self.primary not in self.upstreams:
            raise InvalidInputError(f"primary upstream {self.primary!r} is not one of {sorted(self.upstreams)}")
        unknown = set(self.weights) - set(self.upstreams)
        if unknown:
            raise InvalidInputError(
                f"weights name unknown upstreams {sorted(unknown)}; allowed: {sorted(self.upstreams)}"
            )
        if any(w < 0 or w > 100 for w in self.weights.values()):
            raise InvalidInputError(f"weights must be 0..100 percent, got {self.weights}")
        if abs(sum(self.weights.values()) - 100.0) > 1e-6:
            raise InvalidInputError(f"weights must sum to 100 percent, got {self.weights}")
        for u in self.upstreams.values():
            if not u.name.replace("-", "").replace("_", "").isalnum() or "." in u.name:
                raise InvalidInputError(f"upstream name {u.name!r}: use letters, digits, '-' and '_'")


@dataclass(frozen=True)
class Lease:
    """The ramp's claim on a split: renewed at least every ``interval_s``; void after ``length_s`` without.

    Only the holder writes ``lease.json``; the control plane reads it and, once it has seen no new
    ``seq`` for ``length_s`` by its own clock, sends everything back to the primary.
    """

    holder: str
    interval_s: float
    length_s: float
    seq: int
    renewed: float  # epoch seconds, for people reading the file; expiry is judged by the reader's clock

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Lease:
        if d.get("format") != FORMAT_VERSION:
            raise TrafficError(f"traffic lease format {d.get('format')!r} is not supported (expected {FORMAT_VERSION})")
        return cls(
            holder=str(d["holder"]),
            interval_s=float(d["interval_s"]),
            length_s=float(d["length_s"]),
            seq=int(d["seq"]),
            renewed=float(d["renewed"]),
        )


def split(primary: str, other: str, other_weight: float) -> dict[str, float]:
    """Weights for a two-way split: ``other_weight`` percent to ``other``, the rest to ``primary``."""
    if not 0 <= other_weight <= 100:
        raise InvalidInputError(f"weight must be 0..100 percent, got {other_weight}")
    return {primary: round(100.0 - other_weight, 4), other: round(float(other_weight), 4)}


class StateStore:
    """One control plane's state directory."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)

    @property
    def path(self) -> Path:
        return self.dir / DESIRED

    def exists(self) -> bool:
        return self.path.exists()

    def read(self) -> DesiredState:
        try:
            return DesiredState.from_json(json.loads(self.path.read_text()))
        except FileNotFoundError:
            raise TrafficError(f"no traffic state in {self.dir} (nothing was set up there)") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TrafficError(f"traffic state {self.path} is unreadable: {exc}") from None

    def version(self) -> int:
        """Cheap read of the current version (-1 when there is no state yet)."""
        try:
            return int(json.loads(self.path.read_text())["version"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return -1

    @contextmanager
    def _locked(self, *, create: bool = False) -> Iterator[None]:
        if create:
            private_dir(self.dir)  # the door's state: this user's only (access_control.py)
        elif not self.path.exists():
            raise TrafficError(f"no traffic state in {self.dir} (nothing was set up there)")
        with FileLock(self.dir / ".lock", mode=PRIVATE_FILE, nofollow=True):  # a stop signal cannot leave it held
            yield

    def init(self, state: DesiredState) -> DesiredState:
        """Write the first state (or replace the upstreams of an existing one), bumping the version."""
        state.validate()
        with self._locked(create=True):
            state.version = self.version() + 1 if self.exists() else 1
            state.updated = time.time()
            atomic_write_json(self.path, state.to_json(), mode=PRIVATE_FILE)
        return state

    def update(self, change: Callable[[DesiredState], None]) -> DesiredState:
        """Read, apply ``change`` in place, validate, write with version + 1, all under the lock."""
        with self._locked():
            state = self.read()
            change(state)
            state.validate()
            state.version += 1
            state.updated = time.time()
            atomic_write_json(self.path, state.to_json(), mode=PRIVATE_FILE)
        return state

    def set_weights(self, weights: dict[str, float], *, allow_after_rollback: bool = False) -> DesiredState:
        def change(s: DesiredState) -> None:
            if s.rolled_back and not allow_after_rollback:
                raise TrafficError(
                    f"traffic was rolled back ({s.rolled_back.get('reason')}); weights stay on {s.primary}"
                )
            s.weights = dict(weights)

        return self.update(change)

    # -- the ramp's lease on a split (the control plane's dead man's switch) ------------
    @property
    def lease_path(self) -> Path:
        return self.dir / LEASE

    def renew_lease(self, holder: str, *, interval_s: float, length_s: float, seq: int) -> Lease:
        """Write the holder's renewal number ``seq`` (each renewal must change it)."""
        if not 0 < interval_s <= length_s:
            raise InvalidInputError(f"a lease needs 0 < interval_s <= length_s, got {interval_s}, {length_s}")
        lease = Lease(holder, interval_s, length_s, seq, time.time())
        atomic_write_json(self.lease_path, lease.to_json(), mode=PRIVATE_FILE)
        return lease

    def lease(self) -> Lease | None:
        """The current lease, or None when no ramp holds one (an unreadable file counts as held: the
        reader keeps the previous renewal it saw and judges expiry from that)."""
        try:
            return Lease.from_json(json.loads(self.lease_path.read_text()))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TrafficError(f"traffic lease {self.lease_path} is unreadable: {exc}") from None

    def release_lease(self, holder: str | None = None) -> None:
        """End the lease (the ramp finished, or the control plane acted on its expiry). With ``holder``,
        only that holder's lease is removed."""
        if holder is not None:
            try:
                current = self.lease()
            except TrafficError:
                current = None
            if current is not None and current.holder != holder:
                return
        self.lease_path.unlink(missing_ok=True)

    # -- per-Envoy status written by the control plane -------------------------------
    def write_status(self, node: str, status: dict[str, Any]) -> None:
        atomic_write_json(self.dir / STATUS_DIR / f"{_safe(node)}.json", status, mode=PRIVATE_FILE)

    def status(self, node: str) -> dict[str, Any]:
        """What the control plane last wrote about ``node`` (``{}``: nothing yet)."""
        return self.statuses().get(_safe(node), {})

    def statuses(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        d = self.dir / STATUS_DIR
        if d.is_dir():
            for p in d.glob("*.json"):
                try:
                    out[p.stem] = json.loads(p.read_text())
                except json.JSONDecodeError:
                    continue  # being replaced right now; the next poll reads it
        return out

    def wait_applied(
        self, version: int, nodes: list[str], *, timeout_s: float = 10.0, tick: Callable[[], None] | None = None
    ) -> None:
        """Block until every node ACKed ``version`` (or later). A NACK raises :class:`TrafficError`.
        ``tick`` is called on every poll (the ramp renews its lease there while it waits)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if tick is not None:
                tick()
            st = self.statuses()
            pending = []
            for node in nodes:
                s = st.get(_safe(node), {})
                nack = s.get("nack")
                if nack and int(nack.get("version", -1)) >= version:
                    raise TrafficError(
                        f"envoy {node} rejected config version {nack['version']} ({nack.get('type')}): "
                        f"{nack.get('error')}; it keeps serving its last good config"
                    )
                if int(s.get("applied", -1)) < version:
                    pending.append(node)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TrafficError(
                    f"envoy {', '.join(pending)} did not apply traffic config version {version} "
                    f"within {timeout_s:.0f}s (is the control plane running?)"
                )
            time.sleep(0.02)


def rollback_to_source(state_dir: str | Path, reason: str, *, actor: str | None = None, **details: Any) -> DesiredState:
    """Send 100% of traffic to the primary (source) in one update. Works from any process; idempotent.

    ``details`` (e.g. ``trigger="lease"``) are kept in ``rolled_back`` beside the reason.
    """
    from gpumigrate.settings import operator

    store = StateStore(state_dir)

    def change(s: DesiredState) -> None:
        s.weights = {name: (100.0 if name == s.primary else 0.0) for name in s.upstreams}
        if not s.rolled_back:
            s.rolled_back = {**details, "reason": reason, "actor": actor or operator(), "ts": time.time()}

    return store.update(change)


def _safe(node: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in node)[:100]
