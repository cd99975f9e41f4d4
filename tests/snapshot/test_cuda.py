"""GPU tests (run on the lent GPU machine with `pytest -m gpu tests/snapshot`): the CUDA agent path
and the CUDA driver checkpoint backend. Skipped where CUDA is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.chunks import byte_view, fingerprint_chunks
from gpumigrate.snapshot.engine import SnapshotEngine
from tests.support.memimage import MemoryStore

pytestmark = pytest.mark.gpu
KEY = b"g" * 32


def test_fused_fingerprint_matches_eager_and_sees_changes() -> None:
    t = torch.randn(64 << 20, device="cuda")  # 256 MiB
    v = byte_view(t)
    fused = fingerprint_chunks(v, 4 << 20)
    eager = fingerprint_chunks(v, 4 << 20, fused=False)
    assert torch.equal(fused, eager)
    t.view(torch.int32)[(5 << 20) + 3] ^= 1
    after = fingerprint_chunks(v, 4 << 20)
    assert (after != fused).nonzero().flatten().tolist() == [5]


def test_cuda_training_roundtrip_bit_identical() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(1024, 16)
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256, device=dev), torch.randn(64, 16, device=dev)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> float:
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return float(loss.item())

    for _ in range(3):
        step(model, opt)
    store = MemoryStore()
    src = SnapshotEngine()
    src.track_module("model", model)
    src.track_optimizer("opt", opt)
    src.track_rng()
    src.capture_round(store.writer(KEY, chunk_size=1 << 20))
    step(model, opt)
    src.park()
    ref = src.capture_final(store.writer(KEY, chunk_size=1 << 20)).image
    assert any(r.device.startswith("cuda") for r in store.reader(ref.id, KEY).regions())
    expected = step(model, opt)

    torch.manual_seed(123)
    model2 = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(1024, 16)
    ).to(dev)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    dst = SnapshotEngine()
    dst.track_module("model", model2)
    dst.track_optimizer("opt", opt2)
    dst.track_rng()
    dst.load(store.reader(ref.id, KEY))
    assert all(p.is_cuda for p in model2.parameters())
    assert step(model2, opt2) == expected
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    rec = src.zeroize()
    assert rec["verified"] and "cuda:0" in rec["devices"]
    assert all(int(p.count_nonzero()) == 0 for p in model.parameters())


def test_cuda_live_precopy_ships_only_dirty_chunks() -> None:
    t = torch.randn(16 << 20, device="cuda")  # 64 MiB = 64 chunks of 1 MiB
    store = MemoryStore()
    a = SnapshotEngine()
    a.track_tensor("t", t)
    assert a.capture_round(store.writer(KEY, chunk_size=1 << 20)).stats.chunks_dirty == 64
    t[: 3 << 18] += 1  # first 3 MiB
    assert a.capture_round(store.writer(KEY, chunk_size=1 << 20)).stats.chunks_dirty == 3
    assert a.capture_round(store.writer(KEY, chunk_size=1 << 20)).stats.chunks_dirty == 0
    out = torch.empty_like(t)
    b = SnapshotEngine()
    b.track_tensor("t", out)
    b.load(store.reader(a.last_image.id, KEY))
    assert torch.equal(out, t)


HOLDER = r"""
import json, sys, torch
t = torch.arange(1 << 26, dtype=torch.int32, device="cuda")  # 256 MiB
torch.cuda.synchronize()
print(json.dumps({"sum": int(t.sum().item())}), flush=True)
sys.stdin.readline()
print(json.dumps({"sum": int(t.sum().item())}), flush=True)
"""


class Holder:
    """A child process holding 256 MiB on the GPU; ``digest()`` asks it to re-read its memory."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.first = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def digest(self) -> dict[str, int]:
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]


@pytest.fixture
def holder() -> Iterator[Holder]:
    from gpumigrate.snapshot import cuda_driver

    try:
        cuda_driver.driver()
    except cuda_driver.CudaCheckpointUnavailable as exc:
        pytest.skip(str(exc))
    h = Holder()
    try:
        yield h
    finally:
        h.proc.kill()
        h.proc.wait(10)
        h.proc.stdin.close()  # type: ignore[union-attr]
        h.proc.stdout.close()  # type: ignore[union-attr]


