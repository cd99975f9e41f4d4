"""A planted fingerprint collision: the live rounds are fooled, the frozen final round is not.

The dirty-tracking fingerprint is linear (sum of 64-bit odd weights times sign-extended 32-bit words,
mod 2**64), so a change to a few words whose weighted sum is 0 mod 2**64 leaves it unchanged. Such
a change is a short vector of a lattice, which LLL reduction (sympy) finds; no search is involved.
"""

from __future__ import annotations

import blake3
import pytest
import torch
from sympy import ZZ
from sympy.polys.matrices import DomainMatrix

from gpumigrate.snapshot.chunks import byte_view, chunk_weights, fingerprint_chunks
from gpumigrate.snapshot.engine import SnapshotEngine
from tests.support.memimage import MemoryStore

KEY = b"c" * 32
CHUNK = 4096  # bytes: 1024 words


def colliding_change(positions: list[int]) -> list[int]:
    """Word deltas d (each |d| < 2**31, not all 0) at ``positions`` with sum(w[p] * d) == 0 mod 2**64."""
    w = [int(v) % 2**64 for v in chunk_weights(CHUNK // 4)[positions].tolist()]
    inv = pow(w[0], -1, 2**64)  # weights are odd: invertible mod 2**64
    n = len(positions)
    rows = [[2**64] + [0] * (n - 1)]
    for i in range(1, n):
        rows.append([(-w[i] * inv) % 2**64] + [1 if j == i else 0 for j in range(1, n)])
    reduced = DomainMatrix([[ZZ(v) for v in row] for row in rows], (n, n), ZZ).lll().to_Matrix().tolist()
    for vec in reduced:
        d = [int(v) for v in vec]
        if any(d) and max(abs(v) for v in d) < 2**31:
            assert sum(wi * di for wi, di in zip(w, d, strict=True)) % 2**64 == 0
            return d
    raise AssertionError("no short vector")


def test_planted_collision_is_caught_by_the_final_full_hash() -> None:
    positions = [3, 100, 517, 1000, 1023]
    data = torch.zeros(2 * CHUNK // 4, dtype=torch.int32)  # two chunks of 4 KiB; chunk 0 is the target
    before = fingerprint_chunks(byte_view(data), CHUNK).tolist()
    planted = data.clone()
    for p, d in zip(positions, colliding_change(positions), strict=True):
        planted[p] = d
    after = fingerprint_chunks(byte_view(planted), CHUNK).tolist()
    assert after == before and not torch.equal(planted, data)  # a real collision of the 64-bit fingerprint

    store = MemoryStore()
    agent = SnapshotEngine(workers=1)
    agent.track_tensor("w", data)
    agent.capture_round(store.writer(KEY, chunk_size=CHUNK))
    data.copy_(planted)  # the workload changes chunk 0 in a way the fingerprint cannot see
    live = agent.capture_round(store.writer(KEY, chunk_size=CHUNK)).stats
    assert live.chunks_dirty == 0  # a live round trusts the fingerprint: fooled
    agent.park()
    final = agent.capture_final(store.writer(KEY, chunk_size=CHUNK)).image
    assert agent.fingerprint_collisions == 1  # the final round's BLAKE3 of "unchanged" chunks caught it
    reader = store.reader(final.id, KEY)
    chunk0 = bytes(byte_view(planted)[:CHUNK].numpy())
    assert reader.metadata()["snapshot"]["chunks"]["w"][0] == blake3.blake3(chunk0).hexdigest()

    out = torch.full_like(data, -1)
    target = SnapshotEngine(workers=1)
    target.track_tensor("w", out)
    target.load(reader)
    assert torch.equal(out, planted)  # the target got the bytes, not the stale chunk
    agent.close()


def test_fingerprints_are_64_bit_and_see_paired_sign_flips() -> None:
    """The 32-bit fingerprint this replaced cancelled two sign flips (bit 31 of two words) every time."""
    t = torch.randn(2048, generator=torch.Generator().manual_seed(5))
    base = fingerprint_chunks(byte_view(t), CHUNK).tolist()
    assert any(abs(v) >= 2**32 for v in base)  # values use the whole 64-bit range
    flipped = -t.clone()[:1024]  # every float's sign bit flipped in chunk 0
    u = t.clone()
    u[:2] = -u[:2]
    assert fingerprint_chunks(byte_view(u), CHUNK).tolist()[0] != base[0]
    u[:1024] = flipped
    assert fingerprint_chunks(byte_view(u), CHUNK).tolist()[0] != base[0]


@pytest.mark.gpu
def test_planted_collision_on_cuda_is_caught_by_the_device_hash(tmp_path) -> None:
    """On CUDA the final round hashes the "unchanged" chunks where they live: the transfer engine's
    direct writer computes their ids with its device BLAKE3 kernels (transfer/device/devhash.py)."""
    from gpumigrate import transfer
    from gpumigrate.interfaces import DirectImageWriter
    from gpumigrate.transfer.device import devhash

    positions = [7, 200, 640, 1001, 1022]
    data = torch.zeros(2 * CHUNK // 4, dtype=torch.int32, device="cuda")
    planted = data.clone()
    for p, d in zip(positions, colliding_change(positions), strict=True):
        planted[p] = d
    assert fingerprint_chunks(byte_view(planted), CHUNK).tolist() == fingerprint_chunks(byte_view(data), CHUNK).tolist()
    assert devhash.available(data.device)  # the device path, not the host fallback
    store = "file://" + str(tmp_path / "store")

    def writer(parent: str | None) -> DirectImageWriter:
        w = transfer.open_writer(store, key=KEY, parent=parent, chunk_size=CHUNK)
        assert isinstance(w, DirectImageWriter)
        return w

    agent = SnapshotEngine(workers=1)
    agent.track_tensor("w", data)
    first = agent.capture_round(writer(None)).stats
    assert first.chunks_dirty == 2
    data.copy_(planted)
    assert agent.capture_round(writer(agent.last_image.id if agent.last_image else None)).stats.chunks_dirty == 0
    agent.park()
    final = agent.capture_final(writer(agent.last_image.id if agent.last_image else None)).image
    assert agent.fingerprint_collisions == 1
    out = torch.full_like(data, -1)
    target = SnapshotEngine(workers=1)
    target.track_tensor("w", out)
    target.load(transfer.open_reader(store, final.id, key=KEY))
    assert torch.equal(out, planted)
    agent.close()
