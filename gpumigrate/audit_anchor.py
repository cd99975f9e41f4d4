"""Where audit chain heads are anchored, outside the migration's directory (spec: ``gpumigrate/AUDIT.md``).

``$GPUMIGRATE_AUDIT_ANCHORS`` lists the anchors every record's new head goes to, comma-separated:

- ``file`` (the default): ``$XDG_STATE_HOME/gpumigrate/audit-anchors`` (``~/.local/state/...``);
- ``file:///abs/dir``: another directory (never inside the state root);
- ``s3://bucket/prefix[?mode=COMPLIANCE|GOVERNANCE&days=N]``: an S3 object under object lock
  (``gpumigrate.infra.anchor_s3``);
- ``prefect``: a Prefect artifact per chain (``gpumigrate.audit_anchor_prefect``).

Schemes other than ``file`` come from the entry-point group ``gpumigrate.audit_anchors`` (one
callable per scheme taking the URL), so the core names no cloud SDK and a new anchor is one module.
The flows publish a head to an anchor of their choice (a Prefect artifact at each phase) with
:func:`gpumigrate.audit.AuditLog.anchor_to`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from gpumigrate.errors import InvalidInputError
from gpumigrate.filelock import FileLock
from gpumigrate.interfaces import AuditAnchor
from gpumigrate.settings import state_root, user_state_dir

ANCHORS_ENV = "GPUMIGRATE_AUDIT_ANCHORS"
ENTRY_POINT_GROUP = "gpumigrate.audit_anchors"
_CHAIN_RE = re.compile(r"^[0-9a-f]{32}$")


def log_slug(log: str) -> str:
    """A file- and key-safe name for a log: readable part plus a digest of the full name (no collisions)."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", log).strip("._-")[-80:]
    return f"{readable}-{hashlib.sha256(log.encode()).hexdigest()[:10]}"


def check_chain(chain: str) -> str:
    if not _CHAIN_RE.match(chain):
        raise InvalidInputError(f"audit chain id {chain!r} is not 32 hex digits")
    return chain


def ordered_heads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Heads oldest first, for stores that do not keep publication order (object versions, artifacts)."""

    def number(value: Any) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return -1.0

    return sorted(docs, key=lambda d: (number(d.get("count")), number(d.get("ts"))))


class LocalFileAnchor:
    """Heads appended, one JSON line each, to ``<dir>/<log slug>/<chain>.jsonl``: a directory outside the
    state root, so rewriting ``$GPUMIGRATE_HOME`` leaves the heads where they were."""

    def __init__(self, directory: str | Path | None = None) -> None:
        chosen = Path(directory).expanduser() if directory else user_state_dir() / "audit-anchors"
        self.dir = chosen.resolve()
        root = state_root()
        if self.dir == root or self.dir.is_relative_to(root):
            raise InvalidInputError(
                f"the audit anchor directory {self.dir} is inside the state root {root}: an anchor beside the "
                f"logs protects nothing; name another in {ANCHORS_ENV} (default {user_state_dir()})"
            )

    def describe(self) -> str:
        return f"file://{self.dir}"

    def _path(self, log: str, chain: str) -> Path:
        return self.dir / log_slug(log) / f"{check_chain(chain)}.jsonl"

    def publish(self, log: str, chain: str, head: Mapping[str, Any]) -> None:
        path = self._path(log, chain)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        line = json.dumps(dict(head), sort_keys=True, separators=(",", ":")).encode() + b"\n"
        with FileLock(path, mode=0o600, append=True) as fd:
            os.write(fd, line)
            os.fsync(fd)

    def heads(self, log: str, chain: str) -> list[dict[str, Any]]:
        path = self._path(log, chain)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        out: list[dict[str, Any]] = []
        for lineno, line in enumerate(raw.splitlines(), start=1):
            try:
                head = json.loads(line)
            except json.JSONDecodeError:
                head = None
            if not isinstance(head, dict):
                # Kept as a head that fails its MAC check: a damaged anchor must never pass quietly.
                head = {"damaged": f"{path} line {lineno} is not a JSON object"}
            out.append(head)
        return out

    def latest(self, log: str, chain: str) -> dict[str, Any] | None:
        found = self.heads(log, chain)
        return found[-1] if found else None

    def chains(self, log: str) -> list[str]:
        folder = self.dir / log_slug(log)
        if not folder.is_dir():
            return []
        return sorted(p.stem for p in folder.glob("*.jsonl") if _CHAIN_RE.match(p.stem))


@cache
def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def anchor_from_url(url: str) -> AuditAnchor:
    """One anchor from its URL (see the module's docstring)."""
    text = url.strip()
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise InvalidInputError(f"audit anchor {text!r}: a URL holds no control characters")
    if text in ("file", "file:"):
        return LocalFileAnchor()
    scheme = text.split(":", 1)[0] if ":" in text else text
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc or not parts.path.startswith("/"):
            raise InvalidInputError(f"audit anchor {text!r}: write file:///absolute/dir (or just 'file')")
        return LocalFileAnchor(unquote(parts.path))
    plugin = _plugins().get(scheme)
    if plugin is None:
        known = ", ".join(sorted({"file", *_plugins()}))
        raise InvalidInputError(f"audit anchor {text!r}: unknown kind {scheme!r}; known: {known}")
    anchor = plugin.load()(text)
    if not isinstance(anchor, AuditAnchor):
        raise InvalidInputError(f"audit anchor {scheme!r}: its plugin did not return an anchor")
    return anchor


def configured_anchors() -> list[AuditAnchor]:
    """The anchors named by ``$GPUMIGRATE_AUDIT_ANCHORS`` (default: the local file anchor)."""
    spec = os.environ.get(ANCHORS_ENV, "").strip() or "file"
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    return [anchor_from_url(u) for u in urls]
