"""The huff plane coder (FORMAT.md, plane codec 2): exact round trips at every length and shape of
data, sizes no worse than zstd's Huffman stage, and malformed payloads that fail cleanly, never crash."""

from __future__ import annotations

import numpy as np
import pytest
from transfer_helpers import bf16_weights

from gpumigrate.errors import IntegrityError
from gpumigrate.transfer.format import planehuff, planezstd

pytestmark = pytest.mark.skipif(not planehuff.AVAILABLE, reason="the compiled extension is not built")

RNG = np.random.default_rng(11)


def encode(plane: np.ndarray) -> bytes:
    out = bytearray(len(plane) * 2 + planehuff.HEADER_BYTES + 64)
    n = planehuff.encode_into(plane, out)
    assert n > 0
    return bytes(out[:n])


def exponent_plane(n: int, seed: int = 0) -> np.ndarray:
    return (bf16_weights(n, seed=seed) >> 8).astype(np.uint8)


PLANES = {
    "bf16 exponents": lambda n: exponent_plane(n),
    "uniform bytes": lambda n: RNG.integers(0, 256, n, dtype=np.uint8),
    "one symbol": lambda n: np.full(n, 0xA5, dtype=np.uint8),
    "two symbols": lambda n: RNG.choice(np.array([0, 255], dtype=np.uint8), n),
    "geometric": lambda n: np.minimum(RNG.geometric(0.3, n), 255).astype(np.uint8),
    "every byte once then zeros": lambda n: np.concatenate(
        [np.arange(256, dtype=np.uint8), np.zeros(max(0, n - 256), np.uint8)]
    )[:n],
}


@pytest.mark.parametrize("kind", sorted(PLANES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 1000, 4099, 65536, 65537, 300_001])
def test_round_trip_is_exact(kind: str, n: int) -> None:
    plane = PLANES[kind](n)
    assert planehuff.decode(encode(plane), n).tobytes() == plane.tobytes()


def test_bytes_the_sample_missed_still_round_trip() -> None:
    """The code is built from a 1/16 sample: a byte outside it must still have a code."""
    plane = exponent_plane(1 << 22)
    rare = RNG.choice(len(plane), 50, replace=False)
    plane[rare] = RNG.integers(0, 256, 50, dtype=np.uint8)
    assert planehuff.decode(encode(plane), len(plane)).tobytes() == plane.tobytes()


def test_exponent_planes_code_as_small_as_zstd_huffman() -> None:
    plane = exponent_plane(1 << 21)
    huff = encode(plane)
    zstd = bytes(planezstd.compress_plane(plane))
    assert len(huff) <= len(zstd) * 1.01
    assert len(huff) < 0.36 * len(plane)


def test_a_result_that_does_not_fit_writes_nothing() -> None:
    plane = RNG.integers(0, 256, 10_000, dtype=np.uint8)
    out = bytearray(b"\x5a" * (len(plane) - 1))
    assert planehuff.encode_into(plane, out) == -1
    assert out == bytearray(b"\x5a" * (len(plane) - 1))


def test_coding_over_the_plane_itself_gives_the_same_payload() -> None:
    plane = exponent_plane(1 << 20)
    expected = encode(plane)
    buf = plane.copy()
    n = planehuff.encode_into(buf, memoryview(buf))
    assert bytes(buf[:n]) == expected


def test_concurrent_threads_code_independently() -> None:
    from concurrent.futures import ThreadPoolExecutor

    planes = [exponent_plane(1 << 18, seed=s) for s in range(8)] + [PLANES["uniform bytes"](1 << 18)]
    with ThreadPoolExecutor(4) as pool:
        payloads = list(pool.map(encode, planes * 3))
    for plane, payload in zip(planes * 3, payloads, strict=True):
        assert planehuff.decode(payload, len(plane)).tobytes() == plane.tobytes()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[:100], "shorter than its header"),
        (lambda p: b"\x0d" + p[1:], "code length limit"),
        (lambda p: p[:1] + b"\x11" * 128 + p[129:], "over-subscribe"),
        (lambda p: p[:129] + b"\xff\xff\xff\x7f" + p[133:], "stream sizes"),
        (lambda p: p[: len(p) // 2], "stream sizes exceed"),
        (lambda p: p[:-50], "ends before its symbols"),
    ],
)
def test_malformed_headers_and_streams_are_integrity_errors(mutate, message: str) -> None:
    plane = exponent_plane(50_000)
    with pytest.raises(IntegrityError, match=message):
        planehuff.decode(mutate(encode(plane)), len(plane))


def test_random_damage_never_crashes_the_decoder() -> None:
    """Flipped bytes anywhere decode to something or fail cleanly; the chunk's BLAKE3 catches the rest."""
    plane = exponent_plane(20_000)
    good = encode(plane)
    for trial in range(400):
        damaged = bytearray(good)
        for pos in RNG.integers(0, len(good), 1 + trial % 4):
            damaged[pos] ^= int(RNG.integers(1, 256))
        if trial % 7 == 0:
            damaged = damaged[: int(RNG.integers(0, len(damaged)))]
        try:
            out = planehuff.decode(bytes(damaged), len(plane))
        except IntegrityError:
            continue
        assert len(out) == len(plane)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("elements", [1, 31, 32, 33, 1000, 65_537])
def test_split_puts_byte_j_of_every_element_in_plane_j(k: int, elements: int) -> None:
    data = RNG.integers(0, 256, k * elements, dtype=np.uint8)
    out = np.empty(len(data) + 5, dtype=np.uint8)
    planehuff.split(memoryview(data), k, out)
    assert out[: len(data)].tobytes() == data.reshape(-1, k).T.tobytes()


def test_split_refuses_partial_elements_short_outputs_and_overlap() -> None:
    data = np.arange(10, dtype=np.uint8)
    for k, out, message in [
        (4, np.empty(10, np.uint8), "whole number"),
        (2, np.empty(9, np.uint8), "shorter"),
        (2, data, "overlaps"),
    ]:
        with pytest.raises(ValueError, match=message):
            planehuff.split(memoryview(data), k, out)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("elements", [1, 31, 32, 33, 65_537])
def test_merge_undoes_split(k: int, elements: int) -> None:
    data = RNG.integers(0, 256, k * elements, dtype=np.uint8)
    planes = np.empty(len(data), dtype=np.uint8)
    planehuff.split(memoryview(data), k, planes)
    out = bytearray(len(data))
    planehuff.merge([planes[j * elements : (j + 1) * elements] for j in range(k)], memoryview(out))
    assert bytes(out) == data.tobytes()


def test_merge_refuses_ragged_planes_and_short_outputs() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        planehuff.merge([bytes(4), bytes(5)], memoryview(bytearray(10)))
    with pytest.raises(ValueError, match="shorter"):
        planehuff.merge([bytes(4), bytes(4)], memoryview(bytearray(7)))
    with pytest.raises(TypeError):
        planehuff.merge([bytes(4), 7], memoryview(bytearray(8)))
