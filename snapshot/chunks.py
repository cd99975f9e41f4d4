"""Byte views of tensors, chunk ranges, and the on-device chunk fingerprint used for dirty tracking.

A region's bytes are cut into fixed-size chunks (the writer's ``chunk_size``). Each pre-copy round
fingerprints every chunk where the tensor lives (HBM on a GPU) without copying it to the host: the
chunk is viewed as 32-bit words, each word sign-extended to 64 bits and multiplied by a fixed odd
64-bit weight, and the products summed mod 2**64 (a 64-bit fingerprint). Multiplying by an odd
number is a bijection mod 2**64, so any single changed word always changes the fingerprint. Words
are widened before the multiply so that a change confined to a word's high bits (a sign flip of two
floats, say) still lands in the low bits of the sum: with 32-bit products such a pair cancelled
every time; here a set of changes cancels only if their weighted sum is 0 mod 2**64.

The fingerprint is linear, so collisions can be built on purpose (the tests plant one); it only
decides what a *live* round re-sends. The frozen final round never trusts it alone: every chunk
it calls unchanged is BLAKE3-hashed and compared with the id it would reuse (``engine/capture.py``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np
import torch

DEFAULT_CHUNK_SIZE = 4 << 20
# The fingerprint processes at most this many bytes per launch, bounding the temporary it allocates.
_FP_BATCH_BYTES = 256 << 20
_WEIGHT_SEED = 0x6A09E667F3BCC908
_MT_HASH_BYTES = 8 << 20  # above this, BLAKE3 hashes one buffer on several threads

_weights_lock = threading.Lock()
_weights: dict[tuple[str, int], torch.Tensor] = {}
_compiled: dict[str, Any] = {}


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor sharing its memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be captured")
    # Detached only where autograd tracks it: state_dict's tensors are detached already, and a second detach per
    # tensor was a third of a 500-tensor model's region bookkeeping in every round.
    flat = tensor.detach() if tensor.requires_grad else tensor
    if flat.dim() != 1:  # most of a model's tensors are 1-D already (norms, biases): no reshape to make
        flat = flat.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    if flat.dim() == 0:
        flat = flat.reshape(1)
    return flat.view(torch.uint8)


def chunk_count(nbytes: int, chunk_size: int) -> int:
    return max(1, -(-nbytes // chunk_size)) if nbytes else 0


def chunk_weights(words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed odd 64-bit weights (int64) of the first ``words`` 32-bit words of every chunk."""
    device = torch.device(device)
    key = (str(device), words)
    with _weights_lock:
        w = _weights.get(key)
        if w is None:
            raw = np.random.Generator(np.random.PCG64(_WEIGHT_SEED)).integers(
                0, 2**64, size=words, dtype=np.uint64, endpoint=False
            )
            # Odd weights: multiplication by an odd number is invertible mod 2**64.
            w = torch.from_numpy((raw | np.uint64(1)).view(np.int64)).to(device)
            _weights[key] = w
        return w


def _weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row sums of ``x`` (int32 words, sign-extended) times ``w`` (int64), wrapping mod 2**64."""
    if x.device.type == "cpu":
        # torch's CPU integer reductions are slow; numpy's uint64 dot over the widened words is an order of
        # magnitude faster (bench/README.md). Unsigned arithmetic wraps mod 2**64 by definition; the int32 ->
        # uint64 cast is the sign extension mod 2**64, so the result has the same bits as the int64 path below.
        # Row by row, so that each widened row is still in cache when the dot reads it (a 2-D dot is slower).
        wu = w.numpy().view(np.uint64)
        out = np.fromiter((np.dot(row.astype(np.uint64), wu) for row in x.numpy()), dtype=np.uint64, count=len(x))
        return torch.from_numpy(out.view(np.int64))
    return (x.to(torch.int64) * w).sum(dim=1)


def _kernel(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The fused kernel on CUDA (one read of HBM per chunk) when torch.compile works; eager otherwise."""
    if device.type != "cuda" or os.environ.get("GPUMIGRATE_FP_COMPILE", "1") == "0":
        return _weighted_sum
    fn = _compiled.get("cuda")
    if fn is None:
        try:
            fn = torch.compile(_weighted_sum, dynamic=True, fullgraph=True)
        except Exception:  # no inductor/triton here: the eager version is still correct
            fn = _weighted_sum
        _compiled["cuda"] = fn
    return fn


def fingerprint_chunks(data: torch.Tensor, chunk_size: int, *, fused: bool = True) -> torch.Tensor:
    """One 64-bit fingerprint (int64) per chunk of ``data`` (flat uint8), computed on data's device.

    Returns a device tensor; callers batch several regions and copy the result to the host once.
    ``fused=False`` skips the compiled kernel (cheaper to launch for one chunk at a time).
    """
    nbytes = data.numel()
    n = chunk_count(nbytes, chunk_size)
    out = torch.empty(n, dtype=torch.int64, device=data.device)
    if n == 0:
        return out
    done = _full_fingerprints(data, chunk_size, out, fused=fused)
    for i in range(done, n):
        out[i] = _tail_fingerprint(data[i * chunk_size : (i + 1) * chunk_size])
    return out


