"""Tensors moved straight into the target's tensors on one host, each chunk's BLAKE3 checked where it landed.

For two processes on one GPU host. The target (:class:`DeviceLanding`) holds its destination
tensors and serves a small control channel (``channel.py``): JSON lines over TCP, every request signed
with the control key and every reply signed and bound to it (``gpumigrate.control``, channel ``receiver``).
The source (:class:`~.sender.DeviceSender`, ``sender.py``) names the chunk ids the bytes must hash to (``expect``: from the
image's signed manifest; or the target is given them itself), then moves them one of three ways:

* ``send_all``: the source WRITEs chunk ranges with NIXL (UCX picks ``cuda_ipc``: device to device,
  no host bounce) and after each WRITE sends ``landed``; the target hashes those chunks on the
  device (``hasher``: the BLAKE3 kernels) and answers which ones failed, which the source sends
  again. The two processes' work takes turns on the GPU (no MPS), so this costs the copy plus the
  check; few large WRITEs cost least.
* ``pull_all``: the source ``offer``s its agent metadata and addresses, and the target READs with
  NIXL, checking each batch while its next READ moves (one process: the two can run side by side).
  UCX leaves cuda_ipc READs off on GPUs without NVLink; the agents here turn them on (``LANDING_UCX``).
* ``lend_all``: the source sends CUDA IPC handles of its allocations (``cuda_ipc``; PyTorch's
  per-tensor sharing where the driver cannot export one) and the target copies the regions itself
  with the kernel that hashes the words it stores (``lend.py``, ``devhash.blake3_copy_gather``):
  one pass over memory instead of two. Device memory only.

All three check every chunk on the target and name the ones that still fail after their retries.
TRANSPORTS.md compares them (bench/transfer_link.py gpu).

Inside one host the chunks move as plaintext, unsealed: the copy never leaves the GPU's memory,
and both processes, the driver and the host OS are already trusted with the plaintext (the
workload holds it in clear). What is checked is that the bytes that landed are the bytes the
manifest names (TRANSPORTS.md, nixl:// on one GPU host). CPU tensors work too (UCX then copies
through shared memory or TCP), which is how CI runs this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumigrate import control
from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.stageclock import STAGES, log_stages
from gpumigrate.transfer.device import cuda_ipc
from gpumigrate.transfer.device.channel import Channel, PairedLists, describe, flat, pair_lists, ucx_for
from gpumigrate.transfer.device.devhash import Hasher, cpu_hasher
from gpumigrate.transfer.device.expected import ExpectedIds
from gpumigrate.transfer.device.lend import Hashed, Landed, copy_and_hash, hash_landed
from gpumigrate.transfer.stores.nixl_agent import NixlAgent, XferHandle, make_agent
from gpumigrate.transfer.stores.wire import CHANNEL, parse_listen

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 60.0  # one READ of a batch; a transfer that stalls fails instead of hanging its source
PendingRead = tuple[XferHandle, str, float]  # a posted READ: its handle, its state when last asked, when it was posted


@dataclass
class LandingResult:
    chunks_verified: int = 0
    chunks_failed: int = 0
    bytes_verified: int = 0
    seconds_hashing: float = 0.0
    seconds_opening: float = 0.0  # lend: mapping the source's CUDA IPC handles into this process
    seconds_passes: float = 0.0  # lend and pull passes, whole (opening, copies, checks, retries, release)
    failures: list[str] = field(default_factory=list)


class DeviceLanding:
    """The target: registered destination tensors, a signed control channel, BLAKE3 of every landed chunk.

    ``expected`` maps each region to its chunk ids, from the image's verified manifest; None lets
    the authenticated source name them (``expect``). ``hasher`` hashes equal-length views (default:
    the CPU; pass the device kernels on a GPU). :meth:`wait` returns once the source closed its connection.
    """

    def __init__(
        self,
        regions: Mapping[str, torch.Tensor],
        *,
        chunk_size: int,
        control_key: bytes,
        hasher: Hasher | None = None,
        expected: Mapping[str, Sequence[str]] | None = None,
        listen: str = "127.0.0.1:0",
        transports: str | None = None,
        nixl: bool = True,
        ucx_settings: Mapping[str, str] | None = None,
    ) -> None:
        self.regions = {name: flat(t) for name, t in regions.items()}
        # what a lend must find at the source for each region: its size, or -1 (never lent) for host memory
        self._lend_sizes = {name: t.numel() if t.is_cuda else -1 for name, t in self.regions.items()}
        self.chunk_size = chunk_size
        self.key = control_key
        self.hasher = hasher or cpu_hasher
        # nixl=False: a landing for lend only (CUDA IPC), with no NIXL agent to start or memory to register
        self.agent: NixlAgent | None = (
            make_agent("land", transports=transports, ucx_settings=ucx_for(self.regions.values(), ucx_settings))
            if nixl
            else None
        )
        self._reg = self.agent.register_memory(list(self.regions.values())) if self.agent is not None else None
        self._expected = ExpectedIds(self.regions, chunk_size)
        if expected is not None:
            self._expected.set(expected)
        self.result = LandingResult()
        self.last_bad: list[str] = []  # the chunks the last lend or pull left failing, after its retries
        self._pull_lists: dict[str, PairedLists] = {}
        self._lent: list[cuda_ipc.LentMemory] = []  # the source's memory mapped by lend passes, until released
        self._passing = threading.Lock()  # held by a lend pass: its mappings are not released under it
        self._done = threading.Event()
        self._guard = control.ReplayGuard()
        host, port = parse_listen(listen)
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="gm-nixl-landing", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        channel = Channel(conn, self.key)
        try:
            while True:  # one source, until it closes the connection
                t = time.perf_counter()
                message = channel.receive()
                t = STAGES.add("landing.read", t)
                try:
                    body, nonce = control.verify_request(self.key, CHANNEL, message, self._guard)
                except control.AuthError as exc:
                    channel.send({"error": exc.message})  # unsigned: the client treats it as a failure
                    return
                t = STAGES.add("landing.verify", t)
                answer = self._answer(body)
                t = time.perf_counter()
                channel.send(control.sign_reply(self.key, CHANNEL, nonce, answer))
                STAGES.add("landing.reply", t)
                if body.get("op") == "lend":
                    log_stages("lend")  # where GPUMIGRATE_STAGES_LOG asks for them
        except (OSError, ConnectionError, ValueError):
            return
        finally:
            channel.close()
            self._done.set()

    def _answer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`_handle`, with whatever NIXL, UCX or CUDA raised turned into an error reply: the source
        learns what failed instead of waiting on a landing whose thread died."""
        try:
            return self._handle(body)
        except Exception as exc:  # noqa: BLE001 - any failure of the libraries below ends this request only
            log.warning("device landing: %s failed: %s: %s", body.get("op"), type(exc).__name__, exc)
            return {"error": f"{body.get('op')} failed here: {type(exc).__name__}: {str(exc)[:300]}"}

    def _handle(self, body: Mapping[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if op == "open":
            described = describe(self.agent, self.regions) if self.agent is not None else {}
            return {**described, "chunk_size": self.chunk_size}
        if op == "expect":
            self._expected.set(body["ids"])
            return {"ok": True}
        if op == "landed":
            return {"bad": self._verify(str(body["region"]), int(body["first"]), int(body["count"]))}
        if op == "offer":
            return self._accept_offer(body)
        if op in ("lend", "pull"):
            t0 = time.perf_counter()
            try:
                if op == "lend":
                    with self._passing:
                        reply = self._lend(body)
                else:
                    reply = self._pull(max(1, int(body.get("batch", 256))), max(0, int(body.get("retries", 2))))
            finally:
                self.result.seconds_passes += time.perf_counter() - t0
            # the counts so far ride on the pass's reply: the source needs no second round trip for them
            return {**reply, **self.result.__dict__} if "bad" in reply else reply
        if op == "done":  # the end of one pass; the counts are cumulative over the connection
            return {"ok": True, **self.result.__dict__}
        return {"error": f"unknown op {str(op)[:20]!r}"}

    def _lend(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Copy every region out of the source's own memory, opened through CUDA IPC, and check it on the way.

        The allocations are mapped on a thread in region order while the copies of the first regions run
        (``cuda_ipc.Mapped.map_ahead``); :func:`lend.copy_and_hash` copies every chunk with the kernel
        that hashes what it stores, many regions per launch. All hashes are compared at the end, one wait for the
        device (:meth:`_compare`). Chunks that fail are copied again, ``retries`` times at most; the reply names
        those that still fail."""
        import torch

        batch, retries = max(1, int(body.get("batch", 256))), max(0, int(body.get("retries", 2)))
        t_start = time.perf_counter()
        self._release_lent()  # a previous pass's mappings (the same allocations may come again)
        t = STAGES.add("lend.release", t_start)
        size = self.chunk_size
        timing = bool(os.environ.get("GPUMIGRATE_STAGES_LOG"))
        try:
            source = cuda_ipc.open_lent(body, next(iter(self.regions.values())).device)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return {"error": f"cannot open the lent memory ({type(exc).__name__}: {str(exc)[:120]})"}
        self._lent.append(source)
        source.map_ahead(list(self.regions))  # mapped in region order on another thread while this one copies
        lent = {name: nbytes for name, (_, _, nbytes) in source.regions.items()}
        wrong = next((name for name, n in self._lend_sizes.items() if lent.get(name) != n), None)
        if wrong is not None:
            return {
                "error": f"region {wrong}: the source lent {lent.get(wrong, 0)} bytes of device memory, "
                f"{self.regions[wrong].numel()} here"
            }
        gpu_marks: list[torch.cuda.Event] = []

        def mark_first_launch() -> None:
            if timing:
                STAGES.add("lend.until_first_launch", t_start)
                gpu_marks.append(torch.cuda.Event(enable_timing=True))
                gpu_marks[0].record()

        t = STAGES.add("lend.open_memory", t)
        hashed = copy_and_hash(self.regions, source, size, batch, self._hash_landed, mark_first_launch)
        if gpu_marks:
            gpu_marks.append(torch.cuda.Event(enable_timing=True))
            gpu_marks[1].record()
        self.result.seconds_opening += source.seconds_opening
        t = time.perf_counter()
        failed = self._compare(hashed)
        t = STAGES.add("lend.compare", t)

        def copy_again(name: str, i: int) -> None:
            a, b = i * size, min((i + 1) * size, self.regions[name].numel())
            self.regions[name][a:b].copy_(source.tensor(name)[a:b])

        reply = self._retry(failed, retries, copy_again)
        torch.cuda.synchronize()  # every copy landed before the source hears the reply
        if isinstance(source, cuda_ipc.TorchLent):
            self._release_lent()
        STAGES.add("lend.retry_sync", t)
        if timing:
            STAGES.set("lend.opening", source.seconds_opening)
            STAGES.set("lend.mapping", getattr(source, "seconds_mapping", 0.0))
            if len(gpu_marks) == 2:
                STAGES.set("lend.gpu_gather", gpu_marks[0].elapsed_time(gpu_marks[1]) / 1000)
        return reply

    def _release_lent(self) -> None:
        """Unmap the source's memory mapped by earlier passes. Mappings by allocation are kept past the reply (the
        source waits for the reply, not for this) and go here: at the next pass, or when the landing closes."""
        lent, self._lent = self._lent, []
        for source in lent:
            source.close()

    def _retry(
        self, failed: list[tuple[str, int]], retries: int, move_again: Callable[[str, int], None]
    ) -> dict[str, Any]:
        """Chunks that failed their check moved again (``move_again(region, index)``) and checked again,
        ``retries`` times at most; the pass's reply (:meth:`_passed`)."""
        resent = 0
        for _ in range(retries):
            if not failed:
                break
            resent += len(failed)
            again: list[tuple[str, int]] = []
            for name, i in failed:
                move_again(name, i)
                again += [(name, j) for j in self._verify(name, i, 1)]
            failed = again
        return self._passed(failed, resent)

    def _passed(self, failed: list[tuple[str, int]], resent: int) -> dict[str, Any]:
        """A landing pass's reply; :attr:`last_bad` keeps the chunks that still fail, for the process that owns
        the landing (a tolerant pass's source does not raise on them)."""
        self.last_bad = [f"{name}[{i}]" for name, i in failed]
        return {"bad": self.last_bad, "chunks_resent": resent}

    def _accept_offer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The source's agent and tensor addresses, for READs this side drives (:meth:`_pull`)."""
        if self.agent is None:
            return {"error": "this landing takes lend only (opened without NIXL)"}
        try:
            self._pull_lists = pair_lists(self.agent, self.regions, body, self.chunk_size, "source")
        except InvalidInputError as exc:
            return {"error": exc.message}
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"a malformed offer ({type(exc).__name__}: {str(exc)[:80]})"}
        return {"ok": True}

    def _pull(self, batch: int, retries: int) -> dict[str, Any]:
        """READ every chunk from the source, ``batch`` chunks per READ, and check each batch while the next moves.

        The copy (UCX's stream) and the BLAKE3 kernels (a stream of this process) run side by side on the
        GPU because both belong to this process; when the source WRITEs, the two processes' work takes
        turns on the device. Chunks that fail are read again, ``retries`` times at most; the reply names
        those that still fail."""
        if not self._pull_lists:
            return {"error": "nothing offered yet: the source sends 'offer' before 'pull'"}
        failed: list[tuple[str, int]] = []
        with self._hash_stream():
            for name, (local, remote, n) in self._pull_lists.items():
                spans = [(i, min(batch, n - i)) for i in range(0, n, batch)]
                pending: PendingRead | None = self._read(local, remote, spans[0])
                for k, (first, count) in enumerate(spans):
                    self._finish(pending, name, first, count)
                    pending = self._read(local, remote, spans[k + 1]) if k + 1 < len(spans) else None
                    failed += [(name, i) for i in self._verify(name, first, count)]  # beside the next READ

            def read_again(name: str, i: int) -> None:
                local, remote, _ = self._pull_lists[name]
                self._finish(self._read(local, remote, (i, 1)), name, i, 1)

            return self._retry(failed, retries, read_again)

    def _hash_stream(self) -> AbstractContextManager[object]:
        """A CUDA stream of this process for the checks, or nothing to switch for host memory."""
        region = next(iter(self.regions.values()))
        if not region.is_cuda:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(torch.cuda.Stream(device=region.device))

    def _nixl(self) -> NixlAgent:
        """The landing's NIXL agent (a READ is offered only where there is one: :meth:`_accept_offer`)."""
        if self.agent is None:
            raise TransferError("this landing takes lend only (opened without NIXL)")
        return self.agent

    def _read(self, local: object, remote: object, span: tuple[int, int]) -> PendingRead:
        indices = list(range(span[0], span[0] + span[1]))
        agent = self._nixl()
        handle = agent.make_prepped_xfer("READ", local, indices, remote, indices)
        return handle, agent.transfer(handle), time.monotonic()

    def _finish(self, pending: PendingRead | None, name: str, first: int, count: int) -> None:
        """Wait for one READ; a READ that neither completes nor fails within READ_TIMEOUT_S is an error."""
        if pending is None:
            return
        handle, state, posted = pending
        try:
            while state == "PROC":
                if time.monotonic() - posted > READ_TIMEOUT_S:
                    raise TransferError(
                        f"NIXL READ of {name}[{first}:{first + count}] still pending after {READ_TIMEOUT_S} s"
                    )
                state = self._nixl().check_xfer_state(handle)
        finally:
            handle.release()
        if state != "DONE":
            raise TransferError(f"NIXL READ of {name}[{first}:{first + count}] failed ({state})")

    def _verify(self, name: str, first: int, count: int) -> list[int]:
        """Hash chunks ``first .. first+count-1`` of a region where they landed; return the failing indices."""
        region, want = self.regions[name], self._expected.rows(name)
        n, size = region.numel(), self.chunk_size
        end = min(first + count, -(-n // size))
        whole = min(end, n // size)  # chunks before this one are full-size; a region's last may be shorter
        t0 = time.perf_counter()
        words = []
        if whole > first:
            words.append(self._hash(region[first * size : whole * size], size))
        if end > whole:
            tail = region[whole * size : n]
            words.append(self._hash(tail, tail.numel()))
        import torch

        got = torch.cat(words) if len(words) > 1 else words[0]
        mismatch = (got.to(want.device) != want[first:end]).any(dim=1)
        bad = [first + int(i) for i in mismatch.nonzero().flatten().tolist()]  # the one wait for the device
        self.result.seconds_hashing += time.perf_counter() - t0
        self.result.chunks_verified += end - first - len(bad)
        self.result.chunks_failed += len(bad)
        self.result.bytes_verified += min(end * size, n) - first * size
        self.result.failures += [f"{name}[{i}]" for i in bad]
        return bad

    def _hash_landed(self, landed: Sequence[Landed]) -> list[Hashed]:
        return hash_landed(landed, self._hash)

    def _compare(self, hashed: Sequence[Hashed]) -> list[tuple[str, int]]:
        """Hashes computed where the chunks landed against the expected ids, all at once: one gather of the
        expected words and one wait for the device per pass."""
        if not hashed:
            return []
        t0 = time.perf_counter()
        keys = [key for h in hashed for key in h.keys]
        bad = [keys[p] for p in self._expected.differing(keys, [h.words for h in hashed])]
        self.result.seconds_hashing += time.perf_counter() - t0
        self.result.chunks_verified += len(keys) - len(bad)
        self.result.chunks_failed += len(bad)
        self.result.bytes_verified += sum(h.nbytes for h in hashed)
        self.result.failures += [f"{name}[{i}]" for name, i in bad]
        return bad

    def _hash(self, block: torch.Tensor, chunk: int) -> torch.Tensor:
        """The device hasher where its kernels apply (whole 1 KiB leaves), else the CPU."""
        return (self.hasher if chunk % 1024 == 0 else cpu_hasher)(block, chunk)

    def wait(self, timeout_s: float | None = None) -> LandingResult:
        if not self._done.wait(timeout_s):
            raise TransferError("the source did not finish the device transfer in time")
        return self.result

    def close(self) -> None:
        self._done.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._passing.acquire(timeout=10):  # a pass still running keeps its mappings (a leak, never a fault)
            try:
                self._release_lent()
            finally:
                self._passing.release()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._reg)
