"""Hand the engine's state over by hand: signed admin commands (``--manual-handover``).

A stand-in for the migration's own capture and restore, so the hand-over can be exercised between
two real server processes before the SDK carries the engine's state (issue 33, part B): export the
state from a sealed, paused source, import it into an idle target, then tell the source that its
requests went on there (it relays their streams). ``resume`` is the rollback: the source unseals
and goes on. Off unless the server was started with ``--manual-handover``; every command is signed
with the control key (channel ``gpumigrate-llm-admin``), for an export carries every client's text.

Body: ``control.sign_request(key, CHANNEL, {"command": ..., ...})``; answer: JSON. Commands:
``export`` -> ``{"state": <engine state>, "tensors": {"kv": <base64 raw bytes>}}``;
``import`` ``{"state", "tensors"}`` -> ``{"requests": [ids]}``; ``hand_over`` ``{"target": url}`` ->
``{"requests": [ids]}``; ``resume`` -> ``{}``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gpumigrate import control

from .engine import Engine, EngineStateError
from .handover import Handover
from .openai_api import error_response

CHANNEL = "gpumigrate-llm-admin"
PATH = "/admin/engine"


def encode_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).decode()


def decode_tensor(text: str, shape: list[int], dtype: str) -> torch.Tensor:
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dtype.removeprefix("torch."))).view(shape)


class Admin:
    def __init__(self, engine: Engine, handover: Handover, key: bytes) -> None:
        self.engine = engine
        self.handover = handover
        self.key = key
        self.guard = control.ReplayGuard()

    async def serve(self, request: Request) -> Response:
        try:
            message = json.loads(await request.body() or b"null")
            if not isinstance(message, dict):
                raise ValueError("not a JSON object")
            body, _ = control.verify_request(self.key, CHANNEL, message, self.guard)
        except ValueError as exc:
            return error_response(400, f"the body is not a signed JSON object: {exc}")
        except control.AuthError as exc:
            return error_response(401, exc.message, code="unauthenticated")
        command = body.get("command")
        try:
            if command == "export":
                return JSONResponse(await self._export())
            if command == "import":
                return JSONResponse(await self._import(body))
            if command == "hand_over" and isinstance(body.get("target"), str):
                return JSONResponse({"requests": self.handover.hand_over(body["target"])})
            if command == "resume":
                self.handover.unseal()
                self.engine.resume()
                return JSONResponse({})
        except (EngineStateError, TimeoutError, KeyError, TypeError) as exc:
            return error_response(409, f"{command}: {exc}")
        return error_response(400, "command must be export, import, hand_over (with target) or resume", param="command")

    async def _export(self) -> dict[str, Any]:
        self.handover.seal()  # requests that arrive from now on wait: hand_over proxies them, resume admits them
        await asyncio.to_thread(self.engine.pause)
        state, tensors = await asyncio.to_thread(self.engine.export_state)
        encoded = await asyncio.to_thread(lambda: {k: encode_tensor(t) for k, t in tensors.items()})
        return {"state": state, "tensors": encoded}

    async def _import(self, body: dict[str, Any]) -> dict[str, Any]:
        state = body["state"]
        tensors = {k: decode_tensor(v, state["kv_shape"], state["kv_dtype"]) for k, v in body["tensors"].items()}
        await asyncio.to_thread(self.engine.pause)
        try:
            ids = await asyncio.to_thread(self.engine.import_state, state, tensors)
        finally:
            self.engine.resume()
        self.handover.expect_claims(ids)
        return {"requests": ids}


def sign(key: bytes, command: str, **fields: Any) -> dict[str, Any]:
    """A signed admin command (tests, tools)."""
    return control.sign_request(key, CHANNEL, {"command": command, **fields})
