"""The migration's state record: one directory per migration under the state root.

Layout of ``<state root>/migrations/<id>/``::

    state.json        phase results and the audit chain head; atomic writes (temp, fsync, rename)
    audit.jsonl       the keyed, hash-chained audit log (gpumigrate.audit); its head is anchored outside
    plan.yaml         the plan as submitted (never holds secrets: keys are references)
    rollback.request  present when someone asked for a rollback (CLI, Prefect UI); JSON with reason
    artifacts/        reports, charts, parity results

Each phase records ``status`` (pending|running|completed|failed|skipped|rolled_back), ``seconds``
and a small ``result`` dict; a re-run with the same id skips phases already completed.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpumigrate.atomic import atomic_write_json
from gpumigrate.audit import AuditLog, ChainHead, Verification
from gpumigrate.errors import InvalidInputError, NotFoundError
from gpumigrate.filelock import FileLock
from gpumigrate.interfaces import AuditAnchor
from gpumigrate.settings import identity, migrations_dir, operator

PHASES = ("preflight", "provision", "snapshot", "transfer", "restore", "parity", "ramp", "finalize")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")


def new_migration_id(workload: str) -> str:
    return f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def check_id(migration_id: str) -> str:
    if not _ID_RE.match(migration_id):
        raise InvalidInputError(
            f"migration id {migration_id!r} is not valid: use letters, digits, '.', '_' and '-' (1-80 characters)"
        )
    return migration_id


class Migration:
    """Handle on one migration's directory. Cheap to create; reads and writes go to disk each time."""

    def __init__(self, migration_id: str, root: Path | None = None) -> None:
        self.id = check_id(migration_id)
        self.dir = (root or migrations_dir()) / migration_id
        self.audit = AuditLog(self.dir / "audit.jsonl")

    # -- lifecycle -----------------------------------------------------------------
    @classmethod
    def create(cls, migration_id: str, plan_text: str, *, root: Path | None = None) -> Migration:
        m = cls(migration_id, root)
        if (m.dir / "state.json").exists():
            raise InvalidInputError(f"migration {migration_id} already exists: use --resume to continue it")
        m.dir.mkdir(parents=True, exist_ok=True)
        (m.dir / "artifacts").mkdir(exist_ok=True)
        from gpumigrate.atomic import atomic_write_bytes

        atomic_write_bytes(m.dir / "plan.yaml", plan_text.encode())
        m._write({"id": migration_id, "created": time.time(), "status": "running", "phases": {}, "result": {}})
        m.record("migration.created", {"plan_sha256": plan_sha256(plan_text)})
        return m

    @classmethod
    def open(cls, migration_id: str, *, root: Path | None = None) -> Migration:
        m = cls(migration_id, root)
        if not (m.dir / "state.json").exists():
            raise NotFoundError(f"no migration {migration_id!r} under {m.dir.parent}")
        return m

    @property
    def exists(self) -> bool:
        return (self.dir / "state.json").exists()

    @property
    def artifacts(self) -> Path:
        p = self.dir / "artifacts"
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def plan_path(self) -> Path:
        return self.dir / "plan.yaml"

    def recorded_plan_sha256(self) -> str:
        """The sha256 of the plan this migration was created with: as its audit recorded it at creation, else
        (an audit without that record) of its stored copy."""
        for rec in self.audit.records():
            if rec.get("event") == "migration.created" and (rec.get("data") or {}).get("plan_sha256"):
                return str(rec["data"]["plan_sha256"])
        return plan_sha256(self.plan_path.read_text())

    # -- state ----------------------------------------------------------------------
    def read(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads((self.dir / "state.json").read_text())
            return state
        except FileNotFoundError:
            raise NotFoundError(f"no migration {self.id!r} under {self.dir.parent}") from None

    def _write(self, state: dict[str, Any]) -> None:
        atomic_write_json(self.dir / "state.json", state)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise read-modify-write of state.json across threads and processes (CLI, flow, rollback)."""
        with FileLock(self.dir / ".state.lock"):  # a stop signal cannot leave it held (filelock.py)
            yield

    def mutate(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to the state under the lock and write it atomically; returns the new state."""
        with self._locked():
            state = self.read()
            change(state)
            self._write(state)
            return state

    def update(self, **fields: Any) -> dict[str, Any]:
        return self.mutate(lambda state: state.update(fields))

    def phase(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.read().get("phases", {}).get(name, {"status": "pending"})
        return entry

    def set_phase(
        self, name: str, status: str, *, seconds: float | None = None, result: dict[str, Any] | None = None
    ) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}")

        def change(state: dict[str, Any]) -> None:
            entry = state.setdefault("phases", {}).get(name, {})
            entry["status"] = status
            if seconds is not None:
                entry["seconds"] = round(seconds, 3)
            if result is not None:
                entry["result"] = result
            state["phases"][name] = entry

        self.mutate(change)

    @contextmanager
    def running_phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Mark a phase running, time it, and record completed/failed. Yields a dict for the result."""
        result: dict[str, Any] = {}
        self.set_phase(name, "running")
        self.record(f"phase.{name}.started")
        start = time.monotonic()
        try:
            yield result
        except BaseException as exc:
            self.set_phase(name, "failed", seconds=time.monotonic() - start, result={**result, "error": str(exc)[:500]})
            self.record(f"phase.{name}.failed", {"error": str(exc)[:500]})
            raise
        self.set_phase(name, "completed", seconds=time.monotonic() - start, result=result)
        self.record(f"phase.{name}.completed", {k: v for k, v in result.items() if _small(v)})

    # -- audit ----------------------------------------------------------------------
    def record(self, event: str, data: dict[str, Any] | None = None, *, actor: str | None = None) -> None:
        if not (self.dir / "state.json").exists():
            self.audit.append(event, data, actor=actor)
            return
        with self._locked():  # the chain head in state.json moves with the log, never behind it
            head = self.audit.append(event, data, actor=actor)
            state = self.read()
            state["audit_head"] = {"count": head.count, "tail": head.tail}
            self._write(state)

    def verify_audit(self, *, accept_legacy: bool = False, extra_anchors: Sequence[AuditAnchor] = ()) -> Verification:
        """Verify the keyed chain against its anchors (gpumigrate/AUDIT.md) and the head kept in state.json."""
        head = self.read().get("audit_head")
        expected = ChainHead(head["count"], head["tail"]) if isinstance(head, dict) and "count" in head else None
        return self.audit.verify(expected, accept_legacy=accept_legacy, extra_anchors=extra_anchors)

    # -- rollback signal -----------------------------------------------------------
    def request_rollback(self, reason: str, *, actor: str | None = None, record: bool = True) -> None:
        """The request the running flow acts on. ``record=False``: the caller records ``rollback.requested`` itself
        once it acted (``gpumigrate rollback`` moves traffic first; the audit's actor may take seconds to prove),
        and the request names the claimed operator until then."""
        who = actor or (identity().name if record else operator())
        atomic_write_json(self.dir / "rollback.request", {"reason": reason, "actor": who, "ts": time.time()})
        if record:
            self.record("rollback.requested", {"reason": reason}, actor=actor)

    def rollback_requested(self) -> dict[str, Any] | None:
        try:
            request: dict[str, Any] = json.loads((self.dir / "rollback.request").read_text())
            return request
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def clear_rollback_request(self) -> None:
        (self.dir / "rollback.request").unlink(missing_ok=True)


def list_migrations(root: Path | None = None) -> list[str]:
    base = root or migrations_dir()
    if not base.exists():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "state.json").exists())


def plan_sha256(text: str) -> str:
    """A plan's content hash, as a migration's audit records it."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _small(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) and len(str(v)) < 300
