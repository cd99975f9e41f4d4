"""The plan's transfer bounds reach the capture in the workload: the sealing threads, the bytes per second, the
pacing (gpumigrate/bounds.py → the flow's writer options → the agent's wire → the SDK's writer, transfer/pacing.py);
a frozen round is not bounded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpumigrate.agent as gm
from gpumigrate.bounds import TransferBounds
from gpumigrate.plan import Transfer
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.transfer.direct import WORKERS
from gpumigrate.transfer.stores.file import FileStore

MiB = 1 << 20
THREADS = 3 if WORKERS != 3 else 2  # the plan's: never the default pool's count (one per core), so it shows


class StoreWrites:
    """Which threads store chunks, and how many at once (the real file store does the writing)."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.most_at_once = 0
        self._now = 0
        self._lock = threading.Lock()

    def spy(self, put_chunk: Any) -> Any:
        def put(store: FileStore, chunk_id: str, blob: Any) -> None:
            with self._lock:
                self.threads.add(threading.current_thread().name)
                self._now += 1
                self.most_at_once = max(self.most_at_once, self._now)
            try:
                put_chunk(store, chunk_id, blob)
            finally:
                with self._lock:
                    self._now -= 1

        return put


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreWrites]:
    seen = StoreWrites()
    monkeypatch.setattr(FileStore, "put_chunk", seen.spy(FileStore.put_chunk))
    yield seen


def test_the_plans_parallelism_and_rate_limit_reach_the_capture(
    store: tuple[str, dict[str, str]], writes: StoreWrites
) -> None:
    url, key_ref = store
    plan = Transfer(store=url, parallelism=THREADS, rate_limit="4MiB/s", pacing="off", compression="none")
    # what the flow sends with each round (flows/context.py builds the same from the plan)
    options = {"compression": plan.compression, **plan.bounds().options()}
    tensors = {f"w{i}": torch.randn(MiB // 4) for i in range(8)}  # eight chunks of 1 MiB
    handle = gm.attach(tensors)
    with AgentClient(handle.address) as c:
        stats = c.call("precopy", store=url, key_ref=key_ref, options=options)["stats"]
    assert stats["pacing"] == {"mode": "off", "rate_limit": 4 * MiB}
    # 8 MiB at 4 MiB/s: the first chunk passes at once, each of the other seven waits its turn (a lower bound: a
    # loaded machine only makes the round longer)
    assert stats["seconds"] >= 7 / 4
    assert writes.threads and all(name.startswith(f"gm-direct{THREADS}_") for name in writes.threads)
    assert writes.most_at_once <= THREADS


def test_a_frozen_round_takes_every_core_and_no_cap(store: tuple[str, dict[str, str]], writes: StoreWrites) -> None:
    url, key_ref = store
    options = {"compression": "none", **TransferBounds(THREADS, 4 * MiB, "adaptive").options()}
    handle = gm.attach({f"w{i}": torch.randn(MiB // 4) for i in range(8)})
    with AgentClient(handle.address) as c:
        c.call("freeze")
        final = c.call("final", store=url, key_ref=key_ref, options=options)["stats"]
        c.call("resume")
    assert final["pacing"] == {}  # the source serves nobody while frozen: nothing to yield to
    assert writes.threads and all(name.startswith(f"gm-direct{WORKERS}_") for name in writes.threads)


def test_a_paced_round_reads_the_sources_own_requests(store: tuple[str, dict[str, str]]) -> None:
    """Adaptive pacing with the SDK's real signal: the requests through the safe point before the round set its base
    latency, which the round's report gives."""
    url, key_ref = store
    handle = gm.attach({f"w{i}": torch.randn(MiB // 4) for i in range(4)})
    for _ in range(8):
        with handle.safe_point():
            torch.randn(64, 64).sum()
    with AgentClient(handle.address) as c:
        stats = c.call("precopy", store=url, key_ref=key_ref, options={"pacing": "adaptive"})["stats"]
    pacing = stats["pacing"]
    assert pacing["mode"] == "adaptive" and pacing["base_latency_ms"] is not None and pacing["base_latency_ms"] > 0
    with AgentClient(handle.address) as c:  # the image is whole
        assert c.call("info")["rounds"] == 1


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"parallelism": 99}, "options: parallelism 99: must be a whole number from 1 to 64"),
        ({"rate_limit": "fast"}, "not a rate"),
        ({"pacing": "gentle"}, "pacing 'gentle': allowed are adaptive, off"),
        ({"speed": 1}, "options may hold compression, pacing, parallelism, rate_limit and nothing else"),
    ],
)
def test_bad_bounds_are_refused_before_anything_moves(
    store: tuple[str, dict[str, str]], options: dict[str, Any], says: str
) -> None:
    from gpumigrate.errors import SnapshotError

    url, key_ref = store
    handle = gm.attach({"w": torch.zeros(4)})
    with AgentClient(handle.address) as c, pytest.raises(SnapshotError, match=says):
        c.call("precopy", store=url, key_ref=key_ref, options=options)
    with AgentClient(handle.address) as c:
        assert c.call("info")["rounds"] == 0
