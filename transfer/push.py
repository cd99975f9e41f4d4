"""push (copy an image between stores, resumable), verify, and store_region.

Push is the one code path for ``gpumigrate image push`` and the flows' transfer phase. It checks the
signed manifest, lists the destination once and copies only the objects it lacks. It never reads
back, decrypts or re-hashes the chunks it copies (the snapshot writer hashed them as it wrote
them): each object is checked where it lands, by its AES-GCM tag and BLAKE3 id — a ``stream://``
or ``nixl://`` receiver before it stores the object, any other store by the reader that uses it
(``verify``, a restore). Objects the destination already holds at the right size are verified
before they are trusted: a receiver lists only objects it verified, any other store's are read and
checked here. The manifest goes last, so an interrupted push leaves only whole, reusable chunks and
a re-run sends the rest.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpumigrate.errors import GpumigrateError, IntegrityError
from gpumigrate.transfer.api import _store
from gpumigrate.transfer.format.chunkobj import Sealer, parse_header
from gpumigrate.transfer.latest import resolve_image_id
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter, RateLimiter, TransferStats
from gpumigrate.transfer.reader import StoreImageReader
from gpumigrate.transfer.stores import BucketStore, Store, split_url


class _Scratch(threading.local):
    buf: bytearray | None = None

    def get(self, n: int) -> memoryview:
        if self.buf is None or len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


def _check_object(reader: StoreImageReader, scratch: _Scratch, chunk_id: str, blob: bytes) -> None:
    """Authenticate and hash one stored object without keeping its plaintext."""
    raw_len = parse_header(blob, chunk_id).raw_len
    reader.sealer.open_into(chunk_id, blob, scratch.get(raw_len), reader.read_object)


def _untrusted(dst: Store, reader: StoreImageReader, candidates: list[str], parallelism: int) -> list[str]:
    """The objects among ``candidates`` (present at the right size) that fail verification at ``dst``."""
    if dst.verifies_on_arrival or not candidates:
        return []  # a receiver lists only objects it verified
    scratch = _Scratch()

    def bad(cid: str) -> bool:
        try:
            _check_object(reader, scratch, cid, dst.get_chunk(cid))
        except GpumigrateError:
            return True
        return False

    with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-push-check") as pool:
        return [cid for cid, failed in zip(candidates, pool.map(bad, candidates), strict=True) if failed]


RESENDS = 2  # a chunk a receiver rejects (damaged on the way) is sent again up to this many times


def _flush_or_resend(dst: Store) -> tuple[list[str], str]:
    """Flush ``dst``; return the chunks it rejected (to send again) and why, raising any other failure."""
    try:
        dst.flush()
    except IntegrityError as exc:
        rejected = dst.take_rejected()
        if not rejected:
            raise
        dst.flush()
        return rejected, exc.message
    return [], ""


def push(
    src_url: str | Store,
    dst_url: str | Store,
    image_id: str,
    *,
    key: bytes | None,
    parallelism: int = 4,
    progress: ProgressCallback | None = None,
    rate_limit: float | None = None,
    endpoint_url: str | None = None,
) -> TransferStats:
    """Copy image ``image_id`` and whichever of its chunks ``dst_url`` lacks; returns what moved.

    ``dst_url`` is any store (file://, s3://, gs://) or a receiver (stream://, nixl://).
    ``rate_limit`` caps bytes/s.
    """
    t0 = time.monotonic()
    src = _store(src_url, endpoint_url)
    dst = _store(dst_url, endpoint_url, parallelism)
    try:
        sealer = Sealer(key)
        image_id = resolve_image_id(src, image_id, sealer)
        reader = StoreImageReader(src, image_id, sealer)  # the signed manifest, checked
        manifest = src.get_manifest(image_id)
        objects: dict[str, list[Any]] = reader.objects
        stats = TransferStats(image_id=image_id, chunks_total=len(objects), bytes_logical=reader.ref.bytes_image)
        have = dst.list_chunks()
        todo = [cid for cid in objects if cid not in have]
        wrong_size = [cid for cid in objects if cid in have and have[cid] != int(objects[cid][0])]
        present = [cid for cid in objects if have.get(cid) == int(objects[cid][0])]
        invalid = wrong_size + _untrusted(dst, reader, present, parallelism)
        todo += invalid
        stats.chunks_resent_invalid = len(invalid)
        stats.chunks_skipped = len(objects) - len(todo)
        counter = ProgressCounter(progress, sum(int(objects[c][0]) for c in todo))
        limiter = RateLimiter(rate_limit)
        lock = threading.Lock()

        def copy_one(cid: str) -> None:
            blob = src.get_chunk(cid)
            limiter.take(len(blob))
            dst.put_chunk(cid, blob)
            with lock:
                stats.chunks_sent += 1
                stats.bytes_sent += len(blob)
            counter.add(len(blob))

        with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-push") as pool:
            for attempt in range(RESENDS + 1):
                # Delta bases go before the deltas built on them, so a receiver can verify every delta on arrival.
                bases_first = [c for c in todo if not objects[c][2]], [c for c in todo if objects[c][2]]
                for n, phase in enumerate(bases_first):
                    if n and phase and bases_first[0]:
                        # stores may acknowledge asynchronously (stream:// pipelines): every base must
                        # be stored before a delta that the receiver verifies against it arrives
                        todo_later, _ = _flush_or_resend(dst)
                        phase = phase + todo_later
                    for fut in [pool.submit(copy_one, cid) for cid in phase]:
                        fut.result()
                todo, why = _flush_or_resend(dst)
                if not todo:
                    break
                if attempt == RESENDS:
                    raise IntegrityError(
                        f"{len(todo)} chunks were rejected {RESENDS + 1} times; the last time: {why}",
                        hint="a damaged source copy (`gpumigrate image verify` it) or a receiver with another key",
                    )
                stats.chunks_resent_invalid += len(todo)
                counter.grow(sum(int(objects[c][0]) for c in todo))
        dst.put_manifest(image_id, manifest)
        stats.bytes_sent += len(manifest)
    finally:
        dst.close()
    counter.finish()
    stats.seconds = time.monotonic() - t0
    return stats


def verify(
    store_url: str | Store,
    image_id: str,
    *,
    key: bytes | None,
    parallelism: int = 4,
    endpoint_url: str | None = None,
    progress: ProgressCallback | None = None,
) -> TransferStats:
    """Check the manifest and every chunk (authenticate, decode, BLAKE3); raise IntegrityError naming the bad ones."""
    t0 = time.monotonic()
    store = _store(store_url, endpoint_url)
    sealer = Sealer(key)
    image_id = resolve_image_id(store, image_id, sealer)
    reader = StoreImageReader(store, image_id, sealer)
    objects = reader.objects
    stats = TransferStats(image_id=image_id, chunks_total=len(objects), bytes_logical=reader.ref.bytes_image)
    for reg in reader.body["regions"]:
        for i, cid in enumerate(reg["chunks"]):
            if cid not in objects:
                stats.errors.append(f"{reg['name']}[{i}] names chunk {cid[:16]} that the manifest's objects lack")
    scratch = _Scratch()
    counter = ProgressCounter(progress, sum(int(e[0]) for e in objects.values()))
    lock = threading.Lock()

    def check(cid: str) -> None:
        try:
            blob = store.get_chunk(cid)
            _check_object(reader, scratch, cid, blob)
            counter.add(len(blob))
        except GpumigrateError as exc:
            with lock:
                stats.errors.append(exc.message)

    with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="gm-verify") as pool:
        list(pool.map(check, objects))
    counter.finish()
    stats.seconds = time.monotonic() - t0
    if stats.errors:
        shown = "; ".join(sorted(stats.errors)[:10])
        more = f" (and {len(stats.errors) - 10} more)" if len(stats.errors) > 10 else ""
        raise IntegrityError(f"image {image_id[:16]} in {store.url} failed verification: {shown}{more}")
    return stats


def check_landed(
    store_url: str | Store, image_id: str, *, key: bytes | None, endpoint_url: str | None = None
) -> TransferStats:
    """Check an image where a writer put it, without reading a payload back: its signed manifest (id, key
    id, signature) and every object it names listed at the manifest's size. Each object is authenticated
    where it is checked anyway: a receiver verified it before listing it (push's path), and the reader
    that restores it checks its AES-GCM tag and BLAKE3 before using it. Raises IntegrityError naming
    what is missing; ``chunks_skipped`` counts the objects found."""
    t0 = time.monotonic()
    store = _store(store_url, endpoint_url)
    try:
        sealer = Sealer(key)
        image_id = resolve_image_id(store, image_id, sealer)
        reader = StoreImageReader(store, image_id, sealer)
        objects = reader.objects
        have = store.list_chunks()
    finally:
        store.close()
    missing = [cid for cid, entry in objects.items() if have.get(cid) != int(entry[0])]
    stats = TransferStats(
        image_id=image_id,
        chunks_total=len(objects),
        chunks_skipped=len(objects) - len(missing),
        bytes_logical=reader.ref.bytes_image,
        bytes_landed=sum(have[cid] for cid in objects if cid in have),
        seconds=time.monotonic() - t0,
    )
    if missing:
        shown = ", ".join(cid[:16] for cid in missing[:5])
        raise IntegrityError(
            f"image {image_id[:16]} in {store.url}: {len(missing)} of its {len(objects)} chunks are missing or "
            f"of the wrong size ({shown}{', …' if len(missing) > 5 else ''})",
            hint="the writer did not finish: write the image again (only the missing chunks move)",
        )
    return stats


def store_region(store_url: str, *, endpoint_url: str | None = None) -> str | None:
    """The cloud region a store's bucket lives in (S3 location, GCS location), None for file/stream."""
    with _store(store_url, endpoint_url) as store:
        return store.region()


def ensure_bucket(store_url: str, location: str, *, endpoint_url: str | None = None) -> str | None:
    """The region of the bucket a store URL names, the bucket created (private) in ``location`` when it does
    not exist; None for a store that is no bucket (file://, a receiver). An existing bucket is left where it
    is: the caller checks that location before any byte moves."""
    if split_url(store_url)[0] not in ("s3", "gs"):
        return None
    with _store(store_url, endpoint_url) as store:
        return store.ensure_bucket(location) if isinstance(store, BucketStore) else None