def test_cuda_driver_checkpoint_suspend_and_resume(holder: Holder) -> None:
    from gpumigrate.snapshot import cuda_driver

    proc = cuda_driver.CudaProcess(holder.proc.pid)
    assert proc.state() == "running"
    with pytest.raises(SnapshotError, match="its CUDA state is running, checkpoint needs locked"):
        proc.checkpoint()
    with pytest.raises(SnapshotError, match="unlock needs locked"):
        proc.unlock()
    proc.suspend(timeout_ms=5000)
    assert proc.state() == "checkpointed"
    with pytest.raises(SnapshotError, match="lock needs running"):
        proc.lock()
    uuids = cuda_driver.gpu_uuids()
    proc.unsuspend({u: u for u in uuids})  # restore with gpuPairs mapping every GPU onto itself
    assert proc.state() == "running"
    assert holder.digest() == holder.first


def _used_bytes(device: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_driver_restore_onto_the_other_gpu(holder: Holder) -> None:
    """gpuPairs: a process checkpointed on GPU 0 comes back on GPU 1 (and would take GPU 1's to GPU 0),
    with its memory intact: the driver's way to move an unmodified process between GPUs of one host."""
    from gpumigrate.snapshot import cuda_driver

    used = [_used_bytes(0), _used_bytes(1)]
    proc = cuda_driver.CudaProcess(holder.proc.pid)
    proc.suspend(timeout_ms=5000)
    first, second = cuda_driver.gpu_uuids()[:2]
    proc.unsuspend({u: u for u in cuda_driver.gpu_uuids()} | {first: second, second: first})
    assert proc.state() == "running"
    moved = 200 << 20  # the child's 256 MiB tensor, at least
    assert _used_bytes(1) - used[1] >= moved
    assert used[0] - _used_bytes(0) >= moved
    assert holder.digest() == holder.first


def test_cuda_driver_refuses_non_cuda_pid() -> None:
    from gpumigrate.snapshot import cuda_driver

    try:
        cuda_driver.driver()
    except cuda_driver.CudaCheckpointUnavailable as exc:
        pytest.skip(str(exc))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        with pytest.raises(SnapshotError):
            cuda_driver.CudaProcess(sleeper.pid).lock(timeout_ms=100)
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_cuda_direct_placement_roundtrip_and_corruption_refused() -> None:
    from gpumigrate.errors import IntegrityError

    t = torch.randn(8 << 20, device="cuda")  # 32 MiB
    arena = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    store = MemoryStore(arena=arena)
    a = SnapshotEngine()
    a.track_tensor("t", t)
    a.park()
    ref = a.capture_final(store.writer(KEY, chunk_size=4 << 20)).image
    assert len(store.placed) == 8  # every chunk went straight into the pinned arena
    out = torch.zeros_like(t)
    flags: list[bool] = []
    b = SnapshotEngine(set_ready=flags.append)
    b.track_tensor("t", out)
    b.load(store.reader(ref.id, KEY))
    assert torch.equal(out, t) and flags[-1] is True
    arena[100] ^= 1  # corrupt a byte of chunk 0 in host memory
    with pytest.raises(IntegrityError):
        b.load(store.reader(ref.id, KEY))
    assert flags[-1] is False and not b.ready


BUSY = r"""
import json, torch
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"ready": True}), flush=True)
torch.cuda._sleep(int(1e10))  # a kernel that spins ~5 s
torch.cuda.synchronize()      # ... and a CUDA call blocked on it
x += 1
torch.cuda.synchronize()
print(json.dumps({"done": float(x.item())}), flush=True)
"""


def test_cuda_driver_lock_timeout_leaves_process_running() -> None:
    from gpumigrate.snapshot import cuda_driver

    try:
        cuda_driver.driver()
    except cuda_driver.CudaCheckpointUnavailable as exc:
        pytest.skip(str(exc))
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert json.loads(child.stdout.readline()) == {"ready": True}
        import time

        time.sleep(0.5)  # the child is now inside cudaStreamSynchronize behind a long kernel
        proc = cuda_driver.CudaProcess(child.pid)
        try:
            proc.lock(timeout_ms=200)
        except cuda_driver.LockTimeout as exc:
            assert "left running" in str(exc) and "state: running" in str(exc)
        else:  # the driver took the lock anyway: undo it, and say what happened
            proc.unlock()
            pytest.fail("lock did not time out while the process was blocked in a CUDA call")
        assert proc.state() == "running"
        assert json.loads(child.stdout.readline()) == {"done": 1.0}  # it finished its work undisturbed
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
        child.stdout.close()
