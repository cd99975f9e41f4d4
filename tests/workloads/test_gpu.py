"""The reference workloads on CUDA (run on the lent GPU machine: pytest -m gpu tests/workloads)."""

from __future__ import annotations

import httpx
import pytest
import torch

from gpumigrate.workloads.model import build_model, generate, weights_digest
from gpumigrate.workloads.training import TrainingConfig, TrainingState, run_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_model_is_deterministic(dtype: str) -> None:
    a = build_model(0, "tiny", dtype=dtype, device="cuda")
    b = build_model(0, "tiny", dtype=dtype, device="cuda")
    assert next(a.parameters()).is_cuda
    assert weights_digest(a) == weights_digest(b)
    assert generate(a, "hello", 8) == generate(b, "hello", 8)


def test_params_mb_builds_a_large_model_on_cuda() -> None:
    model = build_model(0, "tiny", dtype="bfloat16", device="cuda", params_mb=1024)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0.7 * 2**30 < nbytes < 1.3 * 2**30
    tokens, logprobs = generate(model, "scale", 4)
    assert len(tokens) == 4 and all(lp <= 0 for lp in logprobs)


def test_cuda_training_restore_gives_identical_loss() -> None:
    cfg = TrainingConfig(seed=1, device="cuda")
    src = TrainingState.create(cfg)
    run_steps(src, 2)
    snap = src.capture()
    assert "cuda" in snap["rng"]
    expected = run_steps(src, 2)
    dst = TrainingState.create(cfg)
    dst.restore(snap)
    assert run_steps(dst, 2) == expected


def test_cuda_server_reports_the_gpu(server_factory) -> None:
    srv = server_factory("--device", "cuda", "--dtype", "bfloat16")
    info = httpx.get(f"{srv.url}/v1/info").json()
    assert info["gpu_model"] != "none" and info["gpu_memory_bytes"] > 0
    assert info["driver_version"] and info["torch_cuda"] == torch.version.cuda
    r = httpx.post(f"{srv.url}/v1/generate", json={"prompt": "gpu", "max_new_tokens": 8}, timeout=30)
    assert r.status_code == 200 and len(r.json()["tokens"]) == 8


def test_cuda_lightning_trainer_matches_plain_loop() -> None:
    from gpumigrate.workloads.training import train

    cfg = TrainingConfig(seed=4, device="cuda")
    plain = TrainingState.create(cfg)
    expected = run_steps(plain, 3)
    lit = TrainingState.create(cfg)
    assert train(lit, 3) == expected
    assert lit.weights_digest() == plain.weights_digest()
