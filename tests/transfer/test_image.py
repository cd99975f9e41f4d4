"""ImageWriter/ImageReader over a file:// store: concurrency, parents, reuse, delta, keys."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import bf16_weights

from gpumigrate.errors import DecryptionError, IntegrityError, InvalidInputError, TransferError
from gpumigrate.interfaces import ImageReader, ImageWriter, RegionInfo
from gpumigrate.transfer import generate_key, open_reader, open_writer, resolve_key
from gpumigrate.transfer.format.manifest import UnsignedImageError

CHUNK = 256 * 1024


def write_tensor(writer: ImageWriter, name: str, data: np.ndarray, dtype: str, threads: int = 4) -> list[str]:
    """Put a tensor's chunks from several threads at once, as the snapshot agent does."""
    writer.add_region(RegionInfo(name=name, nbytes=data.nbytes, dtype=dtype, shape=data.shape, device="cpu"))
    view = memoryview(data).cast("B")
    n = -(-data.nbytes // writer.chunk_size)
    ids: list[str | None] = [None] * n

    def work(start: int) -> None:
        for i in range(start, n, threads):
            ids[i] = writer.put_chunk(name, i, view[i * writer.chunk_size : (i + 1) * writer.chunk_size])

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert all(ids)
    return [str(i) for i in ids]


def test_roundtrip_with_concurrent_writers_and_metadata(store: str, key: bytes) -> None:
    w = open_writer(store, key=key, chunk_size=CHUNK, source="test-host")
    assert isinstance(w, ImageWriter)
    weights = bf16_weights(700_001)  # odd element count: last chunk is short
    fp32 = np.random.default_rng(2).standard_normal(300_000).astype(np.float32)
    write_tensor(w, "layer.weight", weights, "bfloat16")
    write_tensor(w, "opt.state", fp32, "float32")
    w.set_metadata("step", 42)
    ref = w.commit()
    assert ref.bytes_image == weights.nbytes + fp32.nbytes
    assert ref.bytes_stored < ref.bytes_image  # bf16 compressed

    r = open_reader(store, ref.id, key=key)
    assert isinstance(r, ImageReader)
    assert r.metadata()["step"] == 42
    regions = {x.name: x for x in r.regions()}
    assert regions["layer.weight"].shape == (700_001,) and regions["layer.weight"].dtype == "bfloat16"
    out = bytearray(weights.nbytes)
    for i in range(r.chunk_count("layer.weight")):
        off = i * CHUNK
        n = r.read_chunk_into("layer.weight", i, memoryview(out)[off : off + CHUNK])
        assert n == min(CHUNK, weights.nbytes - off)
    assert bytes(out) == weights.tobytes()
    assert bytes(r.read_region("opt.state")) == fp32.tobytes()
    # a prefix of the id opens the same image
    assert open_reader(store, ref.id[:10], key=key).image_id == ref.id


def test_child_image_sends_only_changed_chunks(store: str, key: bytes) -> None:
    base = bf16_weights(1_000_000)
    w = open_writer(store, key=key, chunk_size=CHUNK)
    ids = write_tensor(w, "w", base, "bfloat16")
    parent = w.commit()

    changed = base.copy()
    changed[:1000] += 1  # touches chunk 0 only
    child = open_writer(store, key=key, parent=parent.id)
    assert child.chunk_size == CHUNK  # inherited from the parent
    child.add_region(RegionInfo(name="w", nbytes=changed.nbytes, dtype="bfloat16"))
    view = memoryview(changed).cast("B")
    child.put_chunk("w", 0, view[:CHUNK])
    for i in range(1, len(ids)):
        child.reuse_chunk("w", i, ids[i])  # unchanged since the parent: no bytes
    ref = child.commit()
    assert ref.parent == parent.id
    assert child.chunks_new == 1
    assert ref.bytes_sent < CHUNK  # one compressed chunk plus the manifest
    assert bytes(open_reader(store, ref.id, key=key).read_region("w")) == changed.tobytes()


def test_put_chunk_of_unchanged_content_is_deduplicated(store: str, key: bytes) -> None:
    data = bf16_weights(500_000)
    w = open_writer(store, key=key, chunk_size=CHUNK)
    write_tensor(w, "w", data, "bfloat16")
    first = w.commit()
    again = open_writer(store, key=key, parent=first.id)
    write_tensor(again, "w", data, "bfloat16")
    ref = again.commit()
    assert again.chunks_new == 0 and ref.bytes_stored == first.bytes_stored


def test_xor_delta_against_parent(store: str, key: bytes) -> None:
    base = bf16_weights(400_000)
    w = open_writer(store, key=key, chunk_size=CHUNK)
    write_tensor(w, "w", base, "bfloat16")
    parent = w.commit()
    changed = base.copy()
    changed[::50] ^= 1  # every chunk changes a little: plain dedup saves nothing
    plain = open_writer(store, key=key, parent=parent.id)
    write_tensor(plain, "w", changed, "bfloat16")
    plain_ref = plain.commit()
    delta = open_writer(store, key=key, parent=parent.id, delta=True)
    write_tensor(delta, "w", changed, "bfloat16")
    delta_ref = delta.commit()
    assert delta_ref.bytes_sent < plain_ref.bytes_sent / 3
    assert bytes(open_reader(store, delta_ref.id, key=key).read_region("w")) == changed.tobytes()


def test_a_parent_this_process_committed_is_not_read_back(
    store: str, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next round's writer takes its parent from the manifest this process just signed (no read, no
    re-check); under another key it still reads the parent and refuses it, as before."""
    from gpumigrate.transfer.stores.file import FileStore

    data = np.frombuffer(os.urandom(2 * CHUNK), dtype=np.uint8)
    first = open_writer(store, key=key, chunk_size=CHUNK)
    ids = write_tensor(first, "w", data, "uint8")
    parent = first.commit()
    reads: list[str] = []
    real = FileStore.get_manifest
    monkeypatch.setattr(FileStore, "get_manifest", lambda self, i: reads.append(i) or real(self, i))
    second = open_writer(store, key=key, parent=parent.id)
    second.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8", shape=data.shape, device="cpu"))
    for i, cid in enumerate(ids):
        second.reuse_chunk("w", i, cid)
    child = second.commit()
    assert reads == [] and child.bytes_sent < CHUNK  # nothing read back, no chunk sent again
    assert bytes(open_reader(store, child.id, key=key).read_region("w")) == data.tobytes()
    with pytest.raises(DecryptionError, match="wrong key"):
        open_writer(store, key=os.urandom(32), parent=parent.id)
    assert reads[-1] == parent.id


def test_commit_refuses_an_incomplete_region(store: str, key: bytes) -> None:
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="w", nbytes=3 * CHUNK))
    w.put_chunk("w", 0, memoryview(os.urandom(CHUNK)))
    w.put_chunk("w", 2, memoryview(os.urandom(CHUNK)))
    with pytest.raises(TransferError, match=r"region 'w' is missing chunks \[1\]"):
        w.commit()


def _reuse_both_ways(store: str, key: bytes) -> tuple[dict[str, object], dict[str, object]]:
    """A child image of two regions written once by reuse_chunk per chunk and once by one reuse_chunks call:
    chunks from the parent, one held only by the store (another image's), one region of a single short chunk."""
    from gpumigrate.transfer.writer import committed_body

    data = np.frombuffer(os.urandom(3 * CHUNK + 100), dtype=np.uint8)
    small = np.frombuffer(os.urandom(1000), dtype=np.uint8)
    first = open_writer(store, key=key, chunk_size=CHUNK)
    ids = write_tensor(first, "w", data, "uint8")
    (small_id,) = write_tensor(first, "s", small, "uint8")
    parent = first.commit()
    other = open_writer(store, key=key, chunk_size=CHUNK)  # a chunk in the store that the parent does not hold
    extra = bytes(reversed(data[:CHUNK].tobytes()))
    other.add_region(RegionInfo(name="x", nbytes=CHUNK))
    extra_id = other.put_chunk("x", 0, memoryview(extra))
    other.commit()
    plan = [("w", 0, extra_id), ("w", 1, ids[1]), ("s", 0, small_id), ("w", 2, ids[2]), ("w", 3, ids[3])]
    bodies: list[dict[str, object]] = []
    for batched in (False, True):
        seen: list[tuple[int, int]] = []
        w = open_writer(store, key=key, parent=parent.id, progress=lambda d, t, seen=seen: seen.append((d, t)))
        w.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8", shape=data.shape, device="cpu"))
        w.add_region(RegionInfo(name="s", nbytes=small.nbytes, dtype="uint8", shape=small.shape, device="cpu"))
        if batched:
            w.reuse_chunks(plan)
        else:
            for region, index, cid in plan:
                w.reuse_chunk(region, index, cid)
        counts = (w.chunks_reused, w.chunks_new, w.bytes_logical, w.bytes_sent)
        ref = w.commit()
        body = dict(committed_body(store, ref.id, w.sealer.key_id) or {})
        body.pop("created"), body.pop("sequence")  # when it was written: differs by design
        bodies.append(
            {"body": body, "counts": counts, "progress": seen[-1], "ref": (ref.bytes_image, ref.bytes_stored)}
        )
        reader = open_reader(store, ref.id, key=key)
        assert bytes(reader.read_region("w")) == extra + data[CHUNK:].tobytes()
        assert bytes(reader.read_region("s")) == small.tobytes()
    return bodies[0], bodies[1]


def test_reuse_chunks_records_what_reuse_chunk_records(store: str, key: bytes) -> None:
    one_by_one, batched = _reuse_both_ways(store, key)
    assert batched == one_by_one


def test_reuse_chunks_refuses_what_reuse_chunk_refuses_after_recording_the_chunks_before(
    store: str, key: bytes
) -> None:
    data = np.frombuffer(os.urandom(2 * CHUNK), dtype=np.uint8)
    first = open_writer(store, key=key, chunk_size=CHUNK)
    ids = write_tensor(first, "w", data, "uint8")
    parent = first.commit()
    for bad, match in [
        (("nope", 0, ids[0]), "unknown region"),
        (("w", 2, ids[0]), "past the end"),
        (("w", 1, "ab" * 32), "neither in the parent"),
    ]:
        w = open_writer(store, key=key, parent=parent.id)
        w.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8"))
        with pytest.raises(InvalidInputError, match=match):
            w.reuse_chunks([("w", 0, ids[0]), bad, ("w", 1, ids[1])])
        assert (w.chunks_reused, w.bytes_logical) == (1, CHUNK)  # the chunk before the refusal, not the one after
    w = open_writer(store, key=key, parent=parent.id)
    w.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8"))
    w.reuse_chunks([])
    w.reuse_chunks(iter([("w", 1, ids[1]), ("w", 0, ids[0])]))
    assert bytes(open_reader(store, w.commit().id, key=key).read_region("w")) == data.tobytes()


def test_reuse_regions_writes_the_image_reuse_chunks_writes(store: str, key: bytes) -> None:
    """Regions the parent holds exactly so are taken whole (its manifest entries); one whose layout or chunks differ
    from the parent's, or that also gets a chunk of its own, goes chunk by chunk: the same manifest either way."""
    from gpumigrate.transfer.writer import committed_body

    data = np.frombuffer(os.urandom(3 * CHUNK + 100), dtype=np.uint8)
    first = open_writer(store, key=key, chunk_size=CHUNK)
    ids = write_tensor(first, "w", data, "uint8")
    (s_id,) = write_tensor(first, "s", data[:100].copy(), "uint8")
    parent = first.commit()
    changed = bytes(reversed(data[:CHUNK].tobytes()))
    bodies = []
    for whole in (False, True):
        w = open_writer(store, key=key, parent=parent.id)
        infos = [
            RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8", shape=data.shape, device="cpu"),
            RegionInfo(name="s", nbytes=100, dtype="uint8", shape=(100,), device="cpu"),
            RegionInfo(name="s2", nbytes=100, dtype="uint8", shape=(100,), device="cpu"),  # not in the parent
        ]
        w.add_regions(infos)
        plan = [("w", ids), ("s", [s_id]), ("s2", [s_id])]
        if whole:
            w.reuse_regions(plan)
        else:
            w.reuse_chunks([(name, i, cid) for name, got in plan for i, cid in enumerate(got)])
        counts = (w.chunks_reused, w.bytes_logical)  # (before the put: the second run finds its chunk stored)
        w.put_chunk("w", 0, memoryview(changed))  # after the whole region: recorded chunk by chunk from here
        ref = w.commit()
        body = dict(committed_body(store, ref.id, w.sealer.key_id) or {})
        body.pop("created"), body.pop("sequence")
        bodies.append((body, counts))
        reader = open_reader(store, ref.id, key=key)
        assert bytes(reader.read_region("w")) == changed + data[CHUNK:].tobytes()
        assert bytes(reader.read_region("s2")) == data[:100].tobytes()
    assert bodies[0] == bodies[1]
    w = open_writer(store, key=key, parent=parent.id)  # another shape: not the parent's region, chunk by chunk
    w.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="uint8", shape=(1, data.size), device="cpu"))
    w.reuse_regions([("w", ids)])
    entry = next(r for r in (committed_body(store, w.commit().id, w.sealer.key_id) or {})["regions"])
    assert entry["shape"] == [1, data.size] and entry["chunks"] == ids


