"""Files and directories out of an image: ``unpack``. Nothing appears in the output unless every chunk verified.

Everything is staged in a hidden directory (new, mode 0700) inside the output directory and renamed into place only
after every chunk verified, so a wrong key or a damaged chunk leaves the output directory as it was. The output is
written as the file store is (``stores/nofollow.py``): each directory is opened from the one above it without
following a link, so a link planted in the output (``data/empty -> /etc``) is refused before any byte moves, never
followed; files arrive by rename (which replaces a link, never writes through one); and only the directories this
unpack created take the image's modes: a directory that was already there keeps its own.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from gpumigrate.errors import IntegrityError
from gpumigrate.transfer.api import open_reader
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter
from gpumigrate.transfer.reader import StoreImageReader
from gpumigrate.transfer.stores.nofollow import DirTree, LinkRefusedError, kind_of

STAGED_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(name: str) -> tuple[str, ...]:
    """A tree name as path parts below the output; a name that could leave it is refused."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or not pure.parts or any(part in ("..", ".", "") for part in pure.parts):
        raise IntegrityError(f"image names a path outside the output directory: {name!r}")
    return pure.parts


def unpack(
    store_url: str,
    image_id: str,
    out_dir: str | Path,
    *,
    key: bytes | None,
    parallelism: int = 4,
    endpoint_url: str | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Restore a packed image's files under ``out_dir``; returns a summary. Verifies every chunk first."""
    t0 = time.monotonic()
    reader = open_reader(store_url, image_id, key=key, endpoint_url=endpoint_url)
    tree: dict[str, dict[str, Any]] = dict(reader.metadata().get("tree") or {})
    bundles = set(reader.metadata().get("bundles") or [])
    regions = [r for r in reader.regions() if r.name not in bundles]
    for reg in regions:
        _parts(reg.name)
        tree.setdefault(reg.name, {"type": "file", "mode": 0o644})
    for name in tree:
        _parts(name)
    out = Path(out_dir).resolve()  # the directory the caller named: links above it are theirs
    output = DirTree(out, shown=str(out_dir))
    out_fd = output.dir((), create=True)
    assert out_fd is not None  # created
    # the stage is a new directory (0700) of this unpack's, reached through the output's own handles
    stage = _Stage(output, Path(tempfile.mkdtemp(prefix=".gpumigrate-unpack-", dir=out)).name)
    counter = ProgressCounter(progress, sum(r.nbytes for r in regions))
    try:
        _check_targets(output, out_fd, tree)  # before a byte moves: a refused entry leaves the output as it was
        with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-unpack") as pool:
            futures: list[Future[None]] = []
            staged: list[tuple[int, dict[str, Any]]] = []
            try:
                for reg in regions:
                    fd = _create_staged(stage, reg.name)
                    staged.append((fd, tree[reg.name]))
                    os.ftruncate(fd, reg.nbytes)
                    for i in range(reader.chunk_count(reg.name)):
                        futures.append(pool.submit(_restore_chunk, reader, reg.name, i, fd, counter))
                for fut in futures:
                    fut.result()
            finally:
                for fut in futures:
                    fut.cancel()
                pool.shutdown(wait=True)
                for fd, entry in staged:
                    _finish(fd, entry)
        _restore_bundled(reader, bundles, tree, stage)
        moved = _install(stage, output, tree)
    finally:
        shutil.rmtree(stage.name, dir_fd=out_fd, ignore_errors=True)
        output.close()
    counter.finish()
    return {
        "image_id": reader.image_id,
        "files": moved,
        "bytes": reader.ref.bytes_image,
        "seconds": round(time.monotonic() - t0, 3),
        "out_dir": str(out_dir),
    }


class _Stage:
    """The hidden staging directory ``name`` in the output: its directories are the output tree's, one level down."""

    def __init__(self, output: DirTree, name: str) -> None:
        self.output, self.name = output, name

    def dir(self, parts: tuple[str, ...], *, create: bool) -> int | None:
        return self.output.dir((self.name, *parts), create=create)


def _create_staged(stage: _Stage, name: str) -> int:
    parts = _parts(name)
    parent = stage.dir(parts[:-1], create=True)
    assert parent is not None  # created
    try:
        return os.open(parts[-1], STAGED_FLAGS, 0o600, dir_fd=parent)
    except FileExistsError:
        raise IntegrityError(f"image names the file {name!r} twice") from None


def _finish(fd: int, entry: dict[str, Any]) -> None:
    """A staged file's mode and mtime (set on the file this unpack made, by its descriptor), then durable."""
    try:
        os.fchmod(fd, int(entry.get("mode", 0o644)) & 0o7777)
        if "mtime_ns" in entry:
            os.utime(fd, ns=(int(entry["mtime_ns"]), int(entry["mtime_ns"])))
        os.fsync(fd)
    finally:
        os.close(fd)


def _restore_bundled(
    reader: StoreImageReader, bundles: set[str], tree: dict[str, dict[str, Any]], stage: _Stage
) -> None:
    """Write the small files kept in bundle regions (each bundle read and verified once)."""
    contents = {name: bytes(reader.read_region(name)) for name in sorted(bundles)}
    for name, entry in tree.items():
        if entry.get("type") != "file" or "bundle" not in entry:
            continue
        data = contents.get(entry["bundle"])
        off, size = int(entry.get("offset", -1)), int(entry.get("size", -1))
        if data is None or off < 0 or size < 0 or off + size > len(data):
            raise IntegrityError(f"image's tree places {name!r} outside its bundle")
        fd = _create_staged(stage, name)
        try:
            os.write(fd, data[off : off + size])
        finally:
            _finish(fd, entry)


def _restore_chunk(reader: StoreImageReader, region: str, index: int, fd: int, counter: ProgressCounter) -> None:
    length = reader.chunk_length(region, index)
    buf = bytearray(length)
    reader.read_chunk_into(region, index, memoryview(buf))
    os.pwrite(fd, buf, reader.chunk_offset(region, index))
    counter.add(length)


def _check_targets(output: DirTree, out_fd: int, tree: dict[str, dict[str, Any]]) -> None:
    """Refuse, before anything is written, every entry that would go through a link: one of the image's own
    symlinks, or a link (or a file) already in the output where a directory must be."""
    links = {name for name, e in tree.items() if e.get("type") == "symlink"}
    for name, entry in tree.items():
        parts = _parts(name)
        if {p.as_posix() for p in PurePosixPath(name).parents} & links:
            raise IntegrityError(f"image puts {name!r} below one of its own symlinks")
        parent = out_fd
        for depth in range(1, len(parts) + 1):
            last = depth == len(parts)
            if last and entry.get("type") != "dir":
                if entry.get("type") == "file" and kind_of(parent, parts[-1]) == "a directory":
                    raise IntegrityError(f"refusing to write the file {name!r}: a directory is there in the output")
                break
            try:
                below = output.dir(parts[:depth], create=False)
            except LinkRefusedError:
                shown = "/".join(parts[:depth])
                what = kind_of(parent, parts[depth - 1])
                if what == "a symbolic link":
                    raise LinkRefusedError(
                        f"refusing to write {name!r} through the symlink {output.shown}/{shown} (it is never followed)",
                        hint="remove the link from the output directory, or unpack into a new one",
                    ) from None
                raise IntegrityError(f"refusing to write {name!r}: {output.shown}/{shown} is {what}") from None
            if below is None:
                break  # not there yet: this unpack makes it, as a real directory
            parent = below


def _install(stage: _Stage, output: DirTree, tree: dict[str, dict[str, Any]]) -> int:
    """Move verified files into place (rename), then make symlinks, then give the directories this unpack
    created their modes. Directories that were already there keep theirs."""
    moved = 0
    for name in sorted(tree):  # a directory before what it holds
        entry, parts = tree[name], _parts(name)
        if entry.get("type") == "dir":
            output.dir(parts, create=True)
        elif entry.get("type") == "file":
            source = stage.dir(parts[:-1], create=False)
            target = output.dir(parts[:-1], create=True)
            assert source is not None and target is not None  # staged; created
            os.replace(parts[-1], parts[-1], src_dir_fd=source, dst_dir_fd=target)
            moved += 1
    for name in sorted(tree):  # symlinks last, so no file above was written through one
        entry, parts = tree[name], _parts(name)
        if entry.get("type") == "symlink":
            parent = output.dir(parts[:-1], create=True)
            assert parent is not None  # created
            try:
                os.unlink(parts[-1], dir_fd=parent)  # a link or a file there goes; a directory is refused
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                raise IntegrityError(f"refusing to replace the directory {name!r} in the output by a symlink") from None
            os.symlink(str(entry["target"]), parts[-1], dir_fd=parent)
    for name in sorted(tree, reverse=True):
        entry, parts = tree[name], _parts(name)
        if entry.get("type") == "dir" and parts in output.created:
            fd = output.dir(parts, create=False)
            if fd is not None and stat.S_ISDIR(os.fstat(fd).st_mode):
                os.fchmod(fd, int(entry.get("mode", 0o755)) & 0o7777)
    return moved
