"""Tensors WRITTEN by NIXL straight into the target's tensors, each chunk's BLAKE3 checked where it landed.

For two processes on one GPU host (UCX picks ``cuda_ipc``: a device-to-device copy, no host
bounce). The target (:class:`DeviceLanding`) registers its destination tensors and serves a small
control channel: JSON lines over TCP, every request signed with the control key and every reply
signed and bound to it (``gpumigrate.control``, channel ``receiver``). The source
(:class:`DeviceSender`) asks for the target's agent metadata and tensor addresses (``open``), names
the chunk ids the bytes must hash to (``expect``: from the image's signed manifest), WRITEs chunk
ranges, and after each WRITE is DONE sends ``landed``; the target hashes those chunks on the
device (``hasher``: the BLAKE3 kernels) and answers which ones failed, so the source sends them
again. The next WRITE overlaps the target's check of the last one on the host side; on the GPU the
two processes' work takes turns (no MPS), so a verified transfer costs the copy plus the hashing, and
few large WRITEs cost least (bench/transfer_link.py gpu reports each batch size).

Inside one host the chunks move as plaintext, unsealed: the copy never leaves the GPU's memory,
and both processes, the driver and the host OS are already trusted with the plaintext (the
workload holds it in clear). What is checked is that the bytes that landed are the bytes the
manifest names (TRANSPORTS.md, nixl:// on one GPU host). CPU tensors work too (UCX then copies
through shared memory or TCP), which is how CI runs this module.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumigrate import control
from gpumigrate.errors import IntegrityError, InvalidInputError, TransferError
from gpumigrate.transfer.nixl import make_agent
from gpumigrate.transfer.stream import CHANNEL, parse_listen

# hasher(block, chunk): BLAKE3 of each ``chunk``-byte piece of a contiguous uint8 tensor whose length is a
# multiple of ``chunk`` → [pieces, 8] int32 words (little-endian), computed where the block lives.
Hasher = Callable[[Any, int], Any]
MAX_LINE = 64 << 20  # one control message (the expected ids of a large image fit)
log = logging.getLogger(__name__)


def cpu_hasher(block: Any, chunk: int) -> Any:
    """BLAKE3 on the CPU, in the device kernels' output shape: for CPU tensors and pieces the kernels refuse."""
    import blake3
    import torch

    data = block.contiguous().cpu().numpy()
    digests = b"".join(blake3.blake3(data[o : o + chunk]).digest() for o in range(0, len(data), chunk))
    return torch.frombuffer(bytearray(digests), dtype=torch.int32).view(-1, 8)


def ids_to_words(ids: Sequence[str], device: Any) -> Any:
    """Hex BLAKE3 ids → [n, 8] int32 words on ``device`` (what the hash kernels produce)."""
    import torch

    raw = bytearray(b"".join(bytes.fromhex(i) for i in ids))
    return torch.frombuffer(raw, dtype=torch.int32).view(len(ids), 8).to(device)


def _flat(tensor: Any) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise InvalidInputError("a NIXL region must be a contiguous tensor")
    return tensor.view(-1).view(torch.uint8)


def _chunks(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(o, min(chunk_size, nbytes - o)) for o in range(0, nbytes, chunk_size)]


