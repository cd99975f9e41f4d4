"""A lend pass's plan: every chunk of every region copied once and hashed once, under its own key.

On CPU (CI) the kernels do not apply, so every chunk takes the plain path (one fused copy, then the landing's
hasher); the ``gpu`` tests in test_nixl_device.py run the same pass through the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import blake3
import pytest

from gpumigrate.transfer.device.lend import Hashed, copy_and_hash

torch = pytest.importorskip("torch")
CHUNK = 64 * 1024


class _Source:
    """The source's memory as the landing sees it once mapped: an address and a tensor per region."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def address(self, name: str) -> int:
        return int(self.tensors[name].data_ptr())

    def tensor(self, name: str) -> Any:
        return self.tensors[name]


def _hash_on_host(landed: Sequence[tuple[str, int, Any]]) -> list[Hashed]:
    return [
        Hashed(blake3.blake3(view.numpy().tobytes()).hexdigest(), [(name, i)], view.numel()) for name, i, view in landed
    ]


def test_every_chunk_is_copied_and_hashed_once_under_its_key() -> None:
    g = torch.Generator().manual_seed(7)
    sizes = {"w": 3 * CHUNK, "b": 8 * 1024, "odd": 2 * CHUNK + 1000, "empty": 0}  # whole, short, ragged, none
    src = {k: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for k, n in sizes.items()}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    hashed = copy_and_hash(dst, _Source(src), CHUNK, 4096, _hash_on_host)
    keys = [key for h in hashed for key in h.keys]
    assert sorted(keys) == sorted((k, i) for k, n in sizes.items() for i in range(-(-n // CHUNK)))
    assert all(torch.equal(src[k], dst[k]) for k in sizes)
    by_key = {h.keys[0]: h.words for h in hashed}
    for name, i in keys:
        piece = src[name][i * CHUNK : (i + 1) * CHUNK]
        assert by_key[(name, i)] == blake3.blake3(piece.numpy().tobytes()).hexdigest()
    assert sum(h.nbytes for h in hashed) == sum(sizes.values())
