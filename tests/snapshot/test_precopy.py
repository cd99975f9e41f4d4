"""Dirty tracking: fingerprints catch every change, pre-copy converges, restore loads only deltas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpumigrate.interfaces import ImageRef, Round, RoundStats
from gpumigrate.snapshot.chunks import Fingerprints, byte_view, fingerprint_chunks
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.precopy import converge
from tests.support.memimage import MemoryStore

KEY = b"p" * 32


def test_fingerprint_sees_any_single_word_change() -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(8 * 1024, generator=g)  # 32 KiB = 8 chunks of 4 KiB
    base = fingerprint_chunks(byte_view(t), 4096).tolist()
    assert fingerprint_chunks(byte_view(t.clone()), 4096).tolist() == base
    for pos in (0, 1023, 1024, 5000, 8191):
        u = t.clone()
        u.view(torch.int32)[pos] ^= 1 << (pos % 31)  # flip one bit
        fps = fingerprint_chunks(byte_view(u), 4096).tolist()
        changed = [i for i, (a, b) in enumerate(zip(base, fps, strict=True)) if a != b]
        assert changed == [pos // 1024]
    # Swapping two words inside a chunk changes the weighted sum too (position matters).
    u = t.clone()
    w = u.view(torch.int32)
    w[10], w[11] = int(w[11]), int(w[10])
    assert fingerprint_chunks(byte_view(u), 4096).tolist()[0] != base[0]


def test_fingerprint_short_and_unaligned_tails() -> None:
    t = torch.arange(10_003, dtype=torch.uint8)
    fps = fingerprint_chunks(byte_view(t), 4096)
    assert fps.numel() == 3
    u = t.clone()
    u[-1] += 1
    assert fingerprint_chunks(byte_view(u), 4096).tolist()[:2] == fps.tolist()[:2]
    assert fingerprint_chunks(byte_view(u), 4096).tolist()[2] != fps.tolist()[2]
    odd = byte_view(torch.arange(9000, dtype=torch.uint8))[1:]  # storage offset 1: unaligned
    assert fingerprint_chunks(odd, 4096).numel() == 3


def test_fingerprints_of_many_regions_equal_one_region_at_a_time() -> None:
    """The batched fingerprints (short chunks of all regions stacked by length) are the same values."""
    g = torch.Generator().manual_seed(5)
    raw = byte_view(torch.randn(40_000, generator=g))
    views = {
        "whole": raw[: 3 * 4096],  # only whole chunks
        "tail": raw[: 2 * 4096 + 100],  # whole chunks and a short one
        "same_tail_a": raw[4096 : 4096 + 100],  # short chunks of one length, batched together
        "same_tail_b": raw[8192 : 8192 + 100],
        "unaligned": raw[1 : 1 + 3 * 4096],  # storage offset 1: every chunk goes the byte-wise way
        "odd": raw[7:20],
        "empty": raw[:0],
    }
    got = Fingerprints(views, 4096).to_host()
    assert got == {name: fingerprint_chunks(v, 4096).tolist() for name, v in views.items()}
    assert len(got["tail"]) == 3 and got["same_tail_a"] != got["same_tail_b"] and got["empty"] == []


@pytest.mark.gpu
def test_fingerprints_of_many_device_regions_match_the_host_and_one_region_at_a_time() -> None:
    """On a GPU the whole chunks of all regions go through one gathering launch and their short chunks through
    another (snapshot/fp_kernels.py): the same numbers as one region at a time, and as the host computes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    chunk = 1 << 20  # four programs per chunk
    g = torch.Generator().manual_seed(6)
    host = {f"r{i}": byte_view(torch.randn(n, generator=g)) for i, n in enumerate((3 << 18, 5 << 18, 777_777, 1 << 18))}
    dev = {name: v.to("cuda") for name, v in host.items()}  # separate allocations: offsets on both sides of one
    dev["slice"] = dev["r1"][4096 : 4096 + 2 * chunk]
    host["slice"] = host["r1"][4096 : 4096 + 2 * chunk]
    # short chunks of several lengths at odd addresses: all of them in the one tail launch
    for name, (src, start, n) in {"odd": ("r2", 3, 5_001), "tiny": ("r0", 7, 1), "near": ("r1", 1, chunk - 1)}.items():
        dev[name], host[name] = dev[src][start : start + n], host[src][start : start + n]
    got = Fingerprints(dev, chunk).to_host()
    assert got == {name: fingerprint_chunks(v, chunk).tolist() for name, v in dev.items()}
    assert got == {name: fingerprint_chunks(v, chunk).tolist() for name, v in host.items()}


