"""A final round that returns before its confirmation ends (``final`` with ``confirm: "later"``), over the wire.

The source commits once its hot state is shipped and hashes the rest (the weights) after; the target restores that
image unready beside the source's verdict and is made ready only after it (``snapshot/cutover.py``). A fingerprint
collision planted in the weights (``test_collision.py``'s lattice) is what the confirmation must still catch: the
verdict then names a follow-up image with the changed chunk, and the target is ready only once it holds it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from gpumigrate import transfer
from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.chunks import byte_view, fingerprint_chunks
from gpumigrate.snapshot.cutover import restore_and_ready
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.server import serve
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.snapshot.world import World
from tests.snapshot.test_collision import CHUNK, colliding_change

POSITIONS = [3, 100, 517, 1000, 1023]


@dataclass
class Side:
    engine: SnapshotEngine
    tensors: dict[str, torch.Tensor]
    world: World
    # the target's readiness as its workload saw it, each time it changed: (ready, the weights then, as loaded)
    readiness: list[tuple[bool, torch.Tensor]] = field(default_factory=list)


def _engine(key: bytes, **kwargs: Any) -> SnapshotEngine:
    def open_writer(store: str, key_ref: Any, parent: str | None, **_: Any) -> Any:
        return transfer.open_writer(store, key=key, parent=parent, chunk_size=CHUNK, source="agent")

    def open_reader(store: str, image_id: str, key_ref: Any) -> Any:
        return transfer.open_reader(store, image_id, key=key)

    return SnapshotEngine(writer_factory=open_writer, reader_factory=open_reader, workers=1, **kwargs)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    image_key, control_key = os.urandom(32), os.urandom(32)
    weights = torch.zeros(2 * CHUNK // 4, dtype=torch.int32)  # two chunks, never written by the workload
    kv = torch.zeros(CHUNK // 4, dtype=torch.int32)  # written by every request: the hot region
    src = _engine(image_key, freezer=SafePointGate())
    src.track_tensor("w", weights)
    src.track_tensor("kv", kv)
    out = {"w": torch.full_like(weights, -1), "kv": torch.full_like(kv, -1)}
    readiness: list[tuple[bool, torch.Tensor]] = []
    gate = SafePointGate(ready=False)  # a target awaiting its restore

    def set_ready(ready: bool) -> None:
        readiness.append((ready, out["w"].clone()))
        gate.set_ready(ready)

    tgt = _engine(image_key, freezer=gate, set_ready=set_ready)
    tgt.track_tensor("w", out["w"])
    tgt.track_tensor("kv", out["kv"])
    servers = [serve(src, key=control_key), serve(tgt, key=control_key)]
    worlds = [World([s.address], key=control_key) for s in servers]
    try:
        yield (
            Side(src, {"w": weights, "kv": kv}, worlds[0]),
            Side(tgt, out, worlds[1], readiness),
        )
    finally:
        for w in worlds:
            w.close()
        for s in servers:
            s.stop()
        src.close()
        tgt.close()


def _precopied(src: Side, tgt: Side, store: str) -> None:
    """Round 1 (everything), the hot state changes, round 2 (it alone): each pre-loaded into the target."""
    for _ in range(2):
        live = src.world.precopy_ranks(store, {})
        tgt.world.restore_ranks(store, live["image"]["id"], {}, ready=False)
        src.tensors["kv"].add_(1)


def _plant_collision(weights: torch.Tensor) -> torch.Tensor:
    """Change chunk 0 of ``weights`` so that its fingerprint stays the same; the bytes it now holds."""
    before = fingerprint_chunks(byte_view(weights), CHUNK).tolist()
    for p, d in zip(POSITIONS, colliding_change(POSITIONS), strict=True):
        weights[p] = d
    assert fingerprint_chunks(byte_view(weights), CHUNK).tolist() == before  # the fingerprint cannot see it
    return weights.clone()


def test_the_confirmation_catches_a_collision_after_the_final_returned_and_the_target_is_ready_only_with_it(
    pair: tuple[Side, Side], store_url: str
) -> None:
    src, tgt = pair
    _precopied(src, tgt, store_url)
    planted = _plant_collision(src.tensors["w"])
    src.world.freeze_ranks(lease_s=60)
    final = src.world.final_ranks(store_url, {}, confirm="later")
    assert final["confirmation"] == "pending"  # the weights (cold) were still being hashed
    assert final["ranks"][0]["stats"]["chunks_dirty"] == 1  # the hot kv chunk, confirmed and shipped before it

    done = restore_and_ready(src.world, tgt.world, store_url, {}, final)

    verdict = done["verdict"]
    assert verdict["follow_up"] and verdict["caught"] == 1
    follow_up = verdict["image"]
    assert follow_up["parent"] == final["image"]["id"]  # a child of the round's image, shipping the caught chunk
    # only that chunk moved (and the safe point's progress blob: a blob is read at every load)
    assert done["follow_up_restored"]["ranks"][0]["chunks_loaded"] == 2
    assert src.engine.fingerprint_collisions == 1
    assert torch.equal(tgt.tensors["w"], planted) and torch.equal(tgt.tensors["kv"], src.tensors["kv"])
    # The target's workload was told unready at the first restore and ready once, holding the caught chunk by then.
    assert [ready for ready, _ in tgt.readiness][-2:] == [False, True]
    assert all(not ready for ready, _ in tgt.readiness[:-1])
    assert torch.equal(tgt.readiness[-1][1], planted)
    assert tgt.engine.ready is True and tgt.engine.last_image is not None
    assert tgt.engine.last_image.id == follow_up["id"]


def test_without_a_catch_the_target_reports_ready_on_the_rounds_image_loading_nothing_more(
    pair: tuple[Side, Side], store_url: str
) -> None:
    src, tgt = pair
    _precopied(src, tgt, store_url)
    src.world.freeze_ranks(lease_s=60)
    final = src.world.final_ranks(store_url, {}, confirm="later")
    assert final["confirmation"] == "pending"
    seen_pending: list[bool] = []
    original = tgt.engine.loader.set_ready

    def set_ready(ready: bool) -> None:  # the source's verdict must be taken before the target serves
        if ready:
            seen_pending.append(src.engine.capture.pending is not None)
        assert original is not None
        original(ready)

    tgt.engine.loader.set_ready = set_ready
    done = restore_and_ready(src.world, tgt.world, store_url, {}, final)
    assert done["verdict"]["follow_up"] is False and done["verdict"]["caught"] == 0
    assert done["restored"]["ranks"][0]["ready"] is False and done["ready"][0]["ready"] is True
    assert seen_pending == [False]
    assert all(torch.equal(tgt.tensors[k], src.tensors[k]) for k in src.tensors)
    assert tgt.engine.ready is True and src.engine.info()["confirmation"]["pending"] is False


def test_a_resume_before_the_verdict_takes_it_first_and_the_verdict_is_still_given(
    pair: tuple[Side, Side], store_url: str
) -> None:
    """The undo path: the source resumes right after an early final (a rollback); the confirmation ends while the
    weights are still frozen, ships its follow-up, and ``confirmed`` answers for the round afterwards."""
    src, tgt = pair
    _precopied(src, tgt, store_url)
    planted = _plant_collision(src.tensors["w"])
    src.world.freeze_ranks(lease_s=60)
    final = src.world.final_ranks(store_url, {}, confirm="later")
    src.world.resume_ranks()
    assert src.engine.capture.pending is None and src.engine.frozen is False
    src.tensors["w"].fill_(7)  # the workload runs on and writes: after the verdict, it cannot reach the image
    verdict = src.world.confirmed_ranks([final["image"]["id"]])[0]
    assert verdict["follow_up"] and verdict["caught"] == 1
    # the hot chunk the round shipped has the fingerprint of its bytes recorded (at the verdict, still frozen)
    kv_fps = src.engine.capture.shipped["kv"].fingerprints
    assert kv_fps == fingerprint_chunks(byte_view(src.tensors["kv"]), CHUNK).tolist()
    tgt.world.restore_ranks(store_url, verdict["image"]["id"], {}, ready=True)
    assert torch.equal(tgt.tensors["w"], planted)
    # the next round, after the rollback, starts from the follow-up: it ships what the workload changed since
    again = src.world.precopy_ranks(store_url, {})
    assert again["image"]["parent"] == verdict["image"]["id"]
    tgt.world.restore_ranks(store_url, again["image"]["id"], {}, ready=True)
    assert all(torch.equal(tgt.tensors[k], src.tensors[k]) for k in src.tensors)


def test_the_verdict_and_ready_are_refused_for_images_they_do_not_hold(pair: tuple[Side, Side], store_url: str) -> None:
    src, tgt = pair
    _precopied(src, tgt, store_url)
    with pytest.raises(SnapshotError, match="no final round"):
        src.world.confirmed_ranks(["0" * 64])
    src.world.freeze_ranks(lease_s=60)
    final = src.world.final_ranks(store_url, {}, confirm="later")
    with pytest.raises(SnapshotError, match="is not this agent's last final round"):
        src.world.confirmed_ranks(["0" * 64])
    with pytest.raises(SnapshotError, match="was not loaded here unready"):
        tgt.world.ready_ranks(final["image"]["id"])  # the target holds round 2's pre-load, not the final image
    assert tgt.engine.ready is False
    src.world.resume_ranks()


def test_a_plain_final_confirms_everything_before_it_commits(pair: tuple[Side, Side], store_url: str) -> None:
    src, tgt = pair
    _precopied(src, tgt, store_url)
    planted = _plant_collision(src.tensors["w"])
    src.world.freeze_ranks(lease_s=60)
    final = src.world.final_ranks(store_url, {})
    assert final["confirmation"] == "confirmed" and final["ranks"][0]["stats"]["chunks_dirty"] == 2
    verdict = src.world.confirmed_ranks([final["image"]["id"]])[0]
    assert verdict["follow_up"] is False and verdict["deferred"] is False
    tgt.world.restore_ranks(store_url, final["image"]["id"], {}, ready=True)
    assert torch.equal(tgt.tensors["w"], planted)


def test_a_lease_running_out_before_the_verdict_takes_it_before_the_workload_runs(
    pair: tuple[Side, Side], store_url: str
) -> None:
    """An orchestrator gone after an early final: the lease resumes the source, the verdict (and its follow-up)
    taken first, while the bytes are still the frozen ones."""
    src, tgt = pair
    _precopied(src, tgt, store_url)
    planted = _plant_collision(src.tensors["w"])
    src.world.freeze_ranks(lease_s=0.5)
    final = src.world.final_ranks(store_url, {}, confirm="later")
    deadline = time.monotonic() + 30
    while src.engine.frozen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not src.engine.frozen, "the lease did not resume the source within 30 s"
    assert src.engine.lease.expiries == 1 and src.engine.capture.pending is None
    verdict = src.world.confirmed_ranks([final["image"]["id"]])[0]
    assert verdict["follow_up"] and verdict["caught"] == 1
    tgt.world.restore_ranks(store_url, verdict["image"]["id"], {}, ready=True)
    assert torch.equal(tgt.tensors["w"], planted)
