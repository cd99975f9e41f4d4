"""The reference LLM server: OpenAI-compatible completions over the engine, with the migration SDK embedded.

    GPUMIGRATE_AGENT_ADDR=127.0.0.1:17070 python -m gpumigrate.workloads.llm --host 127.0.0.1 --port 18080 \\
        --size tiny --seed 0 --device cpu --dtype float32 --name local-a

Like any user's server it imports the public SDK: it builds the model's shapes without weights when
``gm.awaiting_restore()``, attaches the SDK to the model and the KV cache, runs each engine step in
the handle's safe point (so a freeze lands between two decode steps), and answers ``/healthz`` and
``/readyz`` through ``gm.ReadinessMiddleware``. Routes and flags: workloads/README.md; design:
DESIGN.md beside this file.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import gpumigrate.agent as gm

from . import handover
from .engine import Engine
from .handover import DisconnectAwareStream, Handover, RelayBroken
from .openai_api import CHAT, COMPLETIONS, DONE, APIError, Chunks, Generation, error_response, parse, sse
from .streams import Output


class EngineFailed(Exception):
    def __str__(self) -> str:
        return "the engine failed while generating this request (see the server's log); nothing more will come"


class LLMServer:
    """The HTTP face of one engine. ``handle``: the attached SDK (readiness, awaiting restore); None in tests."""

    def __init__(
        self,
        engine: Engine,
        *,
        key: bytes,
        name: str,
        handle: gm.Handle | None = None,
        relay: Handover | None = None,
        claim_timeout_s: float = handover.CLAIM_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.name = name
        self.handle = handle
        self.created = int(time.time())
        self.handover = relay if relay is not None else Handover(engine, key, claim_timeout_s=claim_timeout_s)
        self.streams = 0  # client requests being answered here (streamed or not), relayed ones included
        self._warming: asyncio.Task[None] | None = None  # the relay's client, warmed at the first request
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/engine", self.engine_stats, methods=["GET"]),
            Route(handover.PATH, self.handover.serve_continuation, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)
        if handle is not None:
            self.app.add_middleware(gm.ReadinessMiddleware, handle=handle)

    async def models(self, request: Request) -> Response:
        model = {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "gpumigrate"}
        return JSONResponse({"object": "list", "data": [model]})

    async def engine_stats(self, request: Request) -> Response:
        stats = await asyncio.to_thread(self.engine.stats)
        return JSONResponse({**stats, **self.handover.stats(), "host": self.name})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def _generate(self, request: Request, kind: str) -> Response:
        raw = await request.body()
        try:
            gen = parse(raw, kind, model=self.engine.model_id, max_context=self.engine.max_context)
        except APIError as exc:
            return exc.response()
        if self.handle is not None and not self.handle.gate.ready:
            reason = self.handle.reason() or "not ready"
            return error_response(503, f"this server cannot take requests yet ({reason})")
        output = self.engine.submit(gen.prompt, gen.params)
        if self._warming is None and isinstance(request.scope.get("server"), tuple | list):
            host, port = request.scope["server"][:2]
            where = f"[{host}]" if ":" in str(host) else host
            self._warming = asyncio.create_task(self.handover.warm(f"http://{where}:{port}"))
        chunks = Chunks(gen, output.id)
        if gen.stream:
            headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
            return DisconnectAwareStream(
                self._stream(gen, output, chunks), media_type="text/event-stream", headers=headers
            )
        return await self._whole(request, output, chunks)

    async def _stream(self, gen: Generation, output: Output, chunks: Chunks) -> AsyncIterator[str]:
        self.streams += 1
        try:
            first = chunks.first()
            if first is not None:
                yield first
            tokens = 0
            async for piece in self.handover.follow(output):
                tokens = piece.tokens
                if piece.finish_reason == "error":
                    raise EngineFailed
                yield chunks.piece(piece.text, piece.finish_reason)
            if gen.include_usage:
                yield chunks.usage_chunk(len(gen.prompt), tokens)
            yield DONE
        except (RelayBroken, EngineFailed) as exc:  # the stream cannot go on: OpenAI's error event, no [DONE]
            code = "relay_broken" if isinstance(exc, RelayBroken) else "engine_failed"
            yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}})
        finally:
            self.streams -= 1
            self.engine.release(output.id)

    async def _whole(self, request: Request, output: Output, chunks: Chunks) -> Response:
        async def collect() -> tuple[str, str | None, int, tuple[float, ...] | None]:
            text, finish, tokens, logprobs = "", None, 0, None
            async for piece in self.handover.follow(output):
                text, finish, tokens, logprobs = text + piece.text, piece.finish_reason, piece.tokens, piece.logprobs
            return text, finish, tokens, logprobs

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
        self.streams += 1
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.streams -= 1
            gone.cancel()
            if not work.done():
                work.cancel()
            self.engine.release(output.id)
        if work.cancelled():
            return Response(status_code=499)  # nobody reads it: the client has gone
        try:
            text, finish, tokens, logprobs = work.result()
        except RelayBroken as exc:
            return error_response(502, str(exc))
        if finish == "error":
            return error_response(500, str(EngineFailed()), code="engine_failed")
        return JSONResponse(chunks.whole(text, finish, output.prompt_tokens, tokens, logprobs))

    async def close(self) -> None:
        await self.handover.close()
