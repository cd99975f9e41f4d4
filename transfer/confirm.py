"""The frozen final round's confirmation: BLAKE3 of every chunk its fingerprints call unchanged, where it lives.

The final round ships the chunks whose fingerprints changed and, beside that, hashes all the others to prove
that no fingerprint collision reaches the committed image (``snapshot/agent.py``). For a 16 GiB model that is
1,400 chunks. Per chunk, the first version made a view, a job, a tensor for the hasher, a launch batch of 64
and a hex string: on a lent H100 the confirmation's own Python held the GIL against the shipping thread and
its first kernel started 30 ms into the round, with 12 ms of device work to do.

Here device chunks are described by byte offsets from one anchor per (device, length) and hashed by the BLAKE3
kernels (``devhash.blake3_at``) in batches bounded by the device memory of their leaf chaining values, on a
side stream that trails the caller's stream; the digests come back in one copy and are compared as words with
the expected ids. Host chunks, and device chunks the kernels do not take (a length that is not whole 1 KiB
leaves, an unaligned start), are hashed on the CPU. All of it runs on one of the writer's threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from gpumigrate.interfaces import ChunkRun
from gpumigrate.transfer.format.chunkobj import chunk_id_of

if TYPE_CHECKING:
    import torch

# Device memory for one batch's leaf chaining values: 32 bytes per KiB hashed, so 128 chunks of 16 MiB. The
# parents' levels take half as much again at most. Fewer, larger launches; a bounded share of a full GPU.
NODES_BYTES = 64 << 20
_LEAF = 1024


def start(runs: Sequence[ChunkRun], chunk_size: int, pool: ThreadPoolExecutor) -> Callable[[], list[list[bool]]]:
    """Queue the confirmation of ``runs`` (see the module docstring); the returned function waits for it."""
    on_device: dict[tuple[Any, int], list[tuple[int, int, int, Any]]] = {}  # (device, length) -> (run, k, at, view)
    on_host: list[tuple[int, int]] = []
    for r, run in enumerate(runs):
        view = run.view
        n = view.numel()
        wide = _kernel_alignment(view.device) if view.is_cuda else 0  # 0: no device kernels for this view
        base = view.data_ptr() if wide else 0
        for k, i in enumerate(run.indices):
            length = min(chunk_size, n - i * chunk_size)
            at = base + i * chunk_size
            if wide and length > 0 and length % _LEAF == 0 and at % wide == 0:
                on_device.setdefault((view.device, length), []).append((r, k, at, view))
            else:
                on_host.append((r, k))
    after = {device: _torch().cuda.current_stream(device).record_event() for device, _ in on_device}
    job = pool.submit(_confirm, runs, chunk_size, on_device, on_host, after)
    return job.result


def _confirm(
    runs: Sequence[ChunkRun],
    chunk_size: int,
    on_device: dict[tuple[Any, int], list[tuple[int, int, int, Any]]],
    on_host: list[tuple[int, int]],
    after: dict[Any, Any],
) -> list[list[bool]]:
    torch = _torch()
    same = [[False] * len(run.indices) for run in runs]
    queued: list[tuple[list[tuple[int, int, int, Any]], Any]] = []
    for (device, length), members in on_device.items():
        side = torch.cuda.Stream(device=device)  # default priority: the shipping's hash stream goes first
        side.wait_event(after[device])
        with torch.cuda.stream(side):
            queued.append((members, _hash(members, length)))
    for r, k in on_host:  # few: a region's short last chunk, or host tensors
        run = runs[r]
        i = run.indices[k]
        piece = run.view[i * chunk_size : (i + 1) * chunk_size]
        same[r][k] = chunk_id_of(piece.cpu().numpy().data if piece.numel() else b"") == run.ids[k]
    for members, (words, stream) in queued:
        with torch.cuda.stream(stream):
            got = words.cpu().numpy()  # waits for this stream's kernels only
        want = np.frombuffer(bytes.fromhex("".join(runs[r].ids[k] for r, k, _, _ in members)), dtype="<i4")
        equal = (got == want.reshape(-1, 8)).all(axis=1).tolist()
        for (r, k, _, _), ok in zip(members, equal, strict=True):
            same[r][k] = ok
    return same


def _hash(members: list[tuple[int, int, int, Any]], length: int) -> tuple[Any, Any]:
    """BLAKE3 words of ``members`` (all ``length`` bytes, one device) on the current stream, in batches."""
    from gpumigrate.transfer.device import devhash

    torch = _torch()
    # The anchor: the lowest chunk, as a tensor (the kernels take a base pointer; the others are offsets from it).
    low = min(members, key=lambda m: m[2])
    view = low[3]
    anchor = view[low[2] - view.data_ptr() :][:length]
    origin = low[2]
    per = max(1, NODES_BYTES // (length // _LEAF * 32))
    parts = [
        devhash.blake3_at(anchor, [at - origin for _, _, at, _ in members[s : s + per]], length)
        for s in range(0, len(members), per)
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), torch.cuda.current_stream()


def _kernel_alignment(device: torch.device) -> int:
    """The device kernels' input alignment in bytes where they run on ``device``; 0 where they do not."""
    from gpumigrate.transfer.device import devhash

    return devhash.WIDE if devhash.available(device) else 0


def _torch() -> Any:
    import torch

    return torch
