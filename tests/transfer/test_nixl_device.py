"""Tensors WRITTEN by NIXL into a target's tensors, each chunk's BLAKE3 checked where it landed.

On CPU (CI) the tensors are host memory and UCX copies through shared memory; the ``gpu`` tests run
the same code on CUDA tensors (cuda_ipc) with the device BLAKE3 kernels.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import struct
from typing import Any

import blake3
import pytest

torch = pytest.importorskip("torch")
needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu13") is None, reason="NIXL (nixl-cu13) is not installed here"
)  # WRITEs and READs; a lend (CUDA IPC) runs without it, as the agent's fill does

from gpumigrate.control import AuthError  # noqa: E402
from gpumigrate.errors import IntegrityError, InvalidInputError  # noqa: E402
from gpumigrate.transfer.device.devhash import cpu_hasher  # noqa: E402
from gpumigrate.transfer.device.landing import DeviceLanding  # noqa: E402
from gpumigrate.transfer.device.sender import DeviceSender  # noqa: E402

CHUNK = 1 << 20


def ids_of(t: Any) -> list[str]:
    flat = t.view(-1).view(torch.uint8).cpu().numpy()
    return [blake3.blake3(flat[o : o + CHUNK]).hexdigest() for o in range(0, flat.nbytes, CHUNK)]  # chunk ids


def regions(device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(0)
    return {
        "w": torch.randint(0, 255, (6 * CHUNK,), dtype=torch.uint8, generator=g).to(device),
        "b": torch.randn(300_001, generator=g).to(torch.bfloat16).to(device),  # a tail that is not whole KiB
    }


def send(
    src: dict[str, Any], dst: dict[str, Any], hasher: Any, batch: int, mode: str = "write"
) -> tuple[dict[str, Any], DeviceLanding]:
    """One transfer of ``src`` into ``dst``, the source naming the manifest's ids; (done reply, landing).

    ``mode``: the source WRITEs (``write``), the target READs (``pull``) or copies out of the source's lent
    device memory (``lend``)."""
    key = os.urandom(32)
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=key, hasher=hasher)
    sender = DeviceSender(landing.address, src, control_key=key)
    try:
        sender.expect({k: ids_of(v) for k, v in src.items()})
        move = {"write": sender.send_all, "pull": sender.pull_all, "lend": sender.lend_all}[mode]
        return move(batch=batch), landing
    finally:
        sender.close()
        landing.close()


@needs_nixl
@pytest.mark.parametrize("mode", ["write", "pull"])
def test_chunks_land_verified_and_a_damaged_landing_is_sent_again(mode: str) -> None:
    src = regions()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    damaged: list[int] = []

    def damaging_hasher(block: Any, chunk: int) -> Any:
        """BLAKE3 as usual, but the first time chunk w[2] is checked its landed bytes are hit first."""
        w = dst["w"].view(torch.uint8)
        offset = w.data_ptr() + 2 * CHUNK - block.data_ptr()
        if 0 <= offset < block.numel() and not damaged:
            damaged.append(1)
            block[offset + 100] ^= 0xFF
        return cpu_hasher(block, chunk)

    result, landing = send(src, dst, damaging_hasher, batch=2, mode=mode)
    assert damaged and result["chunks_resent"] == 1 and result["failures"] == ["w[2]"]
    assert all(torch.equal(src[k], dst[k]) for k in src)
    assert landing.result.chunks_verified == sum(len(ids_of(v)) for v in src.values())


@needs_nixl
@pytest.mark.parametrize("mode", ["write", "pull"])
def test_expected_ids_come_from_the_manifest_and_a_wrong_source_never_passes(mode: str) -> None:
    key = os.urandom(32)
    src = regions()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    manifest_ids = {k: ids_of(v) for k, v in src.items()}
    src["w"][5] ^= 1  # the source no longer holds what the manifest names
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=key, expected=manifest_ids)
    sender = DeviceSender(landing.address, src, control_key=key)
    try:
        with pytest.raises(IntegrityError, match="still failed"):
            (sender.send_all if mode == "write" else sender.pull_all)(batch=3, retries=1)
    finally:
        sender.close()
        landing.close()
    assert landing.result.chunks_failed == 2 and set(landing.result.failures) == {"w[0]"}


@needs_nixl
def test_a_source_without_the_control_key_gets_nothing() -> None:
    dst = {k: torch.zeros_like(v) for k, v in regions().items()}
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=os.urandom(32))
    try:
        with pytest.raises(AuthError):
            DeviceSender(landing.address, regions(), control_key=os.urandom(32))
    finally:
        landing.close()


@needs_nixl
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["write", "pull"])
def test_device_to_device_with_the_blake3_kernels(mode: str) -> None:
    from gpumigrate.transfer.device.devhash import blake3_chunks

    src = regions("cuda")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    result, _ = send(src, dst, blake3_chunks, batch=4, mode=mode)
    torch.cuda.synchronize()
    assert result["chunks_resent"] == 0 and all(torch.equal(src[k], dst[k]) for k in src)


def test_lending_host_memory_is_refused_by_name() -> None:
    key = os.urandom(32)
    src = regions()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=key, nixl=False)
    sender = DeviceSender(landing.address, src, control_key=key, nixl=False)
    try:
        with pytest.raises(InvalidInputError, match="lend_all needs device tensors"):
            sender.lend_all()
    finally:
        sender.close()
        landing.close()


LANDING_PROCESS = """
import json, os, sys
import torch
from gpumigrate.transfer.device.devhash import blake3_chunks
from gpumigrate.transfer.device.landing import DeviceLanding
job = json.loads(sys.stdin.readline())
dst = {k: torch.zeros(n, dtype=torch.uint8, device="cuda") for k, n in job["sizes"].items()}
landing = DeviceLanding(dst, chunk_size=job["chunk"], control_key=bytes.fromhex(job["key"]),
                        expected=job["ids"], hasher=blake3_chunks, nixl=False)
