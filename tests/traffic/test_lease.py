"""The traffic lease (dead man's switch): a ramp that stops renewing loses its split to the source."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumigrate.traffic.loadgen import LoadProcess
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, split
from gpumigrate.traffic.xds import _LEASE_LOOK_S, LeaseWatch

HERE = Path(__file__).resolve().parent
BODY = {"prompt": "hello", "max_new_tokens": 1}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _store(tmp_path: Path, target_weight: float) -> StateStore:
    store = StateStore(tmp_path / "xds")
    ups = {n: Upstream(n, "127.0.0.1", p) for n, p in (("source", 8001), ("target", 8002))}
    store.init(DesiredState(upstreams=ups, weights=split("source", "target", target_weight)))
    return store


def test_renewals_keep_the_split_and_a_lapse_returns_it(tmp_path: Path) -> None:
    store = _store(tmp_path, 25)
    watch = LeaseWatch(store)
    store.renew_lease("ramp A", interval_s=1.0, length_s=3.0, seq=1)
    assert not watch.check(now=100.0)
    for seq, now in ((2, 102.5), (3, 105.0), (4, 107.5)):  # renewed within every 3 s: never lapses
        store.renew_lease("ramp A", interval_s=1.0, length_s=3.0, seq=seq)
        assert not watch.check(now=now)
    assert not watch.check(now=110.4)  # 2.9 s since seq 4 was first seen
    assert store.read().weights == {"source": 75.0, "target": 25.0}
    assert watch.check(now=110.6)  # 3.1 s: lapsed
    state = store.read()
    assert state.weights == {"source": 100.0, "target": 0.0}
    assert state.rolled_back is not None
    assert state.rolled_back["trigger"] == "lease"
    assert state.rolled_back["actor"] == "gpumigrate-control-plane"
    assert "ramp A" in state.rolled_back["reason"] and "(lease 3s)" in state.rolled_back["reason"]
    assert state.rolled_back["lease"]["seq"] == 4
    assert store.lease() is None  # the lease ended with the rollback
    assert not watch.check(now=200.0)


def test_a_lapse_with_no_split_held_changes_no_weight(tmp_path: Path) -> None:
    store = _store(tmp_path, 0)
    version = store.version()
    watch = LeaseWatch(store)
    store.renew_lease("ramp B", interval_s=0.5, length_s=1.0, seq=1)
    watch.check(now=0.0)
    assert watch.check(now=1.5)
    assert store.version() == version and store.read().rolled_back is None
    assert store.lease() is None  # a stale lease cannot later undo a weight a person set by hand


def test_an_unreadable_lease_is_judged_by_the_last_renewal_seen(tmp_path: Path) -> None:
    store = _store(tmp_path, 50)
    watch = LeaseWatch(store)
    store.renew_lease("ramp C", interval_s=1.0, length_s=2.0, seq=1)
    watch.check(now=0.0)
    store.lease_path.write_text("{not json")
    assert not watch.check(now=1.0)
    assert watch.check(now=2.5)
    assert store.read().rolled_back["trigger"] == "lease"


def test_killed_ramp_loses_its_split_within_the_lease(light_env_external: Any, tmp_path: Path) -> None:
    """A real control plane process and a real Envoy; the ramp runs in its own process and is SIGKILLed."""
    env = light_env_external
    interval, intervals = 1.0, 3  # and no floor: a 3 s lease
    load = LoadProcess(env.url, rps=50, seconds=60, body=BODY)
    ramp = subprocess.Popen(
        [sys.executable, str(HERE / "ramp_process.py"), str(env.state_dir), env.envoy.admin_url]
        + [env.envoy.node_id, str(interval), str(intervals), "50"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while env.envoy.admin.live_weights() != {"source": 5000, "target": 5000}:
            assert time.monotonic() < deadline, "the ramp never reached its 50% stage"
            assert ramp.poll() is None, f"the ramp exited with {ramp.returncode}"
            time.sleep(0.05)
        time.sleep(2 * interval * intervals)  # held well past one lease length: renewals keep it
        assert env.store.read().rolled_back is None
        assert env.envoy.admin.live_weights() == {"source": 5000, "target": 5000}
        _kill(ramp)
        last = env.store.lease()  # the last renewal the dead ramp wrote
        assert last is not None and last.holder == "test ramp"
        deadline = time.monotonic() + 30
        while (state := env.store.read()).rolled_back is None:
            assert time.monotonic() < deadline, "the control plane never acted on the lapsed lease"
            time.sleep(0.02)
        env.store.wait_applied(state.version, [env.envoy.node_id])
        assert env.envoy.admin.live_weights() == {"source": 10000}
    finally:
        _kill(ramp)
        load.stop()
    report = load.wait(60)
    rb = state.rolled_back
    assert rb["trigger"] == "lease" and "test ramp" in rb["reason"]
    # Not before the lease ran out, and no later than the watcher's next look after it did.
    silent = rb["ts"] - last.renewed
    assert last.length_s <= silent <= last.length_s + 2 * _LEASE_LOOK_S + 0.3, silent
    assert env.store.lease() is None
    assert rb["reason"] in (tmp_path / "xds.log").read_text()
    assert report.failed == 0, report.errors
