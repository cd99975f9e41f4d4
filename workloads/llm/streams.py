"""What a request has published, and the coroutines that follow it: the engine thread writes, HTTP reads.

An :class:`Output` is append-only: the text published so far (``text``; a follower asks for what lies
beyond a character offset), the tokens generated when it was last written, and, once finished, why.
The engine thread writes it at step boundaries; any number of asyncio followers (the client's own
stream, a continuation another server relays) wait on it without a thread each.

A request handed over to another server is ``moved``: a follower that has read everything published
here learns where its continuation is (see ``handover.py``), at the character offset it reached.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Text beyond the follower's offset; ``tokens``: generated so far; ``finish_reason`` on the last piece."""

    text: str
    tokens: int
    finish_reason: str | None = None
    logprobs: tuple[float, ...] | None = None  # every generated token's, on the finished piece where asked


@dataclass(frozen=True)
class Moved:
    """The request continues on ``target``; the follower has read ``offset`` characters here."""

    target: str
    offset: int


class Output:
    def __init__(self, request_id: str, prompt_tokens: int, *, text: str = "", tokens: int = 0) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.text = text
        self.tokens = tokens
        self.finish_reason: str | None = None
        self.logprobs: tuple[float, ...] | None = None  # set with the finish, where the request asked for them
        self.moved_to: str | None = None
        self.claimed = False  # an imported request: a continuation has asked for it
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def publish(
        self, delta: str, tokens: int, finish_reason: str | None = None, logprobs: list[float] | None = None
    ) -> None:
        """Append ``delta`` (any thread)."""
        with self._lock:
            self.text += delta
            self.tokens = tokens
            self.finish_reason = finish_reason
            if logprobs is not None:
                self.logprobs = tuple(logprobs)
            self._wake()

    def move(self, target: str) -> None:
        """The request goes on at ``target`` (its followers relay from there once they read all published here)."""
        with self._lock:
            self.moved_to = target
            self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that follower's loop has closed: nobody is waiting any more
                pass

    async def follow(self, offset: int = 0) -> AsyncIterator[Piece | Moved]:
        """Pieces beyond character ``offset`` as they are published, ending with the finished one or a Moved."""
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._lock:
                text, tokens, finish, moved = self.text, self.tokens, self.finish_reason, self.moved_to
                logprobs = self.logprobs
                ready = len(text) > offset or finish is not None or moved is not None
                if not ready:
                    self._waiters.append((loop, event))
            if not ready:
                await event.wait()
                continue
            if len(text) > offset or finish is not None:
                yield Piece(text[offset:], tokens, finish, logprobs if finish is not None else None)
                offset = len(text)
                if finish is not None:
                    return
            elif moved is not None:
                yield Moved(moved, offset)
                return
