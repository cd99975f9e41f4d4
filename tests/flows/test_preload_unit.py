"""flows/preload.py's checks and refusals, each on its own: a real image in a file:// store, a real HTTP
server as the target's ready path, a real listening socket as its agent; the backend is a fake of the
SnapshotBackend Protocol (the real agent's pre-loads go through the flow in tests/flows/test_preload.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.errors import SnapshotError
from gpumigrate.flows import preload
from gpumigrate.flows.context import RunContext
from gpumigrate.interfaces import Host, ImageRef, RegionInfo, Restored, Round, RoundStats, Side
from gpumigrate.snapshot.backends import Setup
from gpumigrate.transfer import generate_key, open_writer, resolve_key

CHUNK = 64 * 1024


@dataclass
class FakeBackend:
    """Scripted rounds; ``preload`` says what a target's agent would (``ready_after``: a broken one)."""

    setup: Setup
    preloads: bool = True
    ready_after: bool = False
    images: list[ImageRef] = field(default_factory=list)  # what each precopy() returns, in turn
    loaded: list[str] = field(default_factory=list)

    name = "fake"
    needs_launch = True
    live_rounds = True

    def precopy(self) -> Round:
        n = len(self.loaded) + 1 if self.preloads else 1
        return Round(RoundStats(n, 4, 4, 0, 0.01), self.images[min(n, len(self.images)) - 1])

    def preload(self, image: ImageRef) -> Restored:
        self.loaded.append(image.id)
        return Restored(image.id, 0.01, bytes_loaded=image.bytes_image, chunks_loaded=4, ready=self.ready_after)

    def check(self) -> dict[str, Any]:
        raise AssertionError("not a preload step")

    def freeze(self, lease_s: float | None = None) -> None:
        raise AssertionError("a pre-load never freezes the source")

    def final(self) -> ImageRef:
        raise AssertionError("not a preload step")

    def resume(self) -> None:
        raise AssertionError("not a preload step")

    def retire(self) -> dict[str, Any]:
        raise AssertionError("not a preload step")

    def restore(self, image: ImageRef | None) -> Restored:
        raise AssertionError("not a preload step")

    def discard(self) -> None:
        raise AssertionError("not a preload step")

    def hand_over(self, target: str) -> dict[str, Any]:
        return {}  # a workload without work in flight hands nothing over

    def take_back(self) -> dict[str, Any]:
        return {}

    def work(self, side: Side) -> dict[str, Any]:
        return {}


@dataclass
class Bench:
    ctx: RunContext
    backend: FakeBackend
    image: ImageRef
    ready: dict[str, int]  # the target's /readyz status

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r["data"] for r in self.ctx.migration.audit.records() if r["event"] == name]


