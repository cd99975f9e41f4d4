"""The file store's objects move by direct I/O where they can (transfer/stores/direct_io.py): an aligned buffer's
body goes straight to the disk, its tail through the page cache, and reads come back whole; an unaligned buffer, a
memory filesystem or a refusal goes the buffered way, with the same bytes."""

from __future__ import annotations

import mmap
import os
import socket
import threading
from pathlib import Path

import pytest

from gpumigrate.errors import TransferError
from gpumigrate.transfer.stores import open_store
from gpumigrate.transfer.stores.direct_io import ALIGN, DirectIO, address_of
from gpumigrate.transfer.stores.file import MEMORY_FILESYSTEMS, FileStore, filesystem_of

MiB = 1 << 20


def aligned(nbytes: int, fill: bytes | None = None) -> memoryview:
    """Page-aligned memory (an anonymous mapping), as a capture's page-locked slots are."""
    area = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
    if fill is not None:
        area[: len(fill)] = fill
    view = memoryview(area)
    assert address_of(view) % ALIGN == 0
    return view


def disk_store(tmp_path: Path) -> FileStore:
    if filesystem_of(tmp_path) in MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is in memory: the file store never uses direct I/O there")
    store = open_store(f"file://{tmp_path / 'store'}")
    assert isinstance(store, FileStore)
    return store


def test_an_aligned_object_goes_to_the_disk_directly_and_comes_back_whole(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    data = os.urandom(3 * MiB + 123)  # a sealed object: a whole number of blocks, and a tail
    store.put_chunk("ab" * 32, aligned(len(data), data)[: len(data)])
    store.flush()
    if not store.io.enabled:
        pytest.skip(f"the filesystem under {tmp_path} refuses O_DIRECT")
    assert (store.io.bytes_direct, store.io.bytes_buffered) == (3 * MiB, 123)
    out = aligned(4 * MiB)  # a reader's slot: room for the largest object, whole blocks
    assert store.get_chunk_into("ab" * 32, out) == len(data)
    assert bytes(out[: len(data)]) == data
    assert store.io.bytes_direct == 6 * MiB + 123  # the read came whole, the last short block included
    assert store.get_chunk("ab" * 32) == data  # a plain read (push, verify) sees the same bytes
    with pytest.raises(TransferError, match="more than the"):
        store.get_chunk_into("ab" * 32, aligned(3 * MiB))  # a file longer than the room: refused, as before


def test_unaligned_memory_goes_through_the_page_cache(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    data = os.urandom(2 * MiB)
    blob = memoryview(bytearray(len(data) + 1))[1:]  # one byte off any block boundary
    blob[:] = data
    store.put_chunk("cd" * 32, blob)
    store.flush()
    assert store.io.bytes_direct == 0 and store.io.bytes_buffered == len(data)
    out = bytearray(3 * MiB)
    assert store.get_chunk_into("cd" * 32, memoryview(out)[1:]) == len(data)
    assert bytes(out[1 : 1 + len(data)]) == data


def test_a_memory_filesystem_is_never_written_directly() -> None:
    if not Path("/dev/shm").is_dir() or filesystem_of(Path("/dev/shm")) not in MEMORY_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm")
    store = open_store(f"file:///dev/shm/gm-direct-io-{os.getpid()}")
    assert isinstance(store, FileStore) and not store.io.enabled


def test_a_refusal_turns_direct_io_off_and_the_bytes_still_arrive() -> None:
    """A descriptor that refuses O_DIRECT (a socket: EINVAL, as tmpfs or an overlay may answer) gets the object
    through the page cache, and the store tries no more direct writes."""
    io = DirectIO(enabled=True)
    data = os.urandom(2 * MiB)
    left, right = socket.socketpair()
    received = bytearray()

    def drain() -> None:
        while len(received) < len(data):
            received.extend(right.recv(1 << 16))

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        io.write(left.fileno(), aligned(len(data), data))
        reader.join(timeout=60)
    finally:
        left.close()
        right.close()
    assert bytes(received) == data
    assert not io.enabled and io.bytes_direct == 0 and io.bytes_buffered == len(data)


def test_the_switch_turns_it_off_for_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMIGRATE_FILE_DIRECT_IO", "0")
    assert not DirectIO(enabled=True).enabled


@pytest.mark.gpu
def test_a_gpu_capture_and_restore_move_the_disk_stores_objects_directly(tmp_path: Path) -> None:
    """The device path's page-locked slots are what a disk store writes from and reads into: the sealed objects
    cross the page cache only for their last partial block, and the restored tensors are bit-identical."""
    import torch

    from gpumigrate import transfer
    from gpumigrate.interfaces import RegionInfo, TensorChunk

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    store = disk_store(tmp_path)
    chunk = 4 * MiB
    weights = (torch.randn(6 * chunk // 2, device="cuda") * 0.02).to(torch.bfloat16).view(torch.uint8).reshape(-1)
    writer = transfer.open_writer(store, key=bytes(range(32)), chunk_size=chunk)
    writer.add_region(RegionInfo("w", weights.numel(), dtype="uint8", shape=tuple(weights.shape)))
    pieces = [TensorChunk("w", i // chunk, weights[i : i + chunk]) for i in range(0, weights.numel(), chunk)]
    for done in writer.put_tensors(pieces):
        done.result()
    image = writer.commit().id
    if not store.io.enabled:
        pytest.skip(f"the filesystem under {tmp_path} refuses O_DIRECT (or the page-locked slots do)")
    assert store.io.bytes_direct > 0.9 * (store.io.bytes_direct + store.io.bytes_buffered)
    written = store.io.bytes_direct
    out = torch.zeros_like(weights)
    reader = transfer.open_reader(store, image, key=bytes(range(32)))
    reader.read_tensors([TensorChunk("w", i // chunk, out[i : i + chunk]) for i in range(0, out.numel(), chunk)])
    assert torch.equal(out, weights)
    assert store.io.bytes_direct > written  # the restore read them straight into its slots too
