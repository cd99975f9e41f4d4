"""The final restore after a pre-load: what it may skip, what it must load again, what it refuses, and the work it
leaves until after its reply (the reader's release, the cyclic collector)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from gpumigrate.snapshot import environment, gchold
from gpumigrate.snapshot import server as server_module
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.errors import EnvironmentMismatchError, ImageMismatchError
from gpumigrate.snapshot.server import serve
from gpumigrate.snapshot.server_commands import restore_from
from tests.support.memimage import MemoryReader, MemoryStore

KEY = b"f" * 32
CS = 16 << 10  # 16 KiB chunks


def _chain(store: MemoryStore, live: dict[str, torch.Tensor], *, cs: int = CS) -> list[str]:
    """Two rounds of a source over ``live`` (a few words changed between them): the image ids."""
    src = SnapshotEngine(workers=1)
    src.track_tensors("m", live)
    src.capture_round(store.writer(KEY, chunk_size=cs))
    first = src.last_image
    live["w"][5] = 42.0
    src.park()
    src.capture_round(store.writer(KEY, chunk_size=cs))
    assert first is not None and src.last_image is not None
    return [first.id, src.last_image.id]


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(32 * 1024, generator=g), "b": torch.randn(4 * 1024, generator=g)}  # 8 + 1 chunks


def _target(tensors: dict[str, torch.Tensor], **kwargs: Any) -> SnapshotEngine:
    dst = SnapshotEngine(workers=1, **kwargs)
    dst.track_tensors("m", lambda: tensors)  # read at each restore: a replaced tensor is seen
    return dst


def test_the_final_restore_loads_only_what_changed_since_the_preload() -> None:
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    out = {k: torch.zeros_like(v) for k, v in live.items()}
    dst = _target(out)
    assert dst.load(store.reader(pre, KEY), ready=False)["chunks_loaded"] == 9
    done = dst.load(store.reader(final, KEY))
    assert (done["chunks_loaded"], done["chunks_skipped"]) == (1, 8)
    assert all(torch.equal(out[k], live[k]) for k in live)
    # ready: the pre-load is forgotten (the target may have served); a next restore loads everything again
    assert dst.load(store.reader(final, KEY))["chunks_loaded"] == 9


def test_a_tensor_reallocated_after_the_preload_is_loaded_whole() -> None:
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    out = {k: torch.zeros_like(v) for k, v in live.items()}
    dst = _target(out)
    dst.load(store.reader(pre, KEY), ready=False)
    out["b"] = torch.zeros_like(live["b"])  # same name, dtype and shape; new memory that holds nothing yet
    done = dst.load(store.reader(final, KEY))
    assert (done["chunks_loaded"], done["chunks_skipped"]) == (2, 7)  # all of b, and w's changed chunk
    assert all(torch.equal(out[k], live[k]) for k in live)


def test_a_dtype_or_shape_changed_after_the_preload_is_refused() -> None:
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    for changed in (torch.zeros(4 * 1024, dtype=torch.float64), torch.zeros(2, 2 * 1024)):
        out = {k: torch.zeros_like(v) for k, v in live.items()}
        dst = _target(out)
        dst.load(store.reader(pre, KEY), ready=False)
        out["b"] = changed
        with pytest.raises(ImageMismatchError, match="m/b"):
            dst.load(store.reader(final, KEY))


def test_another_image_chain_or_chunk_size_loads_what_its_ids_say() -> None:
    store, live = MemoryStore(), _source()
    pre, _ = _chain(store, live)
    other = {k: v + 1 for k, v in live.items()}  # another source's state: every id differs
    _, other_final = _chain(store, other)
    out = {k: torch.zeros_like(v) for k, v in live.items()}
    dst = _target(out)
    dst.load(store.reader(pre, KEY), ready=False)
    assert dst.load(store.reader(other_final, KEY))["chunks_loaded"] == 9
    assert all(torch.equal(out[k], other[k]) for k in other)
    # a pre-load in 16 KiB chunks, then an image of the same bytes in 8 KiB chunks: no id compares across sizes
    _, halves = _chain(store, {k: v.clone() for k, v in live.items()}, cs=8 << 10)
    dst = _target(out)
    dst.load(store.reader(pre, KEY), ready=False)
    assert dst.load(store.reader(halves, KEY))["chunks_skipped"] == 0


def test_a_policy_is_checked_at_the_final_restore_as_at_the_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    dst = _target({k: torch.zeros_like(v) for k, v in live.items()})
    policy = {"torch": "must_match"}
    assert dst.load(store.reader(pre, KEY), policy=policy, ready=False)["environment"]["checked"] == {"torch": "match"}
    # this host's torch is another one now (as on a target host that differs): the final restore checks again
    monkeypatch.setattr(environment, "_FACTS", {**environment.env_facts(), "torch": "0.0.1"})
    with pytest.raises(EnvironmentMismatchError, match="torch"):
        dst.load(store.reader(final, KEY), policy=policy)
    assert dst.ready is False
    assert dst.load(store.reader(final, KEY), policy={"torch": "may_differ"})["ready"] is True


def test_release_later_keeps_an_object_until_its_time_then_drops_it() -> None:
    class Big:
        pass

    obj = Big()
    ref = weakref.ref(obj)
    gchold.release_later(obj, after_s=0.2)
    del obj
    assert ref() is not None  # not freed on the caller's thread, at once
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ref() is None


def _served_target(store: MemoryStore, tensors: dict[str, torch.Tensor], opened: list[MemoryReader]) -> SnapshotEngine:
    def reader(url: str, image_id: str, key_ref: Mapping[str, str]) -> MemoryReader:
        opened.append(store.reader(image_id, KEY))
        return opened[-1]

    dst = SnapshotEngine(workers=1, reader_factory=reader)
    dst.track_tensors("m", tensors)
    return dst


def test_the_ready_restore_frees_its_reader_after_it_returns_not_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gchold, "RELEASE_AFTER_S", 0.2)
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    opened: list[MemoryReader] = []
    dst = _served_target(store, {k: torch.zeros_like(v) for k, v in live.items()}, opened)
    restore_from(dst, store.url, pre, {}, ready=False)
    ref = weakref.ref(opened.pop())
    assert ref() is None  # a pre-load's reader goes at once: later, it could land inside the final restore
    restore_from(dst, store.url, final, {})
    ref = weakref.ref(opened.pop())
    assert ref() is not None
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ref() is None


def test_a_restore_over_the_control_channel_keeps_the_collector_off_until_its_reply_is_signed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, live = MemoryStore(), _source()
    pre, final = _chain(store, live)
    dst = _served_target(store, {k: torch.zeros_like(v) for k, v in live.items()}, [])
    collector: dict[str, bool] = {}
    sign = server_module.control.sign_reply

    def observed(key: bytes, channel: str, nonce: str, body: Mapping[str, Any]) -> dict[str, Any]:
        result = body.get("result")
        command = "restore" if isinstance(result, Mapping) and "chunks_loaded" in result else "other"
        collector[command] = gc.isenabled()
        return sign(key, channel, nonce, body)

    monkeypatch.setattr(server_module.control, "sign_reply", observed)
    assert gc.isenabled()
    key = b"c" * 32
    server = serve(dst, key=key)
    try:
        with AgentClient(server.address, key=key) as client:
            client.call("restore", store=store.url, image_id=pre, key_ref={}, ready=False)
            assert client.call("restore", store=store.url, image_id=final, key_ref={})["ready"] is True
            client.call("ping")
    finally:
        server.stop()
    assert collector == {"restore": False, "other": True}
    assert gc.isenabled()  # and on again once the reply is out
