"""Pacing end to end on a GPU: a source whose state lives on the device serves requests (GPU work through the SDK's
safe point) while a live round captures it with ``transfer.pacing: adaptive``; the controller reads those very
requests, the source keeps serving through the round, the plan's rate limit stays the ceiling, and the image is
whole."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import gpumigrate.agent as gm
from gpumigrate.bounds import TransferBounds
from gpumigrate.snapshot.client import AgentClient

pytestmark = pytest.mark.gpu
MiB = 1 << 20
TENSORS = 16  # of 64 MiB each: a round long enough for the controller to judge it many times


class Requests:
    """The source's clients: one request after another, each a GPU matmul inside the SDK's safe point."""

    def __init__(self, handle: gm.Handle) -> None:
        self.handle = handle
        self.ended: list[float] = []
        self._stop = threading.Event()
        self._a = torch.randn(2048, 2048, device="cuda")
        self._thread = threading.Thread(target=self._serve, name="test-requests", daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self.handle.safe_point():
                (self._a @ self._a).sum().item()  # .item(): the request ends when the GPU did its work
            self.ended.append(time.monotonic())

    def __enter__(self) -> Requests:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the request thread did not stop within 60 s"

    def wait_for(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ended) < count:
            assert time.monotonic() < deadline, f"waited {timeout_s}s for {count} requests to end"
            time.sleep(0.01)


@pytest.mark.parametrize("rate_limit", [None, 2 << 30])
def test_an_adaptive_round_on_a_gpu_reads_the_sources_requests_and_lets_them_run(
    store: tuple[str, dict[str, str]], rate_limit: int | None
) -> None:
    url, key_ref = store
    tensors = {f"w{i}": torch.randn(64 * MiB // 2, device="cuda", dtype=torch.bfloat16) for i in range(TENSORS)}
    handle = gm.attach(tensors)
    options = {"compression": "none", **TransferBounds(None, rate_limit, "adaptive").options()}
    with Requests(handle) as requests, AgentClient(handle.address) as c:
        requests.wait_for(50)  # the requests before the round set its base latency
        t0 = time.monotonic()
        stats = c.call("precopy", store=url, key_ref=key_ref, options=options)["stats"]
        t1 = time.monotonic()
        info = c.call("info")
    during = sum(1 for t in requests.ended if t0 <= t <= t1)
    pacing = stats["pacing"]
    assert pacing["mode"] == "adaptive"
    assert pacing["base_latency_ms"] is not None and pacing["base_latency_ms"] > 0
    assert pacing["verdicts"] >= 1, pacing
    assert during >= 1, f"no request ended during the {t1 - t0:.2f} s round: the source was not served"
    if rate_limit is not None:
        assert pacing["top_rate"] is not None and pacing["top_rate"] <= rate_limit, pacing
        assert all(rate is None or rate <= rate_limit for _, rate, _ in pacing["changes"]), pacing
    assert stats["chunks_total"] == stats["chunks_dirty"] > 0  # round 1 ships everything
    # Every tensor's bytes, and beside them the SDK's own small regions (the RNG states it carries), also dirty
    tensor_bytes = TENSORS * 64 * MiB
    assert tensor_bytes <= stats["bytes_dirty"] < tensor_bytes + MiB, stats["bytes_dirty"]
    assert info["rounds"] == 1
