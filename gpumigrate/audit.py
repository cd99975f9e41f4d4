"""Append-only audit logs: hash-chained, keyed (HMAC-SHA256) and anchored outside the state directory.

Format 2, specified in ``gpumigrate/AUDIT.md``. Each line is one record in canonical JSON; ``prev`` is
the SHA-256 of the previous line's exact bytes, ``mac`` an HMAC over the record with the audit key
(:mod:`gpumigrate.audit_key`), which never lives under ``$GPUMIGRATE_HOME``. After every append the
chain's new head (record count, digest of the last line), itself MACed, goes to each anchor of
:mod:`gpumigrate.audit_anchor`: a rewritten log fails its MACs, and a truncated or rolled-back one falls
behind a head kept where the rewriter cannot reach. :meth:`AuditLog.append` refuses to extend a log that
does not verify. Secrets never go here: callers pass identifiers and digests, never keys or credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumigrate.audit_anchor import configured_anchors
from gpumigrate.audit_key import key_id, load_audit_key
from gpumigrate.errors import GpumigrateError, IntegrityError, InvalidInputError
from gpumigrate.filelock import FileLock
from gpumigrate.interfaces import AuditAnchor
from gpumigrate.settings import identity, state_root

FORMAT = 2
GENESIS = "0" * 64
_RECORD_DOMAIN = b"gpumigrate-audit-record-v2\n"
_HEAD_DOMAIN = b"gpumigrate-audit-head-v2\n"
_log = logging.getLogger("gpumigrate.audit")


def canonical(obj: Any) -> bytes:
    """The one byte form of a record or head: keys sorted, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _mac(key: bytes, domain: bytes, body: dict[str, Any]) -> str:
    return hmac.new(key, domain + canonical(body), hashlib.sha256).hexdigest()


def _mac_ok(key: bytes, domain: bytes, signed: dict[str, Any]) -> bool:
    body = {k: v for k, v in signed.items() if k != "mac"}
    return isinstance(signed.get("mac"), str) and hmac.compare_digest(_mac(key, domain, body), signed["mac"])


@dataclass(frozen=True)
class ChainHead:
    count: int
    tail: str  # sha256 of the last record line, GENESIS if empty


@dataclass
class _Scan:
    """A log read strictly: every record parsed, chained, and (when keyed) MAC-checked."""

    digests: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    legacy: int = 0  # format-1 records (no MAC) at the start of the log
    chain: str | None = None

    @property
    def head(self) -> ChainHead:
        return ChainHead(len(self.digests), self.digests[-1] if self.digests else GENESIS)


@dataclass
class Verification:
    """What :meth:`AuditLog.verify` established. ``warnings`` are facts a reader must see, not failures."""

    count: int
    tail: str
    legacy_records: int
    chain: str | None
    key: str | None  # id of the key that verified the MACs
    anchors: list[dict[str, Any]]  # {anchor, heads, latest_count}
    warnings: list[str]

    @property
    def head(self) -> ChainHead:
        return ChainHead(self.count, self.tail)


def default_log_name(path: Path) -> str:
    """A log's name is its path under the state root (``migrations/m1/audit.jsonl``); records and heads
    carry it, so a record copied into another log fails its MAC."""
    resolved = path.resolve()
    root = state_root()
    return resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else resolved.as_posix()


