"""Cleanup that leaves nothing (issue 35, finding 8): `gpumigrate hosts down` and `gpumigrate gc` remove what a
migration wrote (a target host's image store and logs, scratch, a stopped door's files) unless its rollback window
or its audit still needs it, and say what they kept and why; `hosts down` of a host that was not up says so; a
training target's host goes down once its job is done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import HostSpec
from gpumigrate.state import Migration


def _gm(cli_cmd: list[str], home: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "GPUMIGRATE_HOME": str(home)}
    out = subprocess.run([*cli_cmd, *args, "--json"], capture_output=True, text=True, env=env, timeout=120)
    lines = out.stdout.strip().splitlines()
    return out.returncode, json.loads(lines[-1]) if lines else {}, out.stderr


def _target_of(mid: str, host: str, *, status: str, window_s: float | None) -> Migration:
    """A migration record whose target was the local host ``host`` (as the provision phase leaves it)."""
    m = Migration.create(mid, "version: 1\n")
    runtime: dict[str, Any] = {"target_host": {"name": host, "provider": "local", "region": "local-b",
                                               "address": "127.0.0.1", "instance_id": "x"}}  # fmt: skip
    if window_s is not None:
        runtime["rollback_deadline"] = time.time() + window_s

    def change(state: dict[str, Any]) -> None:
        state.update(status=status, runtime=runtime)

    m.mutate(change)
    return m


def _store(home: Path, host: str, mb: int = 2) -> Path:
    """What a migration leaves in its target host's files: the image store, a log per process."""
    store = home / "hosts" / host / "store" / "chunks"
    store.mkdir(parents=True, exist_ok=True)
    (store / "c0").write_bytes(os.urandom(mb * 1_000_000))
    (home / "hosts" / host / "logs").mkdir(exist_ok=True)
    (home / "hosts" / host / "logs" / "workload-1.log").write_text("serving\n")
    return home / "hosts" / host


def test_hosts_down_removes_the_hosts_files_unless_a_rollback_window_needs_them(
    cli_cmd: list[str], gm_home: Path
) -> None:
    provider = LocalProvider(attached=False)
    for name in ("tgt-done", "tgt-window"):
        provider.provision(HostSpec(name=name, provider="local", region="local-b"), migration_id=None)
    done, window = _store(gm_home, "tgt-done"), _store(gm_home, "tgt-window")
    _target_of("m-done", "tgt-done", status="completed", window_s=-1)  # its window is over
    _target_of("m-window", "tgt-window", status="completed", window_s=600)
    code, out, err = _gm(cli_cmd, gm_home, "hosts", "down", "tgt-done", "tgt-window")
    assert code == 0 and out["stopped"] == ["tgt-done", "tgt-window"], err
    assert not done.exists()  # its image store (2 MB) and its logs went with it
    assert "removed hosts/tgt-done (2.0 MB): local host tgt-done's files: image store 2.0 MB, 1 process log" in err
    assert (window / "store" / "chunks" / "c0").exists()
    assert "kept hosts/tgt-window" in err and "migration m-window's rollback window is open until" in err
    # A host that was not up: said so, and its leftovers still judged.
    code, out, err = _gm(cli_cmd, gm_home, "hosts", "down", "tgt-done", "nowhere")
    assert code == 0 and out["not_up"] == ["tgt-done", "nowhere"] and out["stopped"] == []
    assert "tgt-done was not up: nothing to stop" in err and "nowhere was not up" in err and "down tgt-done" not in err


def test_gc_removes_what_nothing_needs_and_keeps_audit_records(cli_cmd: list[str], gm_home: Path) -> None:
    stale = _store(gm_home, "old-target")  # a host that is down, of a migration rolled back long ago
    _target_of("m-old", "old-target", status="rolled_back", window_s=None)
    running = _store(gm_home, "busy-target")
    _target_of("m-run", "busy-target", status="running", window_s=None)
    scratch = gm_home / "migrations" / "m-old" / "criu-dump"
    scratch.mkdir()
    (scratch / "pages-1.img").write_bytes(b"\0" * 1000)
    door = gm_home / "traffic" / "gone-door" / "envoy"
    door.mkdir(parents=True)
    (door / "access-gone.log").write_text('{"start": "1.000", "ms": 1, "code": 200}\n')

    code, out, err = _gm(cli_cmd, gm_home, "gc", "--dry-run")
    assert code == 0 and out["dry_run"] is True and stale.exists() and scratch.exists(), err
    assert "would remove hosts/old-target" in err

    code, out, err = _gm(cli_cmd, gm_home, "gc")
    assert code == 0, err
    assert not stale.exists() and not scratch.exists() and not door.parent.exists()
    assert running.exists() and "migration m-run is running" in err
    assert (gm_home / "migrations" / "m-old" / "audit.jsonl").exists()  # the audit needs the record
    assert "kept migrations/m-old" in err and "the audit record" in err
    assert out["freed_bytes"] >= 2_000_000


def test_a_training_targets_host_goes_down_once_its_job_is_done(gm_home: Path) -> None:
    provider = LocalProvider()
    host = provider.provision(HostSpec(name="train-tgt", provider="local", region="local-b"), migration_id="m1")
    try:
        provider.spawn(host, [sys.executable, "-c", "print('trained to its end')"], name="workload", ends_host=True)
        deadline = time.monotonic() + 60
        while any(h.name == "train-tgt" for h in provider.list_hosts()):
            assert time.monotonic() < deadline, "the host stayed up after its training job ended"
            time.sleep(0.1)
        supervisor = json.loads((gm_home / "hosts" / "train-tgt" / "supervisor.json").read_text())
        assert [c["returncode"] for c in supervisor["children"]] == [0]
    finally:
        provider.terminate("train-tgt")