def test_precopy_converges_on_workload_dirtying_5_percent_per_step() -> None:
    store = MemoryStore()
    weights = torch.randn(256 * 1024)  # 1 MiB: 64 chunks of 16 KiB
    chunks = 64
    agent = SnapshotEngine(workers=2)
    agent.track_tensor("w", weights)
    step = {"n": 0}

    def workload_step(fraction: float) -> None:
        # Touch `fraction` of the chunks, a different set each step.
        per = 4096
        k = max(1, int(chunks * fraction))
        for j in range(k):
            c = (step["n"] * 7 + j * 13) % chunks
            weights[c * per] += 1.0
        step["n"] += 1

    dirty_per_round: list[int] = []
    # The workload takes one step per round (5% dirty per step); rounds continue while it runs.
    fractions = iter([0.05] * 20)

    def one_round() -> Round:
        stats = agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats
        dirty_per_round.append(stats.chunks_dirty)
        workload_step(next(fractions))
        assert agent.last_image is not None
        return Round(stats, agent.last_image)

    conv = converge(one_round, max_rounds=10, max_downtime_ms=10_000)
    assert dirty_per_round[0] == chunks  # the first round ships everything
    assert all(d <= int(chunks * 0.05) for d in dirty_per_round[1:])  # then only what the step touched
    assert 2 <= len(conv.rounds) < 10 and "fits" in conv.reason
    agent.park()
    final = agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats
    assert final.chunks_dirty == int(chunks * 0.05)


def _rounds(*stats: RoundStats) -> Iterator[Round]:
    return iter(Round(s, ImageRef(f"image-{s.round}", "mem://")) for s in stats)


def test_converge_stops_when_dirty_bytes_stop_shrinking() -> None:
    seq = _rounds(RoundStats(1, 10, 10, 1000, 1.0), RoundStats(2, 10, 9, 950, 1.0), RoundStats(3, 10, 9, 940, 1.0))
    conv = converge(lambda: next(seq), max_rounds=5, max_downtime_ms=1)
    assert len(conv.rounds) == 2 and "stopped shrinking" in conv.reason
    assert conv.images == ["image-1", "image-2"]
    seq2 = _rounds(RoundStats(1, 10, 10, 1000, 1.0), RoundStats(2, 10, 5, 500, 1.0), RoundStats(3, 10, 2, 200, 1.0))
    conv = converge(lambda: next(seq2), max_rounds=3, max_downtime_ms=1)
    assert len(conv.rounds) == 3 and "3 pre-copy rounds" in conv.reason
    assert converge(lambda: next(_rounds(RoundStats(1, 1, 1, 1, 1.0))), max_rounds=0, max_downtime_ms=1).rounds == []


def test_converge_stops_at_once_when_nothing_is_dirty() -> None:
    seq = _rounds(RoundStats(1, 10, 10, 1000, 1.0), RoundStats(2, 10, 0, 0, 0.1))
    conv = converge(lambda: next(seq), max_rounds=5, max_downtime_ms=500)
    assert len(conv.rounds) == 2 and "fits the downtime budget (0 bytes)" in conv.reason


