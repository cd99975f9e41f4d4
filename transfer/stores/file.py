"""``file://DIR``: a directory. Objects are written to a hidden temp file and renamed; fsynced before a manifest.

``?sync=`` (or ``open_store(..., sync=)``) says when chunk data reaches the disk: ``chunk`` (default) fdatasyncs each
chunk before its rename; ``deferred`` syncs on a background thread that ``flush()`` waits for (flush always precedes
a manifest, so a crash can only leave short chunks, caught by push's size check, and no manifest naming them: the
stream receiver uses it so acknowledgements do not wait for the disk); ``none`` leaves it to the page cache, like cp
and rsync (benchmarks, scratch stores). Manifests are always fsynced.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Self

from gpumigrate.atomic import fsync_dir
from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.transfer.stores.base import (
    STORE_MARKER,
    STORE_MARKER_BODY,
    Store,
    StoreOptions,
    chunk_key,
    manifest_key,
    query_param,
    split_url,
)
from gpumigrate.transfer.stores.direct_io import DirectIO

SYNC_MODES = ("chunk", "deferred", "none")
# Concurrent fdatasyncs let the filesystem commit several files' data in one journal transaction.
SYNC_THREADS = 4
_TMP_SERIAL = itertools.count()
# Objects at least this big get their blocks allocated before the write (FileStore._reserve).
PREALLOCATE_BYTES = 256 << 10
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` lives on (Linux ``/proc/self/mounts``); "" where that is unknown."""
    try:
        where = os.path.realpath(path)
        with open("/proc/self/mounts", encoding="utf-8") as fh:
            mounts = [line.split()[1:3] for line in fh if len(line.split()) >= 3]
    except OSError:
        return ""
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


