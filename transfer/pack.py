"""Files and directories into images: ``pack_paths`` (and ``unpack``, out of them, from ``unpack.py``).

Packing maps each file read-only (mmap) and hands zero-copy slices to the writer from a thread
pool, so reading, hashing, compressing, encrypting and storing overlap. Opaque files are cut by
FastCDC (an insert moves only nearby chunks); files whose bytes look like float tensors (a sample
compresses clearly better by byte planes) get fixed-size chunks and the byte-plane codec.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import pyfastcdc

from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.interfaces import ImageRef, RegionInfo
from gpumigrate.transfer.api import open_writer
from gpumigrate.transfer.buffers import POOL
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter
from gpumigrate.transfer.unpack import unpack
from gpumigrate.transfer.writer import StoreImageWriter

__all__ = ["pack_paths", "sniff_itemsize", "unpack"]  # unpack stays importable from here, where callers found it

# FastCDC 512 KiB / 2 MiB / 4 MiB (min/avg/max): every chunk is one stored object, and creating a file has a
# cost of its own whatever its size, so chunks much under 2 MiB cost more than they dedup (bench/README.md).
CDC_MIN, CDC_AVG, CDC_MAX = 512 << 10, 2 << 20, 4 << 20
# Files up to this size are concatenated into shared "bundle" regions (one object per ~4 MiB)
# instead of one object each; the tree records each file's offset and size in its bundle.
SMALL_FILE = 64 << 10
BUNDLE_PREFIX = "//bundle/"  # a leading "//" can never come from a path, so never collides with a file
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
                    items.append(
                        ((PurePosixPath(base) / rel.as_posix() / name).as_posix().replace("/./", "/"), p, p.lstat())
                    )
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


def _cuts(view: memoryview, itemsize: int | None, chunk_size: int) -> Iterator[tuple[int, int]]:
    """Chunk boundaries, produced lazily so workers start on the first chunks while FastCDC reads on."""
    if itemsize:
        for off in range(0, len(view), chunk_size):
            yield off, min(chunk_size, len(view) - off)
        return
    for c in pyfastcdc.FastCDC(avg_size=CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX).cut_buf(view):
        yield c.offset, c.length


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
    reuse_unchanged: bool = True,
) -> ImageRef:
    """Pack files and directories into a new image in ``store_url``; chunks the parent has cost nothing.

    With a parent, a file whose size and mtime match the parent's entry is not even read: its chunk
    list is taken from the parent (as restic does; ``reuse_unchanged=False`` reads everything).
    """
    entries = list(_walk(paths))
    if dtype and codecs.float_itemsize(dtype) is None:
        raise InvalidInputError(
            f"dtype {dtype!r} is not one the byte-plane codec knows", hint=", ".join(codecs.FLOAT_ITEMSIZE)
        )
    writer = open_writer(
        store_url,
        key=key,
        parent=parent,
        compression=compression,
        parallelism=parallelism,
        chunk_size=chunk_size,
        source=source,
        endpoint_url=endpoint_url,
    )
    counter = ProgressCounter(progress, sum(s.st_size for _, _, s in entries if stat.S_ISREG(s.st_mode)))
    tree: dict[str, dict[str, Any]] = {}
    maps: list[tuple[Any, mmap.mmap, memoryview]] = []
    pool = ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-pack")
    parent_files = _parent_files(writer.parent_body)
    bundles: list[str] = []
    bundle = bytearray()
    futures: list[Any] = []

    def seal_bundle() -> None:
        nonlocal bundle
        if bundle:
            bname = f"{BUNDLE_PREFIX}{len(bundles)}"
            writer.add_region(RegionInfo(name=bname, nbytes=len(bundle), kind="blob"))
            futures.append(pool.submit(_put, writer, counter, bname, 0, memoryview(bundle)))
            bundles.append(bname)
            bundle = bytearray()

    try:
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
            if reuse_unchanged and _reuse_unchanged_file(writer, parent_files, name, st):
                counter.add(size)
                continue
            if size <= SMALL_FILE:
                data = path.read_bytes()
                if len(bundle) + len(data) > writer.chunk_size:
                    seal_bundle()
                tree[name].update(bundle=f"{BUNDLE_PREFIX}{len(bundles)}", offset=len(bundle), size=len(data))
                bundle += data
                continue
            fh = open(path, "rb")  # noqa: SIM115 (closed in the finally below, after the pool drains)
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mm)
            maps.append((fh, mm, view))
            mid = max(0, size // 2 - SNIFF_BYTES // 2)
            k = codecs.float_itemsize(dtype) if dtype else sniff_itemsize(view[mid : mid + SNIFF_BYTES])
            hint = dtype or ({2: "float16", 4: "float32"}.get(k) if k else None)
            writer.add_region(RegionInfo(name=name, nbytes=size, kind="file", dtype=hint))
            for index, (off, length) in enumerate(_cuts(view, k, writer.chunk_size)):
                if k:  # fixed-size chunks: each worker reads its own (see _put_read)
                    futures.append(pool.submit(_put_read, writer, counter, name, index, fh.fileno(), off, length))
                else:
                    futures.append(pool.submit(_put, writer, counter, name, index, view[off : off + length]))
        seal_bundle()
        for fut in futures:
            fut.result()
        writer.set_metadata("tree", tree)
        writer.set_metadata("bundles", bundles)
        ref = writer.commit()
        counter.finish()
        return ref
    except BaseException:
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for fh, mm, view in maps:
            view.release()
            try:
                mm.close()
            except BufferError:
                pass  # a slice is still held by a failed future; the map closes when that is collected
            fh.close()


def _parent_files(body: dict[str, Any] | None) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name → (parent tree entry, parent region) for the parent's non-bundled files."""
    if not body:
        return {}
    tree = (body.get("metadata") or {}).get("tree") or {}
    regions = {r["name"]: r for r in body.get("regions", [])}
    return {n: (e, regions[n]) for n, e in tree.items() if e.get("type") == "file" and n in regions}


