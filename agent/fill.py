"""The transfer engine's two ends of a fill from the source (``snapshot/fill.py``), wired into the agent.

The target's agent opens a :class:`~gpumigrate.transfer.device.landing.DeviceLanding` over the slices of
its own tensors that the restore must fill, with the chunk ids from the image's signed manifest, and
asks the source's agent (``lend`` on its signed control channel) to move the same slices into it:

* device memory: ``lend_all``. The source sends CUDA IPC handles; the target copies device to device and
  hashes every chunk on the device as it copies it into place (``DeviceLanding._lend``). No NIXL agent is started on either side.
* host memory: ``pull_all``. The target READs through NIXL (UCX over shared memory or TCP) and hashes on
  the CPU. This is how CI runs the whole path.

Both ends use the lend key the orchestrator granted the target for this source (``gpumigrate/agent_keys.py``):
the target's ``lend`` request and the landing's channel are signed with it, and a landing that anyone else
connects to refuses them before the first byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumigrate.agent.warmup import wait_for_kernels
from gpumigrate.errors import GpumigrateError, TransferError
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.fill import Landed, Run, failed_chunks, slices

if TYPE_CHECKING:
    import torch

# Host memory between two processes of one host: UCX's shared-memory transports carry the bytes, and its TCP
# (which it needs to wire the two up) listens on loopback only: a fill never leaves the host.
HOST_TRANSPORTS = "shm,tcp"
HOST_UCX = {"UCX_NET_DEVICES": "lo"}
LEND_TIMEOUT_S = 600.0  # one fill of the whole state; a stalled source fails it instead of hanging the restore
RETRIES = 2  # a chunk that fails its check is copied again this often; then the restore reads it from the image


def _way_of(tensor: torch.Tensor) -> str:
    """lend for device memory (one GPU host, CUDA IPC), pull for host memory (NIXL)."""
    return "lend" if tensor.is_cuda else "pull"


def _way(tensors: Mapping[str, Any]) -> str:
    """The one way of a landing's tensors (a landing takes one kind of memory)."""
    ways = {_way_of(t) for t in tensors.values()}
    if len(ways) != 1:
        raise TransferError("one landing moves device or host memory, not both: the target splits its runs by kind")
    return ways.pop()


def _transport(way: str) -> dict[str, Any]:
    """What both ends of a landing open for ``way``: NIXL, on the host's own transports, only to pull."""
    pull = way == "pull"
    return {
        "nixl": pull,
        "transports": HOST_TRANSPORTS if pull else None,
        "ucx_settings": HOST_UCX if pull else None,
    }


def _hasher(tensors: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor, int], Any]:
    from gpumigrate.transfer.device.devhash import cpu_hasher

    first = next(iter(tensors.values()))
    if not first.is_cuda:
        return cpu_hasher
    from gpumigrate.transfer.device import devhash

    return devhash.blake3_chunks if devhash.available(first.device) else cpu_hasher


class SourceFill:
    """:class:`~gpumigrate.snapshot.fill.Filler` through ``transfer/device/landing.py`` and ``sender.py``."""

    def land(
        self,
        source: str,
        targets: Mapping[str, Any],
        runs: Sequence[Run],
        expected: Mapping[str, Sequence[str]],
        chunk_size: int,
        *,
        control_key: bytes,
    ) -> Landed:
        t0 = time.perf_counter()
        phases: dict[str, float] = {"kernel_compile_wait": wait_for_kernels()}
        regions = slices(targets, runs, chunk_size)
        by_way: dict[str, list[Run]] = {}
        for run in runs:  # one landing per kind of memory: device runs are lent, host runs pulled
            by_way.setdefault(_way_of(regions[run.name]), []).append(run)
        failed: list[tuple[str, int]] = []
        for way, part in sorted(by_way.items()):
            failed += self._land(
                source, {r.name: regions[r.name] for r in part}, part, expected, chunk_size, way, control_key, phases
            )
        return Landed(
            bytes_moved=sum(v.numel() for v in regions.values()),
            failed=failed,
            seconds=time.perf_counter() - t0,
            way="+".join(sorted(by_way)),
            phases={k: round(v, 4) for k, v in phases.items()},
        )

    def _land(
        self,
        source: str,
        regions: Mapping[str, Any],
        runs: Sequence[Run],
        expected: Mapping[str, Sequence[str]],
        chunk_size: int,
        way: str,
        control_key: bytes,
        phases: dict[str, float],
    ) -> list[tuple[str, int]]:
        from gpumigrate.transfer.device.landing import DeviceLanding

        started = time.perf_counter()
        ids = {run.name: list(expected[run.region][run.first : run.first + run.count]) for run in runs}
        landing = DeviceLanding(
            regions,
            chunk_size=chunk_size,
            control_key=control_key,
            hasher=_hasher(regions),
            expected=ids,
            **_transport(way),
        )
        try:
            t0 = time.perf_counter()
            with AgentClient(
                source, lend_key=control_key, timeout_s=LEND_TIMEOUT_S + 30
            ) as client:  # the source's side
                lent = client.call(
                    "lend",
                    landing=landing.address,
                    runs=[r.to_json() for r in runs],
                    chunk_size=chunk_size,
                    tolerate=True,  # the restore reads what still fails from the image
                )
            landing.wait(30)
            seen = landing.result
            for phase, seconds in (
                ("setup", t0 - started),
                ("source_sharing", float(lent.get("seconds_sharing", 0.0))),
                ("source_lend", float(lent.get("seconds", 0.0))),  # from when the source agent holds its lock
                *((f"source_{k}", float(v)) for k, v in dict(lent.get("source_phases") or {}).items()),
                ("opening", seen.seconds_opening),
                ("landing_passes", seen.seconds_passes),
                ("checking", seen.seconds_hashing),
                ("call", time.perf_counter() - t0),
            ):
                phases[phase] = phases.get(phase, 0.0) + seconds
        except GpumigrateError as exc:
            raise TransferError(f"the fill from the source agent at {source} failed: {exc.message}") from None
        finally:
            landing.close()
        return failed_chunks(landing.last_bad, runs)

    def lend(self, landing: str, tensors: Mapping[str, Any], *, control_key: bytes, tolerate: bool) -> dict[str, Any]:
        from gpumigrate.transfer.device.sender import DeviceSender

        way = _way(tensors)
        t0 = time.perf_counter()
        sender = DeviceSender(landing, tensors, control_key=control_key, **_transport(way))
        t1 = time.perf_counter()
        try:
            if way == "lend":
                done = sender.lend_all(retries=RETRIES, timeout_s=LEND_TIMEOUT_S, tolerate=tolerate)
            else:
                done = sender.pull_all(retries=RETRIES, timeout_s=LEND_TIMEOUT_S, tolerate=tolerate)
        finally:
            t2 = time.perf_counter()
            sender.close()
        return {
            "way": way,
            "chunks_resent": int(done.get("chunks_resent", 0)),
            "seconds_sharing": float(done.get("seconds_sharing", 0.0)),
            "shared_by": done.get("shared_by"),
            # where the source's side of the lend went: connecting to the landing, the pass, closing
            "source_phases": {
                "connect": round(t1 - t0, 4),
                "pass": round(t2 - t1, 4),
                "close": round(time.perf_counter() - t2, 4),
            },
        }