class FileStore(Store):
    """A directory. Objects are written to a hidden temp file and renamed; fsynced before a manifest."""

    writes_inline = True  # a page-cache write; fdatasyncs (sync=chunk) run on the sync threads anyway

    def __init__(self, root: Path, url: str, *, sync: str = "chunk") -> None:
        if sync not in SYNC_MODES:
            raise InvalidInputError(
                f"file store sync mode {sync!r} is unknown", hint=f"allowed: {', '.join(SYNC_MODES)}"
            )
        self.root = root
        self.url = url
        self.sync = sync
        self._unsynced: list[Path] = []
        self._syncer: ThreadPoolExecutor | None = None
        self._sync_futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._made_dirs: set[str] = set()
        # In memory (tmpfs, /dev/shm) fallocate allocates and zeroes every page that write() then fills again, a
        # large share of a GPU capture's sealing threads' time (bench/README.md). Only real disks get it.
        self._in_memory = filesystem_of(root) in MEMORY_FILESYSTEMS
        self._preallocate = not self._in_memory
        self.io = DirectIO(enabled=not self._in_memory)  # objects' bytes to and from the disk (direct_io.py)

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        query_sync = query_param(split_url(url)[3], "sync")
        return cls(file_root(url), url, sync=options.sync or query_sync or "chunk")

    def _path(self, key: str) -> Path:
        return self.root / key

    def _write(
        self, key: str, data: bytes | bytearray | memoryview, *, durable: bool, rename: bool = True
    ) -> tuple[Path, Path]:
        """Write ``data`` to a fresh temp file beside ``key`` and (unless ``rename=False``) rename it into place."""
        path = self._path(key)
        parent = str(path.parent)
        if parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_TMP_SERIAL)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            if len(view) >= PREALLOCATE_BYTES and self._preallocate:
                self._reserve(fd, len(view))
            self.io.write(fd, view)
            if durable:
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        if rename:
            self._install(tmp, path)
        return tmp, path

    def _reserve(self, fd: int, size: int) -> None:
        """Allocate the object's blocks in one call before writing it.

        ext4's delayed allocation otherwise reserves space page by page inside write(); one extent
        up front costs less CPU per object written (bench/README.md). Filesystems without fallocate just skip it.
        """
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._preallocate = False
            else:
                raise

    def _install(self, tmp: Path, path: Path) -> None:
        os.replace(tmp, path)
        with self._lock:
            self._unsynced.append(path)  # its directory entry is made durable at flush()

    def _sync_then_install(self, tmp: Path, path: Path) -> None:
        """The ``chunk`` mode's background step: the data reaches the disk, then the name appears."""
        try:
            _fdatasync_path(tmp)
            self._install(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _ensure_marker(self) -> None:
        marker = self.root / STORE_MARKER
        if not marker.exists():
            self._write(STORE_MARKER, STORE_MARKER_BODY, durable=True)
            fsync_dir(marker.parent)

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        if self.sync == "chunk" and not self._in_memory:
            # Written now (the caller's buffer is free on return); fdatasync and then the rename run
            # on the sync threads, so disk flushes overlap the next chunks' CPU work instead of
            # holding an upload slot each, and a chunk's name never exists before its data is on
            # disk: a crash leaves whole chunks or hidden temp files. flush() waits for them all.
            tmp, path = self._write(chunk_key(chunk_id), blob, durable=False, rename=False)
            self._background(lambda: self._sync_then_install(tmp, path))
            return
        # Renamed at once, on this thread: sync=none, sync=deferred (below), and sync=chunk in memory (tmpfs), where the
        # page cache is the store and fdatasync does nothing. There the sync threads' open, fdatasync, close and
        # rename per object only added GIL hand-offs, which the thread queueing a GPU capture's device work waited
        # behind (bench/HISTORY.md, tenth session).
        self._write(chunk_key(chunk_id), blob, durable=False)
        if self.sync == "deferred":
            # Deferred mode (the stream receiver): the name appears at once (a delta's base must be
            # readable before the next chunk arrives) and the data follows on the sync threads.
            written = self._path(chunk_key(chunk_id))
            self._background(lambda: _fdatasync_path(written))

    def _background(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._syncer is None:
                self._syncer = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="gm-fsync")
            self._sync_futures.append(self._syncer.submit(job))

    def remove_chunk(self, chunk_id: str) -> None:
        """Delete a damaged chunk (a receiver's check of what an earlier run left)."""
        self._path(chunk_key(chunk_id)).unlink(missing_ok=True)

    def get_chunk(self, chunk_id: str) -> bytes:
        try:
            return self._path(chunk_key(chunk_id)).read_bytes()
        except FileNotFoundError:
            raise TransferError(f"chunk {chunk_id[:16]} is missing from {self.url}") from None

    def get_chunk_into(self, chunk_id: str, out: memoryview) -> int:
        """Straight into ``out``: no intermediate bytes object (a fresh multi-MiB one faults its pages in)."""
        try:
            fh = open(self._path(chunk_key(chunk_id)), "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise TransferError(f"chunk {chunk_id[:16]} is missing from {self.url}") from None
        with fh:
            got, more = self.io.read_into(fh.fileno(), out)
            if more:
                raise TransferError(f"chunk {chunk_id[:16]} is more than the {len(out)} bytes expected")
            return got

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        try:
            with open(self._path(chunk_key(chunk_id)), "rb") as fh:
                return fh.read(nbytes)
        except FileNotFoundError:
            raise TransferError(f"chunk {chunk_id[:16]} is missing from {self.url}") from None

    def chunk_size(self, chunk_id: str) -> int | None:
        try:
            return self._path(chunk_key(chunk_id)).stat().st_size
        except (FileNotFoundError, NotADirectoryError):  # a file where a directory belongs holds no chunk
            return None

    def list_chunks(self) -> dict[str, int]:
        found: dict[str, int] = {}
        base = self.root / "chunks"
        if not base.is_dir():
            return found
        for sub in os.scandir(base):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if not entry.name.startswith(".") and entry.is_file():
                    found[entry.name] = entry.stat().st_size
        return found

    def put_manifest(self, image_id: str, data: bytes) -> None:
        self._ensure_marker()
        self._write(manifest_key(image_id), data, durable=True)
        fsync_dir(self._path(manifest_key(image_id)).parent)

    def get_manifest(self, image_id: str) -> bytes:
        try:
            return self._path(manifest_key(image_id)).read_bytes()
        except FileNotFoundError:
            raise self.missing() or NotFoundError(f"no image {image_id} in {self.url}") from None

    def missing(self) -> NotFoundError | None:
        """The error for a store whose directory does not exist (None when it does)."""
        if self.root.is_dir():
            return None
        return NotFoundError(f"the store {self.url} does not exist (no directory {self.root})")

    def list_manifests(self) -> list[str]:
        base = self.root / "manifests"
        if not base.is_dir():
            return []
        return sorted(e.name for e in os.scandir(base) if not e.name.startswith("."))

    def flush(self) -> None:
        with self._lock:
            futures, self._sync_futures = self._sync_futures, []
        errors = []
        for fut in futures:  # every one, even after a failure: none may still rename after we return
            try:
                fut.result()
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise TransferError(f"making chunks durable in {self.url} failed: {errors[0]}") from errors[0]
        with self._lock:
            pending, self._unsynced = self._unsynced, []
        if self.sync == "none":
            return
        for d in {path.parent for path in pending}:
            fsync_dir(d)

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None


def _fdatasync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def file_root(url: str) -> Path:
    rest = url[len("file://") :].split("?", 1)[0]
    if not rest:
        raise InvalidInputError(f"store URL {url!r} names no directory")
    return Path(rest).expanduser().resolve()
