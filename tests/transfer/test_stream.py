"""stream://: parallel TLS connections to a receiver that verifies each chunk before acknowledging."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import bf16_weights

from gpumigrate.errors import IntegrityError, TransferError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer import Receiver, open_reader, open_writer, pack_paths, push, serve_stream, verify
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.stores.stream import StreamStore


@pytest.fixture
def receiver(tmp_path: Path, key: bytes) -> Iterator[Receiver]:
    server = serve_stream("127.0.0.1:0", f"file://{tmp_path / 'target'}", key=key)
    try:
        yield server
    finally:
        server.close()


def test_push_over_stream_then_resume_sends_nothing(tmp_path: Path, key: bytes, receiver: Receiver) -> None:
    src = tmp_path / "in"
    src.mkdir()
    (src / "w").write_bytes(bf16_weights(3 << 20).tobytes())
    (src / "r").write_bytes(os.urandom(3 << 20))
    local = f"file://{tmp_path / 'local'}"
    ref = pack_paths([src], local, key=key)
    stats = push(local, receiver.url, ref.id, key=key, parallelism=4)
    assert stats.chunks_sent == stats.chunks_total == receiver.chunks_received
    assert receiver.manifests == [ref.id]
    assert push(local, receiver.url, ref.id, key=key).chunks_sent == 0
    target = f"file://{tmp_path / 'target'}"
    assert verify(target, ref.id, key=key).chunks_total == stats.chunks_total


def test_writer_streams_tensors_straight_to_the_target(tmp_path: Path, key: bytes, receiver: Receiver) -> None:
    data = bf16_weights(1_500_000)
    w = open_writer(receiver.url, key=key, chunk_size=1 << 20, parallelism=3)
    w.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="bfloat16", shape=data.shape))
    view = memoryview(data).cast("B")
    for i in range(-(-data.nbytes // w.chunk_size)):
        w.put_chunk("w", i, view[i * w.chunk_size : (i + 1) * w.chunk_size])
    ref = w.commit()
    got = open_reader(f"file://{tmp_path / 'target'}", ref.id, key=key).read_region("w")
    assert np.array_equal(np.frombuffer(got, dtype=np.uint16), data)


def test_receiver_rejects_a_tampered_chunk_and_an_early_manifest(
    key: bytes, receiver: Receiver, tmp_path: Path
) -> None:
    sealer = Sealer(key)
    from gpumigrate.transfer.format.chunkobj import chunk_id_of

    plain = os.urandom(4096)
    cid = chunk_id_of(plain)
    blob = sealer.seal(cid, 0, len(plain), plain)
    blob[-1] ^= 1
    sender = StreamStore(receiver.url)
    try:
        sender.put_chunk(cid, blob)  # pipelined: returns once sent
        with pytest.raises(IntegrityError, match="rejected"):
            sender.flush()  # the rejection surfaces before any manifest could be written
        assert sender.chunk_size(cid) is None  # nothing stored
        assert receiver.chunks_rejected == 1
        # a manifest whose chunks have not arrived is refused
        w = open_writer(f"file://{tmp_path / 'elsewhere'}", key=key)
        w.add_region(RegionInfo(name="b", nbytes=len(plain), kind="blob"))
        w.put_chunk("b", 0, memoryview(plain))
        ref = w.commit()
        manifest = (tmp_path / "elsewhere" / "manifests" / ref.id).read_bytes()
        with pytest.raises(IntegrityError, match="have not arrived"):
            sender.put_manifest(ref.id, manifest)
    finally:
        sender.close()


def test_receiver_with_another_key_rejects_chunks(tmp_path: Path, key: bytes) -> None:
    other = serve_stream("127.0.0.1:0", f"file://{tmp_path / 't2'}", key=os.urandom(32))
    try:
        src = tmp_path / "f"
        src.write_bytes(os.urandom(300_000))
        local = f"file://{tmp_path / 'local'}"
        ref = pack_paths([src], local, key=key)
        with pytest.raises(IntegrityError, match="failed authentication"):
            push(local, other.url, ref.id, key=key)
        assert other.chunks_received == 0
    finally:
        other.close()


def test_pinned_fingerprint_mismatch_and_no_receiver(receiver: Receiver) -> None:
    bad = StreamStore(f"stream://127.0.0.1:{receiver.port}?fingerprint={'0' * 64}")
    with pytest.raises(TransferError, match="not the pinned"):
        bad.list_chunks()
    bad.close()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(TransferError, match="cannot connect"):
        StreamStore(f"stream://127.0.0.1:{free}").list_chunks()


def test_precopy_rounds_written_straight_to_the_stream_chain_parents(
    tmp_path: Path, key: bytes, receiver: Receiver
) -> None:
    data = bf16_weights(800_000)
    chunk = 256 * 1024

    def round_(arr: np.ndarray, parent: str | None) -> tuple[str, int]:
        w = open_writer(receiver.url, key=key, chunk_size=chunk, parent=parent)
        w.add_region(RegionInfo(name="w", nbytes=arr.nbytes, dtype="bfloat16"))
        view = memoryview(arr).cast("B")
        for i in range(-(-arr.nbytes // chunk)):
            w.put_chunk("w", i, view[i * chunk : (i + 1) * chunk])
        ref = w.commit()
        return ref.id, w.chunks_new

    first, new1 = round_(data, None)
    changed = data.copy()
    changed[:10] += 1
    second, new2 = round_(changed, first)  # the parent manifest is read (and verified) over the stream
    assert new1 == -(-data.nbytes // chunk) and new2 == 1
    got = open_reader(f"file://{tmp_path / 'target'}", second, key=key).read_region("w")
    assert bytes(got) == changed.tobytes()


def test_writer_reuses_chunks_the_receiver_already_holds(tmp_path: Path, key: bytes, receiver: Receiver) -> None:
    data = os.urandom(600_000)
    refs = []
    for _ in range(2):  # the second image has no parent, yet sends nothing: the receiver has every chunk
        w = open_writer(receiver.url, key=key, chunk_size=256 * 1024)
        w.add_region(RegionInfo(name="b", nbytes=len(data), kind="blob"))
        for i in range(3):
            w.put_chunk("b", i, memoryview(data)[i * 256 * 1024 : (i + 1) * 256 * 1024])
        refs.append((w.commit(), w.chunks_new))
    assert refs[0][1] == 3 and refs[1][1] == 0
    assert bytes(open_reader(f"file://{tmp_path / 'target'}", refs[1][0].id, key=key).read_region("b")) == data


def test_delta_image_pushed_over_pipelined_stream_verifies_every_delta_against_its_base(
    tmp_path: Path, key: bytes, receiver: Receiver
) -> None:
    """Bases and deltas in one push: the receiver must hold each base before a delta built on it arrives."""
    local = f"file://{tmp_path / 'local'}"
    base = bf16_weights(600_000)
    w = open_writer(local, key=key, chunk_size=64 << 10)
    w.add_region(RegionInfo(name="w", nbytes=base.nbytes, dtype="bfloat16"))
    view = memoryview(base).cast("B")
    for i in range(-(-base.nbytes // w.chunk_size)):
        w.put_chunk("w", i, view[i * w.chunk_size : (i + 1) * w.chunk_size])
    parent = w.commit()
    changed = base.copy()
    changed[::40] ^= 1
    d = open_writer(local, key=key, parent=parent.id, delta=True)
    d.add_region(RegionInfo(name="w", nbytes=changed.nbytes, dtype="bfloat16"))
    cview = memoryview(changed).cast("B")
    for i in range(-(-changed.nbytes // d.chunk_size)):
        d.put_chunk("w", i, cview[i * d.chunk_size : (i + 1) * d.chunk_size])
    child = d.commit()
    stats = push(local, receiver.url, child.id, key=key, parallelism=4)  # the parent's chunks are the bases
    assert stats.chunks_sent == receiver.chunks_received and receiver.chunks_rejected == 0
    got = open_reader(f"file://{tmp_path / 'target'}", child.id, key=key).read_region("w")
    assert bytes(got) == changed.tobytes()


def test_small_window_pipelines_many_chunks_and_reports_a_rejection(key: bytes, receiver: Receiver) -> None:
    """A window smaller than two chunks forces the sender to wait for acknowledgements mid-stream;
    a rejected chunk is raised by flush (before any manifest), and take_rejected names it for a resend."""
    from gpumigrate.transfer.format.chunkobj import chunk_id_of

    sealer = Sealer(key)
    sender = StreamStore(receiver.url, connections=2, window_bytes=100_000)
    sent = []
    try:
        with pytest.raises(IntegrityError, match="rejected"):
            for n in range(12):
                plain = os.urandom(60_000)
                cid = chunk_id_of(plain)
                blob = sealer.seal(cid, 0, len(plain), plain)
                if n == 7:
                    blob[-1] ^= 1  # one bad chunk in the middle of the stream
                sender.put_chunk(cid, blob)
                sent.append(cid)
            sender.flush()
        assert len(sent) == 12  # a rejection does not stop the stream: flush reports it
        assert sender.take_rejected() == [sent[7]]
        deadline = time.monotonic() + 10  # chunks sent after the bad one may still be in flight
        while receiver.chunks_received + receiver.chunks_rejected < len(sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        have = StreamStore(receiver.url).list_chunks()
        assert [cid in have for cid in sent] == [n != 7 for n in range(len(sent))]
        assert receiver.chunks_rejected == 1
    finally:
        sender.close()
