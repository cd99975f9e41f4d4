"""BLAKE3 on the device (transfer/device/devhash.py): the reference algorithm on CPU in CI, the Triton
kernels and the device-hashed capture and verified restore on the GPU machine."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
import torch

from gpumigrate import transfer
from gpumigrate.errors import IntegrityError
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.transfer.device import devhash

# One leaf (ROOT on the leaf), two (ROOT on the parent), and odd counts whose last node moves up
# unpaired: the left-balanced tree.
SHAPES = [(1, 3), (2, 2), (3, 2), (5, 1), (6, 2), (7, 1), (16, 2), (33, 1)]


def _inputs(leaves: int, count: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(leaves * 100 + count)
    return torch.randint(0, 256, (leaves * 1024 * count,), dtype=torch.uint8, generator=g).to(device)


def _want(data: torch.Tensor, count: int) -> list[str]:
    size = data.numel() // count
    host = data.cpu().numpy()
    return [blake3.blake3(host[i * size : (i + 1) * size].tobytes()).hexdigest() for i in range(count)]


@pytest.mark.parametrize(("leaves", "count"), SHAPES)
def test_reference_matches_the_blake3_package(leaves: int, count: int) -> None:
    data = _inputs(leaves, count)
    assert devhash.blake3_reference(data, count) == _want(data, count)


def test_reference_refuses_partial_leaves() -> None:
    with pytest.raises(ValueError, match="whole number of 1 KiB leaves"):
        devhash.blake3_reference(torch.zeros(1500, dtype=torch.uint8), 1)


def test_words_round_trip() -> None:
    hex_id = blake3.blake3(b"x").hexdigest()
    assert devhash.words_hex(devhash.digest_words(hex_id)) == hex_id


def test_only_whole_leaf_device_views_are_eligible() -> None:
    assert not devhash.eligible(torch.zeros(2048, dtype=torch.uint8))  # not on a device
    assert not devhash.available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize(("leaves", "count"), [*SHAPES, (16384, 4)])
def test_kernels_match_the_blake3_package(leaves: int, count: int) -> None:
    if not devhash.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    data = _inputs(leaves, count, "cuda")
    size = leaves * 1024
    views = [data[i * size : (i + 1) * size] for i in range(count)][::-1]  # offsets below the first view too
    got = [devhash.words_hex(w) for w in devhash.blake3_device(views).cpu().tolist()]
    assert got == _want(data, count)[::-1]
    by_chunks = [devhash.words_hex(w) for w in devhash.blake3_chunks(data, size).cpu().tolist()]
    assert by_chunks == _want(data, count)


@pytest.mark.gpu
def test_wide_kernels_fall_back_on_inputs_that_are_not_16_byte_aligned() -> None:
    if not devhash.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    data = _inputs(3, 3, "cuda")
    views = [data[4 : 4 + 3072], data[3076 : 3076 + 3072]]  # 4-byte aligned only
    got = [devhash.words_hex(w) for w in devhash.blake3_device(views).cpu().tolist()]
    host = data.cpu().numpy()
    assert got == [blake3.blake3(host[o : o + 3072].tobytes()).hexdigest() for o in (4, 3076)]


@pytest.mark.gpu
def test_device_hashed_capture_and_verified_restore_round_trip_and_refuse_a_flipped_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = torch.device("cuda")
    monkeypatch.setenv("GPUMIGRATE_ALLOW_UNSIGNED_IMAGES", "1")  # unsigned on purpose, read for this test only
    if not devhash.available(dev):
        pytest.skip("Triton is not importable here")
    src = {"a": torch.randn(3 << 20, device=dev), "odd": torch.randn(777, device=dev)}  # odd: CPU-hashed tail
    url = f"file://{tmp_path / 'store'}"  # no key: only BLAKE3 stands between a flipped byte and the target
    a = SnapshotEngine()
    a.track_tensors("w", src)
    a.park()
    a.capture_round(transfer.open_writer(url, key=None, chunk_size=1 << 20, compression="none"))
    image = a.last_image.id
    # Ids come from the GPU kernels: each must be the CPU's BLAKE3 of the stored plaintext.
    objects = sorted((tmp_path / "store" / "chunks").glob("*/*"))
    assert len(objects) >= 12
    for path in objects:
        assert blake3.blake3(path.read_bytes()[60:]).hexdigest() == path.name
    out = {k: torch.zeros_like(v) for k, v in src.items()}
    b = SnapshotEngine()
    b.track_tensors("w", out)
    b.load(transfer.open_reader(url, image, key=None))
    assert all(torch.equal(out[k], src[k]) for k in src)
    victim = max(objects, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[4096] ^= 1
    victim.write_bytes(raw)
    c = SnapshotEngine()
    c.track_tensors("w", {k: torch.zeros_like(v) for k, v in src.items()})
    with pytest.raises(IntegrityError, match="BLAKE3"):
        c.load(transfer.open_reader(url, image, key=None))
    assert not c.ready


@pytest.mark.gpu
def test_the_gathering_copy_moves_chunks_between_many_tensors_and_hashes_what_it_stored() -> None:
    if not devhash.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    chunk = 64 * 1024  # two of the kernel's blocks of leaves
    srcs = [_inputs(chunk // 1024, n, "cuda") for n in (3, 1, 2)]  # three allocations: offsets on both sides of one
    dsts = [torch.zeros_like(s) for s in reversed(srcs)]  # chunks land in other tensors, in another order
    pairs = [(s, i) for s in srcs for i in range(s.numel() // chunk)]
    places = [(d, i) for d in dsts for i in range(d.numel() // chunk)]
    src0, dst0 = srcs[1], dsts[1]
    words = devhash.blake3_copy_gather(
        src0,
        [s.data_ptr() - src0.data_ptr() + i * chunk for s, i in pairs],
        dst0,
        [d.data_ptr() - dst0.data_ptr() + i * chunk for d, i in places],
        chunk,
    )
    got = [devhash.words_hex(w) for w in words.cpu().tolist()]
    for (s, i), (d, j) in zip(pairs, places, strict=True):
        assert torch.equal(s[i * chunk : (i + 1) * chunk], d[j * chunk : (j + 1) * chunk])
    assert got == [_want(s[i * chunk : (i + 1) * chunk], 1)[0] for s, i in pairs]
    with pytest.raises(ValueError, match="multiple of 16"):
        devhash.blake3_copy_gather(src0, [4], dst0, [0], chunk)
    assert devhash.gather_takes(src0, dst0, 8 * 1024)  # the smaller programs: a short last chunk's length
    assert not devhash.gather_takes(src0, dst0, 4 * 1024)  # half of them: copied plainly by callers


@pytest.mark.gpu
def test_the_fused_copy_stores_every_byte_and_hashes_what_it_stored() -> None:
    if not devhash.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    chunk, count = 64 * 1024, 5
    src = _inputs(chunk // 1024, count, "cuda")
    dst = torch.zeros_like(src)
    got = [devhash.words_hex(w) for w in devhash.blake3_copy_chunks(src, dst, chunk).cpu().tolist()]
    assert torch.equal(src, dst)
    assert got == _want(src, count)
    with pytest.raises(ValueError, match="one size"):
        devhash.blake3_copy_chunks(src, dst[:chunk], chunk)
    small = devhash.blake3_copy_chunks(src[: 40 * 1024], dst[: 40 * 1024], 8 * 1024)  # programs of 8 leaves
    assert [devhash.words_hex(w) for w in small.cpu().tolist()] == _want(src[: 40 * 1024], 5)
    with pytest.raises(ValueError, match="multiple of 8192"):
        devhash.blake3_copy_chunks(src[: 12 * 1024], dst[: 12 * 1024], 12 * 1024)