print(json.dumps({"address": landing.address}), flush=True)
result = landing.wait(120)
print(json.dumps({"result": result.__dict__, "tails": {k: v[-7:].tolist() for k, v in dst.items()}}), flush=True)
"""


def lend_to_another_process(src: dict[str, Any], ids: dict[str, list[str]], **lend: Any) -> tuple[Any, dict[str, Any]]:
    """Lend ``src`` to a landing in a process of its own (CUDA IPC handles do not open in the process that
    made them); (what lend_all returned or raised, the landing's result)."""
    import json
    import subprocess
    import sys

    key = os.urandom(32)
    job = {
        "sizes": {k: v.view(-1).view(torch.uint8).numel() for k, v in src.items()},
        "chunk": CHUNK,
        "key": key.hex(),
        "ids": ids,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", LANDING_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin and child.stdout
    child.stdin.write(json.dumps(job) + "\n")
    child.stdin.flush()
    line = child.stdout.readline()
    while not line.startswith('{"address"'):
        line = child.stdout.readline()
    sender = DeviceSender(json.loads(line)["address"], src, control_key=key, nixl=False)
    try:
        outcome: Any = sender.lend_all(**lend)
    except Exception as exc:  # noqa: BLE001 - the caller asserts on it
        outcome = exc
    finally:
        sender.close()
    out, _ = child.communicate(timeout=120)
    return outcome, json.loads(out.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("shared_by", ["allocations", "tensors"])
def test_a_landing_copies_lent_device_memory_verified(shared_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumigrate.transfer.device import cuda_ipc

    if shared_by == "tensors":  # where the driver cannot export an allocation: PyTorch's sharing, per tensor
        monkeypatch.setattr(cuda_ipc, "share", lambda tensors: None)
    src = regions("cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, chunks in (("v", 3), ("u", 2)):  # more regions: the copy's batches span several allocations
        src[name] = torch.randint(0, 255, (chunks * CHUNK + 4096,), dtype=torch.uint8, generator=g).to("cuda")
    outcome, landed = lend_to_another_process(src, {k: ids_of(v) for k, v in src.items()}, batch=4)
    assert not isinstance(outcome, Exception), outcome
    assert outcome["shared_by"] == shared_by
    assert outcome["chunks_resent"] == 0 and landed["result"]["chunks_failed"] == 0
    assert landed["result"]["chunks_verified"] == sum(len(ids_of(v)) for v in src.values())
    tails = {k: v.view(-1).view(torch.uint8)[-7:].tolist() for k, v in src.items()}
    assert landed["tails"] == tails  # down to the short last chunk of the region that is not whole KiB


@pytest.mark.gpu
def test_a_lent_source_that_differs_from_the_manifest_never_passes() -> None:
    src = regions("cuda")
    manifest_ids = {k: ids_of(v) for k, v in src.items()}
    src["w"][CHUNK + 7] ^= 1  # chunk w[1] no longer holds what the manifest names
    outcome, landed = lend_to_another_process(src, manifest_ids, batch=4, retries=1)
    assert isinstance(outcome, IntegrityError) and "still failed" in str(outcome)
    assert landed["result"]["chunks_failed"] == 2 and set(landed["result"]["failures"]) == {"w[1]"}


@pytest.mark.gpu
def test_a_lend_naming_memory_outside_its_allocation_is_refused() -> None:
    from gpumigrate.transfer.device import cuda_ipc

    t = torch.zeros(CHUNK, dtype=torch.uint8, device="cuda")
    shared = cuda_ipc.share({"w": t})
    assert shared is not None and shared["names"] == ["w"]
    k, _, nbytes = struct.unpack("<3q", base64.b64decode(shared["places"]))
    assert nbytes == CHUNK
    past_the_end = struct.pack("<3q", k, shared["sizes"][k], nbytes)  # starts at its allocation's end
    shared["places"] = base64.b64encode(past_the_end).decode()
    with pytest.raises(ValueError, match="outside the allocation"):
        cuda_ipc.Mapped(shared, t.device)
    shared["places"] = base64.b64encode(past_the_end[:16]).decode()  # a truncated table
    with pytest.raises(ValueError, match="bytes of places"):
        cuda_ipc.Mapped(shared, t.device)