class AuditLog:
    def __init__(
        self, path: str | Path, *, name: str | None = None, anchors: Sequence[AuditAnchor] | None = None
    ) -> None:
        self.path = Path(path)
        self._name = name
        self._anchors = list(anchors) if anchors is not None else None

    @property
    def name(self) -> str:
        return self._name or default_log_name(self.path)

    @property
    def anchor_name(self) -> str:
        """Where anchors file this log's heads: its absolute path, so that two state roots holding the same
        migration id never share heads (a state root that moves is verified where it was written)."""
        return self.path.resolve().as_posix()

    @property
    def anchors(self) -> list[AuditAnchor]:
        if self._anchors is None:
            self._anchors = configured_anchors()
        return self._anchors

    # -- writing ---------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[int]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(self.path, append=True) as fd:  # a stop signal cannot leave it held (filelock.py)
            yield fd

    def append(self, event: str, data: dict[str, Any] | None = None, *, actor: str | None = None) -> ChainHead:
        """Append one record under an exclusive lock and anchor the new head; returns it.

        Refuses (IntegrityError) a log that does not verify: a damaged record, a MAC that fails, or a log
        shorter than, or different from, the head its first anchor holds."""
        key = load_audit_key(create=True)
        with self._locked() as fd:
            scan = self._scan(key)
            chain = scan.chain
            if chain is None:
                chain = secrets.token_hex(16)  # a new chain (a new log, or the first keyed record after legacy ones)
            else:
                self._check_heads(self.anchors[0], [self.anchors[0].latest(self.anchor_name, chain)], scan, key)
            who = identity()
            record = {
                "v": FORMAT,
                "log": self.name,
                "chain": chain,
                "seq": len(scan.digests),
                "ts": time.time(),
                "actor": actor or who.name,
                "identity": who.to_json(),
                "event": event,
                "data": json.loads(canonical(data or {})),  # exactly what the MAC covers, once written
                "prev": scan.head.tail,
                "key": key_id(key),
            }
            record["mac"] = _mac(key, _RECORD_DOMAIN, record)
            line = canonical(record)
            os.write(fd, line + b"\n")
            os.fsync(fd)
            head = ChainHead(len(scan.digests) + 1, _digest(line))
            self._publish_all(key, chain, head)
            return head

    def _signed_head(self, key: bytes, chain: str, head: ChainHead) -> dict[str, Any]:
        doc: dict[str, Any] = {"v": FORMAT, "log": self.name, "chain": chain, "count": head.count,
                               "tail": head.tail, "ts": time.time(), "key": key_id(key)}  # fmt: skip
        doc["mac"] = _mac(key, _HEAD_DOMAIN, doc)
        return doc

    def _publish_all(self, key: bytes, chain: str, head: ChainHead) -> None:
        doc = self._signed_head(key, chain, head)
        first, *rest = self.anchors
        first.publish(self.anchor_name, chain, doc)  # the anchor appends check against: its failure is the caller's
        for anchor in rest:
            try:
                anchor.publish(self.anchor_name, chain, doc)
            except Exception as exc:  # a remote anchor that is down: the next append publishes a later head
                _log.warning("audit head of %s not anchored in %s: %s", self.name, anchor.describe(), exc)

    def anchor_to(self, anchor: AuditAnchor) -> dict[str, Any]:
        """Verify the log and publish its current head to ``anchor`` (the flows' call, e.g. a Prefect
        artifact at the end of each phase). Returns the head published."""
        key = load_audit_key()
        with self._locked():
            scan = self._scan(key)
            if scan.chain is None:
                raise IntegrityError(f"audit log {self.name} has no keyed records: nothing to anchor")
            doc = self._signed_head(key, scan.chain, scan.head)
        # Published after the lock is let go: a remote anchor can hang (Prefect's client retries a dead API for
        # minutes), and the log must stay writable meanwhile (a rollback records its steps while a stuck flow waits).
        anchor.publish(self.anchor_name, scan.chain, doc)
        return doc

    # -- reading ---------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_bytes().splitlines() if x.strip()]

    def _scan(self, key: bytes | None, key_error: InvalidInputError | None = None) -> _Scan:
        """Read every record strictly; raise IntegrityError naming the first that is wrong."""
        scan = _Scan()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return scan
        lines = raw.splitlines()
        if raw and not raw.endswith(b"\n"):
            raise IntegrityError(f"audit record #{len(lines) - 1} of {self.name} is a partial record: truncated write")
        prev = GENESIS
        for index, line in enumerate(lines):
            rec = _parse(line, index)
            if rec.get("seq") != index:
                raise IntegrityError(f"audit record #{index} is out of sequence: records were reordered or removed")
            if rec.get("prev") != prev:
                raise IntegrityError(
                    f"audit record #{index} ({_event(rec)}) does not chain to the record before it: tampered or reordered"
                )
            if "v" in rec:
                if key is None:
                    raise key_error or IntegrityError(f"audit record #{index} is keyed: the audit key is needed")
                self._check_record(rec, line, index, scan, key)
            elif scan.chain is not None:
                raise IntegrityError(f"audit record #{index} has no MAC after keyed records: inserted or altered")
            else:
                scan.legacy += 1
            prev = _digest(line)
            scan.digests.append(prev)
            scan.events.append(_event(rec))
        return scan

    def _check_record(self, rec: dict[str, Any], line: bytes, index: int, scan: _Scan, key: bytes) -> None:
        where = f"audit record #{index} ({_event(rec)})"
        if rec.get("v") != FORMAT:
            raise IntegrityError(f"{where} has format {rec.get('v')!r}: this gpumigrate reads format {FORMAT}")
        if rec.get("key") != key_id(key):
            raise IntegrityError(
                f"{where} was keyed with audit key {rec.get('key')!r}, not with the configured key {key_id(key)}: "
                "point GPUMIGRATE_AUDIT_KEY_FILE at the key that wrote this log"
            )
        if not _mac_ok(key, _RECORD_DOMAIN, rec):
            raise IntegrityError(f"{where} fails its MAC: altered, re-chained, or written without the audit key")
        if canonical(rec) != line:
            raise IntegrityError(f"{where} is not in canonical form: rewritten")
        if rec.get("log") != self.name:
            raise IntegrityError(f"{where} belongs to the log {rec.get('log')!r}, not {self.name!r}: copied in")
        if scan.chain is None:
            scan.chain = str(rec.get("chain"))
        elif rec.get("chain") != scan.chain:
            raise IntegrityError(f"{where} belongs to another chain: spliced in from another log")

    def _check_heads(self, anchor: AuditAnchor, heads: Sequence[dict[str, Any] | None], scan: _Scan, key: bytes) -> int:
        """Check the log against every head the anchor holds; return the largest anchored count."""
        valid: list[dict[str, Any]] = []
        for head in heads:
            if head is None:
                continue
            if not _mac_ok(key, _HEAD_DOMAIN, head) or head.get("log") != self.name or head.get("chain") != scan.chain:
                raise IntegrityError(f"a head in {anchor.describe()} fails its MAC check: the anchor was tampered with")
            valid.append(head)
        if not valid:
            return 0
        newest = max(valid, key=lambda h: int(h["count"]))
        if int(newest["count"]) > len(scan.digests):
            raise IntegrityError(
                f"audit log {self.name} truncated: the head anchored in {anchor.describe()} at "
                f"{_when(newest.get('ts'))} counts {newest['count']} records, the log has {len(scan.digests)} "
                f"(first missing record: #{len(scan.digests)})"
            )
        for head in valid:  # oldest first: the earliest rewritten record is the one named
            count = int(head["count"])
            if count and scan.digests[count - 1] != head.get("tail"):
                raise IntegrityError(
                    f"audit record #{count - 1} of {self.name} differs from the head anchored in {anchor.describe()} "
                    f"at {_when(head.get('ts'))}: the log was rewritten"
                )
        return int(newest["count"])

    def verify(
        self,
        expected: ChainHead | None = None,
        *,
        accept_legacy: bool = False,
        extra_anchors: Sequence[AuditAnchor] = (),
    ) -> Verification:
        """Raise :class:`IntegrityError` naming the first bad record; return what was verified.

        ``expected`` is a head kept elsewhere by the caller (``state.json``): checked too, never trusted
        alone. A log with format-1 (unkeyed) records is refused unless ``accept_legacy``."""
        raw_key, key_error = _try_key()
        scan = self._scan(raw_key, key_error)
        anchors = [*self.anchors, *extra_anchors]
        warnings: list[str] = []
        report: list[dict[str, Any]] = []
        if scan.legacy:
            note = (f"records #0-#{scan.legacy - 1} of {self.name} are format 1 (unkeyed): their chain proves order, "
                    "not who wrote them; whoever could write the state directory could have rewritten them")  # fmt: skip
            if not accept_legacy:
                raise IntegrityError(note + " (gpumigrate audit --accept-legacy checks them as a chain only)")
            warnings.append(note)
        if scan.chain is not None and raw_key is not None:
            for anchor in anchors:
                try:
                    heads = anchor.heads(self.anchor_name, scan.chain)
                except GpumigrateError:
                    raise
                except Exception as exc:
                    raise IntegrityError(f"cannot read the audit anchor {anchor.describe()}: {exc}") from None
                best = self._check_heads(anchor, heads, scan, raw_key)
                report.append({"anchor": anchor.describe(), "heads": len(heads), "latest_count": best})
            anchored = max((a["latest_count"] for a in report), default=0)
            if anchored == 0:
                raise IntegrityError(
                    f"no anchor holds a head of {self.name} (chain {scan.chain}): the log was moved or forged, or "
                    f"GPUMIGRATE_AUDIT_ANCHORS names other anchors than the ones that wrote it"
                )
            if anchored < len(scan.digests):
                warnings.append(
                    f"records #{anchored}-#{len(scan.digests) - 1} were written after the last anchored head "
                    "(a crash between the write and the anchor, or an anchor that was down)"
                )
        for anchor in anchors:
            others = [c for c in _safe_chains(anchor, self.anchor_name) if c != scan.chain]
            if others and scan.chain is None and scan.legacy:
                raise IntegrityError(
                    f"{anchor.describe()} holds keyed chains of {self.name} ({', '.join(others)}), and the log has "
                    "none: a keyed log was replaced by an unkeyed one"
                )
            if others:
                warnings.append(
                    f"{anchor.describe()} also holds {len(others)} other chain(s) of {self.name}: an earlier log "
                    "at this path was removed or replaced"
                )
        head = scan.head
        if expected is not None and expected.count > head.count:
            raise IntegrityError(
                f"audit log truncated: state records {expected.count} entries, the log has {head.count} "
                f"(first missing record: #{head.count})"
            )
        if expected is not None and expected.count == head.count and expected.tail != head.tail:
            raise IntegrityError(f"audit log record #{head.count - 1} does not match the chain head kept in state.json")
        return Verification(
            count=head.count, tail=head.tail, legacy_records=scan.legacy, chain=scan.chain,
            key=key_id(raw_key) if raw_key else None, anchors=report, warnings=warnings,
        )  # fmt: skip


def _parse(line: bytes, index: int) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise IntegrityError(f"audit record #{index} is not valid JSON (tampered or truncated)") from None
    if not isinstance(rec, dict):
        raise IntegrityError(f"audit record #{index} is not a JSON object (tampered)")
    return rec


def _event(rec: dict[str, Any]) -> str:
    return str(rec.get("event"))[:80]


def _when(ts: Any) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return "an unknown time"


def _try_key() -> tuple[bytes | None, InvalidInputError | None]:
    """The audit key, or why it cannot be loaded (a log of format-1 records only verifies without one)."""
    try:
        return load_audit_key(), None
    except InvalidInputError as exc:
        return None, exc


def _safe_chains(anchor: AuditAnchor, log: str) -> list[str]:
    try:
        return anchor.chains(log)
    except Exception as exc:  # listing is for a warning only; reading the heads above is what must work
        _log.warning("cannot list chains in %s: %s", anchor.describe(), exc)
        return []
