"""Every kind of damage is detected: flipped bit, truncation, swapped chunks, forged manifest, wrong key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import pytest

from gpumigrate.errors import DecryptionError, IntegrityError
from gpumigrate.transfer import open_reader, pack_paths, push, unpack, verify
from gpumigrate.transfer.stores import chunk_key, manifest_key
from gpumigrate.transfer.stores.file import file_root


@pytest.fixture
def packed(tmp_path: Path, store: str, key: bytes) -> tuple[str, Path]:
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 << 20) + b"tail" * 100_000)
    (src / "b.txt").write_bytes(b"hello world\n" * 50_000)
    ref = pack_paths([src], store, key=key)
    return ref.id, file_root(store)


def chunk_paths(root: Path, image_id: str) -> list[Path]:
    body = json.loads((root / manifest_key(image_id)).read_bytes())["body"]
    return [root / chunk_key(cid) for cid in body["objects"]]


def test_flipped_bit_is_detected_by_verify_and_read(
    packed: tuple[str, Path], store: str, key: bytes, tmp_path: Path
) -> None:
    image_id, root = packed
    victim = chunk_paths(root, image_id)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x04
    victim.write_bytes(data)
    with pytest.raises(IntegrityError, match=victim.name[:16]):
        verify(store, image_id, key=key)
    with pytest.raises(IntegrityError):
        unpack(store, image_id, tmp_path / "out", key=key)
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # nothing half-restored is visible


def test_flipped_bit_without_encryption_is_caught_by_blake3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMIGRATE_ALLOW_UNSIGNED_IMAGES", "1")  # an unsigned image, read for this check only
    src = tmp_path / "in"
    src.mkdir()
    (src / "z").write_bytes(os.urandom(1 << 20))
    store = f"file://{tmp_path / 'plain'}"
    ref = pack_paths([src], store, key=None, compression="none")
    victim = chunk_paths(file_root(store), ref.id)[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x80
    victim.write_bytes(data)
    with pytest.raises(IntegrityError, match="does not match its id"):
        verify(store, ref.id, key=None)


def test_truncated_chunk_is_detected(packed: tuple[str, Path], store: str, key: bytes) -> None:
    image_id, root = packed
    victim = chunk_paths(root, image_id)[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(IntegrityError):
        verify(store, image_id, key=key)
    victim.write_bytes(b"GMC")
    with pytest.raises(IntegrityError, match="truncated"):
        verify(store, image_id, key=key)


def test_swapped_chunks_are_detected(packed: tuple[str, Path], store: str, key: bytes) -> None:
    image_id, root = packed
    a, b = chunk_paths(root, image_id)[:2]
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    with pytest.raises(IntegrityError, match="swapped"):
        verify(store, image_id, key=key)
    reader = open_reader(store, image_id, key=key)
    region = reader.regions()[0].name
    with pytest.raises(IntegrityError):  # a length mismatch or a failed tag, whichever shows first
        reader.read_region(region)


def test_forged_manifest_is_refused(packed: tuple[str, Path], store: str, key: bytes) -> None:
    image_id, root = packed
    doc = json.loads((root / manifest_key(image_id)).read_bytes())
    doc["body"]["metadata"]["tree"]["in/a.bin"]["mode"] = 0o4755  # a setuid bit smuggled in
    forged = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    forged_id = blake3.blake3(forged).hexdigest()
    (root / manifest_key(forged_id)).write_bytes(forged)
    with pytest.raises(IntegrityError, match="signature is invalid"):
        open_reader(store, forged_id, key=key)
    # the same edit in place (id no longer matching) is caught even before the signature
    (root / manifest_key(image_id)).write_bytes(forged)
    with pytest.raises(IntegrityError, match="altered in storage"):
        open_reader(store, image_id, key=key)


def test_wrong_key_writes_nothing(packed: tuple[str, Path], store: str, tmp_path: Path) -> None:
    image_id, _ = packed
    out = tmp_path / "never"
    with pytest.raises(DecryptionError, match="wrong key"):
        unpack(store, image_id, out, key=os.urandom(32))
    assert not out.exists()
    with pytest.raises(DecryptionError, match="wrong key"):
        push(store, f"file://{tmp_path / 'dst'}", image_id, key=os.urandom(32))
    assert not (tmp_path / "dst").exists()


def test_push_resends_truncated_and_corrupt_destination_chunks(
    packed: tuple[str, Path], store: str, key: bytes, tmp_path: Path
) -> None:
    """Destination chunks of the right size are verified before they are trusted (a flipped bit is re-sent)."""
    image_id, _ = packed
    dst = f"file://{tmp_path / 'dst'}"
    first = push(store, dst, image_id, key=key)
    assert first.chunks_sent == first.chunks_total
    paths = chunk_paths(file_root(dst), image_id)
    paths[0].write_bytes(paths[0].read_bytes()[:-7])  # truncated: caught by size
    flipped = bytearray(paths[1].read_bytes())
    flipped[100] ^= 1
    paths[1].write_bytes(flipped)  # same size: caught by its tag
    second = push(store, dst, image_id, key=key)
    assert second.chunks_sent == 2 and second.chunks_resent_invalid == 2
    assert second.chunks_skipped == first.chunks_total - 2
    assert verify(dst, image_id, key=key).chunks_total == first.chunks_total


def test_corrupt_source_chunk_is_refused_where_it_lands(
    packed: tuple[str, Path], store: str, key: bytes, tmp_path: Path
) -> None:
    """Push does not re-hash what it copies: a damaged source object is caught by its tag where it lands."""
    image_id, root = packed
    victim = chunk_paths(root, image_id)[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(data)
    dst = f"file://{tmp_path / 'dst'}"
    push(store, dst, image_id, key=key)
    with pytest.raises(IntegrityError, match=victim.name[:16]):
        verify(dst, image_id, key=key)  # what a restore does before it uses a byte
    with pytest.raises(IntegrityError, match="failed authentication"):
        unpack(dst, image_id, tmp_path / "out", key=key)


def test_header_claiming_a_huge_length_is_refused_before_allocating(
    packed: tuple[str, Path], store: str, key: bytes
) -> None:
    image_id, root = packed
    victim = chunk_paths(root, image_id)[0]
    data = bytearray(victim.read_bytes())
    data[8:16] = (1 << 40).to_bytes(8, "big")  # raw_len field
    victim.write_bytes(data)
    with pytest.raises(IntegrityError, match="claims"):
        verify(store, image_id, key=key)


def test_manifest_signature_covers_the_body_bytes_as_stored(key: bytes) -> None:
    """A sealed manifest is the canonical JSON of the whole document (the body's bytes lie in it verbatim and
    are what the signature covers); a document laid out otherwise opens only through its canonical form,
    and a second "body" key spliced in after the signed one is refused."""
    from gpumigrate.transfer.format.chunkobj import Sealer
    from gpumigrate.transfer.format.manifest import canonical, open_manifest, seal_manifest

    sealer = Sealer(key)
    body = {"key_id": sealer.key_id, "encryption": "aes-256-gcm", "regions": [{"name": "w", "chunks": ["ab"]}], "ü": 1}
    image_id, data = seal_manifest(body, sealer)
    doc = json.loads(data)
    assert data == canonical(doc) and open_manifest(data, image_id, sealer) == body

    spaced = json.dumps(doc, indent=1).encode()  # same document, another layout: checked by re-serialising
    assert open_manifest(spaced, blake3.blake3(spaced).hexdigest(), sealer) == body

    evil = canonical({**body, "regions": []})
    signed = canonical(body)
    spliced = data.replace(signed, signed + b',"body":' + evil, 1)  # the parser keeps the last "body"
    assert json.loads(spliced)["body"]["regions"] == []
    with pytest.raises(IntegrityError, match="signature is invalid"):
        open_manifest(spliced, blake3.blake3(spliced).hexdigest(), sealer)
