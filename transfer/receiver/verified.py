"""What a receiver keeps: a ``file://`` store holding only chunks it verified, under a disk quota.

Every chunk is verified (AES-GCM, decode, BLAKE3 against its id) before it is stored; a chunk that cannot be
verified is never stored. Chunks left by an earlier run (a receiver killed mid-transfer) are verified again before
they are listed, so a resumed push moves only what is missing and trusts nothing unchecked. A manifest is stored
only once every chunk it names is here, verified, at its size.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from gpumigrate.errors import GpumigrateError
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, Sealer, parse_header
from gpumigrate.transfer.format.manifest import open_manifest
from gpumigrate.transfer.stores import check_image_id
from gpumigrate.transfer.stores.file import FileStore
from gpumigrate.transfer.stores.wire import FULL, OK, REJECTED

log = logging.getLogger(__name__)

DISK_RESERVE_BYTES = 64 << 20  # never fill the disk to the last block, whatever the quota
AUDIT_THREADS = 4


class VerifiedStore:
    """``store`` holding only what ``sealer`` verified, at most ``quota_bytes`` (None: the disk's free space).

    The check of what an earlier run left starts here, on a thread; every listing and every landing waits for it.
    """

    def __init__(self, store: FileStore, sealer: Sealer, quota_bytes: int | None) -> None:
        self.store = store
        self.sealer = sealer
        self.quota_bytes = quota_bytes
        self.chunks_received = 0
        self.bytes_received = 0
        self.chunks_present = 0  # verified chunks found at start (left by an earlier run)
        self.chunks_discarded = 0  # chunks found at start that failed verification, removed
        self._lock = threading.Lock()
        self._manifest_lock = threading.Lock()
        self._verified: dict[str, int] = {}
        self._manifests: dict[str, int] = {}  # image id -> size: what is held already costs no quota again
        self._used = 0
        self._audited = threading.Event()
        threading.Thread(target=self._audit, name="gm-recv-audit", daemon=True).start()

    @property
    def bytes_stored(self) -> int:
        with self._lock:
            return self._used

    # ------------------------------------------------------------------ chunks already on disk
    def _audit(self) -> None:
        """Verify what an earlier run left before listing any of it (a kill -9 leaves whole files whose
        data may not have reached the disk, and hidden temp files); remove what fails."""
        try:
            # through the store's own directory handles: a link planted in the store is neither listed,
            # followed nor deleted through (it points outside), only named in the log when it blocks a write
            self.store.remove_leftovers()
            found = self.store.list_chunks()
            is_delta = {c: self._is_delta(c) for c in found}
            bases = [c for c, delta in is_delta.items() if not delta]
            deltas = [c for c, delta in is_delta.items() if delta]
            with ThreadPoolExecutor(AUDIT_THREADS, thread_name_prefix="gm-recv-audit") as pool:
                for phase in (bases, deltas):  # a delta's base must be verified first
                    list(pool.map(self._audit_one, phase))
            manifests = self.store.manifest_sizes()
            with self._lock:
                self._manifests.update(manifests)
                self._used = sum(self._verified.values()) + sum(manifests.values())
                self.chunks_present = len(self._verified)
        except Exception:  # a receiver that cannot read its own store serves an empty listing, never a wrong one
            log.exception("checking the chunks already in %s failed", self.store.url)
        finally:
            self._audited.set()

    def _is_delta(self, chunk_id: str) -> bool:
        header = self.store.chunk_header(chunk_id, HEADER_SIZE)
        return len(header) > 4 and bool(header[4] & 0x80)  # byte 4: codec, 0x80 = XOR delta (FORMAT.md)

    def _audit_one(self, chunk_id: str) -> None:
        try:
            blob = self.store.get_chunk(chunk_id)
            header = parse_header(blob, chunk_id)
            if header.encrypted and not self.sealer.encrypted:
                return  # checkable only with the image key: neither listed nor removed
            out = bytearray(header.raw_len)
            self.sealer.open_into(chunk_id, blob, memoryview(out), self._open_base)
        except GpumigrateError as exc:
            log.warning("removing chunk %s left by an earlier run: %s", chunk_id[:16], exc.message)
            self.store.remove_chunk(chunk_id)
            with self._lock:
                self.chunks_discarded += 1
            return
        with self._lock:
            self._verified[chunk_id] = len(blob)

    def _open_base(self, base_id: str) -> bytes:
        blob = self.store.get_chunk(base_id)
        out = bytearray(parse_header(blob, base_id).raw_len)
        self.sealer.open_into(base_id, blob, memoryview(out), self._open_base)
        return bytes(out)

    def verified_chunks(self) -> dict[str, int]:
        self._audited.wait()
        with self._lock:
            return dict(self._verified)

    def header(self, chunk_id: str) -> tuple[int, bytes] | None:
        """A verified chunk's stored size and header; None when it is not here verified."""
        size = self.verified_chunks().get(chunk_id)
        return None if size is None else (size, self.store.chunk_header(chunk_id, HEADER_SIZE))

    # ------------------------------------------------------------------ arrivals
    def _reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the quota and the disk's free space; False when either would overflow."""
        if self.store.free_bytes() < nbytes + DISK_RESERVE_BYTES:
            return False
        with self._lock:
            if self.quota_bytes is not None and self._used + nbytes > self.quota_bytes:
                return False
            self._used += nbytes
        return True

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def land(self, ident: str, blob: memoryview, scratch: bytearray) -> tuple[int, bytes]:
        """Verify one object, then store it (the reply's status and body); nothing unverified is ever stored.
        A failed check raises (the caller answers REJECTED); ``scratch`` takes the plaintext when it is large enough."""
        self._audited.wait()
        n = len(blob)
        with self._lock:
            have = self._verified.get(ident)
        if have == n:
            return OK, b""  # already here and verified (a re-sent chunk)
        if not self._reserve(n):
            with self._lock:
                used = self._used
            return FULL, f"quota: {n} more bytes would exceed {self.quota_bytes} (holding {used})".encode()
        try:
            header = parse_header(blob, ident)
            out = scratch if len(scratch) >= header.raw_len else bytearray(header.raw_len)
            self.sealer.open_into(ident, blob, memoryview(out)[: header.raw_len], self._open_base)
            self.store.put_chunk(ident, blob)
        except BaseException:
            self._unreserve(n)
            raise
        with self._lock:
            replaced = self._verified.get(ident)  # read again: another connection may have landed it meanwhile
            if replaced is not None:
                self._used -= replaced
            self._verified[ident] = n
            self.chunks_received += 1
            self.bytes_received += n
        return OK, b""

    def accept_manifest(self, image_id: str, data: bytes) -> tuple[int, bytes]:
        """Store a manifest whose signature checks out and whose every chunk is here, verified (status, body).

        The quota is counted once per image: a manifest this store already holds (the same id is the same bytes)
        is acknowledged again without a second reservation, however often it is sent."""
        check_image_id(image_id)
        body = open_manifest(data, image_id, self.sealer)  # signature, key id; alg none only where allowed
        have = self.verified_chunks()
        missing = [cid for cid, entry in body["objects"].items() if have.get(cid) != int(entry[0])]
        if missing:
            return (
                REJECTED,
                f"{len(missing)} chunks named by the manifest have not arrived (first {missing[0][:16]})".encode(),
            )
        self._audited.wait()
        with self._manifest_lock:  # one reservation per image, however many connections send it at once
            with self._lock:
                held = self._manifests.get(image_id)
            if held == len(data) and self.store.manifest_sizes().get(image_id) == held:
                return OK, b""  # already here, already counted
            if not self._reserve(len(data)):
                return FULL, b"quota: no room for the manifest"
            try:
                self.store.flush()
                self.store.put_manifest(image_id, data)
            except BaseException:
                self._unreserve(len(data))
                raise
            with self._lock:
                if held is not None:
                    self._used -= held  # a damaged copy replaced: counted once
                self._manifests[image_id] = len(data)
        return OK, b""
