"""OpenAI's HTTP contract for completions: request validation, error bodies and response chunks.

The shapes follow OpenAI's API reference as the official ``openai`` client reads them: a completion
or chat completion object, ``text/event-stream`` chunks ending with ``data: [DONE]``, usage on an extra
last chunk when ``stream_options.include_usage`` asks, and errors as ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status. Parameters this server cannot honour (``n`` > 1, ``echo``,
``logprobs`` above 1 or on a stream or a chat, penalties, ``top_p`` below 1, ...) are refused with a 400 naming
them, never ignored. ``logprobs`` 0 or 1 on a non-streamed completion returns each generated token's
log-probability (``choices[0].logprobs.token_logprobs``: parity compares them within a tolerance).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from .model import encode
from .requests import SamplingParams

COMPLETIONS = "completions"
CHAT = "chat"
MAX_STOP = 4
_COMMON = {"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "n", "user"}
_COMMON |= {"top_p", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos"}
ALLOWED = {
    COMPLETIONS: _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"},
    CHAT: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
}
# What a parameter must be for this server to honour it: (value it must equal when given, why).
UNSUPPORTED = {
    "n": (1, "n must be 1"),
    "best_of": (1, "best_of must be 1"),
    "echo": (False, "echo is not supported"),
    "top_logprobs": (None, "top_logprobs are not supported"),
    "suffix": (None, "suffix is not supported"),
    "top_p": (1, "top_p must be 1 (only temperature sampling)"),
    "presence_penalty": (0, "presence_penalty must be 0"),
    "frequency_penalty": (0, "frequency_penalty must be 0"),
    "logit_bias": (None, "logit_bias is not supported"),
}


class APIError(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "service_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


@dataclass(frozen=True)
class Generation:
    """A validated request: what to generate and how to answer."""

    kind: str  # COMPLETIONS | CHAT
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool = False  # token_logprobs in the (non-streamed) completion


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The chat template: each message as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` for the answer."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise APIError(f"{name} must be a number in [{low:g}, {high:g}]; got {value!r}", param=name)
    return float(value)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(f"messages[{i}].role must be system, developer, user or assistant", param=f"messages.[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise APIError(f"messages[{i}].content parts must all be text parts", param=f"messages.[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string", param=f"messages.[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def parse(raw: bytes, kind: str, *, model: str, max_context: int) -> Generation:
    """Validate a request body; APIError names the parameter at fault and what is allowed."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED[kind])
    if unknown:
        raise APIError(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    if body.get("model") != model:
        raise APIError(
            f"the model {body.get('model')!r} does not exist; this server has {model!r}",
            param="model",
            code="model_not_found",
        )
    for name, (allowed, why) in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] != allowed:
            raise APIError(why, param=name)
    if kind == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError("prompt must be a string (or an array of one string)", param="prompt")
        text, where, default_max = prompt, "prompt", 16  # OpenAI's default for completions
    else:
        text, where, default_max = chat_prompt(_messages(body)), "messages", None
    tokens = encode(text)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max_context - len(tokens)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise APIError(f"{name} must be a positive integer; got {max_tokens!r}", param=name)
    if len(tokens) + max(max_tokens, 1) > max_context:
        raise APIError(
            f"this model's maximum context length is {max_context} tokens; the {where} has {len(tokens)} "
            f"and {max_tokens} were asked for: shorten the {where} or lower {name}",
            param=where,
            code="context_length_exceeded",
        )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"stop must be a non-empty string or an array of up to {MAX_STOP} of them", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(f"seed must be an integer; got {seed!r}", param="seed")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError("stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not stream and options:
        raise APIError("stream_options may only hold include_usage, and only with stream: true", param="stream_options")
    logprobs = body.get("logprobs")
    asked = logprobs is not None and logprobs is not False
    if asked and (kind != COMPLETIONS or stream or isinstance(logprobs, bool) or logprobs not in (0, 1)):
        raise APIError(
            "logprobs: 0 or 1 on a non-streamed /v1/completions request gives each token's log-probability; "
            "nothing else is supported (no top alternatives, none on streams or chats)",
            param="logprobs",
        )
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError("ignore_eos must be a boolean", param="ignore_eos")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        seed=None if seed is None else seed % (1 << 63),
        stop=tuple(stop),
        ignore_eos=ignore_eos,
        logprobs=isinstance(logprobs, int) and not isinstance(logprobs, bool),
    )
    return Generation(kind, model, tokens, params, stream, bool(options.get("include_usage")), params.logprobs)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Chunks:
    """The response objects of one request: its id, creation time and model are the same in every chunk."""

    def __init__(self, gen: Generation, request_id: str) -> None:
        self.gen = gen
        self.id = request_id if gen.kind == COMPLETIONS else request_id.replace("cmpl-", "chatcmpl-", 1)
        self.created = int(time.time())
        self.object = "text_completion" if gen.kind == COMPLETIONS else "chat.completion.chunk"

    def _choice(self, text: str | None, finish: str | None, *, first: bool = False) -> dict[str, Any]:
        finish = "stop" if finish == "cancelled" else finish
        if self.gen.kind == COMPLETIONS:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.gen.model,
            "choices": choices,
        }
        if self.gen.include_usage:
            out["usage"] = None
        return {**out, **extra}

    def first(self) -> str | None:
        """The chat stream's opening chunk (the assistant's role); completions have none."""
        return None if self.gen.kind == COMPLETIONS else sse(self._envelope([self._choice(None, None, first=True)]))

    def piece(self, text: str, finish: str | None) -> str:
        return sse(self._envelope([self._choice(text, finish)]))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        return sse(self._envelope([], usage=usage(prompt_tokens, completion_tokens)))

    def whole(
        self,
        text: str,
        finish: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: tuple[float, ...] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed answer."""
        finish = "stop" if finish == "cancelled" else finish
        if self.gen.kind == COMPLETIONS:
            lp = None
            if self.gen.logprobs:
                lp = {"tokens": None, "token_logprobs": list(logprobs or ()), "top_logprobs": None, "text_offset": None}
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        else:
            message = {"role": "assistant", "content": text}
            choice, obj = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}, "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.gen.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = sse("[DONE]")
