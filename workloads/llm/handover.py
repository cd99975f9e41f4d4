"""Streams that survive a move: the target's continuation endpoint and the source's relay.

A client's stream stays on the connection it opened to the source. When its request moves (the
migration hands the engine's work over: ``migration.py``), the source reads what the target generates
next from the target's continuation endpoint, at the character offset the client has reached, and
writes it on that connection: the client sees one stream, no text lost or repeated (DESIGN.md, "The
stream hand-over"). New requests are the source's own until the traffic ramp moves them.

The continuation endpoint serves what any client generated, so a request to it is signed with the
deployment's control key (``gpumigrate.control``: HMAC, timestamp, one-time nonce); the source and
the target of a migration hold the same key. Wire format: DESIGN.md, "Continuation endpoint".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gpumigrate import control

from .engine import Engine
from .openai_api import error_response, sse
from .streams import Moved, Output, Piece

CHANNEL = "gpumigrate-llm-continuation"
PATH = "/v1/internal/continuations"
CLAIM_TIMEOUT_S = 60.0  # an imported request no relay asked for within this long is cancelled (its client left)


class RelayBroken(Exception):
    """The target's continuation failed mid-stream (unreachable, refused, or ended without finishing)."""


class Handover:
    """The relay and the continuation endpoint of one engine (the source's and the target's sides)."""

    def __init__(self, engine: Engine, key: bytes, *, claim_timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        self.engine = engine
        self.key = key
        self.claim_timeout_s = claim_timeout_s
        self.guard = control.ReplayGuard()
        self.moved_to: str | None = None
        self.moved = 0  # requests handed over to another server
        self.relaying = 0
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))

    # -- the source side
    def moved_on(self, request_ids: list[str], target: str) -> None:
        """These requests go on at ``target`` (which restored them): their followers relay from there."""
        self.moved_to = target.rstrip("/")
        self.moved += len(request_ids)
        for rid in request_ids:
            output = self.engine.outputs.get(rid)
            if output is not None:
                output.move(self.moved_to)

    async def warm(self, url: str) -> None:
        """One request through the relay's client to this very server (``url``): an HTTP client's first request sets
        up its machinery (17-20 ms on the CPU, against 2 ms for a request on a new connection after it), which every
        moved stream would otherwise wait for at the hand-over. The server calls it once it serves."""
        with contextlib.suppress(httpx.HTTPError):
            await self._client.get(url + "/healthz")

    async def follow(self, output: Output) -> AsyncIterator[Piece]:
        """The request's pieces from here and then, once it moved, from the target's continuation."""
        async for item in output.follow(0):
            if isinstance(item, Moved):
                self.relaying += 1
                try:
                    async for piece in self.continuation(item.target, output.id, item.offset):
                        yield piece
                finally:
                    self.relaying -= 1
                return
            yield item

    async def continuation(self, target: str, request_id: str, offset: int) -> AsyncIterator[Piece]:
        body = control.sign_request(self.key, CHANNEL, {"request_id": request_id, "offset": offset})
        try:
            async with self._client.stream("POST", target + PATH, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    raise RelayBroken(
                        f"the target refused the continuation of {request_id}: {resp.status_code} {detail}"
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    d = json.loads(line[6:])
                    logprobs = d.get("logprobs")
                    yield Piece(
                        d["text"], d["tokens"], d["finish_reason"], None if logprobs is None else tuple(logprobs)
                    )
                    if d["finish_reason"] is not None:
                        return
        except httpx.HTTPError as exc:
            raise RelayBroken(f"the continuation of {request_id} from {target} failed: {exc}") from None
        raise RelayBroken(f"the continuation of {request_id} from {target} ended before the request finished")

    # -- the target side
    def expect_claims(self, request_ids: list[str]) -> None:
        """Imported requests: cancel those no relay asks for within ``claim_timeout_s`` (their clients left, or a
        rollback kept them on the source). Any thread."""
        timer = threading.Timer(self.claim_timeout_s, self._reap, [list(request_ids)])
        timer.daemon = True
        timer.start()

    def _reap(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            output = self.engine.outputs.get(rid)
            if output is not None and not output.claimed:
                self.engine.release(rid)

    async def serve_continuation(self, request: Request) -> Response:
        try:
            message = json.loads(await request.body() or b"null")
            if not isinstance(message, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return error_response(400, f"the body is not a signed JSON object: {exc}")
        try:
            body, _ = control.verify_request(self.key, CHANNEL, message, self.guard)
        except control.AuthError as exc:
            return error_response(401, exc.message, code="unauthenticated")
        rid, offset = body.get("request_id"), body.get("offset")
        if not isinstance(rid, str) or isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            return error_response(400, "request_id (a string) and offset (an integer >= 0) are required")
        output = self.engine.outputs.get(rid)
        if output is None:
            return error_response(404, f"no request {rid} here", code="not_found")
        if offset > len(output.text):
            return error_response(400, f"offset {offset} is beyond the {len(output.text)} characters published")
        output.claimed = True
        return DisconnectAwareStream(self._pieces(output, offset), media_type="text/event-stream")

    async def _pieces(self, output: Output, offset: int) -> AsyncIterator[str]:
        try:
            async for item in self.follow_here(output, offset):
                piece = {"text": item.text, "tokens": item.tokens, "finish_reason": item.finish_reason}
                yield sse(piece if item.logprobs is None else {**piece, "logprobs": list(item.logprobs)})
        finally:  # finished, or the relay (so its client) went away: then the request stops here too
            self.engine.release(output.id)

    async def follow_here(self, output: Output, offset: int) -> AsyncIterator[Piece]:
        async for item in output.follow(offset):
            if isinstance(item, Moved):  # moved on again: chain through this server
                async for piece in self.continuation(item.target, output.id, item.offset):
                    yield piece
                return
            yield item

    async def close(self) -> None:
        await self._client.aclose()

    def stats(self) -> dict[str, Any]:
        return {"moved_to": self.moved_to, "moved": self.moved, "relaying": self.relaying}


class DisconnectAwareStream(StreamingResponse):
    """A streaming response that notices its client leaving even while it has nothing to write.

    Starlette (under ASGI 2.4 servers such as uvicorn) only notices a gone client when a write fails;
    a stream waiting for a token (a frozen engine) would keep its request's slot. Listening for the
    disconnect beside the writer cancels the writer at once, and the generator's cleanup frees the slot.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        writer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
        failure = None if writer.cancelled() else writer.exception()
        if failure is not None and not isinstance(failure, OSError):  # OSError: the client went away mid-write
            raise failure
