"""The GPU map of a world: which GPU of the target each GPU of the source goes to, for the CUDA driver's restore.

``rank_gpu_pairs`` pairs the GPUs the ranks use (source rank r's i-th GPU onto target rank r's i-th), and
``gpu_pairs`` completes it over every GPU the driver sees (``dict(gpu_pairs(...))`` is what
``cuda_driver.CudaProcess.unsuspend(gpu_pairs=...)`` takes). UUIDs name the physical GPUs whatever
``CUDA_VISIBLE_DEVICES`` renumbered. No torch here: this runs in the orchestrator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpumigrate.errors import InvalidInputError


def canonical_uuid(text: str) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's and the driver's form) from any
    spelling of a GPU UUID (torch prints it without the prefix)."""
    digits = text.removeprefix("GPU-").replace("-", "").lower()
    if len(digits) != 32 or not all(c in "0123456789abcdef" for c in digits):
        raise InvalidInputError(f"{text!r} is not a GPU UUID (32 hex digits, optionally GPU- and dashes)")
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def rank_gpu_pairs(source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Old → new GPU UUID for the GPUs the ranks use: source rank r's i-th GPU goes to target rank r's i-th.

    ``source`` and ``target``: per-rank descriptions in rank order (the world manifest's ``ranks``,
    ``World.describe()``), each with ``gpus: [{"uuid": ...}, ...]``."""
    if len(source) != len(target):
        raise InvalidInputError(f"the source world has {len(source)} ranks, the target {len(target)}")
    pairs: dict[str, str] = {}
    for r, (src, dst) in enumerate(zip(source, target, strict=True)):
        old = [canonical_uuid(g["uuid"]) for g in src.get("gpus") or []]
        new = [canonical_uuid(g["uuid"]) for g in dst.get("gpus") or []]
        if len(old) != len(new):
            raise InvalidInputError(f"rank {r} uses {len(old)} GPU(s) on the source and {len(new)} on the target")
        for a, b in zip(old, new, strict=True):
            if pairs.setdefault(a, b) != b:
                raise InvalidInputError(f"GPU {a} would go to both {pairs[a]} and {b}")
    return pairs


def gpu_pairs(used: Mapping[str, str], visible: Sequence[str]) -> list[tuple[str, str]]:
    """The complete old → new pairing over every GPU in ``visible`` (the CUDA driver's ``gpuPairs``
    must name every GPU it sees, none twice): the ranks' GPUs as ``used`` says, each remaining GPU
    onto a remaining one in index order. UUIDs in the driver's form (``canonical_uuid``)."""
    used = {canonical_uuid(a): canonical_uuid(b) for a, b in used.items()}
    visible = [canonical_uuid(g) for g in visible]
    seen = set(visible)
    unknown = sorted((set(used) | set(used.values())) - seen)
    if unknown:
        raise InvalidInputError(
            f"GPU(s) {', '.join(unknown)} are not among those the driver sees: {', '.join(visible)}"
        )
    taken = set(used.values())
    if len(taken) != len(used):
        raise InvalidInputError("two GPUs of the source would go onto one GPU of the target")
    free_new = iter(g for g in visible if g not in taken)
    return [(g, used[g]) if g in used else (g, next(free_new)) for g in visible]
