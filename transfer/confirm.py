"""The frozen final round's confirmation: BLAKE3 of every chunk its fingerprints call unchanged, where it lives.

The final round ships the chunks whose fingerprints changed and, beside that, hashes all the others to prove
that no fingerprint collision reaches the committed image (the snapshot agent). For a large model that is more
than a thousand chunks. Per chunk, the first version made a view, a job, a tensor for the hasher, a launch batch
and a hex string: the confirmation's own Python held the GIL against the shipping thread, and its first kernel
started long after the round did, with little device work to do (bench/README.md).

Here device chunks are described by byte offsets from one anchor per (device, length) and hashed by the BLAKE3
kernels (``devhash.blake3_at``) in batches bounded by the device memory of their leaf chaining values, on a
side stream that trails the caller's stream; the digests come back in one copy and are compared as words with
the expected ids. Host chunks, and device chunks the kernels do not take (a length that is not whole 1 KiB
leaves, a start off a 16-byte boundary), are hashed on the CPU. All of it runs on one of the writer's threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from gpumigrate.interfaces import ChunkRun
from gpumigrate.transfer.format.chunkobj import chunk_id_of

if TYPE_CHECKING:
    import torch

# A device chunk to confirm: (run, its k-th index, the chunk's address, the run's view)
_Member = tuple[int, int, int, "torch.Tensor"]

# Device memory for one batch's leaf chaining values: 32 bytes per KiB hashed, so 128 chunks of 16 MiB. The
# parents' levels take half as much again at most. Fewer, larger launches; a bounded share of a full GPU.
NODES_BYTES = 64 << 20
_LEAF = 1024
HIGH_PRIORITY = -1  # CUDA's higher stream priority (0 is the lowest), as the shipping's hash stream has


def start(
    runs: Sequence[ChunkRun], chunk_size: int, pool: ThreadPoolExecutor, *, background: bool = False
) -> Callable[[], list[list[bool]]]:
    """Queue the confirmation of ``runs`` (see the module docstring); the returned function waits for it.
    ``background``: the side streams at the devices' lowest priority, behind the round's other device work
    (the shipping's hash stream and a hot confirmation run at the higher one)."""
    on_device: dict[tuple[torch.device, int], list[_Member]] = {}  # (device, length) -> members
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
    after = {device: _current_event(device) for device, _ in on_device}
    job = pool.submit(_confirm, runs, chunk_size, on_device, on_host, after, 0 if background else HIGH_PRIORITY)
    return job.result


def _confirm(
    runs: Sequence[ChunkRun],
    chunk_size: int,
    on_device: dict[tuple[torch.device, int], list[_Member]],
    on_host: list[tuple[int, int]],
    after: dict[torch.device, torch.cuda.Event],
    priority: int,
) -> list[list[bool]]:
    import torch

    same = [[False] * len(run.indices) for run in runs]
    queued: list[tuple[list[_Member], tuple[torch.Tensor, torch.cuda.Stream]]] = []
    for (device, length), members in on_device.items():
        side = torch.cuda.Stream(device=device, priority=priority)
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


def _hash(members: list[_Member], length: int) -> tuple[torch.Tensor, torch.cuda.Stream]:
    """BLAKE3 words of ``members`` (all ``length`` bytes, one device) on the current stream, in batches."""
    import torch

    from gpumigrate.transfer.device import devhash

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


def _current_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded now on ``device``'s current stream (what the confirmation's side stream waits for)."""
    import torch

    event: torch.cuda.Event = torch.cuda.current_stream(device).record_event()
    return event
