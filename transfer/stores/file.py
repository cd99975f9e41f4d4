"""``file://DIR``: a directory. Objects are written to a hidden temp file and renamed; fsynced before a manifest.

Every name below the root is opened from a directory file descriptor without following a link (``nofollow.py``):
the root, ``chunks/``, ``manifests/`` and each ``chunks/XX`` fan-out directory are opened once, as they are first
needed, and each object is one ``openat`` in its directory. A link planted anywhere in the store is refused, never
followed, and ids are checked (``base.check_image_id``) before they name a file.

``?sync=`` (or ``open_store(..., sync=)``) says when chunk data reaches the disk: ``chunk`` (default) fdatasyncs each
chunk before its rename; ``deferred`` syncs on a background thread that ``flush()`` waits for (flush always precedes
a manifest, so a crash can only leave short chunks, caught by push's size check, and no manifest naming them: the
stream receiver uses it so acknowledgements do not wait for the disk); ``none`` leaves it to the page cache, like cp
and rsync (benchmarks, scratch stores). Manifests are always fsynced.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Self

from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.transfer.stores.base import (
    ID_PATTERN,
    STORE_MARKER,
    STORE_MARKER_BODY,
    Store,
    StoreOptions,
    check_chunk_id,
    check_image_id,
    query_param,
    split_url,
)
from gpumigrate.transfer.stores.direct_io import DirectIO
from gpumigrate.transfer.stores.nofollow import (
    CREATE_FLAGS,
    READ_FLAGS,
    DirTree,
    LinkRefusedError,
    open_regular,
    regular_size,
)
from gpumigrate.transfer.stores.syncing import SyncThreads

log = logging.getLogger(__name__)

SYNC_MODES = ("chunk", "deferred", "none")
# Concurrent fdatasyncs let the filesystem commit several files' data in one journal transaction.
SYNC_THREADS = 4
_TMP_SERIAL = itertools.count()
# Objects at least this big get their blocks allocated before the write (FileStore._reserve).
PREALLOCATE_BYTES = 256 << 10
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_FAN_OUT = re.compile(r"[0-9a-f]{2}").fullmatch  # chunks/XX: the first two digits of the ids it holds


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
        self._unsynced: set[int] = set()  # directory fds whose new entries flush() makes durable
        self._syncer = SyncThreads(SYNC_THREADS, "gm-fsync")
        self._lock = threading.Lock()
        self._dirs = DirTree(root, shown=url)  # closed by close(), or when the store is collected
        self._warned: set[str] = set()
        weakref.finalize(self, _release, self._syncer, self._dirs)
        # In memory (tmpfs, /dev/shm) fallocate allocates and zeroes every page that write() then fills again, a
        # large share of a GPU capture's sealing threads' time (bench/README.md). Only real disks get it.
        self._in_memory = filesystem_of(root) in MEMORY_FILESYSTEMS
        self._preallocate = not self._in_memory
        self.io = DirectIO(enabled=not self._in_memory)  # objects' bytes to and from the disk (direct_io.py)

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        query_sync = query_param(split_url(url)[3], "sync")
        return cls(file_root(url), url, sync=options.sync or query_sync or "chunk")

    def location(self) -> str:
        return f"file://{self.root}"

    # ------------------------------------------------------------------ directories, never through a link
    def _root_fd(self, create: bool) -> int | None:
        return self._dirs.dir((), create=create)

    def _dir(self, rel: str, create: bool) -> int | None:
        """The directory ``rel`` ("chunks", "manifests" or "chunks/XX") as an fd held open; None when it does
        not exist and ``create`` is False. Opened once: after that a chunk costs one ``openat``, no path walk."""
        return self._dirs.dir(tuple(rel.split("/")), create=create)

    def _chunk_dir(self, chunk_id: str, create: bool) -> int | None:
        return self._dirs.dir(("chunks", check_chunk_id(chunk_id)[:2]), create=create)

    def _where(self, rel: str) -> str:
        return f"{self.url}: {rel}"

    # ------------------------------------------------------------------ writes
    def _write(
        self, dir_fd: int, name: str, data: bytes | bytearray | memoryview, *, durable: bool, rename: bool = True
    ) -> str:
        """Write ``data`` to a fresh temp file beside ``name`` in ``dir_fd`` and (unless ``rename=False``) rename it
        into place; returns the temp file's name. The temp file is created new (``O_EXCL``, never through a link),
        and a rename replaces whatever sits at ``name``, a planted link included, without following it."""
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_TMP_SERIAL)}.tmp"
        fd = os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            if len(view) >= PREALLOCATE_BYTES and self._preallocate:
                self._reserve(fd, len(view))
            self.io.write(fd, view)
            if durable:
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(dir_fd, tmp)
            raise
        os.close(fd)
        if rename:
            self._install(dir_fd, tmp, name)
        return tmp

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

    def _install(self, dir_fd: int, tmp: str, name: str) -> None:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        with self._lock:
            self._unsynced.add(dir_fd)  # its directory entry is made durable at flush()

    def _sync_then_install(self, dir_fd: int, tmp: str, name: str) -> None:
        """The ``chunk`` mode's background step: the data reaches the disk, then the name appears."""
        try:
            _fdatasync_at(dir_fd, tmp)
            self._install(dir_fd, tmp, name)
        except BaseException:
            _unlink_quietly(dir_fd, tmp)
            raise

    def _ensure_marker(self, root: int) -> None:
        if regular_size(root, STORE_MARKER) is None:
            self._write(root, STORE_MARKER, STORE_MARKER_BODY, durable=True)
            os.fsync(root)

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        where = self._chunk_dir(chunk_id, create=True)
        assert where is not None  # created
        if self.sync == "chunk" and not self._in_memory:
            # Written now (the caller's buffer is free on return); fdatasync and then the rename run
            # on the sync threads, so disk flushes overlap the next chunks' CPU work instead of
            # holding an upload slot each, and a chunk's name never exists before its data is on
            # disk: a crash leaves whole chunks or hidden temp files. flush() waits for them all.
            tmp = self._write(where, chunk_id, blob, durable=False, rename=False)
            self._background(lambda: self._sync_then_install(where, tmp, chunk_id))
            return
        # Renamed at once, on this thread: sync=none, sync=deferred (below), and sync=chunk in memory (tmpfs), where the
        # page cache is the store and fdatasync does nothing. There the sync threads' open, fdatasync, close and
        # rename per object only added GIL hand-offs, which the thread queueing a GPU capture's device work waited
        # behind (bench/HISTORY.md, tenth session).
        self._write(where, chunk_id, blob, durable=False)
        if self.sync == "deferred":
            # Deferred mode (the stream receiver): the name appears at once (a delta's base must be
            # readable before the next chunk arrives) and the data follows on the sync threads.
            self._background(lambda: _fdatasync_at(where, chunk_id))

    def _background(self, job: Callable[[], None]) -> None:
        self._syncer.submit(job)

    def remove_chunk(self, chunk_id: str) -> None:
        """Delete a damaged chunk (a receiver's check of what an earlier run left): the name in its real fan-out
        directory, never anything a link points to."""
        where = self._chunk_dir(chunk_id, create=False)
        if where is not None:
            _unlink_quietly(where, chunk_id)

    def remove_leftovers(self) -> int:
        """Delete the hidden temp files an earlier process left (a kill -9 mid-write) in the store's real
        directories; links and what they point to are left alone. Returns how many went."""
        removed = 0
        for rel in ["manifests", *(f"chunks/{sub}" for sub in self._fan_outs())]:
            where = self._listed_dir(rel)
            if where is None:
                continue
            for entry in os.scandir(where):
                if entry.name.startswith(".") and entry.name.endswith(".tmp") and not entry.is_symlink():
                    removed += _unlink_quietly(where, entry.name)
        return removed

    def _listed_dir(self, rel: str) -> int | None:
        """``rel`` for a listing: None when it does not exist, or when it is a link (never listed through, and
        said once in the log: a write there is refused with the same words)."""
        try:
            return self._dir(rel, create=False)
        except LinkRefusedError as exc:
            if rel not in self._warned:
                self._warned.add(rel)
                log.warning("%s", exc)
            return None

    # ------------------------------------------------------------------ reads
    def _open_chunk(self, chunk_id: str) -> int:
        where = self._chunk_dir(chunk_id, create=False)
        fd = None if where is None else open_regular(where, chunk_id, self._where(f"chunks/{chunk_id[:2]}/{chunk_id}"))
        if fd is None:
            raise TransferError(f"chunk {chunk_id[:16]} is missing from {self.url}")
        return fd

    def get_chunk(self, chunk_id: str) -> bytes:
        with open(self._open_chunk(chunk_id), "rb", closefd=True) as fh:
            return fh.read()

    def get_chunk_into(self, chunk_id: str, out: memoryview) -> int:
        """Straight into ``out``: no intermediate bytes object (a fresh multi-MiB one faults its pages in)."""
        with open(self._open_chunk(chunk_id), "rb", buffering=0, closefd=True) as fh:
            got, more = self.io.read_into(fh.fileno(), out)
            if more:
                raise TransferError(f"chunk {chunk_id[:16]} is more than the {len(out)} bytes expected")
            return got

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        fd = self._open_chunk(chunk_id)
        try:
            return os.pread(fd, nbytes, 0)
        finally:
            os.close(fd)

    def chunk_size(self, chunk_id: str) -> int | None:
        try:
            where = self._chunk_dir(chunk_id, create=False)
        except LinkRefusedError:
            return None  # a link or a file where a directory belongs holds no chunk (and a write there is refused)
        return None if where is None else regular_size(where, chunk_id)  # a link there holds no chunk either

    def _fan_outs(self) -> list[str]:
        """The names of ``chunks/``'s real fan-out directories (a link there is skipped: never listed through)."""
        base = self._listed_dir("chunks")
        if base is None:
            return []
        return [e.name for e in os.scandir(base) if _FAN_OUT(e.name) and e.is_dir(follow_symlinks=False)]

    def list_chunks(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for sub in self._fan_outs():
            where = self._listed_dir(f"chunks/{sub}")
            if where is None:
                continue
            for entry in os.scandir(where):
                name = entry.name
                if name.startswith(sub) and ID_PATTERN.fullmatch(name) and entry.is_file(follow_symlinks=False):
                    found[name] = entry.stat(follow_symlinks=False).st_size
        return found

    def put_manifest(self, image_id: str, data: bytes) -> None:
        check_image_id(image_id)
        root = self._root_fd(create=True)
        assert root is not None  # created
        self._ensure_marker(root)
        where = self._dir("manifests", create=True)
        assert where is not None  # created
        self._write(where, image_id, data, durable=True)
        os.fsync(where)

    def get_manifest(self, image_id: str) -> bytes:
        check_image_id(image_id)
        where = self._dir("manifests", create=False)
        fd = None if where is None else open_regular(where, image_id, self._where(f"manifests/{image_id}"))
        if fd is None:
            raise self.missing() or NotFoundError(f"no image {image_id} in {self.url}")
        with open(fd, "rb", closefd=True) as fh:
            return fh.read()

    def manifest_sizes(self) -> dict[str, int]:
        """Every manifest the store holds (regular files named by an image id), with its size."""
        where = self._listed_dir("manifests")
        if where is None:
            return {}
        return {
            e.name: e.stat(follow_symlinks=False).st_size
            for e in os.scandir(where)
            if ID_PATTERN.fullmatch(e.name) and e.is_file(follow_symlinks=False)
        }

    def missing(self) -> NotFoundError | None:
        """The error for a store whose directory does not exist (None when it does)."""
        if self.root.is_dir():
            return None
        return NotFoundError(f"the store {self.url} does not exist (no directory {self.root})")

    def list_manifests(self) -> list[str]:
        return sorted(self.manifest_sizes())

    def free_bytes(self) -> int:
        """Bytes free to an unprivileged writer on the store's filesystem (of its parent before it exists)."""
        root = self._root_fd(create=False)
        st = os.fstatvfs(root) if root is not None else os.statvfs(self.root.parent)
        return st.f_bavail * st.f_frsize

    def flush(self) -> None:
        errors = self._syncer.wait()  # every job, even after a failure: none may still rename after we return
        for exc in errors:
            if not isinstance(exc, OSError):
                raise exc
        if errors:
            raise TransferError(f"making chunks durable in {self.url} failed: {errors[0]}") from errors[0]
        with self._lock:
            pending, self._unsynced = self._unsynced, set()
        if self.sync == "none":
            return
        for fd in pending:
            os.fsync(fd)

    def close(self) -> None:
        self._syncer.close()
        with self._lock:
            self._unsynced = set()
        self._dirs.close()  # a later call opens them again


def _release(syncer: SyncThreads, dirs: DirTree) -> None:
    """A collected store's clean-up: its sync threads end after their jobs, its directory fds close."""
    syncer.release()
    dirs.close()


def _unlink_quietly(dir_fd: int, name: str) -> int:
    """Remove ``name`` from ``dir_fd`` (a link itself, never its target); 1 when it went, 0 when it was not there."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    return 1


def _fdatasync_at(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fdatasync(fd)
    finally:
        os.close(fd)


def file_root(url: str) -> Path:
    rest = url[len("file://") :].split("?", 1)[0]
    if not rest:
        raise InvalidInputError(f"store URL {url!r} names no directory")
    return Path(rest).expanduser().resolve()
