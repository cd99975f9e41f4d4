"""The direct reader: a :class:`StoreImageReader` that also fills tensors (``direct.py`` says how).

Worker threads read each object into a pinned slot, decrypt it in place, decode it (CPU codecs, or plane codec 3 on
the destination's GPU), copy it to its destination tensor and, once every copy landed, check every chunk's BLAKE3
on the device against its id. Host tensors go the plain way, into their own memory, verified on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from gpumigrate import cudacalls
from gpumigrate.errors import IntegrityError, InvalidInputError
from gpumigrate.interfaces import TensorChunk
from gpumigrate.stageclock import STAGES, log_stages
from gpumigrate.transfer.buffers import PinnedSlots
from gpumigrate.transfer.device import gpupayload
from gpumigrate.transfer.direct import OBJECT_AT, PAYLOAD_AT, SLOTS, STREAMS, DeviceIds, pool, slots_for, wait_for
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import chunk_id_of
from gpumigrate.transfer.reader import StoreImageReader

if TYPE_CHECKING:
    import torch

    from gpumigrate.transfer.direct import Landed


class DirectStoreImageReader(StoreImageReader):
    """A :class:`StoreImageReader` that also fills tensors (see the module docstring)."""

    def read_tensors(self, chunks: Sequence[TensorChunk]) -> int:
        import torch

        workers = pool()
        futures: list[Future[int]] = []
        devices: set[torch.device] = set()
        # The copies run on side streams: they must start after whatever the caller's stream still has
        # queued for the destinations (a zero fill of a fresh tensor would otherwise land on top of them).
        producers: dict[torch.device, Landed] = {}
        for chunk in chunks:
            if chunk.data.numel() != self.chunk_length(chunk.region, chunk.index):
                raise IntegrityError(
                    f"image chunk {chunk.region}#{chunk.index} holds {self.chunk_length(chunk.region, chunk.index)} "
                    f"bytes; the destination needs {chunk.data.numel()}"
                )
            if chunk.data.is_cuda:
                devices.add(chunk.data.device)
                if chunk.data.device not in producers:
                    current = torch.cuda.current_stream(chunk.data.device)
                    producers[chunk.data.device] = cudacalls.recorded(chunk.data.device, current)
                futures.append(workers.submit(self._load_device, chunk, producers[chunk.data.device]))
            else:
                futures.append(workers.submit(self._load_host, chunk))
        try:
            total = sum(f.result() for f in futures)
        finally:
            for f in futures:  # none may still write into a destination after we return
                f.exception()
        for device in devices:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        self._verify_on_device([c for c in chunks if c.data.is_cuda])
        STAGES.add("restore.main.verify", t)
        log_stages("restore")
        return total

    def _load_host(self, chunk: TensorChunk) -> int:
        return self.read_chunk_into(chunk.region, chunk.index, memoryview(chunk.data.numpy()))

    def _load_device(self, chunk: TensorChunk, after: Landed) -> int:
        import torch

        n: int = chunk.data.numel()
        chunk_id = self._region(chunk.region)["chunks"][chunk.index]
        where = f" ({chunk.region}[{chunk.index}])"
        slots = slots_for(self.chunk_size, SLOTS)
        t = time.perf_counter()
        slot = slots.take()
        t = STAGES.add("restore.worker.slot_wait", t)
        plain: int | None = None
        try:
            view = slots.view(slot)
            size = self._fetch_into(chunk_id, view[OBJECT_AT:])
            t = STAGES.add("restore.worker.read", t)
            hdr, payload = self.sealer.open_payload(chunk_id, view[OBJECT_AT : OBJECT_AT + size], where)
            t = STAGES.add("restore.worker.open", t)
            if hdr.raw_len != n:
                raise IntegrityError(f"chunk {chunk_id[:16]}{where} records {hdr.raw_len} bytes, the manifest says {n}")
            stream = STREAMS.get(chunk.data.device, "copy")
            wait_for(after, stream)
            with torch.cuda.stream(stream):
                if hdr.codec == codecs.NONE:
                    if len(payload) != n:
                        raise IntegrityError(f"chunk {chunk_id[:16]}{where} is truncated or padded")
                    _to_device(chunk.data, slots, slot, PAYLOAD_AT, stream)
                elif hdr.codec == codecs.BYTEPLANE and (k := gpupayload.layout(payload, n)):
                    gpupayload.decode_on_device(
                        k,
                        payload,
                        PAYLOAD_AT,
                        lambda dest, start: _to_device(dest, slots, slot, start, stream),
                        chunk.data,
                        stream,
                        where,
                    )
                else:  # CPU codecs (and deltas): decoded into a second slot, then one copy
                    plain = slots.take()
                    out = slots.view(plain)
                    if hdr.codec & codecs.DELTA_FLAG:
                        self.sealer.open_into(chunk_id, self._fetch(chunk_id), out, self.read_object, where)
                    else:
                        try:
                            codecs.decode_into(hdr.codec, payload, n, out)
                        except IntegrityError as exc:
                            raise IntegrityError(f"chunk {chunk_id[:16]}{where}: {exc.message}") from None
                    _to_device(chunk.data, slots, plain, 0, stream)
                done = cudacalls.recorded(chunk.data.device, stream)
            t = STAGES.add("restore.worker.decode_queue", t)
            done.synchronize()
            STAGES.add("restore.worker.copy_wait", t)
            return n
        finally:
            slots.give(slot)
            if plain is not None:
                slots.give(plain)

    def _fetch_into(self, chunk_id: str, out: memoryview) -> int:
        if not self.store.readable:
            raise InvalidInputError(
                f"{self.store.url} is write-only: read the image's chunks from the receiver's store"
            )
        try:
            return self.store.get_chunk_into(chunk_id, out)
        except IntegrityError:
            raise
        except Exception as exc:
            raise IntegrityError(f"image {self.image_id[:16]}: {getattr(exc, 'message', exc)}") from None

    def _verify_on_device(self, chunks: Sequence[TensorChunk]) -> None:
        """Every chunk's BLAKE3 from the bytes that landed, against its id; the CPU hashes odd lengths."""
        import torch

        by_device: dict[str, list[TensorChunk]] = {}
        for chunk in chunks:
            by_device.setdefault(str(chunk.data.device), []).append(chunk)
        for members in by_device.values():
            ids = DeviceIds([c.data for c in members], torch.cuda.current_stream(members[0].data.device))
            for i, chunk in enumerate(members):
                want = self._region(chunk.region)["chunks"][chunk.index]
                got = ids.get(i) or chunk_id_of(memoryview(chunk.data.cpu().numpy()))
                if got != want:
                    raise IntegrityError(
                        f"chunk {chunk.index} of {chunk.region}: BLAKE3 of the restored bytes does not match its id "
                        "(corrupted)"
                    )


def _to_device(out: torch.Tensor, slots: PinnedSlots, slot: int, start: int, stream: torch.cuda.Stream) -> None:
    """Queue the copy of ``out.numel()`` bytes from the slot (from ``start``) into the contiguous device tensor
    ``out``, on ``stream`` (the current stream): raw where the runtime is here (``cudacalls``), else torch's."""
    rt = cudacalls.runtime()
    if rt is None or not out.is_contiguous():
        out.copy_(slots.tensor(slot, start, start + out.numel()), non_blocking=True)
        return
    cudacalls.copy(
        rt, out.device.index or 0, out.data_ptr(), slots.address(slot) + start, out.numel(), stream.cuda_stream
    )