def _full_fingerprints(data: torch.Tensor, chunk_size: int, out: torch.Tensor, *, fused: bool) -> int:
    """Fingerprints of ``data``'s whole, word-aligned chunks into ``out[:k]``; returns k (0 if unaligned)."""
    full = data.numel() // chunk_size
    if not full or data.storage_offset() % 4 or chunk_size % 4:
        return 0
    words = chunk_size // 4
    w = chunk_weights(words, data.device)
    kernel = _kernel(data.device) if fused else _weighted_sum
    per_batch = max(1, _FP_BATCH_BYTES // chunk_size)
    mat = data[: full * chunk_size].view(torch.int32).view(full, words)
    for start in range(0, full, per_batch):
        stop = min(full, start + per_batch)
        try:
            out[start:stop] = kernel(mat[start:stop], w)
        except Exception:
            if kernel is _weighted_sum:
                raise
            _compiled["cuda"] = _weighted_sum  # a compile failure must not stop a migration
            kernel = _weighted_sum
            out[start:stop] = kernel(mat[start:stop], w)
    return full


def _gathered_fingerprints(views: Mapping[str, torch.Tensor], chunk_size: int) -> dict[str, torch.Tensor]:
    """Fingerprints of the whole chunks of every word-aligned CUDA region, one launch per device (fp_kernels.py);
    regions it does not take (host memory, unaligned, no Triton) are left to :func:`_full_fingerprints`."""
    if chunk_size % 4 or not any(v.is_cuda for v in views.values()):
        return {}
    from gpumigrate.snapshot import fp_kernels

    if not fp_kernels.available():
        return {}
    words = chunk_size // 4
    by_device: dict[torch.device, list[tuple[str, torch.Tensor, int]]] = {}
    for name, data in views.items():
        full = data.numel() // chunk_size
        if data.is_cuda and full and data.data_ptr() % 4 == 0:
            by_device.setdefault(data.device, []).append((name, data, full))
    out: dict[str, torch.Tensor] = {}
    for device, members in by_device.items():
        anchor = members[0][1]
        base = anchor.data_ptr()
        offsets = [(data.data_ptr() - base) // 4 + i * words for _, data, full in members for i in range(full)]
        sums = fp_kernels.weighted_sums(anchor[:4].view(torch.int32), offsets, words, chunk_weights(words, device))
        at = 0
        for name, _, full in members:
            out[name] = sums[at : at + full]
            at += full
    return out


def _tail_fingerprint(piece: torch.Tensor) -> torch.Tensor:
    """Fingerprint of a short or unaligned chunk: byte-wise weights (rare: last chunk of a region)."""
    w = chunk_weights(max(piece.numel(), 1), piece.device)[: piece.numel()]
    return (piece.to(torch.int64) * w).sum() + piece.numel()


def _tail_fingerprints(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_tail_fingerprint` of each of several pieces of one length and device, in a few launches."""
    n = pieces[0].numel()
    w = chunk_weights(max(n, 1), pieces[0].device)[:n]
    return (torch.stack(list(pieces)).to(torch.int64) * w).sum(dim=1) + n


class Fingerprints:
    """Every chunk's fingerprint of many regions, left on their devices until :meth:`to_host`.

    A model has hundreds of tensors and most end in a short chunk (a bias, a norm's weight): one
    :func:`fingerprint_chunks` per region fingerprinted each of those alone, five launches and their
    Python apiece, on every round (most of the reference model's tensors). Here the whole
    chunks of each region go through the kernel as before, and the short chunks of all regions are
    fingerprinted together, stacked by length: the same values, in a handful of launches.
    """

    def __init__(self, views: Mapping[str, torch.Tensor], chunk_size: int) -> None:
        self.counts: dict[str, int] = {}
        self.full: dict[str, torch.Tensor] = {}  # region -> fingerprints of its first chunks, on its device
        tails: dict[tuple[torch.device, int], list[tuple[str, int, torch.Tensor]]] = {}
        gathered = _gathered_fingerprints(views, chunk_size)
        for name, data in views.items():
            n = chunk_count(data.numel(), chunk_size)
            self.counts[name] = n
            if name in gathered:
                self.full[name] = gathered[name]
                done = gathered[name].numel()
            else:
                out = torch.empty(n, dtype=torch.int64, device=data.device)
                done = _full_fingerprints(data, chunk_size, out, fused=True) if n else 0
                self.full[name] = out[:done]
            for i in range(done, n):
                piece = data[i * chunk_size : (i + 1) * chunk_size]
                tails.setdefault((data.device, piece.numel()), []).append((name, i, piece))
        # The stacked copy of one batch (as int64: 8 bytes a byte) is bounded like a whole-chunk batch.
        self.tails: list[tuple[torch.Tensor, list[tuple[str, int]]]] = []
        tails = self._gathered_tails(tails, chunk_size)
        for (_, length), members in tails.items():
            per_batch = max(1, _FP_BATCH_BYTES // 8 // max(1, length))
            for start in range(0, len(members), per_batch):
                part = members[start : start + per_batch]
                self.tails.append((_tail_fingerprints([p for _, _, p in part]), [(r, i) for r, i, _ in part]))

    def _gathered_tails(
        self, tails: dict[tuple[torch.device, int], list[tuple[str, int, torch.Tensor]]], chunk_size: int
    ) -> dict[tuple[torch.device, int], list[tuple[str, int, torch.Tensor]]]:
        """The short chunks of every length on each CUDA device in one launch (``fp_kernels.tail_sums``); returns
        those left for the stacked sums (other devices, or no Triton). A live round's batches hold a few short
        chunks of many lengths: stacked per length, each length was five launches and their GIL crossings."""
        cuda = [key for key in tails if key[0].type == "cuda"]
        if not cuda:
            return tails
        from gpumigrate.snapshot import fp_kernels

        if not fp_kernels.available():
            return tails
        by_device: dict[torch.device, list[tuple[str, int, torch.Tensor]]] = {}
        for key in cuda:
            by_device.setdefault(key[0], []).extend(tails[key])
        for device, members in by_device.items():
            anchor = members[0][2]
            base = anchor.data_ptr()
            sums = fp_kernels.tail_sums(
                anchor,
                [piece.data_ptr() - base for _, _, piece in members],
                [piece.numel() for _, _, piece in members],
                chunk_weights(max(chunk_size, max(p.numel() for _, _, p in members)), device),
            )
            self.tails.append((sums, [(name, i) for name, i, _ in members]))
        return {key: found for key, found in tails.items() if key[0].type != "cuda"}

    def to_host(self) -> dict[str, list[int]]:
        """Every region's fingerprints as Python ints: one device→host copy per device."""
        return fingerprints_to_host([self])[0]


def fingerprints_to_host(sets: Sequence[Fingerprints]) -> list[dict[str, list[int]]]:
    """Each set's :meth:`Fingerprints.to_host`, with one device→host copy per device for all the sets (a live
    round fingerprints each staged batch as a set of its own: one copy and one wait per batch otherwise)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for one in sets:
        for t in [*one.full.values(), *(t for t, _ in one.tails)]:
            parts.setdefault(str(t.device), []).append(t)
    flat: dict[str, list[int]] = {d: torch.cat(ts).cpu().tolist() for d, ts in parts.items()}
    pos = dict.fromkeys(flat, 0)
    found: list[dict[str, list[int]]] = []
    for one in sets:
        out: dict[str, list[int]] = {}
        for name, t in one.full.items():
            d = str(t.device)
            k = t.numel()
            out[name] = flat[d][pos[d] : pos[d] + k] + [0] * (one.counts[name] - k)
            pos[d] += k
        for t, members in one.tails:
            d = str(t.device)
            for (name, i), v in zip(members, flat[d][pos[d] : pos[d] + len(members)], strict=True):
                out[name][i] = v
            pos[d] += len(members)
        found.append(out)
    return found


def host_chunk_ids(pieces: Sequence[torch.Tensor]) -> list[str]:
    """Chunk ids (BLAKE3-256 of the bytes, transfer/FORMAT.md) of flat uint8 tensors, hashed on the host,
    one chunk per core (BLAKE3 releases the GIL); device tensors are copied to the host first."""

    def one(piece: torch.Tensor) -> str:
        data = piece.cpu().numpy().data if piece.numel() else b""
        threads = blake3.blake3.AUTO if len(data) >= _MT_HASH_BYTES else 1
        return blake3.blake3(data, max_threads=threads).hexdigest()

    if not pieces:
        return []
    with ThreadPoolExecutor(max_workers=min(len(pieces), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, pieces))


def unchanged_by_hash(
    pieces: Sequence[torch.Tensor], ids: Sequence[str], hasher: Callable[[Sequence[torch.Tensor]], list[str]] | None
) -> list[bool]:
    """Whether each chunk's bytes (flat uint8, any device) still hash to the id it would reuse.

    The frozen final round calls this for every chunk its fingerprint calls unchanged, so that no
    fingerprint collision reaches a committed image. ``hasher``: the image writer's own (a direct
    writer hashes CUDA chunks on their device); without one, :func:`host_chunk_ids`.
    """
    got = (hasher or host_chunk_ids)(pieces)
    return [g == want for g, want in zip(got, ids, strict=True)]
