"""Audit events of a migration, with in-process listeners.

Every phase reports what it decided through :func:`emit`: the event goes to the migration's
hash-chained audit log (prefixes ``residency.``, ``image.``, ``parity.``, ``traffic.``, ``rollback.``
are what ``gpumigrate audit`` groups) and to any listener registered for that migration in this
process — the CLI's live view and the demo's fault injector listen; the flow never depends on them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpumigrate.state import Migration

Listener = Callable[[str, dict[str, Any]], None]

_lock = threading.Lock()
_listeners: dict[str, list[Listener]] = {}
_log = logging.getLogger("gpumigrate.flows")


@contextmanager
def listening(migration_id: str, listener: Listener) -> Iterator[None]:
    """Call ``listener(event, data)`` for every event of ``migration_id`` emitted in this process."""
    with _lock:
        _listeners.setdefault(migration_id, []).append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners[migration_id].remove(listener)
            if not _listeners[migration_id]:
                del _listeners[migration_id]


def notify(migration_id: str, event: str, data: dict[str, Any] | None = None) -> None:
    """Tell listeners only (progress ticks that do not belong in the audit log)."""
    with _lock:
        targets = list(_listeners.get(migration_id, ()))
    for listener in targets:
        try:
            listener(event, data or {})
        except Exception:  # a broken view must never break a migration
            _log.exception("listener for %s failed on %s", migration_id, event)


def emit(migration: Migration, event: str, data: dict[str, Any] | None = None, *, actor: str | None = None) -> None:
    """Record ``event`` in the audit log, then tell listeners. ``data`` must never hold secrets."""
    migration.record(event, data, actor=actor)
    notify(migration.id, event, data)