def test_reuse_of_an_unknown_chunk_and_unknown_region_are_refused(store: str, key: bytes) -> None:
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="w", nbytes=CHUNK))
    with pytest.raises(InvalidInputError, match="neither in the parent"):
        w.reuse_chunk("w", 0, "ab" * 32)
    with pytest.raises(InvalidInputError, match="unknown region"):
        w.put_chunk("nope", 0, memoryview(b"x"))


def test_wrong_key_and_missing_key(store: str, key: bytes) -> None:
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="b", nbytes=10, kind="blob"))
    w.put_chunk("b", 0, memoryview(b"0123456789"))
    ref = w.commit()
    with pytest.raises(DecryptionError, match="wrong key"):
        open_reader(store, ref.id, key=os.urandom(32))
    with pytest.raises(InvalidInputError, match="give its key"):
        open_reader(store, ref.id, key=None)


def test_unsigned_image_is_refused_unless_the_development_flag_is_set(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = open_writer(store, key=None, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="b", nbytes=5, kind="blob"))
    w.put_chunk("b", 0, memoryview(b"hello"))
    ref = w.commit()
    monkeypatch.delenv("GPUMIGRATE_ALLOW_UNSIGNED_IMAGES", raising=False)
    with pytest.raises(UnsignedImageError, match="unsigned") as refused:
        open_reader(store, ref.id, key=None)
    assert refused.value.exit_code == 2
    monkeypatch.setenv("GPUMIGRATE_ALLOW_UNSIGNED_IMAGES", "1")
    assert bytes(open_reader(store, ref.id, key=None).read_region("b")) == b"hello"
    with pytest.raises(IntegrityError, match="not signed"):  # a reader given a key never accepts one
        open_reader(store, ref.id, key=os.urandom(32))
    with pytest.raises(Exception, match="not signed"):
        open_reader(store, ref.id, key=os.urandom(32))


