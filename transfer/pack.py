"""Files and directories in and out of images: ``pack_paths`` and ``unpack``.

Packing maps each file read-only (mmap) and hands zero-copy slices to the writer from a thread
pool, so reading, hashing, compressing, encrypting and storing overlap. Opaque files are cut by
FastCDC (an insert moves only nearby chunks); files whose bytes look like float tensors (a sample
compresses clearly better by byte planes) get fixed-size chunks and the byte-plane codec.
Unpacking stages everything in a hidden directory and renames into place only after every chunk
verified, so a wrong key or a corrupt chunk leaves the output directory as it was.
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import pyfastcdc
from gpumigrate.transfer import codecs
from gpumigrate.transfer.api import open_reader, open_writer
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter
from gpumigrate.transfer.reader import StoreImageReader

from gpumigrate.errors import IntegrityError, InvalidInputError, NotFoundError
from gpumigrate.interfaces import ImageRef, RegionInfo

CDC_AVG = 1 << 20  # FastCDC min/max default to avg/4 and avg*4: 256 KiB / 1 MiB / 4 MiB
SNIFF_BYTES = 256 * 1024
# Byte planes must beat whole-buffer zstd by this much on a sample before a file is treated as floats.
PLANES_MARGIN = 0.03


def _walk(paths: Iterable[str | Path]) -> Iterator[tuple[str, Path, os.stat_result]]:
    """(region name, path, lstat) for every file, symlink and directory under ``paths``."""
    seen: set[str] = set()
    for raw in paths:
        top = Path(raw)
        try:
            st = top.lstat()
        except FileNotFoundError:
            raise NotFoundError(f"no such file or directory: {top}") from None
        base = top.resolve().name if str(raw) in (".", "./") else top.name
        items: list[tuple[str, Path, os.stat_result]] = [(base, top, st)]
        if stat.S_ISDIR(st.st_mode):
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames.sort()
                rel = Path(dirpath).relative_to(top)
                for name in dirnames + sorted(filenames):
                    p = Path(dirpath) / name
                    items.append(((PurePosixPath(base) / rel.as_posix() / name).as_posix().replace("/./", "/"), p, p.lstat()))
        for name, p, s in items:
            name = str(PurePosixPath(name))
            if name in seen:
                raise InvalidInputError(f"two inputs map to the same name {name!r} in the image")
            seen.add(name)
            yield name, p, s


def sniff_itemsize(sample: memoryview) -> int | None:
    """2 or 4 when byte planes compress ``sample`` clearly better than zstd over the whole buffer."""
    if len(sample) < 4096:
        return None
    whole = len(codecs._compressor().compress(sample))
    best, best_k = whole, None
    for k in (2, 4):
        n = len(sample) - len(sample) % k
        _, payload = codecs.encode(sample[:n], mode="byteplane", dtype={2: "float16", 4: "float32"}[k])
        if len(payload) < best * (1 - PLANES_MARGIN):
            best, best_k = len(payload), k
    return best_k


def _cuts(view: memoryview, itemsize: int | None, chunk_size: int) -> list[tuple[int, int]]:
    if itemsize:
        return [(off, min(chunk_size, len(view) - off)) for off in range(0, len(view), chunk_size)]
    return [(c.offset, c.length) for c in pyfastcdc.FastCDC(CDC_AVG).cut_buf(view)]


def pack_paths(
    paths: Iterable[str | Path],
    store_url: str,
    *,
    key: bytes | None,
    parent: str | None = None,
    compression: str = "auto",
    parallelism: int = 4,
    chunk_size: int | None = None,
    dtype: str | None = None,
    source: str | None = None,
    endpoint_url: str | None = None,
    progress: ProgressCallback | None = None,
) -> ImageRef:
    """Pack files and directories into a new image in ``store_url``; chunks the parent has cost nothing."""
    entries = list(_walk(paths))
    if dtype and codecs.float_itemsize(dtype) is None:
        raise InvalidInputError(f"dtype {dtype!r} is not one the byte-plane codec knows", hint=", ".join(codecs.FLOAT_ITEMSIZE))
    writer = open_writer(store_url, key=key, parent=parent, compression=compression, parallelism=parallelism,
                         chunk_size=chunk_size, source=source, endpoint_url=endpoint_url)
    counter = ProgressCounter(progress, sum(s.st_size for _, _, s in entries if stat.S_ISREG(s.st_mode)))
    tree: dict[str, dict[str, Any]] = {}
    maps: list[tuple[Any, mmap.mmap]] = []
    pool = ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-pack")
    try:
        futures = []
        for name, path, st in entries:
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                tree[name] = {"type": "dir", "mode": mode}
                continue
            if stat.S_ISLNK(st.st_mode):
                tree[name] = {"type": "symlink", "target": os.readlink(path)}
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # sockets, fifos, devices have no content to move
            tree[name] = {"type": "file", "mode": mode, "mtime_ns": st.st_mtime_ns}
            size = st.st_size
            if size == 0:
                writer.add_region(RegionInfo(name=name, nbytes=0, kind="file"))
                continue
            fh = open(path, "rb")  # noqa: SIM115 (closed in the finally below, after the pool drains)
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append((fh, mm))
            view = memoryview(mm)
            mid = max(0, size // 2 - SNIFF_BYTES // 2)
            k = codecs.float_itemsize(dtype) if dtype else sniff_itemsize(view[mid : mid + SNIFF_BYTES])
            hint = dtype or ({2: "float16", 4: "float32"}.get(k) if k else None)
            writer.add_region(RegionInfo(name=name, nbytes=size, kind="file", dtype=hint))
            for index, (off, length) in enumerate(_cuts(view, k, writer.chunk_size)):
                futures.append(pool.submit(_put, writer, counter, name, index, view[off : off + length]))
        for fut in futures:
            fut.result()
        writer.set_metadata("tree", tree)
        ref = writer.commit()
        counter.finish()
        return ref
    except BaseException:
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for fh, mm in maps:
            try:
                mm.close()
            except BufferError:
                pass  # a slice is still referenced by a failed future; the map closes with the process
            fh.close()


def _put(writer: Any, counter: ProgressCounter, name: str, index: int, data: memoryview) -> None:
    try:
        writer.put_chunk(name, index, data)
        counter.add(len(data))
    finally:
        data.release()


def _safe_target(root: Path, name: str) -> Path:
    pure = PurePosixPath(name)
    if pure.is_absolute() or any(part in ("..", "") for part in pure.parts) or not pure.parts:
        raise IntegrityError(f"image names a path outside the output directory: {name!r}")
    return root.joinpath(*pure.parts)


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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    regions = reader.regions()
    for reg in regions:
        _safe_target(out, reg.name)
        tree.setdefault(reg.name, {"type": "file", "mode": 0o644})
    for name in tree:
        _safe_target(out, name)
    stage = Path(tempfile.mkdtemp(prefix=".gpumigrate-unpack-", dir=out))
    counter = ProgressCounter(progress, sum(r.nbytes for r in regions))
    try:
        with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-unpack") as pool:
            futures = []
            fds = []
            for reg in regions:
                target = _safe_target(stage, reg.name)
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                fds.append(fd)
                os.ftruncate(fd, reg.nbytes)
                for i in range(reader.chunk_count(reg.name)):
                    futures.append(pool.submit(_restore_chunk, reader, reg.name, i, fd, counter))
            try:
                for fut in futures:
                    fut.result()
            finally:
                for fd in fds:
                    os.fsync(fd)
                    os.close(fd)
        moved = _install(stage, out, tree)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    counter.finish()
    return {"image_id": reader.image_id, "files": moved, "bytes": reader.ref.bytes_image,
            "seconds": round(time.monotonic() - t0, 3), "out_dir": str(out)}


def _restore_chunk(reader: StoreImageReader, region: str, index: int, fd: int, counter: ProgressCounter) -> None:
    length = reader.chunk_length(region, index)
    buf = bytearray(length)
    reader.read_chunk_into(region, index, memoryview(buf))
    os.pwrite(fd, buf, reader.chunk_offset(region, index))
    counter.add(length)


def _install(stage: Path, out: Path, tree: dict[str, dict[str, Any]]) -> int:
    """Move verified files into place (rename), then create dirs' modes and symlinks."""
    moved = 0
    for name in sorted(tree):
        entry = tree[name]
        target = _safe_target(out, name)
        if entry.get("type") == "dir":
            target.mkdir(parents=True, exist_ok=True)
        elif entry.get("type") == "file":
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = _safe_target(stage, name)
            os.chmod(staged, int(entry.get("mode", 0o644)) & 0o7777)
            if "mtime_ns" in entry:
                os.utime(staged, ns=(int(entry["mtime_ns"]), int(entry["mtime_ns"])))
            os.replace(staged, target)
            moved += 1
    for name in sorted(tree):  # symlinks last, so no file above was written through one
        entry = tree[name]
        if entry.get("type") == "symlink":
            target = _safe_target(out, name)
            if target.is_symlink() or target.exists():
                target.unlink()
            os.symlink(str(entry["target"]), target)
    for name in sorted(tree, reverse=True):
        entry = tree[name]
        if entry.get("type") == "dir":
            os.chmod(_safe_target(out, name), int(entry.get("mode", 0o755)) & 0o7777)
    return moved
