"""The LLM engine's state through the SDK's real capture and restore, in one process: two engines, two snapshot
engines, the transfer engine's writer and reader over a file store.

The KV cache is tracked with its written-ranges report (``attach(written=...)``): a round ships exactly the chunks
the rows written since the last round touch, and the target's cache, pre-loaded and then given the final delta, is
the source's bit for bit. The engine's requests travel through the in-flight hooks (``InFlight``): captured at the
freeze between two decode steps, restored on the target before it is ready, set aside on the source and taken back
on a rollback; every text equals an unmigrated control run's, stop sequences across the cut included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_support import Job, control_run, engine, jobs, pause_at_step, straddling_plan, submit_all, wait_for

from gpumigrate import transfer
from gpumigrate.interfaces import ImageReader, ImageWriter
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.workloads.llm.engine import Engine
from gpumigrate.workloads.llm.handover import Handover
from gpumigrate.workloads.llm.migration import EngineWork
from gpumigrate.workloads.llm.model import build_model, encode

KEY = bytes.fromhex(transfer.generate_key())  # images are sealed and signed, as every image is
CHUNK = 64 << 10  # small chunks, so that a tiny cache's rows fall in many of them
CUT = 14  # the engine stops here (its on_boundary hook), the migration's freeze lands at this boundary


@dataclass
class Side:
    engine: Engine
    gate: SafePointGate
    snap: SnapshotEngine
    work: EngineWork

    def close(self) -> None:
        self.snap.close()
        self.engine.close()


def _side(store: Path, *, target: bool, device: str = "cpu") -> Side:
    def writer(store_url: str, key_ref: Any, parent: str | None, **_: Any) -> ImageWriter:
        return transfer.open_writer(store_url, key=KEY, parent=parent, chunk_size=CHUNK, parallelism=2)

    def reader(store_url: str, image_id: str, key_ref: Any) -> ImageReader:
        return transfer.open_reader(store_url, image_id, key=KEY)

    model = build_model(0, "tiny", device=device, load_weights=not target)
    e = engine(model)
    gate = SafePointGate(ready=not target)
    e.step_guard = lambda: gate.safe_point(None)
    snap = SnapshotEngine(writer_factory=writer, reader_factory=reader, freezer=gate, set_ready=gate.set_ready)
    snap.track_module("model", model)
    snap.track_tensors("state", {"kv": e.cache.kv})
    snap.track_written("state/kv", e.cache.take_written)
    work = EngineWork(e, Handover(e, b"k" * 32, claim_timeout_s=600))
    snap.track_work(work)
    return Side(e, gate, snap, work)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Side, Side, str]]:
    source, target = _side(tmp_path, target=False), _side(tmp_path, target=True)
    yield source, target, f"file://{tmp_path / 'store'}"
    source.close()
    target.close()


@pytest.fixture
def cuda_pair(tmp_path: Path) -> Iterator[tuple[Side, Side, str]]:
    source, target = _side(tmp_path, target=False, device="cuda"), _side(tmp_path, target=True, device="cuda")
    yield source, target, f"file://{tmp_path / 'store'}"
    source.close()
    target.close()


def _round(side: Side, store: str, *, final: bool = False) -> tuple[Any, str]:
    w = side.snap.open_writer(store, {}, None)
    done = side.snap.capture_final(w) if final else side.snap.capture_round(w)
    return done.stats, done.image.id


def _load(side: Side, store: str, image: str, *, ready: bool) -> dict[str, Any]:
    assert side.snap.reader_factory is not None
    return side.snap.load(side.snap.reader_factory(store, image, {}), ready=ready)


def _kv_ids(store: str, image: str) -> list[str]:
    reader = transfer.open_reader(store, image, key=KEY)
    ids: list[str] = reader.metadata()["snapshot"]["chunks"]["state/kv"]
    return ids


def _stop_at(e: Engine, step: int) -> None:
    e.on_boundary[:] = [pause_at_step(step)]
    e.resume()
    wait_for(lambda: e.steps == step and e.parked, f"the engine to stop at step {step}")


def test_kv_deltas_ship_only_the_chunks_written_and_the_target_continues_exactly(
    pair: tuple[Side, Side, str],
) -> None:
    source, target, store = pair
    js, stops = straddling_plan(CUT)
    expected = {o.id: o.text for o in control_run(js)}
    src = source.engine
    src.on_boundary.append(pause_at_step(4))
    submit_all(src, js[:10])
    wait_for(lambda: src.steps == 4 and src.parked, "the source to stop at step 4")
    _, first = _round(source, store)  # the first round ships everything
    _load(target, store, first, ready=False)  # pre-loaded: the target stays unready

    _stop_at(src, CUT - 3)
    kv_before = src.cache.kv.clone()
    stats, second = _round(source, store)  # a live round: the rows of steps 4..CUT-3, nothing else
    _load(target, store, second, ready=False)

    _stop_at(src, CUT)
    for i, j in enumerate(js[10:], start=10):  # arrive at the freeze: they travel in the inbox
        src.submit(encode(j.prompt), j.params, request_id=f"req-{i}")
    source.snap.park(600)  # the freeze: between two decode steps
    final_stats, final = _round(source, store, final=True)
    assert src.stats()["aside"] and not src.stats()["running"]  # sealed: set aside, slots kept

    # The final round shipped exactly the KV chunks whose bytes changed since the second round.
    flat_before, flat_now = kv_before.view(-1).view(torch.uint8), src.cache.kv.view(-1).view(torch.uint8)
    changed = {
        i for i in range(len(_kv_ids(store, final))) if not torch.equal(flat_before[i * CHUNK : (i + 1) * CHUNK],
                                                                       flat_now[i * CHUNK : (i + 1) * CHUNK])
    }  # fmt: skip
    ids2, ids3 = _kv_ids(store, second), _kv_ids(store, final)
    assert {i for i, (a, b) in enumerate(zip(ids2, ids3, strict=True)) if a != b} == changed
    assert 0 < len(changed) < len(ids3) // 2
    assert final_stats.bytes_dirty < (len(changed) + 8) * CHUNK  # the cache's delta and a few small blobs

    target.engine.pause()  # hold the target's loop to compare its cache before it steps
    restored = _load(target, store, final, ready=True)
    assert restored["chunks_loaded"] < len(ids3)  # only what the final image changed
    assert torch.equal(target.engine.cache.kv, src.cache.kv)
    assert target.gate.ready and sorted(target.engine.stats()["arrived"]) == ["req-10", "req-11"]
    target.engine.resume()
    source.snap.unpark()  # the source serves on; its requests wait aside
    source.snap.hand_over("http://target.example:1")
    assert not src.stats()["aside"] and src.cache.free_slots == src.cache.slots
    outs = target.engine.outputs
    wait_for(lambda: all(outs[f"req-{i}"].done for i in range(12)), "the target to finish every request")
    assert {f"req-{i}": outs[f"req-{i}"].text for i in range(12)} == expected
    for rid, stop in stops.items():  # stopped right: the stop sequence never shows, the text ends before it
        assert outs[rid].finish_reason == "stop" and stop not in outs[rid].text


def test_a_rollback_takes_the_work_back_and_every_request_goes_on_where_it_stopped(
    pair: tuple[Side, Side, str],
) -> None:
    source, _, store = pair
    js: list[Job] = jobs(6, tokens=60)  # two slots stay free: the requests set aside keep theirs
    late_job = Job("A request after the final image.", js[0].params)
    expected = {o.id: o.text for o in control_run(js)}
    late_expected = control_run([late_job])[0].text
    src = source.engine
    src.on_boundary.append(pause_at_step(CUT))
    outs = submit_all(src, js)
    wait_for(lambda: src.steps == CUT and src.parked, f"the source to stop at step {CUT}")
    source.snap.park(600)
    _round(source, store, final=True)
    assert len(src.stats()["aside"]) == 6
    source.snap.unpark()  # the source serves on while its work waits for a hand-over
    src.on_boundary.clear()
    src.resume()
    late = src.submit(encode(late_job.prompt), late_job.params, request_id="late")
    wait_for(lambda: late.done, "the source to serve a request that arrived after the final image")
    assert late.text == late_expected and not any(o.done for o in outs)  # the work set aside does not advance
    assert source.snap.take_back()["taken_back"] is True  # the migration gave up
    assert source.snap.take_back()["taken_back"] is False  # idempotent
    wait_for(lambda: all(o.done for o in outs), "the source to finish its requests")
    assert {o.id: o.text for o in outs} == expected
    assert source.snap.hand_over("http://t:1")["handed_over"] is False  # nothing is held any more


def test_the_engine_decodes_through_a_live_round_and_the_final_round_ships_what_it_wrote_meanwhile(
    pair: tuple[Side, Side, str],
) -> None:
    """Only the freeze stops decoding: while a live round is in progress (inside it, at its written-ranges report,
    the workload's own callable) the engine takes further steps; the frozen round sees none. The rows those steps
    wrote after the live round took its ranges reach the target through the final round, bit for bit."""
    _decode_through_a_live_round(*pair)


@pytest.mark.gpu
def test_on_cuda_the_engine_decodes_through_a_live_round(cuda_pair: tuple[Side, Side, str]) -> None:
    """The same on a GPU, where the round waits for the device (``settle``) and copies beside the decode kernels."""
    _decode_through_a_live_round(*cuda_pair)


def _decode_through_a_live_round(source: Side, target: Side, store: str) -> None:
    src = source.engine
    submit_all(src, jobs(4, tokens=300))
    wait_for(lambda: src.steps >= 3, "the source to decode")
    _, first = _round(source, store)  # the first round ships everything
    _load(target, store, first, ready=False)

    seen: list[tuple[bool, int, int]] = []  # (frozen, steps when the round took its ranges, steps when it returned)

    def report_after_steps() -> list[tuple[int, int]]:
        frozen, taken = source.snap.frozen, src.steps
        if not frozen:  # a live round waits, in progress, for the engine to step on beside it
            deadline = time.monotonic() + 120
            while src.steps < taken + 5 and time.monotonic() < deadline:
                time.sleep(0.005)
        ranges = src.cache.take_written()
        seen.append((frozen, taken, src.steps))
        return ranges

    source.snap.track_written("state/kv", report_after_steps)
    _, second = _round(source, store)
    frozen, taken, after = seen[-1]
    assert not frozen and after >= taken + 5, f"the engine took {after - taken} step(s) during a live round, not 5"
    _load(target, store, second, ready=False)

    wait_for(lambda: src.steps >= after + 3, "the source to decode after the live round")
    source.snap.park(600)  # the freeze: between two decode steps
    parked_at = src.steps
    _, final = _round(source, store, final=True)
    assert seen[-1][0] and src.steps == parked_at  # frozen: the final round read a cache no step was writing
    target.engine.pause()
    _load(target, store, final, ready=True)
    assert torch.equal(target.engine.cache.kv, src.cache.kv)  # the rows written during and after the live round
    source.snap.unpark()
    source.snap.hand_over("http://target.example:1")
