"""``transfer.restore_from: source`` through ``gpumigrate migrate``: the target copies the source's tensors out of
its memory (here host memory, so NIXL READs over UCX; on a GPU host CUDA IPC), each chunk checked against the
image's signed manifest, while the image is still written to the store.

The source serves load throughout and 1 MiB of its state changes with every request (as a KV cache would): the
chunks that changed since an image fail their check where they land and are read from the image instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

WORKLOAD = "fill-lm"
SOURCE_ARGS = ("--mutable-mb", "1")


# pytest-timeout's guard counts this module's setup too (the session's Prefect server, a source that loads its
# model): on a loaded machine those and the migration's own bound (400 s, migrate_under_load) passed 600 s, and the
# guard's stack dump hid which wait ran long. Above the sum of the bounds, a slow step fails with its own message.
@pytest.mark.timeout(1500)
def test_a_migration_fills_the_target_from_the_source_memory(
    inference_source: Any, inference_plan: Any, migrate_under_load: Any, tmp_path: Path
) -> None:
    src = inference_source
    weights = httpx.get(src.endpoint + "/v1/info", timeout=10).json()["weights_digest"]
    plan = inference_plan(
        src,
        tmp_path / "plan.yaml",
        target="fill-tgt",
        transfer={
            "store": "file://store",
            "encryption_key": {"file": str(src.key_file)},
            "parallelism": 2,
            "restore_from": "source",
        },
    )
    mid = "fill-from-source"
    out, report = migrate_under_load(src, plan, mid)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", (result["error"], out.stderr[-2000:])
    assert report.failed == 0, report.errors
    assert result["parity"]["passed"] is True

    run_dir = src.home / "migrations" / mid
    records = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    preloaded = next(r["data"] for r in records if r["event"] == "image.preloaded")
    restored = next(r["data"] for r in records if r["event"] == "image.restored")
    committed = next(r["data"] for r in records if r["event"] == "image.committed")
    # The pre-load moved the tensors from the source's memory (host memory: NIXL READs), each chunk checked.
    filled = preloaded["from_source"]
    assert filled["way"] == "pull" and filled["chunks"] > 0, preloaded
    assert filled["chunks"] + filled["chunks_from_image"] <= preloaded["chunks_loaded"]
    # The final load: only what the pre-load left, from the source where its bytes still match the image.
    assert restored["chunks_skipped"] > 0 and restored["bytes_loaded"] < committed["bytes_image"]
    # The image was still written to the store, and the target's weights are the source's, bit for bit.
    assert committed["image_id"] and committed["store"].startswith("file://")
    target = json.loads((run_dir / "state.json").read_text())["runtime"]["target_endpoint"]
    assert httpx.get(target + "/v1/info", timeout=10).json()["weights_digest"] == weights
