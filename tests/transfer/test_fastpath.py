"""The pack hot path's shortcuts: the huff plane coder (and zstd as a literal coder where it is
missing), per-region plane verdicts, in-place sealing, inline stores. Each one must leave the bytes
readers see exactly as FORMAT.md says and every special float bit pattern intact."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import zstandard
from transfer_helpers import bf16_weights

from gpumigrate.errors import TransferError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer import open_reader, open_writer
from gpumigrate.transfer.format import codecs, planehuff, planezstd
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, Sealer, chunk_id_of, sealed_size


def planes_of(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """(plane codec, stored length) of every plane in a byte-plane payload (FORMAT.md, byte-plane)."""
    p = bytes(payload)
    k = p[0]
    return [(p[1 + 9 * j], int.from_bytes(p[2 + 9 * j : 10 + 9 * j], "big")) for j in range(k)]


def decode(codec: int, payload: bytes | memoryview, n: int) -> bytes:
    out = bytearray(n)
    codecs.decode_into(codec, memoryview(bytes(payload)), n, memoryview(out))
    return bytes(out)


def special_bf16(n: int) -> bytes:
    """bf16 weights with NaNs (with payloads), ±Inf, ±0, denormals sprinkled through."""
    w = bf16_weights(n, seed=5)
    specials = np.array(
        [0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x0040], dtype=np.uint16
    )
    w[::97] = np.resize(specials, len(w[::97]))
    return w.tobytes()


def test_literal_coder_writes_standard_frames_that_shrink_exponent_planes() -> None:
    hi = (bf16_weights(1 << 20) >> 8).astype(np.uint8)
    packed = bytes(planezstd.compress_plane(hi))
    assert zstandard.ZstdDecompressor().decompress(packed) == hi.tobytes()  # any zstd reader decodes it
    assert len(packed) < 0.4 * len(hi)
    # the content size is in the frame header, as FORMAT.md's zstd codec promises
    assert zstandard.frame_content_size(packed) == len(hi)


def test_literal_coder_is_in_use_and_fallback_gives_the_same_bytes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the huff coder, exponent planes are zstd frames: literal mode, or the tuned fallback."""
    assert planezstd.USES_LITERAL_MODE  # this libzstd accepts the parameters; otherwise the fallback runs
    monkeypatch.setattr(planehuff, "AVAILABLE", False)
    data = special_bf16(300_000)
    _, fast = codecs.encode(memoryview(data), dtype="bfloat16")
    fast = bytes(fast)
    assert [c for c, _ in planes_of(fast)] == [codecs.NONE, codecs.ZSTD]
    monkeypatch.setattr(planezstd, "USES_LITERAL_MODE", False)
    codec, slow = codecs.encode(memoryview(data), dtype="bfloat16")
    assert decode(codec, slow, len(data)) == data == decode(codec, fast, len(data))
    assert len(fast) <= len(slow) * 1.01  # skipping the match finder costs no ratio


def test_huff_planes_match_zstd_planes_in_size_and_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    data = special_bf16(1 << 20)
    codec, huff = codecs.encode(memoryview(data), dtype="bfloat16")
    huff = bytes(huff)
    assert [c for c, _ in planes_of(huff)] == [codecs.NONE, codecs.PLANE_HUFF]
    assert decode(codec, huff, len(data)) == data
    monkeypatch.setattr(planehuff, "AVAILABLE", False)
    _, zstd_payload = codecs.encode(memoryview(data), dtype="bfloat16")
    assert len(huff) <= len(zstd_payload) * 1.01


def test_runs_in_a_plane_go_to_zstd_not_to_a_one_bit_per_byte_code() -> None:
    """fp32 widened from bf16: the two low planes are all zero, which zstd stores in a few bytes."""
    widened = (bf16_weights(1 << 18).astype(np.uint32) << 16).tobytes()
    codec, payload = codecs.encode(memoryview(widened), dtype="float32")
    planes = planes_of(payload)
    assert [c for c, _ in planes] == [codecs.ZSTD, codecs.ZSTD, codecs.NONE, codecs.PLANE_HUFF]
    assert planes[0][1] < 100 and planes[1][1] < 100
    assert decode(codec, payload, len(widened)) == widened


def test_a_huff_plane_without_the_extension_is_a_clear_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    data = special_bf16(100_000)
    codec, payload = codecs.encode(memoryview(data), dtype="bfloat16")
    monkeypatch.setattr(planehuff, "_huffplane", None)
    with pytest.raises(TransferError, match="compiled extension"):
        decode(codec, payload, len(data))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_plane_plan_round_trips_special_values_over_many_chunks(dtype: str) -> None:
    plan = codecs.PlanePlan()
    chunk = special_bf16(64 * 1024)
    if dtype == "float32":
        x = np.frombuffer(special_bf16(2 * 64 * 1024), dtype=np.uint32).copy()
        x[::53] = np.resize(
            np.array([0x7FC00001, 0xFF800000, 0x80000000, 0x00000001, 0x007FFFFF], dtype=np.uint32), len(x[::53])
        )
        chunk = x.tobytes()
    scratch = bytearray(codecs.scratch_size(len(chunk)))
    for _ in range(codecs.PlanePlan.RECHECK * 2 + 3):
        codec, payload = codecs.encode_into(memoryview(chunk), scratch, dtype=dtype, plan=plan)
        assert codec == codecs.BYTEPLANE
        assert decode(codec, payload, len(chunk)) == chunk