def _reuse_unchanged_file(
    writer: StoreImageWriter, parent_files: dict[str, Any], name: str, st: os.stat_result
) -> bool:
    found = parent_files.get(name)
    if found is None or writer.parent_body is None:  # parent files come from the parent's body
        return False
    old_entry, region = found
    if old_entry.get("mtime_ns") != st.st_mtime_ns or int(region["nbytes"]) != st.st_size or st.st_size <= SMALL_FILE:
        return False
    writer.add_region(RegionInfo(name=name, nbytes=st.st_size, kind="file", dtype=region.get("dtype")))
    chunk = int(writer.parent_body["chunk_size"])
    sizes = region.get("sizes") or [min(chunk, st.st_size - i * chunk) for i in range(len(region["chunks"]))]
    for index, (cid, length) in enumerate(zip(region["chunks"], sizes, strict=True)):
        writer.reuse_chunk(name, index, cid, int(length))
    return True


def _put(writer: StoreImageWriter, counter: ProgressCounter, name: str, index: int, data: memoryview) -> None:
    try:
        writer.put_chunk(name, index, data)
        counter.add(len(data))
    finally:
        data.release()


def _put_read(
    writer: StoreImageWriter, counter: ProgressCounter, name: str, index: int, fd: int, offset: int, length: int
) -> None:
    """Read one fixed-size chunk with pread into a recycled buffer, then store it.

    Faulting the file's page cache in through the map costs more than copying it out once the
    cached pages are small or cold (equal on a file just written; bench/README.md), and pread lets the
    kernel's readahead work for files that are not cached at all.
    """
    buf = POOL.take(length)
    view = memoryview(buf)[:length]
    try:
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise TransferError(f"{name} shrank while it was being packed (chunk {index} ends early)")
            got += n
        writer.put_chunk(name, index, view)
        counter.add(length)
    finally:
        try:
            view.release()
        except BufferError:  # a failed encode's traceback still holds a view: let it be collected
            pass
        else:
            POOL.give(buf)
