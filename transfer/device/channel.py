"""What the device landing (``landing.py``) and its sender (``sender.py``) share: the signed control channel, and
how each side describes its tensors to the other and to NIXL.

The channel is JSON lines over one TCP connection, every request signed with the control key and every reply signed
and bound to it (``gpumigrate.control``, the receivers' channel, ``stores/wire.py``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.transfer.stores.nixl_agent import NixlAgent

if TYPE_CHECKING:
    import torch

MAX_LINE = 64 << 20  # one control message (the expected ids of a large image fit)
# UCX leaves cuda_ipc GETs off ("auto") on GPUs without NVLink, where it found concurrent reads slow; between two
# processes on one GPU its READs then took a path through the host (TRANSPORTS.md, nixl:// on one GPU host).
LANDING_UCX = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
# A region's prepared descriptor lists: (this side's, the other side's, the chunk count).
PairedLists = tuple[object, object, int]


class Channel:
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
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("a control message is a JSON object")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
            self.sock.close()


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    import torch

    if not tensor.is_contiguous():
        raise InvalidInputError("a NIXL region must be a contiguous tensor")
    return tensor.view(-1).view(torch.uint8)


def chunk_spans(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of ``nbytes`` bytes cut into ``chunk_size`` pieces (the last may be shorter)."""
    return [(o, min(chunk_size, nbytes - o)) for o in range(0, nbytes, chunk_size)]


def describe(agent: NixlAgent, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What the other side needs to move bytes to or from ``tensors``: this agent and the tensors' addresses."""
    return {
        "agent": agent.name,
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "mem": "VRAM" if next(iter(tensors.values())).is_cuda else "DRAM",
        "regions": {n: [t.data_ptr(), t.numel(), max(t.get_device(), 0)] for n, t in tensors.items()},
    }


def pair_lists(
    agent: NixlAgent, tensors: Mapping[str, torch.Tensor], other: Mapping[str, Any], chunk_size: int, side: str
) -> dict[str, PairedLists]:
    """Chunk by chunk, each local tensor beside the other side's (its :func:`describe`): the prepared
    descriptor lists of a WRITE or a READ, and the chunk count, by region name."""
    agent.add_remote_agent(base64.b64decode(str(other["metadata"])))
    lists = {}
    for name, t in tensors.items():
        addr, nbytes, dev = other["regions"][name]
        if int(nbytes) != t.numel():
            raise InvalidInputError(f"region {name}: {t.numel()} bytes here, {nbytes} at the {side}")
        spans = chunk_spans(t.numel(), chunk_size)
        here = [(t.data_ptr() + o, n, max(t.get_device(), 0)) for o, n in spans]
        there = [(int(addr) + o, n, int(dev)) for o, n in spans]
        lists[name] = (
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", here, "VRAM" if t.is_cuda else "DRAM"),
            agent.prep_xfer_dlist(str(other["agent"]), there, str(other["mem"])),
            len(spans),
        )
    return lists


def ucx_for(tensors: Iterable[torch.Tensor], extra: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """LANDING_UCX where device memory moves; nothing on host memory (UCX warns, on stdout, about a
    variable of a transport it did not load); then the caller's ``extra`` settings."""
    wanted = {**(LANDING_UCX if any(t.is_cuda for t in tensors) else {}), **(extra or {})}
    return wanted or None