def test_plane_plan_reuses_a_verdict_then_samples_again() -> None:
    plan = codecs.PlanePlan()
    assert plan.reuse(1) is None  # nothing known: sample
    plan.remember(1, codecs.PLANE_HUFF)
    reused = [plan.reuse(1) for _ in range(codecs.PlanePlan.RECHECK - 1)]
    assert reused == [codecs.PLANE_HUFF] * (codecs.PlanePlan.RECHECK - 1)
    assert plan.reuse(1) is None  # used up: the next chunk is sampled again


def test_a_plane_that_stops_compressing_is_stored_raw_and_resampled() -> None:
    """A remembered 'compress' verdict never makes a chunk bigger, and a poor full result resets it."""
    plan = codecs.PlanePlan()
    weights = bf16_weights(1 << 20).tobytes()
    noise = os.urandom(len(weights))
    scratch = bytearray(codecs.scratch_size(len(weights)))
    _, payload = codecs.encode_into(memoryview(weights), scratch, dtype="bfloat16", plan=plan)
    assert [c for c, _ in planes_of(payload)] == [codecs.NONE, codecs.PLANE_HUFF]  # mantissa raw, exponent coded
    codec, payload = codecs.encode_into(memoryview(noise), scratch, dtype="bfloat16", plan=plan)
    assert planes_of(payload) == [(codecs.NONE, len(noise) // 2)] * 2
    assert decode(codec, payload, len(noise)) == noise
    assert plan.reuse(1) is None  # the exponent plane's verdict was dropped


def test_mantissa_plane_is_still_compressed_when_a_region_turns_compressible() -> None:
    """Skipping samples must not freeze a 'raw' verdict: after RECHECK chunks the plane is asked again."""
    plan = codecs.PlanePlan()
    noise = os.urandom(1 << 20)
    zeros = bytes(1 << 20)
    scratch = bytearray(codecs.scratch_size(len(noise)))
    codecs.encode_into(memoryview(noise), scratch, dtype="bfloat16", plan=plan)
    seen = []
    for _ in range(codecs.PlanePlan.RECHECK):
        codec, payload = codecs.encode_into(memoryview(zeros), scratch, dtype="bfloat16", plan=plan)
        assert decode(codec, payload, len(zeros)) == zeros
        seen.append(planes_of(payload)[0][0])
    assert seen[-1] == codecs.ZSTD


@pytest.mark.parametrize("encrypted", [True, False])
def test_in_place_seal_matches_a_copying_seal(encrypted: bool) -> None:
    sealer = Sealer(os.urandom(32) if encrypted else None)
    data = special_bf16(200_000)
    cid = chunk_id_of(data)
    buf = bytearray(sealed_size(codecs.scratch_size(len(data)), True))
    codec, payload = codecs.encode_into(memoryview(data), memoryview(buf)[HEADER_SIZE:], dtype="bfloat16")
    copied = bytes(sealer.seal(cid, codec, len(data), bytes(payload)))
    blob = bytes(sealer.seal(cid, codec, len(data), payload, out=buf, in_place=True))
    assert len(blob) == len(copied) and blob[:16] == copied[:16]  # same header up to the (random) nonce
    out = bytearray(len(data))
    assert sealer.open_into(cid, blob, memoryview(out)) == len(data)
    assert bytes(out) == data


def test_images_packed_through_the_fast_path_read_back_bit_exact(tmp_path: Path) -> None:
    key = os.urandom(32)
    url = f"file://{tmp_path / 'store'}?sync=none"
    chunks = [special_bf16(1 << 19), os.urandom(1 << 20), bytes(1 << 20), special_bf16(1 << 19)]
    writer = open_writer(url, key=key, chunk_size=1 << 20)
    writer.add_region(RegionInfo(name="w", nbytes=sum(map(len, chunks)), kind="tensor", dtype="bfloat16"))
    for i, c in enumerate(chunks):
        writer.put_chunk("w", i, c)
    ref = writer.commit()
    reader = open_reader(url, ref.id, key=key)
    assert bytes(reader.read_region("w")) == b"".join(chunks)
    assert ref.bytes_stored < sum(map(len, chunks))


def test_an_inline_store_failure_is_a_transfer_error_and_no_image(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "chunks").write_bytes(b"not a directory")  # no chunk is there, and every chunk write fails
    writer = open_writer(f"file://{root}", key=os.urandom(32))
    writer.add_region(RegionInfo(name="w", nbytes=1 << 16, kind="tensor", dtype="bfloat16"))
    with pytest.raises(TransferError, match="storing chunk"):
        writer.put_chunk("w", 0, bf16_weights(1 << 15).tobytes())
    writer.abort()
    assert not (root / "manifests").exists()


def test_a_file_that_shrinks_while_packed_is_a_transfer_error(tmp_path: Path) -> None:
    from gpumigrate.transfer import pack
    from gpumigrate.transfer.progress import ProgressCounter

    src = tmp_path / "w.bin"
    src.write_bytes(bf16_weights(1 << 15).tobytes())  # 64 KiB, but the chunk below claims 128 KiB
    writer = open_writer(f"file://{tmp_path / 'store'}", key=os.urandom(32))
    writer.add_region(RegionInfo(name="w", nbytes=1 << 17, kind="file", dtype="bfloat16"))
    with open(src, "rb") as fh, pytest.raises(TransferError, match="shrank"):
        pack._put_read(writer, ProgressCounter(None, 1 << 17), "w", 0, fh.fileno(), 0, 1 << 17)
    writer.abort()
