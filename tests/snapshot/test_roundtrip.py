"""CPU round trips: the next training step after restore is bit-identical to the source's."""

from __future__ import annotations

import torch

from gpumigrate.agent.images import make_engine
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.server_commands import final_to, precopy_to, restore_from
from tests.support.memimage import MemoryStore


def _agent(model: torch.nn.Module, opt: torch.optim.Optimizer, agent: SnapshotEngine) -> SnapshotEngine:
    agent.track_module("model", model)
    agent.track_optimizer("opt", opt)
    agent.track_rng()
    return agent


def test_training_roundtrip_through_transfer_engine(batch, key_env, store_url, net_cls, step_fn) -> None:
    x, y = batch
    torch.manual_seed(1)
    src_model = net_cls()
    src_opt = torch.optim.AdamW(src_model.parameters(), lr=1e-2)
    for _ in range(3):
        step_fn(src_model, src_opt, x, y)
    src = _agent(src_model, src_opt, make_engine())
    precopy_to(src, store_url, key_env)
    step_fn(src_model, src_opt, x, y)  # keeps training between rounds
    src.park()
    final = final_to(src, store_url, key_env)
    assert final["stats"]["chunks_dirty"] > 0
    # Source and target share this process's global RNG: take the source's next step first, then
    # scramble the RNG, so only the restore can make the target draw the same numbers.
    expected = {k: v.clone() for k, v in src_model.state_dict().items()}
    loss_src = step_fn(src_model, src_opt, x, y)

    torch.manual_seed(999)  # the target starts from different weights and RNG
    dst_model = net_cls()
    dst_opt = torch.optim.AdamW(dst_model.parameters(), lr=1e-3)  # even another lr: the image's wins
    dst = _agent(dst_model, dst_opt, make_engine())
    res = restore_from(dst, store_url, final["image"]["id"], key_env)
    assert res["ready"] is True and dst.ready
    for name, value in dst_model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert dst_opt.param_groups[0]["lr"] == src_opt.param_groups[0]["lr"]

    # The next step on the target: same loss and same resulting weights, bit for bit.
    loss_dst = step_fn(dst_model, dst_opt, x, y)
    assert loss_src == loss_dst
    for a, b in zip(src_model.parameters(), dst_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tensors_and_json_state_roundtrip_in_memory() -> None:
    store = MemoryStore()
    key = b"k" * 32
    state = {"requests": 41, "tag": "blue"}
    kv = torch.arange(10_000, dtype=torch.float16).reshape(100, 100)
    odd = torch.arange(7, dtype=torch.uint8)  # not a multiple of 4 bytes
    src = SnapshotEngine()
    src.track_tensor("kv", kv)
    src.track_tensors("misc", {"odd": odd, "empty": torch.empty(0)})
    src.track_state("counters", lambda: state, lambda v: state.update(v))
    src.park()
    ref = src.capture_final(store.writer(key, chunk_size=4096)).image

    got: dict = {}
    kv2, odd2 = torch.zeros_like(kv), torch.zeros_like(odd)
    dst = SnapshotEngine()
    dst.track_tensor("kv", kv2)
    dst.track_tensors("misc", {"odd": odd2, "empty": torch.empty(0)})
    dst.track_state("counters", lambda: got, lambda v: got.update(v))
    dst.load(store.reader(ref.id, key))
    assert torch.equal(kv, kv2) and torch.equal(odd, odd2)
    assert got == state


def test_capture_streams_through_a_ring_smaller_than_the_state() -> None:
    """More chunks than ring slots: slots are recycled only after the writer returned."""
    store = MemoryStore()
    key = b"r" * 32
    big = torch.randn(64 * 1024)  # 256 KiB in 4 KiB chunks = 64 chunks through ~8 slots
    src = SnapshotEngine(workers=2)
    src.track_tensor("big", big)
    stats = src.capture_round(store.writer(key, chunk_size=4096)).stats
    assert stats.chunks_dirty == 64
    out = torch.zeros_like(big)
    dst = SnapshotEngine(workers=2)
    dst.track_tensor("big", out)
    dst.load(store.reader(src.last_image.id, key))
    assert torch.equal(big, out)


def test_direct_placement_into_an_arena_and_fallback_when_full() -> None:
    """A direct writer with an arena gets the bytes placed in its memory; when the arena is full it
    takes the remaining chunks the plain way."""
    data = torch.randn(48 * 1024)  # 192 KiB = 12 chunks of 16 KiB
    arena = torch.empty(100 << 10, dtype=torch.uint8)  # room for 6 chunks only
    store = MemoryStore(arena=arena)
    src = SnapshotEngine(workers=2)
    src.track_tensor("d", data)
    stats = src.capture_round(store.writer(b"a" * 32, chunk_size=16 << 10)).stats
    assert stats.chunks_dirty == 12
    assert len(store.placed) == 6 and len(store.chunks) == 6
    out = torch.zeros_like(data)
    dst = SnapshotEngine(workers=2)
    dst.track_tensor("d", out)
    dst.load(store.reader(src.last_image.id, b"a" * 32))
    assert torch.equal(out, data)
    arena[: 16 << 10].zero_()  # damage a placed chunk: the reader's BLAKE3 check refuses it
    import pytest

    from gpumigrate.errors import IntegrityError

    with pytest.raises(IntegrityError, match="BLAKE3"):
        dst.load(store.reader(src.last_image.id, b"a" * 32))


def test_downtime_commands_report_their_phases_and_hold_the_collector(key_env, store_url) -> None:
    """final's stats and restore's reply say where their seconds went (the phases cover the call); while they
    run, Python's cyclic collector is off, and it is on again afterwards (off, if the workload had it off)."""
    import gc

    seen: list[bool] = []
    weights = torch.randn(3000)
    src = make_engine()
    src.track_tensor("w", weights)
    src.track_state("probe", lambda: seen.append(gc.isenabled()) or {"n": 1}, lambda v: None)
    precopy_to(src, store_url, key_env)
    weights[:10] += 1
    src.park()
    assert gc.isenabled()
    final = final_to(src, store_url, key_env)
    assert seen[-1] is False and gc.isenabled()
    stats = final["stats"]
    assert list(stats["phases"]) == [
        "lock", "open", "regions", "fingerprint", "plan", "ship", "confirm", "reuse", "metadata", "commit"
    ]  # fmt: skip
    assert sum(stats["phases"].values()) <= stats["seconds"] + 0.001

    got: list[bool] = []
    dst = make_engine()
    dst.track_tensor("w", torch.zeros(3000))
    dst.track_state("probe", lambda: {"n": 0}, lambda v: got.append(gc.isenabled()))
    gc.disable()
    try:
        res = restore_from(dst, store_url, final["image"]["id"], key_env)
        assert got == [False] and not gc.isenabled()  # the workload's own choice stands
    finally:
        gc.enable()
    assert list(res["phases"]) == ["open", "lock", "check", "from_image", "from_source", "after", "ready"]
    assert sum(res["phases"].values()) <= res["seconds"] + 0.001


def test_collector_holds_nest_and_overlap_across_threads() -> None:
    """The collector comes back on when the last hold ends, whichever thread took it, and only if it was on."""
    import gc
    import threading

    from gpumigrate.snapshot.gchold import gc_held

    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        with gc_held():
            inside.set()
            release.wait(10)

    assert gc.isenabled()
    with gc_held():
        worker = threading.Thread(target=other)
        worker.start()
        assert inside.wait(10)
        with gc_held():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's hold is still on
    release.set()
    worker.join(10)
    assert gc.isenabled()


def test_restore_hands_each_item_exactly_its_own_regions() -> None:
    """Items whose names share beginnings ("a", "ab"), a name with a slash ("x/y", the rng's "rng/torch"):
    each item's targets() and after_restore() see its own regions, in order, and nothing else."""
    from collections.abc import Mapping
    from typing import Any

    from gpumigrate.snapshot import tracked as tr

    class Recording(tr.TensorsItem):
        def __init__(self, prefix: str, tensors: dict[str, torch.Tensor], seen: dict[str, list[str]]) -> None:
            super().__init__(prefix, lambda: tensors)
            self.seen = seen

        def targets(self, regions: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            self.seen[f"targets {self.prefix}"] = list(regions)
            return super().targets(regions, meta)

        def after_restore(self, meta: Mapping[str, Any], loaded: Mapping[str, torch.Tensor]) -> None:
            self.seen[f"after {self.prefix}"] = list(loaded)

    layout = {
        "a": {"w": 3, "v": 2},
        "ab": {"": 4},
        "x/y": {"z": 5, "q/r": 6},
        "abc/d": {"e": 1},
    }

    def agent(fill: float, seen: dict[str, list[str]]) -> tuple[SnapshotEngine, dict[str, dict[str, torch.Tensor]]]:
        a = SnapshotEngine()
        made = {p: {k: torch.full((n,), fill + n) for k, n in parts.items()} for p, parts in layout.items()}
        for p, tensors in made.items():
            a.track(Recording(p, tensors, seen))
        a.track_rng()
        return a, made

    store, key = MemoryStore(), b"k" * 32
    src, made = agent(1.0, {})
    src.park()
    ref = src.capture_final(store.writer(key, chunk_size=4096)).image
    seen: dict[str, list[str]] = {}
    dst, out = agent(-50.0, seen)
    dst.load(store.reader(ref.id, key))
    assert all(torch.equal(out[p][k], made[p][k]) for p in layout for k in layout[p])
    for p, parts in layout.items():
        names = [f"{p}/{k}" if k else p for k in parts]
        assert seen[f"targets {p}"] == names and seen[f"after {p}"] == names