def test_chunk_changed_during_copy_and_changed_back_is_resent() -> None:
    """The recorded fingerprint is that of the bytes shipped, so an A→B→A change is still caught."""
    store = MemoryStore()
    buf = torch.zeros(4096, dtype=torch.int32)  # 16 KiB: 4 chunks

    agent = SnapshotEngine(workers=1)
    agent.track_tensor("buf", buf)
    agent.capture_round(store.writer(KEY, chunk_size=4096))
    buf[0] = 7  # B: dirty, shipped in round 2
    inner = store.writer(KEY, chunk_size=4096)
    real_put = inner.put_chunk

    def put(region, index, data):  # the workload changes back to A while the chunk is on its way
        cid = real_put(region, index, data)
        buf[0] = 0
        return cid

    inner.put_chunk = put
    agent.capture_round(inner)
    # Round 3: content is A again, the target holds B: the fingerprint of the shipped B differs.
    stats = agent.capture_round(store.writer(KEY, chunk_size=4096)).stats
    assert stats.chunks_dirty == 1
    out = torch.ones_like(buf)
    dst = SnapshotEngine(workers=1)
    dst.track_tensor("buf", out)
    dst.load(store.reader(agent.last_image.id, KEY))
    assert torch.equal(out, buf)


def test_incremental_restore_loads_only_changed_chunks() -> None:
    store = MemoryStore()
    w = torch.randn(64 * 1024)  # 256 KiB: 16 chunks of 16 KiB
    src = SnapshotEngine(workers=2)
    src.track_tensor("w", w)
    first = src.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats
    img1 = src.last_image.id
    w[5] = 42.0
    w[40_000] = -1.0
    src.park()
    src.capture_round(store.writer(KEY, chunk_size=16 << 10))
    img2 = src.last_image.id
    assert first.chunks_dirty == 16

    out = torch.zeros_like(w)
    flags: list[bool] = []
    dst = SnapshotEngine(workers=2, set_ready=flags.append)
    dst.track_tensor("w", out)
    pre = dst.load(store.reader(img1, KEY), ready=False)
    assert pre["chunks_loaded"] == 16 and not pre["ready"] and flags == [False]
    fin = dst.load(store.reader(img2, KEY))
    assert fin["chunks_loaded"] == 2 and fin["chunks_skipped"] == 14
    assert flags == [False, False, True]
    assert torch.equal(out, w)


def test_a_new_chunk_size_ships_everything_instead_of_reusing_misaligned_chunks() -> None:
    store = MemoryStore()
    t = torch.randn(16 * 1024)  # 64 KiB
    a = SnapshotEngine(workers=1)
    a.track_tensor("t", t)
    assert a.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats.chunks_dirty == 4
    assert a.capture_round(store.writer(KEY, chunk_size=8 << 10)).stats.chunks_dirty == 8
    assert a.capture_round(store.writer(KEY, chunk_size=8 << 10)).stats.chunks_dirty == 0
    out = torch.zeros_like(t)
    b = SnapshotEngine(workers=1)
    b.track_tensor("t", out)
    b.load(store.reader(a.last_image.id, KEY))
    assert torch.equal(out, t)


def test_frozen_round_of_a_host_tensor_ships_the_chunks_its_hash_finds_changed() -> None:
    """A host tensor's final round hashes every chunk instead of fingerprinting it first: the changed chunks
    ship, the rest are reused, the image restores exactly, and the fingerprints kept for a round after a
    rollback are those of the bytes shipped (an unchanged tensor then ships nothing, one change one chunk)."""
    store = MemoryStore()
    weights = torch.randn(64 * 1024)  # 256 KiB: 16 chunks of 16 KiB
    agent = SnapshotEngine(workers=2)
    agent.track_tensor("w", weights)
    agent.track_state("steps", lambda: {"n": 1}, lambda v: None)
    first = agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats
    weights[5000] += 1.0  # chunk 1
    weights[40_000] += 1.0  # chunk 9
    agent.park()
    final = agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats  # frozen: the final round
    assert (first.chunks_total, final.chunks_dirty, agent.fingerprint_collisions) == (17, 2, 0)
    out = torch.zeros_like(weights)
    target = SnapshotEngine()
    target.track_tensor("w", out)
    target.track_state("steps", lambda: {"n": 0}, lambda v: None)
    assert agent.last_image is not None
    target.load(store.reader(agent.last_image.id, KEY))
    assert torch.equal(out, weights)
    agent.unpark()
    assert agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats.chunks_dirty == 0
    weights[0] += 1.0
    assert agent.capture_round(store.writer(KEY, chunk_size=16 << 10)).stats.chunks_dirty == 1
    agent.close()


