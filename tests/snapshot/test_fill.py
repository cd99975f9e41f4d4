"""A restore filled from the source's memory (``snapshot/fill.py``, ``agent/fill.py``): two real agents with their
control servers, an encrypted file:// image, and NIXL READs between them (host memory, as CI has no GPU; on a
GPU host the same requests lend CUDA IPC handles, tests/transfer/test_nixl_device.py runs that way there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from gpumigrate.errors import PlanError
from gpumigrate.snapshot.errors import SnapshotError
from gpumigrate.snapshot.fill import Run, failed_chunks, runs_arg, runs_of


def test_runs_merge_consecutive_chunks_of_one_region() -> None:
    chunks = [("a", 0), ("a", 1), ("a", 2), ("a", 5), ("b", 0), ("b", 1), ("a", 6)]
    assert runs_of(chunks) == [Run("a", 0, 3), Run("a", 5, 1), Run("b", 0, 2), Run("a", 6, 1)]
    assert failed_chunks(["a@5[0]", "b@0[1]"], runs_of(chunks)) == [("a", 5), ("b", 1)]
    with pytest.raises(SnapshotError, match="no run it was given"):
        failed_chunks(["c@0[0]"], runs_of(chunks))


@pytest.mark.parametrize(
    "bad", [None, [], [["a", -1, 1]], [["a", 0, 0]], [["a", "0", 1]], [[1, 0, 1]], [["a", 0]], [["a", True, 1]]]
)
def test_a_malformed_run_list_is_refused_naming_the_shape(bad: Any) -> None:
    with pytest.raises(SnapshotError, match=r"\[region"):
        runs_arg(bad)


@dataclass
class Pair:
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    src_agent: Any
    tgt_agent: Any
    src_addr: str
    tgt_addr: str
    key: bytes
    state: dict[str, Any]


def _agents(key: bytes, target_key: bytes, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    from gpumigrate.agent.images import make_engine
    from gpumigrate.snapshot.server import serve

    pytest.importorskip("nixl_cu13")  # host memory moves by NIXL READs
    monkeypatch.setenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "1")  # 1 MiB chunks: several per tensor
    g = torch.Generator().manual_seed(3)
    source = {"w": torch.randn(3_000_000, generator=g), "ids": torch.arange(500_000, dtype=torch.int64)}
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    state = {"source": {"step": 7}, "target": {}}
    src, tgt = make_engine(), make_engine()
    src.track_tensors("m", source)
    src.track_state("meta", lambda: state["source"], lambda v: state.__setitem__("source", v))
    tgt.track_tensors("m", target)
    tgt.track_state("meta", lambda: state["target"], lambda v: state.__setitem__("target", v))
    ss, ts = serve(src, key=key), serve(tgt, key=target_key)
    try:
        yield Pair(source, target, src, tgt, ss.address, ts.address, key, state)
    finally:
        ss.stop()
        ts.stop()
        src.close()
        tgt.close()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    key = os.urandom(32)
    yield from _agents(key, key, monkeypatch)


def _image(pair: Pair, store: str, key_env: dict[str, str]) -> str:
    from gpumigrate.snapshot.client import AgentClient

    with AgentClient(pair.src_addr, key=pair.key) as client:
        return client.request_precopy(store, key_env).image.id


def _restore(pair: Pair, store: str, image: str, key_env: dict[str, str], *, ready: bool = True) -> Any:
    from gpumigrate.snapshot.client import AgentClient

    with AgentClient(pair.tgt_addr, key=pair.key) as client:
        return client.request_restore(store, image, key_env, source=pair.src_addr, ready=ready)


def test_the_target_is_filled_from_the_source_and_blobs_come_from_the_image(
    pair: Pair, store_url: str, key_env: dict[str, str]
) -> None:
    image = _image(pair, store_url, key_env)
    pair.state["source"] = {"step": 8}  # the source's blob moved on since its image: the image's one is restored
    done = _restore(pair, store_url, image, key_env)
    assert done.ready is True and pair.tgt_agent.ready is True
    assert all(torch.equal(pair.source[k], pair.target[k]) for k in pair.source)
    assert pair.state["target"] == {"step": 7}
    assert done.from_source["way"] == "pull" and done.from_source["chunks_from_image"] == 0
    assert done.from_source["chunks"] == done.chunks_loaded - 1  # every tensor chunk; the blob's one from the image


def test_chunks_the_source_changed_since_its_image_are_read_from_the_image(
    pair: Pair, store_url: str, key_env: dict[str, str]
) -> None:
    image = _image(pair, store_url, key_env)
    at_image = pair.source["w"].clone()
    pair.source["w"][:10] += 1.0  # chunk 0 of m.w no longer matches the image
    done = _restore(pair, store_url, image, key_env)
    assert torch.equal(pair.target["w"], at_image), "the target holds the image's state, not the changed source's"
    assert done.from_source["chunks_from_image"] == 1


def test_only_the_chunks_the_target_lacks_move_on_the_next_load(
    pair: Pair, store_url: str, key_env: dict[str, str]
) -> None:
    first = _image(pair, store_url, key_env)
    preload = _restore(pair, store_url, first, key_env, ready=False)
    assert preload.ready is False and pair.tgt_agent.ready is False
    pair.source["ids"][-5:] = -1  # the last chunk of m.ids changes; the next image holds it
    second = _image(pair, store_url, key_env)
    done = _restore(pair, store_url, second, key_env)
    # every tensor chunk but the changed one is skipped; the blob is always read from the image
    assert done.from_source["chunks"] == 1 and done.chunks_skipped == preload.from_source["chunks"] - 1
    assert torch.equal(pair.target["ids"], pair.source["ids"])


def test_a_source_holding_another_key_lends_nothing_and_the_target_stays_unready(
    monkeypatch: pytest.MonkeyPatch, store_url: str, key_env: dict[str, str]
) -> None:
    from gpumigrate.control import AuthError
    from gpumigrate.snapshot.client import AgentClient

    pairs = _agents(b"s" * 32, b"t" * 32, monkeypatch)  # the target signs with a key the source does not hold
    pair = next(pairs)
    try:
        with AgentClient(pair.src_addr, key=b"s" * 32) as client:
            image = client.request_precopy(store_url, key_env).image.id
        before = {k: v.clone() for k, v in pair.source.items()}
        # The orchestrator's key cannot prove the source (its hello) nor grant its lend key: nothing is asked of it.
        with AgentClient(pair.tgt_addr, key=b"t" * 32) as client, pytest.raises(AuthError, match=pair.src_addr):
            client.request_restore(store_url, image, key_env, source=pair.src_addr)
        assert pair.tgt_agent.ready is not True
        assert not pair.target["w"].any(), "nothing landed"
        assert all(torch.equal(before[k], pair.source[k]) for k in before)
        assert pair.src_agent.frozen is False
    finally:
        pairs.close()


def test_a_plan_asks_restore_from_source_only_where_the_target_shares_the_source_host() -> None:
    from gpumigrate.plan import parse_plan

    plan = {
        "workload": {"name": "svc", "kind": "inference", "source_host": "a", "endpoint": "http://127.0.0.1:1"},
        "target": {"provider": "aws", "region": "eu-central-1", "instance_type": "g5.xlarge"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["EU"]},
        "snapshot": {"backend": "criu"},
        "transfer": {"store": "s3://gm-images/p", "restore_from": "source"},
    }
    with pytest.raises(
        PlanError, match="transfer.restore_from: source needs snapshot.backend agent and a local target"
    ):
        parse_plan(plan)


@pytest.mark.gpu
def test_on_a_gpu_the_target_copies_the_source_tensors_through_cuda_ipc(tmp_path: Any) -> None:
    """Two processes on one GPU (a source service and a target awaiting its restore, started by the launcher):
    every load lends CUDA IPC handles, each chunk is hashed on the device where it landed, the state comes back
    bit-identical and the target answers like the source (bench/e2e.py, small)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bench = Path(__file__).resolve().parents[2] / "bench" / "e2e.py"
    argv = [sys.executable, str(bench), "--device", "cuda", "--gb", "0.5", "--mutable-mb", "16"]
    argv += ["--runs", "shm:auto:source", "--no-driver", "--no-baselines", "--root", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])["runs"]["shm:auto:source"]
    assert "error" not in run, run
    assert run["bit_identical"] == {"weights": True, "mutable": True} and run["same_answer"] is True
    assert run["restore"]["from_source"]["way"] == "lend" and run["restore"]["from_source"]["chunks"] > 0
    assert run["downtime"]["restore_from_source"]["way"] == "lend"