def test_resolve_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hexkey = generate_key()
    raw = bytes.fromhex(hexkey)
    monkeypatch.setenv("GM_TEST_KEY", hexkey)
    assert resolve_key(env="GM_TEST_KEY") == raw
    import base64

    (tmp_path / "b64").write_text(base64.b64encode(raw).decode() + "\n")
    (tmp_path / "raw").write_bytes(raw)
    assert resolve_key(file=str(tmp_path / "b64")) == raw
    assert resolve_key(file=str(tmp_path / "raw")) == raw
    monkeypatch.setenv("GM_BAD_KEY", "secret-but-short")
    with pytest.raises(InvalidInputError) as err:
        resolve_key(env="GM_BAD_KEY")
    assert "GM_BAD_KEY" in str(err.value) and "secret-but-short" not in str(err.value)
    with pytest.raises(InvalidInputError, match="not set"):
        resolve_key(env="GM_UNSET_KEY_VAR")
    with pytest.raises(InvalidInputError, match="cannot read key file"):
        resolve_key(file=str(tmp_path / "absent"))
    with pytest.raises(InvalidInputError, match="exactly one"):
        resolve_key()


@pytest.mark.parametrize("sync", ["chunk", "deferred", "none"])
def test_file_store_sync_modes_roundtrip(tmp_path: Path, key: bytes, sync: str) -> None:
    url = f"file://{tmp_path / 's'}?sync={sync}"
    data = os.urandom(3 * CHUNK + 5)
    w = open_writer(url, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="b", nbytes=len(data), kind="blob"))
    for i in range(4):
        w.put_chunk("b", i, memoryview(data)[i * CHUNK : (i + 1) * CHUNK])
    ref = w.commit()
    assert bytes(open_reader(url, ref.id, key=key).read_region("b")) == data


