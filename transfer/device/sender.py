"""The source of a one-host device transfer: its tensors' chunks moved into a :class:`~.landing.DeviceLanding`.

The sender names the chunk ids the bytes must hash to (``expect``), then moves them one of three ways (the
landing's module docstring says how each works): ``send_all`` (NIXL WRITEs, each batch announced and checked),
``pull_all`` (the target READs) or ``lend_all`` (the target copies out of this process's memory through CUDA IPC).
Every request goes over the signed control channel (``channel.py``).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumigrate import control
from gpumigrate.errors import IntegrityError, InvalidInputError, TransferError
from gpumigrate.stageclock import STAGES
from gpumigrate.transfer.device import cuda_ipc
from gpumigrate.transfer.device.channel import Channel, PairedLists, describe, flat, pair_lists, ucx_for
from gpumigrate.transfer.stores.nixl_agent import NixlAgent, make_agent
from gpumigrate.transfer.stores.wire import CHANNEL, parse_listen

if TYPE_CHECKING:
    import torch


class DeviceSender:
    """The source: WRITEs its tensors' chunks into a :class:`DeviceLanding` at ``address`` (host:port)."""

    def __init__(
        self,
        address: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        control_key: bytes,
        transports: str | None = None,
        nixl: bool = True,
        ucx_settings: Mapping[str, str] | None = None,
    ) -> None:
        host, port = parse_listen(address)
        self.key = control_key
        self.tensors = {name: flat(t) for name, t in tensors.items()}
        # nixl=False: lend_all only (CUDA IPC handles), no NIXL agent
        self.agent: NixlAgent | None = (
            make_agent("push", transports=transports, ucx_settings=ucx_for(self.tensors.values(), ucx_settings))
            if nixl
            else None
        )
        self._reg = self.agent.register_memory(list(self.tensors.values())) if self.agent is not None else None
        try:
            sock = socket.create_connection((host, port), timeout=30)
        except OSError as exc:
            raise TransferError(f"cannot reach the device landing at {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel = Channel(sock, control_key)
        self._waiting: list[tuple[str, str]] = []  # (nonce, region) of ``landed`` notices whose replies are unread
        self._offered = False  # the target holds this side's agent and addresses (pull_all)
        offer = self.call({"op": "open"})
        self.chunk_size = int(offer["chunk_size"])
        self.remote = offer.get("agent")
        self._lists: dict[str, PairedLists] = {}  # empty unless both ends run NIXL (WRITEs and READs can move)
        if self.agent is not None and self.remote is not None:
            self._lists = pair_lists(self.agent, self.tensors, offer, self.chunk_size, "target")

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
        t = time.perf_counter()
        nonce = self._post(body)
        t = STAGES.add("sender.post", t)
        reply = self._reply(nonce)
        STAGES.add("sender.reply", t)
        return reply

    def expect(self, ids: Mapping[str, Sequence[str]]) -> None:
        self.call({"op": "expect", "ids": {k: list(v) for k, v in ids.items()}})

    def write(self, name: str, first: int, count: int, *, announce: bool = True) -> None:
        """WRITE chunks ``first .. first+count-1`` of a region, then announce them (the reply is read later).

        ``announce=False`` only copies (a benchmark's baseline: nothing is checked, nothing trusted)."""
        if not self._lists or self.agent is None:
            raise TransferError("a WRITE needs NIXL at both ends; this transfer was opened for lend_all only")
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

    def lend_all(
        self, *, batch: int = 4096, retries: int = 2, timeout_s: float = 300.0, tolerate: bool = False
    ) -> dict[str, Any]:
        """Every chunk of every region, copied by the target itself out of this process's memory (CUDA IPC
        handles sent over the signed channel) and checked as it lands (:meth:`DeviceLanding._lend`). One GPU
        host only; the tensors stay alive and unchanged until this returns."""
        t0 = time.perf_counter()
        if any(not t.is_cuda for t in self.tensors.values()):
            raise InvalidInputError("lend_all needs device tensors (CUDA IPC); host memory goes by send_all")
        shared = cuda_ipc.share_all(self.tensors)
        sharing = time.perf_counter() - t0
        STAGES.add("sender.share", t0)
        done = self._landing_pass({"op": "lend", **shared}, batch, retries, timeout_s, "copies", tolerate)
        by = "allocations" if "handles" in shared else "tensors"  # one handle per allocation, or per tensor
        return {**done, "seconds_sharing": sharing, "shared_by": by}

    def pull_all(
        self, *, batch: int = 256, retries: int = 2, timeout_s: float = 300.0, tolerate: bool = False
    ) -> dict[str, Any]:
        """Every chunk of every region, READ by the target itself (``batch`` chunks per READ) and checked
        there while its next READ moves; chunks that fail are read again (:meth:`DeviceLanding._pull`)."""
        if self.agent is None:
            raise TransferError("pull_all needs NIXL at the source; this sender was opened for lend_all only")
        if not self._offered:
            self.call({"op": "offer", **describe(self.agent, self.tensors)})
            self._offered = True
        return self._landing_pass({"op": "pull"}, batch, retries, timeout_s, "re-reads", tolerate)

    def _landing_pass(
        self, request: Mapping[str, Any], batch: int, retries: int, timeout_s: float, again: str, tolerate: bool
    ) -> dict[str, Any]:
        """One pass the target drives (``lend`` or ``pull``): its reply comes when every chunk moved and was
        checked; chunks that still fail after ``retries`` ``again`` are an IntegrityError, unless ``tolerate``
        (the reply's ``bad`` then names them: a pre-load leaves them to the final load)."""
        self.channel.sock.settimeout(timeout_s)
        try:
            reply = self.call({**request, "batch": batch, "retries": retries})
        finally:
            self.channel.sock.settimeout(30)
        if reply["bad"] and not tolerate:
            raise IntegrityError(
                f"{len(reply['bad'])} chunks still failed their BLAKE3 check after {retries} {again}: "
                + ", ".join(reply["bad"][:5])
            )
        return reply

    def _reply_one(self) -> list[tuple[str, int]]:
        nonce, name = self._waiting.pop(0)
        return [(name, int(i)) for i in self._reply(nonce)["bad"]]

    def close(self) -> None:
        self.channel.close()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._reg)