def test_rounds_reuse_unchanged_regions_whole_and_ship_the_changed_chunks_of_the_others() -> None:
    """Regions of several chunks, of one short chunk, and empty ones, across live rounds and a frozen one: each
    round ships exactly the changed chunks, its ids are those a fresh capture of the same bytes gives, and the
    image restores bit-identically."""
    cs = 16 << 10
    state = {
        "big": torch.randn(4 * cs // 4),  # 4 chunks
        "odd": torch.randn(cs // 4 + 3),  # 2 chunks, the second short
        "small": torch.randn(100),  # one short chunk
        "empty": torch.zeros(0),
        "steady": torch.randn(3 * cs // 4),  # never changes
    }
    store = MemoryStore()
    agent = SnapshotEngine(workers=2)
    agent.track_tensors("s", state)

    def fresh_ids() -> dict[str, list[str]]:
        other = SnapshotEngine(workers=1)
        other.track_tensors("s", {k: v.clone() for k, v in state.items()})
        other.capture_round(store.writer(KEY, chunk_size=cs))
        assert other.last_image is not None
        ids: dict[str, list[str]] = store.reader(other.last_image.id, KEY).metadata()["snapshot"]["chunks"]
        return ids

    def check(stats: RoundStats, dirty: int) -> None:
        assert (stats.chunks_total, stats.chunks_dirty) == (10, dirty)
        assert agent.last_image is not None
        reader = store.reader(agent.last_image.id, KEY)
        assert reader.metadata()["snapshot"]["chunks"] == fresh_ids()
        out = {k: torch.full_like(v, 7.0) for k, v in state.items()}
        target = SnapshotEngine(workers=1)
        target.track_tensors("s", out)
        target.load(reader)
        assert all(torch.equal(out[k], state[k]) for k in state)

    check(agent.capture_round(store.writer(KEY, chunk_size=cs)).stats, 10)
    check(agent.capture_round(store.writer(KEY, chunk_size=cs)).stats, 0)
    state["big"][cs // 4 * 2 + 5] += 1.0  # chunk 2 of 4
    state["odd"][-1] += 1.0  # the short chunk
    state["small"][0] += 1.0
    check(agent.capture_round(store.writer(KEY, chunk_size=cs)).stats, 3)
    state["big"][0] += 1.0
    state["odd"][0] += 1.0
    agent.park()
    check(
        agent.capture_round(store.writer(KEY, chunk_size=cs)).stats, 2
    )  # frozen: host tensors confirmed by their hash
    assert agent.fingerprint_collisions == 0
    agent.close()


def test_each_round_describes_the_regions_as_they_are_then() -> None:
    """A tracked name whose tensor changes shape, dtype or kind between rounds is described anew each round."""
    current = {"t": torch.zeros(8, dtype=torch.float32)}
    store = MemoryStore()
    agent = SnapshotEngine(workers=1)
    agent.track_tensors("s", lambda: current)

    def described() -> tuple[int, str | None, tuple[int, ...] | None]:
        agent.capture_round(store.writer(KEY, chunk_size=4096))
        assert agent.last_image is not None
        (info,) = store.reader(agent.last_image.id, KEY).regions()
        return info.nbytes, info.dtype, info.shape

    assert described() == (32, "float32", (8,))
    assert described() == (32, "float32", (8,))
    current["t"] = torch.zeros(2, 4, dtype=torch.float32)
    assert described() == (32, "float32", (2, 4))
    current["t"] = torch.zeros(2, 4, dtype=torch.int32)
    assert described() == (32, "int32", (2, 4))
    current["t"] = torch.zeros(3, 4, dtype=torch.int32)
    assert described() == (48, "int32", (3, 4))
    agent.close()
