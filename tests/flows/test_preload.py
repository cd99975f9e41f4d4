"""The pre-loaded target through the migrate flow: the reference inference server on a local host, the real
agent on both sides, a real front door.

Each live pre-copy round is loaded into the target while the source serves (the target stays unready),
so the restore phase loads only what the final image changed. A target lost during the pre-copy fails
the migration with the round's image named; the source, never frozen, serves on.

The fixtures (tests/flows/conftest.py) give both tests one source; the completed migration retires it,
so that test runs last.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

WORKLOAD = "preload-lm"
# 1 MiB of device state that every request changes (as a KV cache would): the final image has a dirty set.
SOURCE_ARGS = ("--mutable-mb", "1")


def events(home: Path, mid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (home / "migrations" / mid / "audit.jsonl").read_text().splitlines()]


def runtime(home: Path, mid: str) -> dict[str, Any]:
    try:
        return dict(json.loads((home / "migrations" / mid / "state.json").read_text()).get("runtime") or {})
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def info(endpoint: str) -> dict[str, Any]:
    reply = httpx.get(endpoint + "/v1/info", timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def serves(url: str) -> bool:
    try:
        reply = httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=10)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def watch_ready(home: Path, mid: str, stop: threading.Event, seen: dict[str, float]) -> None:
    """Record when the target's ready path first answered 200 (epoch seconds), from the moment it exists."""
    while not stop.is_set() and "ready" not in seen:
        endpoint = runtime(home, mid).get("target_endpoint")
        if endpoint:
            try:
                if httpx.get(endpoint + "/readyz", timeout=2).status_code == 200:
                    seen["ready"] = time.time()
            except httpx.HTTPError:
                pass
        time.sleep(0.02)


def test_a_target_killed_during_pre_copy_fails_the_migration_and_the_source_serves_on(
    inference_source: Any, inference_plan: Any, prefect_api: str, tmp_path: Path
) -> None:
    """The target's workload dies once the first round is written: its pre-load fails, the migration fails
    naming the image, the target is torn down, and the source (never frozen) serves every request."""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.events import listening
    from gpumigrate.flows.migrate import migrate_flow
    from gpumigrate.infra.launch import accepts
    from gpumigrate.traffic.loadgen import LoadProcess
    from gpumigrate.traffic.state import StateStore

    src = inference_source
    plan = inference_plan(src, tmp_path / "plan.yaml", target="preload-tgt-killed", snapshot={"precopy_rounds": 2})
    ctx = RunContext.create(plan, migration_id="preload-killed", resume=False)
    killed: list[int] = []

    def kill_target(event: str, data: dict[str, Any]) -> None:
        if event != "snapshot.precopy" or killed:
            return
        host = ctx.runtime.target_host
        assert host is not None
        pid = int(host.meta["workload"]["pid"])
        src.provider.signal(host, pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while accepts(host.address, host.ports["agent"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append(pid)

    lp = LoadProcess(src.door.url + "/v1/generate", rps=20, seconds=120)
    try:
        with listening(ctx.migration.id, kill_target):
            state = migrate_flow(migration_id=ctx.migration.id, return_state=True)
    finally:
        lp.stop()
        report = lp.wait()
    out = state.result(raise_on_failure=False)
    assert killed, "the target was never killed: no pre-copy round ran"
    assert out["status"] == "failed", out
    assert "pre-load of pre-copy image" in out["error"] and "preload-tgt-killed" in out["error"], out["error"]
    names = [r["event"] for r in events(src.home, ctx.migration.id)]
    assert "image.preloaded" not in names and "image.committed" not in names  # never frozen, nothing final
    assert "rollback.target_torn_down" in names
    assert ctx.runtime.source_frozen is False and ctx.runtime.target_torn_down is True
    assert StateStore(src.door.state_dir).read().weights.get("target", 0.0) == 0.0  # no traffic ever moved
    assert report.failed == 0, report.errors  # the source served every request meanwhile
    assert serves(src.endpoint) and serves(src.door.url)


def test_the_final_restore_loads_only_what_the_pre_loads_left(
    inference_source: Any, inference_plan: Any, migrate_under_load: Any, tmp_path: Path
) -> None:
    """Two rounds pre-loaded through a receiver the flow started on the target (it stays up across the
    rounds), then the final restore loads the dirty set only; the target was never ready before it."""
    src = inference_source
    weights = info(src.endpoint)["weights_digest"]
    plan = inference_plan(
        src,
        tmp_path / "plan.yaml",
        target="preload-tgt",
        snapshot={"precopy_rounds": 2},
        transfer={"store": "stream://target", "encryption_key": {"file": str(src.key_file)}, "parallelism": 2},
    )
    mid = "preload-delta"
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(target=watch_ready, args=(src.home, mid, stop, seen), daemon=True)
    watcher.start()
    try:
        out, report = migrate_under_load(src, plan, mid)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", (result["error"], out.stderr[-2000:])
    assert report.failed == 0, report.errors  # the clients never noticed
    assert result["parity"]["passed"] is True

    records = events(src.home, mid)
    names = [r["event"] for r in records]
    preloads = [r["data"] for r in records if r["event"] == "image.preloaded"]
    committed = next(r for r in records if r["event"] == "image.committed")
    restored = next(r["data"] for r in records if r["event"] == "image.restored")
    # One pre-load per live round, each recorded with its image, what it loaded and how long it took.
    assert len(preloads) == committed["data"]["precopy_rounds"] == committed["data"]["preloaded"] == 2
    assert all(p["image_id"] and p["seconds"] >= 0 and p["host"] == "preload-tgt" for p in preloads)
    first, second = preloads
    assert first["chunks_skipped"] == 0 and first["bytes_loaded"] > 0  # the whole first image
    assert second["chunks_skipped"] > 0 and second["bytes_loaded"] < first["bytes_loaded"]  # only what changed
    # The final restore loaded the dirty set (what requests changed since round 2), not the image.
    image = committed["data"]["bytes_image"]
    assert restored["bytes_loaded"] < image and restored["chunks_skipped"] > 0
    assert result["bytes"]["restored"] == restored["bytes_loaded"]
    assert result["bytes"]["preloaded"] == sum(p["bytes_loaded"] for p in preloads)
    assert f"the final restore loaded {restored['bytes_loaded']}" in Path(result["report"]).read_text()
    # Never ready before the final restore; the receiver served every round and the final image, then stopped.
    assert "ready" in seen and seen["ready"] > committed["ts"]
    assert names.index("transfer.receiver.stopped") > max(i for i, n in enumerate(names) if n == "image.preloaded")
    # Bit-identical weights on the target (the source's were read before the migration: it is retired now).
    assert info(runtime(src.home, mid)["target_endpoint"])["weights_digest"] == weights