@pytest.fixture
def agent_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def bench(gm_home: Path, tmp_path: Path, json_http: Callable[..., str], agent_port: int) -> Bench:
    ready = {"status": 503}

    def route(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        return (ready["status"], {}) if path == "/readyz" else (200, {})

    target = json_http(route)
    key_file = tmp_path / "image.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    plan = {
        "version": 1,
        "workload": {"name": "svc", "kind": "inference", "source_host": "src", "endpoint": "http://127.0.0.1:9",
                     "agent": "127.0.0.1:7070", "launch": {"argv": ["{python}", "-m", "svc", "--port", "{service_port}"]}},
        "target": {"provider": "local", "region": "local-b", "host": "tgt"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "transfer": {"store": "file://store", "encryption_key": {"file": str(key_file)}},
    }  # fmt: skip
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    ctx = RunContext.create(tmp_path / "plan.yaml", migration_id="m-preload", resume=False)
    host = Host("tgt", "local", "local-b", "127.0.0.1", ports={"agent": agent_port})
    ctx.update(target_host=host, target_agent=f"127.0.0.1:{agent_port}", target_endpoint=target)
    writer = open_writer(ctx.store_url(), key=resolve_key(file=str(key_file)), chunk_size=CHUNK, source="src")
    data = np.arange(CHUNK, dtype=np.float32)  # 4 chunks
    writer.add_region(RegionInfo(name="w", nbytes=data.nbytes, dtype="float32", shape=data.shape, device="cpu"))
    view = memoryview(data).cast("B")
    for i in range(4):
        writer.put_chunk("w", i, view[i * CHUNK : (i + 1) * CHUNK])
    image = writer.commit()
    fake = FakeBackend(Setup(store=ctx.store_url()), images=[image])
    return Bench(ctx, fake, image, ready)


def test_each_round_is_checked_where_the_target_reads_then_loaded_unready_and_recorded(bench: Bench) -> None:
    live = preload.precopy_rounds(bench.ctx, bench.backend, max_rounds=1)
    assert bench.backend.loaded == [bench.image.id] and len(live.preloads) == 1
    verified, loaded = bench.events("image.verified"), bench.events("image.preloaded")
    assert verified[0]["preload"] is True and verified[0]["read_back"] is False and verified[0]["chunks_total"] == 4
    assert loaded[0]["image_id"] == bench.image.id and loaded[0]["bytes_loaded"] == bench.image.bytes_image
    assert loaded[0]["host"] == "tgt" and loaded[0]["seconds"] >= 0
    assert bench.ctx.migration.read()["result"]["bytes"]["preloaded"] == bench.image.bytes_image


def test_a_target_that_answers_ready_after_a_preload_is_refused(bench: Bench) -> None:
    bench.ready["status"] = 200  # its ready path answers although only a pre-copy image is in it
    with pytest.raises(SnapshotError, match="reports ready after the pre-load"):
        preload.preload(bench.ctx, bench.backend, bench.image)
    bench.ready["status"] = 503
    bench.backend.ready_after = True  # or its agent says so
    with pytest.raises(SnapshotError, match="reports ready after the pre-load"):
        preload.preload(bench.ctx, bench.backend, bench.image)
    assert not bench.events("image.preloaded")


def test_an_image_missing_where_the_target_reads_is_never_loaded(bench: Bench) -> None:
    missing = ImageRef("0" * 64, bench.ctx.store_url(), bytes_image=1)
    with pytest.raises(SnapshotError, match=f"pre-load of pre-copy image {'0' * 16} into the target tgt failed"):
        preload.preload(bench.ctx, bench.backend, missing)
    assert bench.backend.loaded == [] and not bench.events("image.preloaded")


def test_no_target_agent_stops_before_the_first_round(bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bench.ctx.update(target_agent=f"127.0.0.1:{port}")
    monkeypatch.setattr(preload, "TARGET_AGENT_WAIT_S", 0.3)
    bench.backend.images = []  # a round would fail the test: the source must not be touched
    with pytest.raises(SnapshotError, match="does not accept connections"):
        preload.precopy_rounds(bench.ctx, bench.backend, max_rounds=2)


def test_a_backend_that_does_not_preload_runs_its_rounds_as_before(bench: Bench) -> None:
    bench.backend.preloads = False
    bench.ctx.update(target_agent=None)  # not even asked for
    live = preload.precopy_rounds(bench.ctx, bench.backend, max_rounds=2)
    assert len(live.convergence.rounds) == 1 and live.preloads == [] and bench.backend.loaded == []
    assert not bench.events("image.verified") and "preloaded" not in bench.ctx.migration.read().get("result", {}).get(
        "bytes", {}
    )


def test_every_ranks_agent_is_waited_for_before_the_first_round(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A world's ranks start their agents one by one (rank r at the first rank's port + r): the first pre-load must
    wait for rank 1's too, not only rank 0's (CI once pre-loaded a 2-rank world whose rank 1 did not listen yet)."""
    import threading

    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    doc["workload"]["ranks"] = 2
    (tmp_path / "plan2.yaml").write_text(yaml.safe_dump(doc))
    ctx = RunContext.create(tmp_path / "plan2.yaml", migration_id="m-preload-ranks", resume=False)
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        base = first.getsockname()[1]
        try:
            second.bind(("127.0.0.1", base + 1))
        except OSError:
            pytest.skip(f"port {base + 1} is taken here: rank 1's port must be rank 0's + 1")
        first.listen()
        ctx.update(target_agent=f"127.0.0.1:{base}")
        monkeypatch.setattr(preload, "TARGET_AGENT_WAIT_S", 0.5)
        with pytest.raises(SnapshotError, match=f"127.0.0.1:{base + 1} does not accept connections"):
            preload.wait_for_target(ctx)  # rank 0 listens, rank 1 not yet
        later = threading.Timer(0.2, second.listen)
        later.start()
        preload.wait_for_target(ctx, timeout_s=30)  # returns once rank 1 listens too
        later.join()
