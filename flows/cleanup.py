"""What migrations leave on this machine, and what ``gpumigrate hosts down`` and ``gpumigrate gc`` remove of it.

Under the state root a migration writes:

* its record, ``migrations/<id>/`` (``state.json``, ``audit.jsonl``, ``artifacts/``): the audit needs it, so it
  is never removed here; a host-level backend's dump of the source (``migrations/<id>/criu-dump``) is scratch;
* on a local target host, the host's work directory ``hosts/<name>/``: the image store the target read (every
  pre-copy round and the final image, sealed), each process's log, the supervisor's files;
* while a front door runs, its directory ``traffic/<workload>/``: Envoy's files, its access log, the control
  plane's state.

Each is removed once nothing needs it, and what stays is said with the reason: a host that is up (``hosts down``
stops it first), a migration still running, or one whose rollback window is open (its source is kept warm, and
the image on the target's host is the state's copy until the source is retired), a door that runs. The plan's
own image store outside the state root (a bucket, a shared file system) is never touched: its chunks may be
shared by other images.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.settings import hosts_dir, migrations_dir, state_root

SCRATCH = ("criu-dump",)  # per migration, beside its record


@dataclass(frozen=True)
class Leftover:
    """One thing a migration wrote: where, what it is, its size, and why it stays (None: it goes)."""

    path: Path
    what: str
    bytes: int
    kept: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "what": self.what, "bytes": self.bytes, "kept": self.kept}


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


def _states() -> Iterator[tuple[str, dict[str, Any]]]:
    base = migrations_dir()
    if not base.is_dir():
        return
    for path in sorted(base.glob("*/state.json")):
        try:
            yield path.parent.name, json.loads(path.read_text())
        except (OSError, ValueError):
            continue


def needed_by(migration_id: str, state: dict[str, Any], *, now: float | None = None) -> str | None:
    """Why a migration still needs what it wrote, or None: it runs (or waits at its gate), or it cut over and its
    rollback window is open with the source not retired."""
    status = state.get("status")
    if status in ("running", "paused"):
        return f"migration {migration_id} is {status} (if its process is gone, `gpumigrate rollback {migration_id}` ends it)"
    runtime = state.get("runtime") or {}
    deadline = runtime.get("rollback_deadline")
    retired = runtime.get("source_retired") or runtime.get("source_zeroized")
    if not isinstance(deadline, int | float) or deadline <= (time.time() if now is None else now):
        return None
    if status == "completed" and not retired:
        until = dt.datetime.fromtimestamp(deadline, dt.UTC).isoformat(timespec="seconds")
        return f"migration {migration_id}'s rollback window is open until {until} (`gpumigrate retire` ends it)"
    return None


def _host_needed(name: str) -> str | None:
    for mid, state in _states():
        target = (state.get("runtime") or {}).get("target_host") or {}
        if target.get("name") == name and (why := needed_by(mid, state)):
            return why
    return None


def host_files(name: str, *, up: bool) -> list[Leftover]:
    """A local host's work directory: removed unless the host is up or a migration that targeted it needs it."""
    workdir = hosts_dir() / name
    if not workdir.is_dir():
        return []
    kept = f"host {name} is up (`gpumigrate hosts down {name}` stops it and removes its files)" if up else None
    what = ", ".join(_contents(workdir)) or "empty"
    return [Leftover(workdir, f"local host {name}'s files: {what}", _size(workdir), kept or _host_needed(name))]


def _contents(workdir: Path) -> list[str]:
    out = []
    store = workdir / "store"
    if store.is_dir():
        out.append(f"image store {_mb(_size(store))}")
    logs = list((workdir / "logs").glob("*.log")) if (workdir / "logs").is_dir() else []
    if logs:
        out.append(f"{len(logs)} process log{'s' if len(logs) != 1 else ''}")
    return out


def _scratch() -> Iterator[Leftover]:
    for mid, state in _states():
        for name in SCRATCH:
            path = migrations_dir() / mid / name
            if path.exists():
                yield Leftover(path, f"migration {mid}'s {name}", _size(path), needed_by(mid, state))


def _records() -> Iterator[Leftover]:
    for mid, _ in _states():
        path = migrations_dir() / mid
        yield Leftover(path, f"migration {mid}'s record", _size(path), "the audit record (`gpumigrate audit`)")


def _doors() -> Iterator[Leftover]:
    from gpumigrate.traffic.detached import door_status

    base = state_root() / "traffic"
    if not base.is_dir():
        return
    needing = {_workload_of(mid): why for mid, state in _states() if (why := needed_by(mid, state))}
    for path in sorted(p for p in base.iterdir() if p.is_dir()):
        status = door_status(path)
        running = bool(status.get("up")) or any(p.get("running") for p in (status.get("processes") or {}).values())
        kept = "its front door runs (`gpumigrate frontdoor down` stops it)" if running else needing.get(path.name)
        yield Leftover(path, f"front door {path.name}'s files", _size(path), kept)


def _workload_of(migration_id: str) -> str | None:
    try:
        from gpumigrate.plan import load_plan

        return load_plan(migrations_dir() / migration_id / "plan.yaml").workload.name
    except Exception:
        return None


def collect(up_hosts: Iterable[str]) -> list[Leftover]:
    """Everything ``gc`` looks at; ``up_hosts``: the local hosts that are up now."""
    up = set(up_hosts)
    root = hosts_dir()
    hosts = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    found = [item for name in hosts for item in host_files(name, up=name in up)]
    return [*found, *_scratch(), *_doors(), *_records()]


def remove(items: Iterable[Leftover], *, dry_run: bool = False) -> list[Leftover]:
    """Remove every item nothing needs (under the state root only); returns them all, as they stand."""
    root = state_root()
    out = []
    for item in items:
        if item.kept is None and not dry_run and item.path.resolve().is_relative_to(root):
            if item.path.is_dir() and not item.path.is_symlink():
                shutil.rmtree(item.path, ignore_errors=True)
            else:
                item.path.unlink(missing_ok=True)
        out.append(item)
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n / 1e3:,.0f} kB"


def describe(item: Leftover, *, dry_run: bool = False) -> str:
    """One line for the operator: what went (or would go), or what stayed and why."""
    try:
        where = item.path.relative_to(state_root())
    except ValueError:
        where = item.path
    if item.kept is None:
        return f"{'would remove' if dry_run else 'removed'} {where} ({_mb(item.bytes)}): {item.what}"
    return f"kept {where} ({_mb(item.bytes)}): {item.kept}"
