"""Append-only, hash-chained audit log (``audit.jsonl``).

Each line is one JSON record ``{"seq", "ts", "actor", "event", "data", "prev"}`` where ``prev`` is
the SHA-256 (hex) of the previous line's exact bytes (without its newline); the first record's
``prev`` is 64 zeros. Appends are fsynced. :func:`verify` re-walks the chain and names the first
record that is malformed, out of order, or whose ``prev`` does not match — so a tampered,
reordered or truncated log is detected. Truncation at the end is detected against the record
count and tail hash kept in the migration's ``state.json`` (see :mod:`gpumigrate.state`).
Secrets never go here: callers pass identifiers and digests, never keys or credentials.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.errors import IntegrityError
from gpumigrate.settings import operator

GENESIS = "0" * 64


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


@dataclass(frozen=True)
class ChainHead:
    count: int
    tail: str  # sha256 of the last record line, GENESIS if empty


class AuditLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, event: str, data: dict[str, Any] | None = None, *, actor: str | None = None) -> ChainHead:
        """Append one record under an exclusive lock; returns the new chain head."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            head = _scan(self.path, strict=False)
            record = {
                "seq": head.count,
                "ts": time.time(),
                "actor": actor or operator(),
                "event": event,
                "data": data or {},
                "prev": head.tail,
            }
            line = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str).encode()
            os.write(fd, line + b"\n")
            os.fsync(fd)
            return ChainHead(head.count + 1, _digest(line))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_bytes().splitlines() if x.strip()]

    def verify(self, expected: ChainHead | None = None) -> ChainHead:
        """Raise :class:`IntegrityError` naming the first bad record; return the head if all is well."""
        head = _scan(self.path, strict=True)
        if expected is not None and expected.count > head.count:
            raise IntegrityError(
                f"audit log truncated: state records {expected.count} entries, the log has {head.count} "
                f"(first missing record: #{head.count})"
            )
        if expected is not None and expected.count == head.count and expected.tail != head.tail:
            raise IntegrityError(f"audit log record #{head.count - 1} does not match the chain head kept in state.json")
        return head


def _scan(path: Path, *, strict: bool) -> ChainHead:
    if not path.exists():
        return ChainHead(0, GENESIS)
    raw = path.read_bytes()
    lines = raw.splitlines()
    if strict and raw and not raw.endswith(b"\n"):
        raise IntegrityError(f"audit record #{len(lines) - 1} is a partial record: truncated write")
    prev = GENESIS
    for index, line in enumerate(lines):
        if strict:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise IntegrityError(f"audit record #{index} is not valid JSON (tampered or truncated)") from None
            if not isinstance(rec, dict) or rec.get("seq") != index:
                raise IntegrityError(f"audit record #{index} is out of sequence: records were reordered or removed")
            if rec.get("prev") != prev:
                raise IntegrityError(
                    f"audit record #{index} ({rec.get('event')}) does not chain to the record before it: tampered or reordered"
                )
        prev = _digest(line)
    return ChainHead(len(lines), prev)
