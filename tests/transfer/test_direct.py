"""The direct writer/reader (transfer/direct_writer.py, direct_reader.py) against the plain ones, and the end-to-end smoke.

On CPU (CI) the direct path takes host tensors; the ``gpu``-marked tests run the device path
(device BLAKE3 ids, pinned slots, device-side verification, the nvCOMP plane codec where present)
on the lent GPU machine.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import blake3
import pytest
import torch

from gpumigrate import transfer
from gpumigrate.errors import DecryptionError, IntegrityError
from gpumigrate.interfaces import DirectImageReader, DirectImageWriter, RegionInfo, TensorChunk
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.transfer import writer
from gpumigrate.transfer.device import gpucodec

KEY = bytes(range(32))
REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10


class _FixedClock(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime's own signature
        return datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": (torch.randn(5 * CHUNK // 2 + 300, generator=g) * 0.02).to(torch.bfloat16).to(device),
        "f": torch.randn(CHUNK // 4 * 2, generator=g).to(device),
        "b": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g).to(device),
        # whole chunks of other dtypes: mostly zero pages (a GPU codes them whole, k = 1), random int8 (stays raw)
        "z": torch.zeros(2 * CHUNK, dtype=torch.uint8).index_fill_(0, torch.arange(0, 2 * CHUNK, 4099), 7).to(device),
        "r": torch.randint(-128, 128, (CHUNK,), dtype=torch.int8, generator=g).to(device),
    }


def _write(url: str, tensors: dict[str, torch.Tensor], *, direct: bool, key: bytes | None = KEY) -> str:
    w = transfer.open_writer(url, key=key, chunk_size=CHUNK)
    chunks = []
    for name, t in tensors.items():
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        w.add_region(RegionInfo(name, flat.numel(), dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)))
        for i in range(0, flat.numel(), CHUNK):
            chunks.append(TensorChunk(name, i // CHUNK, flat[i : i + CHUNK]))
    if direct:
        for f in w.put_tensors(chunks):
            f.result()
    else:
        for c in chunks:
            w.put_chunk(c.region, c.index, memoryview(c.data.cpu().numpy()))
    return w.commit().id


def test_open_writer_and_reader_are_the_declared_direct_kinds(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    image = _write(url, _tensors(), direct=False)
    assert isinstance(transfer.open_writer(url, key=KEY), DirectImageWriter)
    assert isinstance(transfer.open_reader(url, image, key=KEY), DirectImageReader)


def test_direct_and_plain_writers_make_the_same_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "datetime", _FixedClock)
    monkeypatch.setattr(writer, "next_sequence", lambda parent: 1)  # the same moment for both writers
    tensors = _tensors()
    plain = _write(f"file://{tmp_path / 'plain'}", tensors, direct=False, key=None)
    direct = _write(f"file://{tmp_path / 'direct'}", tensors, direct=True, key=None)
    assert plain == direct  # the manifest (ids, sizes, codecs, metadata) is byte for byte the same
    for path in (tmp_path / "plain" / "chunks").glob("*/*"):  # unencrypted: the objects are equal too
        assert path.read_bytes() == (tmp_path / "direct" / path.relative_to(tmp_path / "plain")).read_bytes()
    # Encrypted, the nonces differ but ids, stored sizes and plaintext do not.
    a = transfer.open_reader(
        f"file://{tmp_path / 'pe'}", _write(f"file://{tmp_path / 'pe'}", tensors, direct=False), key=KEY
    )
    b = transfer.open_reader(
        f"file://{tmp_path / 'de'}", _write(f"file://{tmp_path / 'de'}", tensors, direct=True), key=KEY
    )
    assert a.objects == b.objects
    for name in tensors:
        assert a.chunk_ids(name) == b.chunk_ids(name)
        assert a.read_region(name) == b.read_region(name)


def test_direct_reader_fills_tensors_like_the_plain_reader(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    tensors = _tensors()
    reader = transfer.open_reader(url, _write(url, tensors, direct=True), key=KEY)
    for name, t in tensors.items():
        out = torch.zeros_like(t).view(torch.uint8).reshape(-1)
        chunks = [TensorChunk(name, i // CHUNK, out[i : i + CHUNK]) for i in range(0, out.numel(), CHUNK)]
        assert reader.read_tensors(chunks) == out.numel()
        assert bytes(out.numpy()) == bytes(reader.read_region(name))
        assert torch.equal(out, t.contiguous().view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("key", [KEY, None], ids=["encrypted", "plain"])
def test_a_damaged_chunk_is_caught_by_the_direct_reader(tmp_path: Path, key: bytes | None) -> None:
    url = f"file://{tmp_path / 's'}"
    tensors = _tensors()
    image = _write(url, tensors, direct=True, key=key)
    victim = max((tmp_path / "s" / "chunks").glob("*/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(raw)
    out = {k: torch.zeros_like(v).view(torch.uint8).reshape(-1) for k, v in tensors.items()}
    chunks = [TensorChunk(n, i // CHUNK, o[i : i + CHUNK]) for n, o in out.items() for i in range(0, o.numel(), CHUNK)]
    with pytest.raises((IntegrityError, DecryptionError)):
        transfer.open_reader(url, image, key=key).read_tensors(chunks)


def test_agent_round_trip_through_the_direct_path_refuses_damage_and_stays_unready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumigrate.agent.images import make_engine
    from gpumigrate.snapshot.server_commands import precopy_to, restore_from

    monkeypatch.setenv("GM_DIRECT_TEST_KEY", transfer.generate_key())
    key_env = {"env": "GM_DIRECT_TEST_KEY"}
    url = f"file://{tmp_path / 'store'}"
    src = make_engine()
    data = _tensors()
    src.track_tensors("w", data)
    ref = precopy_to(src, url, key_env)["image"]
    dst = make_engine()
    got = {k: torch.zeros_like(v) for k, v in data.items()}
    dst.track_tensors("w", got)
    restore_from(dst, url, ref["id"], key_env)
    assert dst.ready and all(torch.equal(got[k], data[k]) for k in data)
    for path in (tmp_path / "store" / "chunks").glob("*/*"):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 1
        path.write_bytes(raw)
    cold = make_engine()
    cold.track_tensors("w", {k: torch.zeros_like(v) for k, v in data.items()})
    with pytest.raises((IntegrityError, DecryptionError)):
        restore_from(cold, url, ref["id"], key_env)
    assert cold.ready is False


def test_a_chunk_that_fails_to_store_fails_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumigrate.errors import TransferError

    w = transfer.open_writer(f"file://{tmp_path / 's'}", key=KEY, chunk_size=CHUNK)
    data = torch.randint(0, 256, (3 * CHUNK,), dtype=torch.uint8)
    w.add_region(RegionInfo("x", data.numel()))

    def broken(chunk_id: str, blob: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w.store, "put_chunk", broken)
    futures = w.put_tensors([TensorChunk("x", i, data[i * CHUNK : (i + 1) * CHUNK]) for i in range(3)])
    with pytest.raises(TransferError, match="No space left"):
        w.commit()
    assert all(f.exception() is not None for f in futures)
    assert not list((tmp_path / "s").glob("manifests/*"))  # no image names chunks that are not there


def test_a_manifest_naming_an_unknown_decoder_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    w = transfer.open_writer(url, key=KEY)
    w.add_region(RegionInfo("x", 4))
    w.put_chunk("x", 0, b"abcd")
    w.decoders.add("from-the-future")
    image = w.commit().id
    with pytest.raises(Exception, match="from-the-future"):
        transfer.open_reader(url, image, key=KEY)


def test_plane_codec_3_says_what_it_needs_without_a_gpu() -> None:
    if gpucodec.available():
        pytest.skip("this host can decode plane codec 3")
    with pytest.raises(Exception, match="nvCOMP"):
        gpucodec.decode_plane_to_host(memoryview(b"\0" * 16), 8)
    # a chunk of another dtype coded whole on a GPU (k = 1): a CPU reader names what it needs as well
    from gpumigrate.errors import TransferError
    from gpumigrate.transfer.device import gpupayload
    from gpumigrate.transfer.format import codecs

    payload = bytearray(gpupayload.coded_length(1, 4096, 16))
    gpupayload.write_header(memoryview(payload), 0, 1, 4096, 16)
    assert gpupayload.layout(memoryview(payload), 4096) == 0  # no GPU here to decode it on
    with pytest.raises(TransferError, match="nvidia-nvcomp"):
        codecs.decode_into(codecs.BYTEPLANE, memoryview(payload), 4096, memoryview(bytearray(4096)))


# ---------------------------------------------------------------------------------------------- GPU
CONFIRM_CHUNK = 64 << 10


def _cuda() -> str:
    from gpumigrate.transfer.device import devhash

    if not devhash.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["auto", "cpu"])
def test_device_direct_path_matches_the_plain_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str) -> None:
    dev = _cuda()
    if codec == "cpu":
        monkeypatch.setenv("GPUMIGRATE_GPU_CODEC", "0")
    tensors = _tensors(dev)
    url = f"file://{tmp_path / 'd'}"
    image = _write(url, tensors, direct=True)
    plain = transfer.open_reader(
        f"file://{tmp_path / 'p'}", _write(f"file://{tmp_path / 'p'}", tensors, direct=False), key=KEY
    )
    reader = transfer.open_reader(url, image, key=KEY)
    for name in tensors:
        assert reader.chunk_ids(name) == plain.chunk_ids(name)  # device BLAKE3 = CPU BLAKE3
    coded = [cid for cid, entry in reader.objects.items() if entry[1] == 2]
    if codec == "auto" and gpucodec.available():
        assert reader.body.get("decoders") == [gpucodec.DECODER]
        assert reader.objects[reader.chunk_ids("w")[0]][0] < 0.8 * CHUNK  # fewer bytes crossed PCIe
        zero_page = reader.objects[reader.chunk_ids("z")[0]]
        assert zero_page[1] == 2 and zero_page[0] < 0.1 * CHUNK  # coded whole on the device (k = 1)
        assert reader.objects[reader.chunk_ids("r")[0]][1] == 0  # random bytes do not shrink: stored raw
    assert coded
    for name, t in tensors.items():
        assert bytes(reader.read_region(name)) == bytes(t.cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
        out = torch.zeros_like(t).view(torch.uint8).reshape(-1)
        reader.read_tensors([TensorChunk(name, i // CHUNK, out[i : i + CHUNK]) for i in range(0, out.numel(), CHUNK)])
        assert torch.equal(out, t.contiguous().view(torch.uint8).reshape(-1))


@pytest.mark.gpu
def test_device_confirmation_matches_host_ids_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final round's confirmation on the device: whole chunks of several regions in more than one batch,
    a short tail of whole leaves (kernels), an odd tail and an unaligned region (host), and a wrong id caught."""
    from gpumigrate.interfaces import ChunkRun
    from gpumigrate.transfer import confirm
    from gpumigrate.transfer.format.chunkobj import chunk_id_of

    dev = _cuda()
    monkeypatch.setattr(confirm, "NODES_BYTES", 3 * (CONFIRM_CHUNK // 1024) * 32)  # three chunks a batch
    block = torch.randint(0, 256, (3 * CONFIRM_CHUNK + 8 * 1024 + 5000 + 3,), dtype=torch.uint8, device=dev)
    regions = {
        "a": block[: 3 * CONFIRM_CHUNK + 8 * 1024],  # three whole chunks, then a tail of 8 leaves
        "b": block[3 * CONFIRM_CHUNK + 8 * 1024 : 3 * CONFIRM_CHUNK + 8 * 1024 + 5000],  # one odd chunk
        "c": block[3:],  # unaligned start: the host hashes it
    }
    runs, expect = [], []
    for name, view in regions.items():
        count = -(-view.numel() // CONFIRM_CHUNK)
        ids = [
            chunk_id_of(view[i * CONFIRM_CHUNK : (i + 1) * CONFIRM_CHUNK].cpu().numpy().tobytes()) for i in range(count)
        ]
        if name == "a":
            ids[1] = ids[0]  # its bytes do not have this id
        runs.append(ChunkRun(name, view, range(count), ids))
        expect.append([not (name == "a" and i == 1) for i in range(count)])
    writer = transfer.open_writer(f"file://{tmp_path / 's'}", key=KEY, chunk_size=CONFIRM_CHUNK)
    assert writer.confirm_chunks(runs)() == expect
    writer.abort()


@pytest.mark.gpu
def test_device_direct_path_refuses_a_flipped_byte_and_live_rounds_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = _cuda()
    # unencrypted, so the test can hash chunk bodies on disk: unsigned images are read for this test only
    monkeypatch.setenv("GPUMIGRATE_ALLOW_UNSIGNED_IMAGES", "1")
    url = f"file://{tmp_path / 's'}"
    w = {"a": torch.randn(5 << 20, device=dev).to(torch.bfloat16), "odd": torch.randn(777, device=dev)}
    src = SnapshotEngine()
    src.track_tensors("w", w)
    src.capture_round(transfer.open_writer(url, key=None, chunk_size=1 << 20))  # live: staged batches
    w["a"][: 1 << 10].add_(1)
    stats = src.capture_round(transfer.open_writer(url, key=None, parent=src.last_image.id, chunk_size=1 << 20)).stats
    assert stats.chunks_dirty == 1
    image = src.last_image.id
    for path in (tmp_path / "s" / "chunks").glob("*/*"):
        body = path.read_bytes()[60:]
        entry = transfer.open_reader(url, image, key=None).objects.get(path.name)
        if entry is not None and entry[1] == 0:
            assert blake3.blake3(body).hexdigest() == path.name
    out = {k: torch.zeros_like(v) for k, v in w.items()}
    dst = SnapshotEngine()
    dst.track_tensors("w", out)
    dst.load(transfer.open_reader(url, image, key=None))
    assert all(torch.equal(out[k], w[k]) for k in w)
    victim = max((tmp_path / "s" / "chunks").glob("*/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 1
    victim.write_bytes(raw)
    cold = SnapshotEngine()
    cold.track_tensors("w", {k: torch.zeros_like(v) for k, v in w.items()})
    with pytest.raises(IntegrityError):
        cold.load(transfer.open_reader(url, image, key=None))
    assert not cold.ready


@pytest.mark.gpu
def test_a_live_round_in_many_staging_batches_round_trips(tmp_path: Path) -> None:
    """A live round stages a batch of device slots at a time: more chunks than several batches hold, with tails of
    many lengths, come back bit-identical, and a second round ships only the changed chunk."""
    from gpumigrate.snapshot import pipeline

    dev = _cuda()
    chunk = 64 << 10
    torch.manual_seed(1)
    w = {f"t{i}": torch.randn(chunk // 2 * (1 + i % 5) + 17 * i, device=dev).to(torch.bfloat16) for i in range(60)}
    assert sum(-(-v.numel() * 2 // chunk) for v in w.values()) > 2 * pipeline.STAGE_SLOTS
    url = f"file://{tmp_path / 's'}"
    src = SnapshotEngine()
    src.track_tensors("w", w)
    src.capture_round(transfer.open_writer(url, key=KEY, chunk_size=chunk))
    w["t7"][5:9].add_(1)
    stats = src.capture_round(transfer.open_writer(url, key=KEY, parent=src.last_image.id, chunk_size=chunk)).stats
    assert stats.chunks_dirty == 1
    out = {k: torch.zeros_like(v) for k, v in w.items()}
    dst = SnapshotEngine()
    dst.track_tensors("w", out)
    dst.load(transfer.open_reader(url, src.last_image.id, key=KEY))
    assert all(torch.equal(out[k], w[k]) for k in w)


def test_confirm_chunks_hashes_without_storing_and_matches_the_stored_ids(tmp_path) -> None:
    """The final round's confirmation hashes through the writer: a chunk with its stored id is confirmed, one whose
    bytes differ from the id it would reuse is not, and nothing is stored."""
    from gpumigrate import transfer
    from gpumigrate.interfaces import ChunkRun, DirectImageWriter, RegionInfo, TensorChunk
    from gpumigrate.transfer.format.chunkobj import chunk_id_of

    data = torch.randint(0, 256, (4096 + 100,), dtype=torch.uint8)  # four whole chunks and a short one
    writer = transfer.open_writer("file://" + str(tmp_path / "s"), key=b"k" * 32, chunk_size=1024)
    assert isinstance(writer, DirectImageWriter)
    pieces = [data[i * 1024 : (i + 1) * 1024] for i in range(5)]
    ids = [chunk_id_of(p.numpy().tobytes()) for p in pieces]
    wrong = list(ids)
    wrong[2] = ids[1]
    check = writer.confirm_chunks(
        [ChunkRun("r", data, [0, 2, 4], [wrong[0], wrong[2], wrong[4]]), ChunkRun("r", data, [1, 3], ids[1:4:2])]
    )
    assert check() == [[True, False, True], [True, True]]
    assert not any(p.is_file() for p in (tmp_path / "s").rglob("*"))
    writer.add_region(RegionInfo("r", data.numel(), dtype="uint8", shape=(data.numel(),)))
    stored = [f.result() for f in writer.put_tensors([TensorChunk("r", i, p) for i, p in enumerate(pieces)])]
    assert stored == ids
    writer.abort()
