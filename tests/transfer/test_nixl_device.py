"""Tensors WRITTEN by NIXL into a target's tensors, each chunk's BLAKE3 checked where it landed.

On CPU (CI) the tensors are host memory and UCX copies through shared memory; the ``gpu`` tests run
the same code on CUDA tensors (cuda_ipc) with the device BLAKE3 kernels.
"""

from __future__ import annotations

import os
from typing import Any

import blake3
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl_cu13")

from gpumigrate.control import AuthError  # noqa: E402
from gpumigrate.errors import IntegrityError  # noqa: E402
from gpumigrate.transfer.nixl_device import DeviceLanding, DeviceSender, cpu_hasher  # noqa: E402

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


def send(src: dict[str, Any], dst: dict[str, Any], hasher: Any, batch: int) -> tuple[dict[str, Any], DeviceLanding]:
    """One transfer of ``src`` into ``dst``, the source naming the manifest's ids; (done reply, landing)."""
    key = os.urandom(32)
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=key, hasher=hasher)
    sender = DeviceSender(landing.address, src, control_key=key)
    try:
        sender.expect({k: ids_of(v) for k, v in src.items()})
        return sender.send_all(batch=batch), landing
    finally:
        sender.close()
        landing.close()


def test_chunks_land_verified_and_a_damaged_landing_is_sent_again() -> None:
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

    result, landing = send(src, dst, damaging_hasher, batch=2)
    assert damaged and result["chunks_resent"] == 1 and result["failures"] == ["w[2]"]
    assert all(torch.equal(src[k], dst[k]) for k in src)
    assert landing.result.chunks_verified == sum(len(ids_of(v)) for v in src.values())


def test_expected_ids_come_from_the_manifest_and_a_wrong_source_never_passes() -> None:
    key = os.urandom(32)
    src = regions()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    manifest_ids = {k: ids_of(v) for k, v in src.items()}
    src["w"][5] ^= 1  # the source no longer holds what the manifest names
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=key, expected=manifest_ids)
    sender = DeviceSender(landing.address, src, control_key=key)
    try:
        with pytest.raises(IntegrityError, match="still failed"):
            sender.send_all(batch=3, retries=1)
    finally:
        sender.close()
        landing.close()
    assert landing.result.chunks_failed == 2 and set(landing.result.failures) == {"w[0]"}


def test_a_source_without_the_control_key_gets_nothing() -> None:
    dst = {k: torch.zeros_like(v) for k, v in regions().items()}
    landing = DeviceLanding(dst, chunk_size=CHUNK, control_key=os.urandom(32))
    try:
        with pytest.raises(AuthError):
            DeviceSender(landing.address, regions(), control_key=os.urandom(32))
    finally:
        landing.close()


@pytest.mark.gpu
def test_device_to_device_with_the_blake3_kernels() -> None:
    from gpumigrate.transfer.devhash import blake3_chunks

    src = regions("cuda")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    result, _ = send(src, dst, blake3_chunks, batch=4)
    torch.cuda.synchronize()
    assert result["chunks_resent"] == 0 and all(torch.equal(src[k], dst[k]) for k in src)