def test_file_store_rejects_an_unknown_sync_mode(tmp_path: Path) -> None:
    from gpumigrate.transfer.stores import open_store

    with pytest.raises(InvalidInputError, match="sync mode"):
        open_store(f"file://{tmp_path}?sync=sometimes")


def test_put_chunk_accepts_typed_buffers_and_refuses_strided_ones(store: str, key: bytes) -> None:
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="x", nbytes=x.nbytes, dtype="float32", shape=x.shape))
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        w.put_chunk("x", 0, memoryview(x[:, ::2]))
    w.put_chunk("x", 0, memoryview(x))  # a 2-D float32 view is taken as its bytes
    ref = w.commit()
    assert bytes(open_reader(store, ref.id, key=key).read_region("x")) == x.tobytes()


def test_progress_callbacks_reach_the_total(tmp_path: Path, key: bytes) -> None:
    from gpumigrate.transfer import pack_paths, push, verify

    src = tmp_path / "in"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(3 << 20))
    (src / "b").write_bytes(bytes(2 << 20))
    seen: dict[str, list[tuple[int, int]]] = {"pack": [], "push": [], "verify": []}
    store = f"file://{tmp_path / 's'}"
    ref = pack_paths([src], store, key=key, progress=lambda d, t: seen["pack"].append((d, t)))
    push(store, f"file://{tmp_path / 'd'}", ref.id, key=key, progress=lambda d, t: seen["push"].append((d, t)))
    verify(store, ref.id, key=key, progress=lambda d, t: seen["verify"].append((d, t)))
    for name, calls in seen.items():
        assert calls, name
        done = [d for d, _ in calls]
        assert done == sorted(done), name
        assert calls[-1][0] == calls[-1][1] > 0, name
    assert seen["pack"][-1][1] == 5 << 20