class _Channel:
    """Signed JSON lines over one TCP connection (CONTROL.md), one thread at a time per direction."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self.key = sock, key
        self.reader = sock.makefile("rb")

    def send(self, obj: Mapping[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def receive(self) -> dict[str, Any]:
        line = self.reader.readline(MAX_LINE + 1)
        if not line:
            raise ConnectionError("control channel closed")
        if len(line) > MAX_LINE:
            raise ConnectionError("control message too large")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
            self.sock.close()


# ----------------------------------------------------------------------------- target
@dataclass
class LandingResult:
    chunks_verified: int = 0
    chunks_failed: int = 0
    bytes_verified: int = 0
    seconds_hashing: float = 0.0
    failures: list[str] = field(default_factory=list)


class DeviceLanding:
    """The target: registered destination tensors, a signed control channel, BLAKE3 of every landed chunk.

    ``expected`` maps each region to its chunk ids, from the image's verified manifest; None lets
    the authenticated source name them (``expect``). ``hasher`` hashes equal-length views (default:
    the CPU; pass the device kernels on a GPU). :meth:`wait` returns once the source closed its connection.
    """

    def __init__(
        self,
        regions: Mapping[str, Any],
        *,
        chunk_size: int,
        control_key: bytes,
        hasher: Hasher | None = None,
        expected: Mapping[str, Sequence[str]] | None = None,
        listen: str = "127.0.0.1:0",
        transports: str | None = None,
    ) -> None:
        self.regions = {name: _flat(t) for name, t in regions.items()}
        self.chunk_size = chunk_size
        self.key = control_key
        self.hasher = hasher or cpu_hasher
        self.agent = make_agent("land", transports=transports)
        self._reg = self.agent.register_memory(list(self.regions.values()))
        self._expected: dict[str, Any] = {}
        if expected is not None:
            self._expect(expected)
        self.result = LandingResult()
        self._done = threading.Event()
        self._guard = control.ReplayGuard()
        host, port = parse_listen(listen)
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="gm-nixl-landing", daemon=True)
        self._thread.start()

    def _expect(self, expected: Mapping[str, Sequence[str]]) -> None:
        for name, ids in expected.items():
            region = self.regions.get(name)
            if region is None or len(ids) != len(_chunks(region.numel(), self.chunk_size)):
                raise IntegrityError(f"expected ids for region {name!r} do not match its chunks")
            self._expected[name] = ids_to_words(list(ids), region.device)

    def _serve(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        channel = _Channel(conn, self.key)
        try:
            while True:  # one source, until it closes the connection
                message = channel.receive()
                try:
                    body, nonce = control.verify_request(self.key, CHANNEL, message, self._guard)
                except control.AuthError as exc:
                    channel.send({"error": exc.message})  # unsigned: the client treats it as a failure
                    return
                channel.send(control.sign_reply(self.key, CHANNEL, nonce, self._answer(body)))
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
            return {
                "agent": self.agent.name,
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "mem": "VRAM" if next(iter(self.regions.values())).is_cuda else "DRAM",
                "chunk_size": self.chunk_size,
                "regions": {n: [t.data_ptr(), t.numel(), max(t.get_device(), 0)] for n, t in self.regions.items()},
            }
        if op == "expect":
            self._expect(body["ids"])
            return {"ok": True}
        if op == "landed":
            return {"bad": self._verify(str(body["region"]), int(body["first"]), int(body["count"]))}
        if op == "done":  # the end of one pass; the counts are cumulative over the connection
            return {"ok": True, **self.result.__dict__}
        return {"error": f"unknown op {str(op)[:20]!r}"}

    def _verify(self, name: str, first: int, count: int) -> list[int]:
        """Hash chunks ``first .. first+count-1`` of a region where they landed; return the failing indices."""
        region, want = self.regions[name], self._expected.get(name)
        if want is None:
            raise IntegrityError(f"no expected ids for region {name!r}: nothing landed there can be trusted")
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

    def _hash(self, block: Any, chunk: int) -> Any:
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
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


# ----------------------------------------------------------------------------- source
class DeviceSender:
    """The source: WRITEs its tensors' chunks into a :class:`DeviceLanding` at ``address`` (host:port)."""

    def __init__(
        self, address: str, tensors: Mapping[str, Any], *, control_key: bytes, transports: str | None = None
    ) -> None:
        host, port = parse_listen(address)
        self.key = control_key
        self.tensors = {name: _flat(t) for name, t in tensors.items()}
        self.agent = make_agent("push", transports=transports)
        self._reg = self.agent.register_memory(list(self.tensors.values()))
        try:
            sock = socket.create_connection((host, port), timeout=30)
        except OSError as exc:
            raise TransferError(f"cannot reach the device landing at {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel = _Channel(sock, control_key)
        self._waiting: list[tuple[str, str]] = []  # (nonce, region) of ``landed`` notices whose replies are unread
        offer = self.call({"op": "open"})
        self.chunk_size = int(offer["chunk_size"])
        self.remote = offer["agent"]
        self.agent.add_remote_agent(base64.b64decode(offer["metadata"]))
        self._lists: dict[str, tuple[Any, Any, int]] = {}
        for name, t in self.tensors.items():
            addr, nbytes, dev = offer["regions"][name]
            if nbytes != t.numel():
                raise InvalidInputError(f"region {name}: {t.numel()} bytes here, {nbytes} at the target")
            spans = _chunks(nbytes, self.chunk_size)
            mem = "VRAM" if t.is_cuda else "DRAM"
            here = [(t.data_ptr() + o, n, max(t.get_device(), 0)) for o, n in spans]
            there = [(int(addr) + o, n, int(dev)) for o, n in spans]
            self._lists[name] = (
                self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", here, mem),
                self.agent.prep_xfer_dlist(self.remote, there, offer["mem"]),
                len(spans),
            )

    def _post(self, body: Mapping[str, Any]) -> str:
        request = control.sign_request(self.key, CHANNEL, body)
        self.channel.send(request)
        return str(request["auth"]["nonce"])

    def _reply(self, nonce: str) -> dict[str, Any]:
        message = self.channel.receive()
        try:
            body = control.verify_reply(self.key, CHANNEL, nonce, message)
        except (control.AuthError, KeyError, TypeError):
            raise control.AuthError(
                f"the device landing refused or failed: {message.get('error', 'bad reply')}"
            ) from None
        if "error" in body:
            raise TransferError(f"the device landing failed: {body['error']}")
        return body

    def call(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.collect()
        return self._reply(self._post(body))

    def expect(self, ids: Mapping[str, Sequence[str]]) -> None:
        self.call({"op": "expect", "ids": {k: list(v) for k, v in ids.items()}})

    def write(self, name: str, first: int, count: int, *, announce: bool = True) -> None:
        """WRITE chunks ``first .. first+count-1`` of a region, then announce them (the reply is read later).

        ``announce=False`` only copies (a benchmark's baseline: nothing is checked, nothing trusted)."""
        local, remote, _ = self._lists[name]
        indices = list(range(first, first + count))
        handle = self.agent.make_prepped_xfer("WRITE", local, indices, remote, indices)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
        finally:
            handle.release()
        if state != "DONE":
            raise TransferError(f"NIXL WRITE of {name}[{first}:{first + count}] failed ({state})")
        if announce:
            self.announce(name, first, count)

    def announce(self, name: str, first: int, count: int) -> None:
        """Tell the target these chunks landed; it checks them (the reply, read later, names failures)."""
        self._waiting.append((self._post({"op": "landed", "region": name, "first": first, "count": count}), name))

    def collect(self) -> list[tuple[str, int]]:
        """Read every outstanding ``landed`` reply; return the chunks that failed their check."""
        bad: list[tuple[str, int]] = []
        waiting, self._waiting = self._waiting, []
        for nonce, name in waiting:
            bad += [(name, int(i)) for i in self._reply(nonce)["bad"]]
        return bad

    def send_all(self, *, batch: int = 256, retries: int = 2) -> dict[str, Any]:
        """Every chunk of every region, ``batch`` chunks per WRITE; failed chunks are sent again."""
        todo = [(name, i, min(batch, n - i)) for name, (_, _, n) in self._lists.items() for i in range(0, n, batch)]
        resent = 0
        for _attempt in range(retries + 1):
            failed: list[tuple[str, int]] = []
            for name, first, count in todo:
                self.write(name, first, count)
                if len(self._waiting) > 1:  # one check stays in flight behind the next WRITE
                    failed += self._reply_one()
            failed += self.collect()
            if not failed:
                return {**self.call({"op": "done"}), "chunks_resent": resent}
            resent += len(failed)
            todo = [(name, i, 1) for name, i in failed]
        raise IntegrityError(f"{len(todo)} chunks still failed their BLAKE3 check after {retries} resends")

    def _reply_one(self) -> list[tuple[str, int]]:
        nonce, name = self._waiting.pop(0)
        return [(name, int(i)) for i in self._reply(nonce)["bad"]]

    def close(self) -> None:
        self.channel.close()
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)
