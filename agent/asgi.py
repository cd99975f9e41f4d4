"""An ASGI middleware for a service with the agent attached: health, readiness, and held requests.

``GET <health_path>`` answers 200 while the process lives; ``GET <ready_path>`` answers 503 with
the reason while the process cannot serve (awaiting its restore, zeroized), so a load balancer,
Envoy or gpumigrate's own checks stop sending to it in time, and 200 otherwise: ``{"status":
"held", "reason": "frozen"}`` while a migration's freeze holds requests (they are served on resume;
see ``SafePointGate.readiness``). A request held at a frozen safe point longer than its timeout gets
a 503 instead of a 500.

With Starlette or FastAPI: ``app.add_middleware(ReadinessMiddleware)``; any other ASGI app:
``app = ReadinessMiddleware(app)``. Without ``handle`` it reads the handle attached in this process
(so the app can be built before ``attach()``); before any attach the readiness path answers 503.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gpumigrate.snapshot.stepgate import SafePointUnavailable

from .handle import Handle, current

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


class ReadinessMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        handle: Handle | None = None,
        ready_path: str = "/readyz",
        health_path: str = "/healthz",
    ) -> None:
        self.app = app
        self.handle = handle
        self.ready_path = ready_path
        self.health_path = health_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        if path == self.health_path:
            await _json(send, 200, {"status": "alive"})
            return
        if path == self.ready_path:
            handle = self.handle or current()
            if handle is None:
                await _json(send, 503, {"status": "not ready", "reason": "agent not attached"})
            else:
                await _json(send, *handle.gate.readiness())
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except SafePointUnavailable as exc:
            if started:
                raise
            await _json(send, 503, {"error": exc.message})