@pytest.mark.parametrize(
    ("lengths", "fixed"),
    [
        ([CHUNK, CHUNK, 100], True),
        ([100, CHUNK, CHUNK], False),  # the same total, the short chunk first: sizes are listed
        ([CHUNK, 100, CHUNK], False),
        ([CHUNK], True),
        ([CHUNK, CHUNK], True),
        ([CHUNK // 2, CHUNK // 2], False),  # two chunks where one would do
        ([7], True),
    ],
)
def test_manifest_lists_chunk_sizes_only_when_they_are_not_whole_chunks_but_the_last(
    store: str, key: bytes, lengths: list[int], fixed: bool
) -> None:
    data = os.urandom(sum(lengths))
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="r", nbytes=len(data)))
    at = 0
    for i, n in enumerate(lengths):
        w.put_chunk("r", i, memoryview(data)[at : at + n])
        at += n
    ref = w.commit()
    reader = open_reader(store, ref.id, key=key)
    region = reader.body["regions"][0]
    assert region["sizes"] == (None if fixed else lengths)
    assert bytes(reader.read_region("r")) == data


def test_commit_refuses_chunks_that_do_not_add_up_to_the_region(store: str, key: bytes) -> None:
    w = open_writer(store, key=key, chunk_size=CHUNK)
    w.add_region(RegionInfo(name="r", nbytes=CHUNK + 10))
    w.put_chunk("r", 0, memoryview(os.urandom(CHUNK)))
    w.put_chunk("r", 1, memoryview(os.urandom(9)))
    with pytest.raises(TransferError, match=r"chunks hold 262153 bytes, the region declares 262154"):
        w.commit()
